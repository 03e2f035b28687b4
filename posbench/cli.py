"""The ``posbench`` command: ``posbench <train|eval|report> [Hydra overrides or options]``.

    posbench train scheme=alibi train.seq_len=64             # one run into outputs/<date>/<time>_alibi
    posbench train -m experiment=demo                        # the four-scheme sweep; a table at the end
    posbench train --cfg job                                 # print the composed config (any Hydra flag works)
    posbench eval run=outputs/…/alibi eval.protocol=sliding eval.stride=64   # re-evaluate, no retraining
    posbench report multirun/2026-11-21/10-00-00 [--out DIR]  # report.md, report.csv and plots

Each of ``train`` and ``eval`` is one ``@hydra.main`` over the schemas this module stores in Hydra's ConfigStore
(:func:`register`). Before Hydra starts, every job of the command line (each combination of a sweep, the
experiment's declared sweep included) is composed and prepared (:func:`preflight`: posbench/train_job.py,
posbench/eval_job.py), so a typo, a wrong type or a bad value stops everything with one line on stderr and exit
status 2, before any folder is made, any data is read or any step is trained. Each Hydra job then runs the job
prepared for it (in this process; a sweep's worker process prepares its own, once).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the Hub is opt-in: set HF_HUB_OFFLINE=0 to download corpora
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")  # offline runs: `wandb sync <run>/wandb/offline-run-*` uploads later
if not sys.stderr.isatty() or os.environ.get("CI"):
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # logs and CI get no progress bars

import hydra  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: E402
from hydra.errors import MissingConfigException  # noqa: E402
from hydra.experimental.callback import Callback  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig, OmegaConf, open_dict  # noqa: E402
from omegaconf.errors import ConfigAttributeError, ConfigKeyError  # noqa: E402

from posbench import compare, dist, eval_job, gpus, report, train_job  # noqa: E402  (gpus registers ${posbench_gpus:})
from posbench.checkpoint import CheckpointError  # noqa: E402
from posbench.config import ConfigError, PosbenchConfig, eval_schema, scheme_of, scheme_schema, to_dict  # noqa: E402
from posbench.data import DataError  # noqa: E402
from posbench.schemes import SCHEMES  # noqa: E402
from posbench.tracking import Tracker  # noqa: E402
from posbench.train import EXIT_PREEMPTED, Preempted, TrainingFailed, train  # noqa: E402

CONFIG_MODULE = "posbench.conf"
USAGE = """usage: posbench <command> [overrides...]

commands:
  train    train at length L, evaluate at L..16L        posbench train scheme=alibi
  eval     re-evaluate a trained run          posbench eval run=<run folder> eval.protocol=sliding eval.stride=64
  report   tables and plots from runs         posbench report <folders...> [--out DIR]

Overrides are Hydra's: key=value, group=option, -m for a sweep, --cfg job to print the config."""
PREPARED: dict[str, object] = {}  # the composed job config (YAML) → its prepared job, made by preflight


class Exit(SystemExit):
    """A deliberate exit (2: refused, 1: training failed, 75: preempted) that every torchrun rank takes at the
    same point, so the ranks can leave the process group together; any other exit may be one rank's alone."""


def fail(message: str) -> None:
    """Print one error line and exit with status 2."""
    print(f"posbench: error: {message}", file=sys.stderr)
    raise Exit(2)


def register() -> None:
    """Store the schemas in Hydra's ConfigStore: ``posbench_schema`` (train), ``posbench_eval_schema`` (eval), and
    one option of the ``scheme`` group per scheme in ``SCHEMES`` now (``posbench.config.scheme_schema``), replacing
    the options a previous call stored; and the resolver ``${posbench_schemes:}``, the registered scheme names
    joined by commas (``experiment=zoo`` sweeps them)."""
    OmegaConf.register_new_resolver("posbench_schemes", lambda: ",".join(SCHEMES), replace=True)
    store = ConfigStore.instance()
    store.store(name="posbench_schema", node=PosbenchConfig)
    store.store(name="posbench_eval_schema", node=eval_schema())
    store.repo.pop("scheme", None)
    for name in SCHEMES:
        store.store(group="scheme", name=name, node=scheme_schema(name))


# ---- before Hydra: every job composed and prepared ----------------------------------------------------------


def _one_line(err: Exception) -> str:
    """Hydra's and OmegaConf's multi-line composition errors, as one line naming the value and the choices."""
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
        return f"unknown config key {key!r}; see the keys with: posbench train --cfg job"
    if key and "could not be converted" in text:
        return f"{key}: {text.replace('Value', 'value', 1)}"
    return f"{key}: {text}" if key else text


def _jobs(overrides: list[str], multirun: bool, config_name: str) -> list[list[str]]:
    """The override lists of every job the command line asks for (sweeps expanded, the config's own too)."""
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    if not multirun:
        return [overrides]
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    declared = compose(config_name, overrides=fixed, return_hydra_config=True).hydra.sweeper.params or {}
    given = {o.key_or_group for o in parsed}
    parsed += parser.parse_overrides([f"{k}={v}" for k, v in declared.items() if k not in given])
    axes = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
            for o in parsed]
    return [list(c) for c in itertools.product(*axes)]


def _key(cfg: DictConfig) -> str:
    """What identifies a job: its composed config (without Hydra's node), as YAML."""
    return OmegaConf.to_yaml(cfg)


def _job(cfg: DictConfig, prepare):
    """The job :func:`preflight` prepared for Hydra's composed ``cfg`` in this process, or, in a sweep's worker
    process, ``prepare(cfg)``. (Hydra's tasks reach :data:`PREPARED` only through here: a joblib worker receives a
    task function pickled by value, with the globals it names, and must not receive the prepared jobs.)"""
    return PREPARED.get(_key(cfg)) or prepare(cfg)


def _prepare(config_name: str, cfg: DictConfig, multirun: bool):
    """(the key Hydra's task will find it by, the prepared job) of the composed ``cfg``, Hydra's node popped first. A
    single training run's job carries the training state of its run folder; a sweep's jobs look theirs up in their
    Hydra tasks, once Hydra has named their folders."""
    with open_dict(cfg):
        hydra_cfg = cfg.pop("hydra")
    key = _key(cfg)
    if config_name == "eval":
        return key, eval_job.prepare(cfg)
    run_dir = None if multirun else Path(os.path.abspath(OmegaConf.to_container(hydra_cfg.run, resolve=True)["dir"]))
    return key, train_job.prepare(cfg, run_dir)


def preflight(argv: list[str], config_name: str) -> None:
    """Compose and prepare every job of ``argv`` (values checked and resolved, data prepared into its cache and
    the splits' sizes checked, a single run's resume state found or refused, an evaluation's model loaded), keep
    each in :data:`PREPARED` for Hydra's job, and set ``POSBENCH_SWEPT``; exit with one error line on the first
    bad one."""
    flags = [a for a in argv if a.startswith("-")]
    if any(f not in ("-m", "--multirun") for f in flags):
        return  # --cfg, --help, --info ...: Hydra's own business
    overrides = [a for a in argv if not a.startswith("-")]
    PREPARED.clear()
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            jobs = _jobs(overrides, bool(flags), config_name)
            for job in jobs:
                key, prepared = _prepare(config_name, compose(config_name, overrides=job, return_hydra_config=True),
                                         bool(flags))
                PREPARED[key] = prepared
    except (ConfigError, DataError) as e:
        fail(str(e))
    except Exception as e:  # Hydra / OmegaConf composition errors
        fail(_one_line(e))
    swept = {o.split("=", 1)[0] for job in jobs for o in job if sum(o in other for other in jobs) < len(jobs)}
    os.environ["POSBENCH_SWEPT"] = ",".join(sorted(swept))  # the run name of each job: its swept overrides


# ---- Hydra's jobs -------------------------------------------------------------------------------------------


def _run_name(job: train_job.TrainJob, hc) -> str:
    """A training run's wandb name: its variant label (``rope+yarn×16``) and its other swept overrides (``seed=1``)."""
    swept = set(os.environ.get("POSBENCH_SWEPT", "").split(","))
    others = [o for o in hc.overrides.task if o.split("=", 1)[0] in swept and not o.startswith("scheme")]
    return ",".join([job.label, *others])


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="train", version_base="1.3")
def _train(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    with gpus.job_gpu(hc):  # first: the job's own GPU (joblib sweeps), before anything touches CUDA
        out_dir = Path(hc.runtime.output_dir)
        try:
            job = train_job.in_folder(_job(cfg, train_job.prepare), out_dir)
        except (ConfigError, DataError) as e:
            fail(str(e))
        multirun = hc.mode == RunMode.MULTIRUN
        tracker = Tracker.from_config(job.config, out_dir, "train", name=_run_name(job, hc),
                                      sweep_dir=Path(hc.sweep.dir) if multirun else None, config=to_dict(job.config))
        try:
            train(job, tracker)
        except CheckpointError as e:
            tracker.finish(exit_code=2)
            fail(str(e))
        except TrainingFailed as e:
            tracker.finish(exit_code=1)
            print(f"posbench: error: {e}", file=sys.stderr)
            if not multirun:
                raise Exit(1)  # in a sweep the other jobs go on; the report lists this run as failed
        except Preempted as e:
            tracker.finish(exit_code=EXIT_PREEMPTED)
            print(f"posbench: {e}", file=sys.stderr)
            raise Exit(EXIT_PREEMPTED)
        tracker.finish()


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="eval", version_base="1.3")
def _eval(cfg: DictConfig) -> None:
    with gpus.job_gpu(HydraConfig.get()):
        try:
            job = _job(cfg, eval_job.prepare)
        except (ConfigError, DataError) as e:
            fail(str(e))
        rec = eval_job.run(job)
        tracker = Tracker.from_config(job.config, job.run_dir, "eval", config=rec["config"],
                                      name=f"{rec['label']} {rec['protocol']} {rec['split']}")
        tracker.log_eval(rec["results"])
        tracker.finish()


class ReportCallback(Callback):
    """Hydra callback (conf/train.yaml): at the end of every multirun, write the report into the sweep folder,
    print its tables, and log the perplexity-vs-length chart and the PNGs to a wandb run of the sweep's group."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep = Path(config.hydra.sweep.dir)
        try:
            table_text, rows, images = report.write_report([sweep], sweep)
        except compare.ReportError as e:
            report.log.warning("no report: %s", e)
            return
        print(f"\n{table_text}\n\nreport: {sweep / 'report.md'}", flush=True)
        tracker = Tracker.from_config(config, sweep, "report", name="report", sweep_dir=sweep)
        tracker.log_report(compare.ppl_series(rows), images)
        tracker.finish()


def _report(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="posbench report", description="Tables and plots from the runs under FOLDERs.")
    parser.add_argument("folders", nargs="+", type=Path, help="run or sweep folders (searched recursively)")
    parser.add_argument("--out", type=Path, help="where to write the report (default: the first folder)")
    args = parser.parse_args(argv)
    try:
        table_text, _, _ = report.write_report(args.folders, args.out or args.folders[0])
    except compare.ReportError as e:
        fail(str(e))
    print(f"{table_text}\n\nreport: {(args.out or args.folders[0]) / 'report.md'}")


COMMANDS = {"train": (_train, "train"), "eval": (_eval, "eval")}


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``posbench`` console script and of ``python -m posbench``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, rest = argv[0], argv[1:]
    if command == "report":
        return _report(rest)
    if command not in COMMANDS:
        fail(f"unknown command {command!r}; choose one of: train, eval, report")
    task, config_name = COMMANDS[command]
    register()
    dist.init()  # torchrun: every rank checks the same jobs, then writes one run folder (rank 0's time stamps it)
    os.environ["POSBENCH_RUN_STAMP"] = dist.broadcast(time.strftime("%Y-%m-%d/%H-%M-%S"))  # preflight's and Hydra's
    if dist.rank() > 0:  # only rank 0 writes Hydra's files and logs
        rest = [*rest, "hydra.output_subdir=null", "hydra/job_logging=disabled"]
    sys.argv = [f"posbench-{command}", *rest]
    try:
        preflight(rest, config_name)
        os.environ.setdefault(gpus.LOCK_DIR_ENV, str(gpus.default_lock_dir()))  # one GPU lock folder for a sweep
        task()
    except Exit:  # a refused, failed or preempted run: every rank exits here with the same status
        dist.finish()
        raise
    except BaseException:  # an unforeseen error (Hydra turns it into exit 1), maybe on this rank alone: leave
        dist.finish(together=False)  # without waiting for the others
        raise
    dist.finish()
