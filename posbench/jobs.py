"""Every job of a ``posbench train`` or ``posbench eval`` command line, composed and prepared before Hydra starts.

:func:`prepare_all` puts what a run started from a parent (``init_from`` on the command line) takes from it into
Hydra's composition (:func:`inherit`), expands the command line's sweep (the experiment's declared sweep
included), composes each job's config with Hydra's compose API and prepares it (posbench/train_job.py,
posbench/eval_job.py: values checked and resolved once, data prepared into its cache, a single run's resume state
found, an evaluation's model loaded), checks that the folders the jobs will write can be written, and takes a
single training run's folder lock (posbench/runlock.py). The first bad job stops everything with :class:`Refused`,
one line, before any folder is made or touched; the CLI (posbench/cli.py) prints it and exits 2. What preparing a
job logs (a warning about a value, the options a fine-tune changes) is held, and logged when the job starts. Hydra's
tasks then find their prepared job with :func:`job_for`.

    prepare_all(["scheme=alibi", "train.seq_len=64"], "train")   # raises Refused
    job = job_for(cfg, train_job.prepare)                          # in Hydra's task: cfg is Hydra's composed config
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shlex
from contextlib import contextmanager
from importlib.resources import files
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from posbench import checkpoint, dist, eval_job, lineage, runlock, train_job
from posbench.config import ConfigError, PosbenchConfig, eval_schema, scheme_of, scheme_schema
from posbench.data import DataError
from posbench.schemes import SCHEMES

CONFIG_MODULE = "posbench.conf"
PREPARED: dict[str, object] = {}  # the composed job config (YAML) → its prepared job, made by prepare_all
HELD: dict[str, list[logging.LogRecord]] = {}  # the same key → what preparing it logged, logged when it starts
PARENT_GROUP, PARENT_SCHEME = "parent", "parent"  # the ConfigStore options inherit() stores (conf/train.yaml)


class Refused(Exception):
    """A job the command line asks for cannot run; the message is one line naming the value and the fix."""


def one_line(err: Exception, overrides: tuple[str, ...] = (), command: str = "train") -> str:
    """Hydra's and OmegaConf's multi-line composition errors, as one line naming the value and the choices (the
    command line's ``overrides``, to name the one at fault, and its ``command``, whose keys a hint shows)."""
    added = re.match(r"Could not override '([\w/]+)'\. No match in the defaults list", str(err))
    if added:  # `extend=yarn`: a group outside the defaults list is added with a plus
        given = next((o for o in overrides if o.split("=", 1)[0] == added[1]), f"{added[1]}=<option>")
        return f"{given}: {added[1]} is not in the defaults list; add it with a plus: +{given}"
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, name = err.missing_cfg_file.rsplit("/", 1)
        return f"unknown {group} {name!r}; choose one of: {', '.join(err.options or [])}"
    while err.__cause__ is not None:
        err = err.__cause__
    key = getattr(err, "full_key", None)
    text = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        scheme = scheme_of(getattr(err, "object_type", None))
        if getattr(err, "object_type", None) is eval_schema().__dataclass_fields__["scheme"].type:
            what = "cannot change the run's scheme" if key == "scheme.name" else "knows no scheme with that option"
            return (f"{key}: posbench eval {what}; it takes options of the run's scheme only "
                    f"(see them with: posbench train scheme=<name> --cfg job)")
        if scheme is not None:
            options = ", ".join(SCHEMES[scheme].options()) or "none"
            return f"{key} is not an option of the {scheme} scheme; its options: {options}"
        return f"unknown config key {key!r}; see the keys with: {SHOW_KEYS[command]}"
    if key and "is not a ListConfig, list or tuple" in text:  # `eval.probes=passkey`: a value where a list goes
        return f"{key}={err.value}: {key} must be a list, e.g. '{key}=[{err.value}]' (quoted, for the shell)"
    if key and "could not be converted" in text:
        return f"{key}: {text.replace('Value', 'value', 1)}"
    return f"{key}: {text}" if key else text


SHOW_KEYS = {"train": "posbench train --cfg job", "eval": "posbench eval run=<run folder> --cfg job"}
FINE_TUNES = ("extend",)  # the experiment presets that fine-tune a parent: refused without init_from
TRAIN_GROUPS = ("scheme", "model", "data", "experiment", "debug", "tricks", "extend", "hybrid",
                "recipe")  # conf/'s groups, train's only


EVAL_NAMES = {"train.device": "device", "train.threads": "threads"}  # train's names, posbench eval's own
HYDRA_VALUED = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd",
                "--config-dir", "--experimental-rerun"}  # Hydra's flags whose value is the next argument
HYDRA_INFO = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}  # --info's optional value


def eval_argv(argv: list[str]) -> list[str]:
    """``posbench eval``'s command line in the vocabulary of ``posbench train`` and ``posbench report`` too: a run
    folder given as an argument (as the report takes folders) is ``run=<folder>``; ``run=`` (or the argument) may
    name the run's checkpoint.pt, as ``init_from`` may; ``train.device=`` and ``train.threads=`` are eval's
    ``device=`` and ``threads=``. Raises Refused for an argument that is neither an override nor a run folder."""
    out = []
    for i, a in enumerate(argv):
        if a.startswith(("-", "~")) or (i and argv[i - 1] in HYDRA_VALUED) or \
                (i and argv[i - 1] in ("-i", "--info") and a in HYDRA_INFO):
            out.append(a)
            continue
        key, eq, value = a.partition("=")
        if not eq:  # an argument, as posbench report takes its folders
            key, value = "run", a
            if not (Path(a).is_dir() or Path(a).name == checkpoint.NAME):
                raise Refused(f"{a}: not a run folder; posbench eval takes the run as run=<run folder> (or its "
                              "folder alone) and its options as key=value, e.g. posbench eval run=outputs/…_alibi "
                              "eval.protocol=sliding")
        if key == "run" and Path(value).name == checkpoint.NAME:
            value = str(Path(value).parent)
        out.append(f"{EVAL_NAMES.get(key, key)}={value}")
    runs = [a for a in out if a.startswith("run=")]
    if len(runs) > 1:
        raise Refused(f"{' '.join(runs)}: posbench eval evaluates one run; for several, sweep them: posbench eval -m "
                      f"run={','.join(r.removeprefix('run=') for r in runs)}")
    return out


def slips(overrides: list[str], multirun: bool, config_name: str) -> None:
    """Raise Refused for the command-line slips Hydra answers with an error that does not say the fix: a
    comma-separated value without ``-m`` (``scheme=alibi,rope``: a sweep) and a config group given a non-string value
    (``debug=true``). An override Hydra cannot parse is left to composition, which names it."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:  # (composition names it)
        return
    for o in parsed:
        if o.is_sweep_override():
            if multirun:
                continue
            if o.value_type == ValueType.SIMPLE_CHOICE_SWEEP and is_list(o.key_or_group.lstrip("+"), config_name):
                raise Refused(f"{o.input_line}: {o.key_or_group} takes a list, written in brackets (quoted, for the "
                              f"shell): '{o.key_or_group}=[{o.input_line.split('=', 1)[1]}]'; without -m a "
                              "comma-separated value is a sweep")
            kept = [a for a in overrides if not a.startswith("hydra.run.")]  # a sweep writes under hydra.sweep.dir
            raise Refused(f"{o.input_line}: a sweep value, which runs with -m: posbench {config_name} -m {shlex.join(kept)}")
        group = o.key_or_group.lstrip("+~").split("@")[0]
        if group in TRAIN_GROUPS and o.value() is not None and not isinstance(o.value(), str):
            raise Refused(f"{o.input_line}: {group} is a config group; choose one of its options: "
                          f"{', '.join(group_options(group))}")


def is_list(key: str, config_name: str) -> bool:
    """Whether ``key`` (dotted) is a list in the schema of ``posbench <config_name>``."""
    schema = OmegaConf.structured(PosbenchConfig if config_name == "train" else eval_schema())
    try:
        return isinstance(OmegaConf.select(schema, key, throw_on_missing=False), ListConfig)
    except Exception:  # noqa: BLE001 - a key the schema cannot select (the scheme's): not a list of the schema's
        return False


def group_options(group: str) -> list[str]:
    """The options of one of conf/'s config groups (its YAML files' names; the scheme group's also the registered
    schemes, which the CLI stores in Hydra's ConfigStore), sorted."""
    stored = list(SCHEMES) if group == "scheme" else []
    return sorted({*stored, *(f.name.removesuffix(".yaml") for f in files(CONFIG_MODULE).joinpath(group).iterdir()
                              if f.name.endswith(".yaml"))})


def check_eval_overrides(overrides: list[str]) -> None:
    """Raise Refused for a ``posbench eval`` override that picks an option of one of training's config groups
    (``scheme=alibi``, ``model=small``): an evaluation scores the run's trained model as it was built. An override
    Hydra cannot parse is left to composition, which names it."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:  # (composition names it)
        return
    for o in parsed:
        group = o.key_or_group.split("@")[0]
        if group == "scheme":
            raise Refused(f"{o.input_line}: the scheme cannot be changed by posbench eval (it scores the run's trained "
                          "weights); it takes options of the run's scheme only, e.g. scheme.scaling=yarn "
                          "scheme.factor=4 on a rotary run (see them with: posbench train scheme=<name> --cfg job)")
        if group in TRAIN_GROUPS:
            raise Refused(f"{o.input_line}: the {group} cannot be changed by posbench eval (it scores the run's "
                          "trained model); it takes eval.*, device, threads and options of the run's scheme "
                          "(scheme.<option>=…)")


def inherit(overrides: list[str]) -> None:
    """Make Hydra compose, for a run started from a parent (``init_from=<run>`` on the command line, or each value
    of a sweep over it), the parent's scheme with the parent's options, its L (``train.seq_len``) and its layers'
    options (``model.layer_pattern`` …: posbench.lineage.LAYER_KEYS), unless the
    command line or a preset gives them (posbench/lineage.py :func:`~posbench.lineage.inherited`). It stores two
    options in Hydra's ConfigStore, replacing those of an earlier call: ``scheme/parent``, the parent's scheme
    options on its scheme's schema, and ``parent/init`` (package ``_global_``), which overrides the scheme group's
    default with it and sets ``train.seq_len``. conf/train.yaml takes ``parent/init``, when stored, after the model
    and data and before debug=fast's lengths and the presets, so a command line's ``scheme=…`` or
    ``train.seq_len=…``, a preset's and debug=fast's come after it; a sweep's joblib and SLURM workers get the
    ConfigStore with Hydra's state.

    Raises ConfigError: a parent that cannot be read (``posbench.lineage.read``), or a sweep over parents that
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
            **({"model": t["model"]} if t.get("model") else {})})


def expand(overrides: list[str], multirun: bool, config_name: str) -> list[list[str]]:
    """The override lists of every job the command line asks for (sweeps expanded, the config's own too)."""
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    if not multirun:
        return [overrides]
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    declared = compose(config_name, overrides=fixed, return_hydra_config=True).hydra.sweeper.params or {}
    given = {o.key_or_group for o in parsed}
    parsed += parser.parse_overrides([f"{k}={v}" for k, v in declared.items() if k.lstrip("+~").split("@")[0] not in given])
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
        hydra_cfg = cfg.pop("hydra")
    key = key_of(cfg)
    preset = hydra_cfg.runtime.choices.get("experiment")
    if config_name == "train" and preset in FINE_TUNES and cfg.init_from is None:
        raise ConfigError(f"experiment={preset} fine-tunes a trained run: give it one with init_from=<run folder or "
                          f"its checkpoint.pt>, e.g. posbench train -m experiment={preset} init_from=outputs/rope128")
    if config_name == "train" and not multirun:
        unpinned(hydra_cfg, preset)
    if config_name == "eval":
        job = eval_job.prepare(cfg)
        return key, job, job.run_dir
    folder = Path(os.path.abspath(hydra_cfg.sweep.dir if multirun else hydra_cfg.run.dir))
    if not multirun and dist.rank() == 0:
        runlock.check_free(folder)  # before its training states are read: another run may be writing them
    return key, train_job.prepare(cfg, None if multirun else folder), folder


def unpinned(hydra_cfg: DictConfig, preset: str | None) -> None:
    """Raise ConfigError for a single run (no ``-m``) of a preset that declares a sweep
    (``hydra.sweeper.params``) and whose command line does not pick a value of every key it sweeps: Hydra would
    silently run the config's defaults, one job, where the preset means a sweep. A command line that picks each
    swept key runs that one job of the sweep (``posbench train experiment=demo scheme=alibi``)."""
    declared = hydra_cfg.sweeper.params or {}
    given = {o.split("=", 1)[0].lstrip("+~").split("@")[0] for o in hydra_cfg.overrides.task}
    command = [*hydra_cfg.overrides.task, *(o for o in hydra_cfg.overrides.hydra
                                            if not o.startswith(("hydra.run.", "hydra.mode")))]  # a sweep's: not run.dir
    free = [k for k in declared if k.lstrip("+~").split("@")[0] not in given]
    if free:
        pins = " ".join(f"{k}=<one of {declared[k]}>" for k in free)
        name = f"experiment={preset}" if preset else "the config"
        raise ConfigError(f"{name} declares a sweep over {', '.join(free)}: run it with -m "
                          f"(posbench train -m {shlex.join(command)}), or run one of its jobs with {pins}")


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
    that their folders can be written, take a single training run's folder lock (posbench/runlock.py), keep each
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
