"""Every job of a ``posbench train`` or ``posbench eval`` command line, composed and prepared before Hydra starts.

:func:`prepare_all` puts what a run started from a parent (``init_from`` on the command line) takes from it into
Hydra's composition (:func:`inherit`), expands the command line's sweep (the experiment's declared sweep
included), composes each job's config with Hydra's compose API and prepares it (posbench/jobs/train_job.py,
posbench/jobs/eval_job.py: values checked and resolved once, data prepared into its cache, a single run's resume state
found, an evaluation's model loaded), checks that the folders the jobs will write can be written, and takes a
single training run's folder lock (posbench/runtime/runlock.py); the command line's overrides are read first
(posbench/jobs/overrides.py). The first bad job stops everything with :class:`Refused`,
one line, before any folder is made or touched; the CLI (posbench/cli.py) prints it and exits 2. What preparing a
job logs (a warning about a value, the options a fine-tune changes) is held, and logged when the job starts. Hydra's
tasks then find their prepared job with :func:`job_for`. After a sweep that stopped (a signal, a worker that died),
:func:`stopped_sweep` and :func:`broken_sweep` say how to resume it.

    prepare_all(["scheme=alibi", "train.seq_len=64"], "train")   # raises Refused
    job = job_for(cfg, train_job.prepare)                          # in Hydra's task: cfg is Hydra's composed config
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shlex
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict

from posbench.config.checks import ConfigError
from posbench.config.schema import scheme_schema
from posbench.data.cache import DataError
from posbench.jobs import eval_job, train_job
from posbench.jobs.overrides import CONFIG_MODULE, FINE_TUNES, Refused, bare, check_eval_overrides, one_line, slips
from posbench.runtime import dist, runlock, sweep_stop
from posbench.runtime.signals import exit_status
from posbench.training import lineage

PREPARED: dict[str, object] = {}  # the composed job config (YAML) → its prepared job, made by prepare_all
HELD: dict[str, list[logging.LogRecord]] = {}  # the same key → what preparing it logged, logged when it starts
PARENT_GROUP, PARENT_SCHEME = "parent", "parent"  # the ConfigStore options inherit() stores (conf/train.yaml)


def inherit(overrides: list[str]) -> None:
    """Make Hydra compose, for a run started from a parent (``init_from=<run>`` on the command line, or each value
    of a sweep over it), the parent's scheme with the parent's options, its L (``train.seq_len``) and its layers'
    options (``model.layer_pattern`` …: posbench.config.schema.LAYER_KEYS), unless the
    command line or a preset gives them (posbench/training/lineage.py :func:`~posbench.training.lineage.inherited`). It stores two
    options in Hydra's ConfigStore, replacing those of an earlier call: ``scheme/parent``, the parent's scheme
    options on its scheme's schema, and ``parent/init`` (package ``_global_``), which overrides the scheme group's
    default with it and sets ``train.seq_len``. conf/train.yaml takes ``parent/init``, when stored, after the model
    and data and before debug=fast's lengths and the presets, so a command line's ``scheme=…`` or
    ``train.seq_len=…``, a preset's and debug=fast's come after it; a sweep's joblib and SLURM workers get the
    ConfigStore with Hydra's state.

    Raises ConfigError: a parent that cannot be read (``posbench.training.lineage.read``), or a sweep over parents that
    differ in what their runs take from them."""
    store = ConfigStore.instance()
    store.repo.pop(PARENT_GROUP, None)
    store.repo.get("scheme", {}).pop(f"{PARENT_SCHEME}.yaml", None)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:  # (composition names it)
        return
    paths = [str(v) for o in parsed if o.key_or_group == "init_from" and not o.is_delete()
             for v in (o.sweep_string_iterator() if o.is_sweep_override() else [o.value()])
             if v is not None and "${" not in str(v)]
    taken = {path: lineage.inherited(lineage.read(path)) for path in dict.fromkeys(paths)}
    if len({json.dumps(t, sort_keys=True, default=str) for t in taken.values()}) > 1:
        layers = {k for t in taken.values() for k, v in t["model"].items()  # the layer options where parents differ
                  if any(u["model"].get(k) != v for u in taken.values())}
        described = "; ".join(f"{path}: {' '.join(f'scheme.{k}={v}' for k, v in t['scheme'].items())} "
                              f"train.seq_len={t['seq_len']}" + "".join(f" model.{k}={t['model'].get(k)}"
                                                                         for k in sorted(layers))
                              for path, t in taken.items())
        raise ConfigError(f"init_from={','.join(taken)}: a run takes its parent's scheme, scheme options, L and layers, and "
                          f"these parents differ ({described}); sweep over parents that share them, or run one command "
                          "per parent")
    for t in list(taken.values())[:1]:
        store.store(group="scheme", name=PARENT_SCHEME, node=scheme_schema(t["scheme"]["name"])(**t["scheme"]))
        store.store(group=PARENT_GROUP, name="init", package="_global_", node={
            "defaults": [{"override /scheme": PARENT_SCHEME}], "train": {"seq_len": t["seq_len"]},
            **({"model": t["model"]} if t.get("model") else {}), **({"data": t["data"]} if t.get("data") else {})})


def expand(overrides: list[str], multirun: bool, config_name: str) -> list[list[str]]:
    """The override lists of every job the command line asks for (sweeps expanded, the config's own too)."""
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    if not multirun:
        return [overrides]
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    declared = compose(config_name, overrides=fixed, return_hydra_config=True).hydra.sweeper.params or {}
    given = {o.key_or_group for o in parsed}
    parsed += parser.parse_overrides([f"{k}={v}" for k, v in declared.items() if bare(k) not in given])
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
            for o in parsed]
    return [list(c) for c in itertools.product(*axes)]


def key_of(cfg: DictConfig) -> str:
    """What identifies a job: its composed config (without Hydra's node), as YAML."""
    return OmegaConf.to_yaml(cfg)


def job_for(cfg: DictConfig, prepare):
    """The job :func:`prepare_all` prepared for Hydra's composed ``cfg`` in this process, or, in a sweep's worker
    process, ``prepare(cfg)``. (Hydra's tasks reach :data:`PREPARED` only through here: a joblib worker receives a
    task function pickled by value, with the globals it names, and must not receive the prepared jobs.) What
    preparing the job logged is logged now (rank 0), where the job's log goes."""
    key = key_of(cfg)
    job = PREPARED.get(key)
    if job is None:
        return prepare(cfg)
    for record in HELD.pop(key, []) if dist.rank() == 0 else []:
        logging.getLogger(record.name).handle(record)
    return job


@contextmanager
def held_logs():
    """Hold what posbench logs (INFO and up) inside the block, in the list it yields, instead of logging it."""
    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    logger, held, handler = logging.getLogger("posbench"), [], Hold()
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield held
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def prepare(config_name: str, cfg: DictConfig, multirun: bool):
    """(the key Hydra's task will find it by, the prepared job, the folder it writes in) of the composed ``cfg``,
    Hydra's node popped first. A single training run's job carries the training state of its run folder; a sweep's
    jobs look theirs up in their Hydra tasks, once Hydra has named their folders (the folder here: the sweep's)."""
    with open_dict(cfg):
        folder = cfg.hydra.run.dir if config_name == "eval" else None  # (resolved here, where ${run} is in reach)
        hydra_cfg = cfg.pop("hydra")
    key = key_of(cfg)
    preset = hydra_cfg.runtime.choices.get("experiment")
    if config_name == "train" and preset in FINE_TUNES and cfg.init_from is None:
        raise ConfigError(f"experiment={preset} fine-tunes a trained run: give it one with init_from=<run folder or "
                          f"its checkpoint.pt>, e.g. posbench train -m experiment={preset} init_from=outputs/rope128")
    if not multirun:
        unpinned(hydra_cfg, preset if config_name == "train" else hydra_cfg.runtime.choices.get("eval_experiment"),
                 config_name)
    if config_name == "eval":
        job = eval_job.prepare(cfg, folder)
        return key, job, job.run_dir
    folder = Path(os.path.abspath(hydra_cfg.sweep.dir if multirun else hydra_cfg.run.dir))
    if not multirun and dist.rank() == 0:
        runlock.check_free(folder)  # before its training states are read: another run may be writing them
    return key, train_job.prepare(cfg, None if multirun else folder), folder


def unpinned(hydra_cfg: DictConfig, preset: str | None, config_name: str = "train") -> None:
    """Raise ConfigError for a single run (no ``-m``) of a preset that declares a sweep
    (``hydra.sweeper.params``: ``experiment=demo`` of ``posbench train``, ``eval_experiment=remaps`` of ``posbench
    eval``) and whose command line does not pick a value of every key it sweeps: Hydra would silently run the config's
    defaults, one job, where the preset means a sweep. A command line that picks each swept key runs that one job of
    the sweep (``posbench train experiment=demo scheme=alibi``)."""
    declared = hydra_cfg.sweeper.params or {}
    given = {bare(o.split("=", 1)[0]) for o in hydra_cfg.overrides.task}
    command = [*hydra_cfg.overrides.task, *(o for o in hydra_cfg.overrides.hydra
                                            if not o.startswith(("hydra.run.", "hydra.mode")))]  # a sweep's: not run.dir
    free = [k for k in declared if bare(k) not in given]
    if free:
        pins = " ".join(f"{k}=<one of {declared[k]}>" for k in free)
        group = "experiment" if config_name == "train" else "eval_experiment"
        name = f"{group}={preset}" if preset else "the config"
        raise ConfigError(f"{name} declares a sweep over {', '.join(free)}: run it with -m "
                          f"(posbench {config_name} -m {shlex.join(command)}), or run one of its jobs with {pins}")


def writable(folder: Path, fix: str) -> None:
    """Raise ConfigError unless ``folder``, or the nearest of its parents that exists, can be written to (by
    permissions, and not on a read-only file system); nothing is written to find out. ``fix``: what to do instead,
    the message's end."""
    folder = Path(os.path.abspath(folder))
    existing = next(p for p in [folder, *folder.parents] if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"cannot make the folder {folder}: {existing} is a file; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK) or os.statvfs(existing).f_flag & os.ST_RDONLY:
        where = "" if existing == folder else f", where {folder} would go"
        raise ConfigError(f"cannot write to {existing} (a read-only file system, or no permission){where}; {fix}")


WRITE_FIX = {"eval": "copy the run folder somewhere writable and evaluate the copy",
             False: "choose a writable run folder with hydra.run.dir=DIR", True: "choose a writable sweep folder with "
             "hydra.sweep.dir=DIR"}
MODES = {"-m", "--multirun", "-c", "--cfg", "-i", "--info", "-r", "--run", "-sc", "--shell-completion"}  # Hydra: one


def prepare_all(argv: list[str], config_name: str) -> None:
    """Compose and prepare every job of ``argv`` (values checked and resolved, data prepared into its cache and
    the splits' sizes checked, a single run's resume state found or refused, an evaluation's model loaded), check
    that their folders can be written, take a single training run's folder lock (posbench/runtime/runlock.py), keep each
    job in :data:`PREPARED` for Hydra's job (and what preparing it logged in :data:`HELD`), and set
    ``POSBENCH_SWEPT``; first, for ``posbench train``, put what a run takes from its parent into the composition
    (:func:`inherit`). Raises Refused on the first bad one."""
    flags = [a.split("=", 1)[0] for a in argv if a.startswith("-")]
    if len(set(flags) & MODES) > 1:
        raise Refused(f"{' and '.join(sorted(set(flags) & MODES))} cannot be combined (Hydra runs one mode at a time); to see "
             f"one job's config, drop -m: posbench {config_name} <overrides> --cfg job")
    overrides = [a for a in argv if not a.startswith("-")]
    if any(f not in ("-m", "--multirun") for f in flags):  # --cfg, --help, --info ...: Hydra's own business
        try:
            if config_name == "train":  # (--cfg job shows what the run takes from its parent; "job": a flag's value)
                inherit([o for o in overrides if "=" in o or o.startswith("~")])
        except ConfigError as e:
            raise Refused(str(e)) from None
        return
    if config_name == "eval":
        check_eval_overrides(overrides)
    slips(overrides, bool(flags), config_name)
    PREPARED.clear()
    HELD.clear()
    message, jobs, folder = "", [], None
    try:
        if config_name == "train":
            inherit(overrides)
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            jobs = expand(overrides, bool(flags), config_name)
            for job in jobs:
                with held_logs() as held:
                    key, prepared, folder = prepare(config_name, compose(config_name, overrides=job,
                                                                          return_hydra_config=True), bool(flags))
                writable(folder, WRITE_FIX[config_name if config_name == "eval" else bool(flags)])
                PREPARED[key], HELD[key] = prepared, held
    except (ConfigError, DataError, runlock.FolderInUse) as e:
        message = str(e)
    except Exception as e:  # noqa: BLE001 - Hydra / OmegaConf composition errors, of many kinds
        message = one_line(e, tuple(overrides), config_name)
    refused = [m for m in dist.gather(message) if m]  # torchrun: a rank's own refusal (its memory, its GPU) stops all
    if refused:
        raise Refused(refused[0])
    if config_name == "train" and not flags:
        lock(folder)
    swept = {o.split("=", 1)[0] for job in jobs for o in job if sum(o in other for other in jobs) < len(jobs)}
    os.environ["POSBENCH_SWEPT"] = ",".join(sorted(swept))  # the run name of each job: its swept overrides


def lock(run_dir: Path) -> None:
    """Take the lock of a training run's folder on rank 0. Raises Refused, on every rank, when another process
    holds it or the folder cannot be made."""
    def take() -> str:
        try:
            runlock.acquire(run_dir)
        except (runlock.FolderInUse, OSError) as e:
            return str(e) if isinstance(e, runlock.FolderInUse) else f"cannot make the run folder {run_dir}: {e}"
        return ""

    message = dist.broadcast(take() if dist.rank() == 0 else "")
    if message:
        raise Refused(message)


# ---- a sweep that stopped ------------------------------------------------------------------------------------


def resume_hint(argv: list[str], sweep: Path) -> str:
    """How to resume the sweep in ``sweep`` that ``argv`` (``train -m …``) started: its command with hydra.sweep.dir."""
    again = ["posbench", *(a for a in argv if not a.startswith("hydra.sweep.dir=")), f"hydra.sweep.dir={sweep}"]
    return ("to resume this sweep (each job from its training state, the finished ones skipped, the rest started), "
            f"run the same command with hydra.sweep.dir: {shlex.join(again)}")


def broken_sweep(argv: list[str], sweep: Path) -> None:
    """After a sweep that ended in an error (Hydra's message above): name the jobs whose run folder still holds a lock
    file, which a process that died left (a worker killed, out of memory, and the jobs joblib then killed with it),
    and say how to resume the sweep."""
    left = sorted(str(p.parent) for p in sweep.glob(f"*/{runlock.NAME}"))
    if left:
        print(f"posbench: a job's process died and joblib stopped the sweep's other jobs at once; the jobs that were "
              f"running, each keeping its newest saved training state: {', '.join(left)}; {resume_hint(argv, sweep)}",
              file=sys.stderr, flush=True)


def stopped_sweep(argv: list[str]) -> int | None:
    """After a sweep a signal stopped (posbench/runtime/sweep_stop.py): say so and how to resume it, and return the
    exit status of the signal (130 for Ctrl-C, 75 for SIGTERM); None when no signal stopped it."""
    sweep = sweep_stop.PARENT.sweep_dir
    signum = sweep_stop.requested(sweep) if sweep is not None else None
    if signum is None:
        return None
    sweep_stop.clear(sweep)
    what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped ({signal.Signals(signum).name})"
    print(f"posbench: {what}: the sweep's running jobs saved their training states and stopped, and no other job "
          f"started; {resume_hint(argv, sweep)}", file=sys.stderr, flush=True)
    return exit_status(signum)
