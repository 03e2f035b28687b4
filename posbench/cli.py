"""The ``posbench`` command: ``posbench <train|eval|report> [Hydra overrides or options]``.

    posbench train scheme=alibi train.seq_len=64             # one run into outputs/<date>/<time>_alibi
    posbench train -m experiment=demo                        # the four-scheme sweep; a table at the end
    posbench train --cfg job                                 # print the composed config (any Hydra flag works)
    posbench eval run=outputs/…/alibi eval.protocol=sliding eval.stride=64   # re-evaluate, no retraining
    posbench report multirun/2026-11-21/10-00-00 [--out DIR]  # report.md, report.csv and plots

Each subcommand is one ``@hydra.main``. Before Hydra starts, every job of the command line (each
combination of a sweep, the experiment's declared sweep included) is composed and checked, so a typo,
a wrong type or a bad value stops everything with one line on stderr and exit status 2, before any
folder is made, any data is read or any step is trained.
"""

from __future__ import annotations

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
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig, OmegaConf, open_dict  # noqa: E402

from posbench.config import ConfigError, finalize, register, scheme_of  # noqa: E402
from posbench.eval_job import eval_config, eval_schema  # noqa: E402
from posbench import dist, gpus  # noqa: E402  (registers ${posbench_gpus:}; at module level so joblib workers have it)
from posbench.data import DataError  # noqa: E402
from posbench.positional import SCHEMES  # noqa: E402

CONFIG_MODULE = "posbench.conf"
USAGE = """usage: posbench <command> [overrides...]

commands:
  train    train at length L, evaluate at L..16L        posbench train scheme=alibi
  eval     re-evaluate a trained run          posbench eval run=<run folder> eval.protocol=sliding eval.stride=64
  report   tables and plots from runs         posbench report <folders...> [--out DIR]

Overrides are Hydra's: key=value, group=option, -m for a sweep, --cfg job to print the config."""


class Exit(SystemExit):
    """A deliberate exit (2: refused, 1: training failed, 75: preempted) that every torchrun rank takes at the
    same point, so the ranks can leave the process group together; any other exit may be one rank's alone."""


def fail(message: str) -> None:
    """Print one error line and exit with status 2."""
    print(f"posbench: error: {message}", file=sys.stderr)
    raise Exit(2)


def _one_line(err: Exception) -> str:
    """Hydra's and OmegaConf's multi-line composition errors, as one line naming the value and the choices."""
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, name = err.missing_cfg_file.rsplit("/", 1)
        return f"unknown {group} {name!r}; choose one of: {', '.join(err.options or [])}"
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

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
    from hydra import compose
    from hydra.core.override_parser.overrides_parser import OverridesParser

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


def _check_train(cfg: DictConfig, multirun: bool) -> None:
    """Values, data, and (a single run into an existing folder) that its checkpoint is of the same config."""
    from posbench.resume import resume_state
    from posbench.train import check_data

    hydra_cfg = _pop_hydra(cfg)
    check_data(finalize(cfg, SCHEMES))
    if not multirun and cfg.resume == "auto":
        resume_state(cfg, Path(OmegaConf.to_container(hydra_cfg.run, resolve=True)["dir"]))


def _check_eval(job: DictConfig, multirun: bool) -> None:
    _pop_hydra(job)
    eval_config(job, SCHEMES)


def _pop_hydra(cfg: DictConfig) -> DictConfig:
    """Remove and return the ``hydra`` node of a config composed with ``return_hydra_config=True``."""
    with open_dict(cfg):
        return cfg.pop("hydra")


CHECKS = {"train": _check_train, "eval": _check_eval}


def preflight(argv: list[str], config_name: str) -> None:
    """Compose and check every job of ``argv`` (values, then data: the corpus is prepared into its cache
    and the splits' sizes checked); exit with one error line on the first bad one."""
    from hydra import compose, initialize_config_module

    flags = [a for a in argv if a.startswith("-")]
    if any(f not in ("-m", "--multirun") for f in flags):
        return  # --cfg, --help, --info ...: Hydra's own business
    overrides = [a for a in argv if not a.startswith("-")]
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            jobs = _jobs(overrides, bool(flags), config_name)
            for job in jobs:
                CHECKS[config_name](compose(config_name, overrides=job, return_hydra_config=True), bool(flags))
    except (ConfigError, DataError) as e:
        fail(str(e))
    except Exception as e:  # Hydra / OmegaConf composition errors
        fail(_one_line(e))
    swept = {o.split("=", 1)[0] for job in jobs for o in job if sum(o in other for other in jobs) < len(jobs)}
    os.environ["POSBENCH_SWEPT"] = ",".join(sorted(swept))  # the run name of each job: its swept overrides


def _tracker(cfg: DictConfig, out_dir: Path, job_type: str):
    """The wandb tracker of this Hydra job: named by its variant label (``rope+yarn×16``) and its other swept
    overrides (``alibi,seed=1``), grouped by its sweep."""
    from posbench.config import to_dict
    from posbench.positional import variant_label
    from posbench.report import sweep_group
    from posbench.tracking import Tracker

    hc = HydraConfig.get()
    swept = set(os.environ.get("POSBENCH_SWEPT", "").split(","))
    others = [o for o in hc.overrides.task if o.split("=", 1)[0] in swept and not o.startswith("scheme")]
    name = ",".join([variant_label(to_dict(cfg.scheme)), *others])
    group = sweep_group(Path(hc.sweep.dir)) if hc.mode == RunMode.MULTIRUN else None
    w = cfg.wandb
    return Tracker(w.enabled and dist.rank() == 0, out_dir, w.project, w.entity, name=name, group=group, config=to_dict(cfg),
                   job_type=job_type, tags=list(w.tags))


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="train", version_base="1.3")
def _train(cfg: DictConfig) -> None:
    from posbench.checkpoint import CheckpointError
    from posbench.train import EXIT_PREEMPTED, Preempted, TrainingFailed, train

    with gpus.job_gpu(HydraConfig.get()):  # first: the job's own GPU (joblib sweeps), before anything touches CUDA
        out_dir = Path(HydraConfig.get().runtime.output_dir)
        tracker = _tracker(cfg, out_dir, "train")
        try:
            train(cfg, out_dir, tracker)
        except (ConfigError, DataError, CheckpointError) as e:
            tracker.finish(exit_code=2)
            fail(str(e))
        except TrainingFailed as e:
            tracker.finish(exit_code=1)
            print(f"posbench: error: {e}", file=sys.stderr)
            if HydraConfig.get().mode != RunMode.MULTIRUN:
                raise Exit(1)  # in a sweep the other jobs go on; the report lists this run as failed
        except Preempted as e:
            tracker.finish(exit_code=EXIT_PREEMPTED)
            print(f"posbench: {e}", file=sys.stderr)
            raise Exit(EXIT_PREEMPTED)
        tracker.finish()


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="eval", version_base="1.3")
def _eval(job: DictConfig) -> None:
    from posbench.evaluate import reevaluate
    from posbench.tracking import Tracker
    from posbench.train import resolve_device, set_threads

    with gpus.job_gpu(HydraConfig.get()):
        try:
            cfg, state = eval_config(job, SCHEMES)
            device, threads = resolve_device(job.device), set_threads(job.threads)
            rec = reevaluate(cfg, state, Path(job.run), device, threads)
        except (ConfigError, DataError) as e:
            fail(str(e))
        w = cfg.wandb
        tracker = Tracker(w.enabled and dist.rank() == 0, Path(job.run), w.project, w.entity, job_type="eval", config=rec["config"],
                          name=f"{rec['label']} {rec['protocol']} {rec['split']}",
                          tags=list(w.tags))
        tracker.log_eval(rec["results"])
        tracker.finish()


def _report(argv: list[str]) -> None:
    import argparse

    from posbench.report import ReportError, write_report

    parser = argparse.ArgumentParser(prog="posbench report", description="Tables and plots from the runs under FOLDERs.")
    parser.add_argument("folders", nargs="+", type=Path, help="run or sweep folders (searched recursively)")
    parser.add_argument("--out", type=Path, help="where to write the report (default: the first folder)")
    args = parser.parse_args(argv)
    try:
        table_text, _, _ = write_report(args.folders, args.out or args.folders[0])
    except ReportError as e:
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
    preflight(rest, config_name)
    os.environ.setdefault(gpus.LOCK_DIR_ENV, str(gpus.default_lock_dir()))  # one GPU lock folder for a sweep's workers
    if dist.world() > 1:  # torchrun: one run folder for all ranks; only rank 0 writes Hydra's files and logs
        dist.init()
        os.environ["POSBENCH_RUN_STAMP"] = dist.broadcast(time.strftime("%Y-%m-%d/%H-%M-%S"))
        if dist.rank() > 0:
            rest = [*rest, "hydra.output_subdir=null", "hydra/job_logging=disabled"]
    sys.argv = [f"posbench-{command}", *rest]
    try:
        task()
    except Exit:  # a failed, refused or preempted run: every rank exits here with the same status
        dist.finish()
        raise
    except BaseException:  # an unforeseen error (Hydra turns it into exit 1), maybe on this rank alone: leave
        dist.finish(together=False)  # without waiting for the others
        raise
    dist.finish()
