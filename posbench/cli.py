"""The ``posbench`` command: ``posbench <train|eval|report|export> [Hydra overrides or options]``.

    posbench train scheme=alibi train.seq_len=64             # one run into outputs/<date>/<time>_alibi
    posbench train -m experiment=demo                        # the four-scheme sweep; a table at the end
    posbench train --cfg job                                 # print the composed config (any Hydra flag works)
    posbench eval run=outputs/…/alibi eval.protocol=sliding eval.stride=64   # re-evaluate, no retraining
    posbench eval pretrained=SmolLM2-135M-Instruct.Q4_1.gguf eval.remap=self_extend   # a pretrained checkpoint
    posbench report multirun/2026-11-21/10-00-00 [--out DIR]  # report.md, report.csv and plots
    posbench export run=outputs/…/rope out=exported/rope       # a Llama-block run as a Hugging Face model folder

Each of ``train`` and ``eval`` is one ``@hydra.main`` over the schemas this module stores in Hydra's ConfigStore
(:func:`register`). Before Hydra starts, every job of the command line (each combination of a sweep, the
experiment's declared sweep included) is composed and prepared (:func:`preflight`: posbench/jobs/train_job.py,
posbench/jobs/eval_job.py), so a typo, a wrong type or a bad value stops everything with one line on stderr and exit
status 2, before any folder is made, any data is read or any step is trained. Each Hydra job then runs the job
prepared for it (in this process; a sweep's worker process prepares its own, once).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the Hub is opt-in: set HF_HUB_OFFLINE=0 to download corpora
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")  # offline runs: `wandb sync <run>/wandb/offline-run-*` uploads later
if not sys.stderr.isatty() or os.environ.get("CI"):
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # logs and CI get no progress bars

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import posbench
from posbench.attention import flex
from posbench.config.checks import ConfigError
from posbench.config.schema import PosbenchConfig, eval_schema, scheme_schema, to_dict
from posbench.data.cache import DataError
from posbench.evaluation import passkey
from posbench.jobs import command, eval_job, export_job, overrides, train_job
from posbench.jobs.command import CONFIG_MODULE, writable
from posbench.report import compare, render
from posbench.report.records import ReportError
from posbench.runtime import dist, gpus, runlock, sweep_stop  # (gpus registers ${posbench_gpus:})
from posbench.runtime.signals import EXIT_INTERRUPTED, Interrupted
from posbench.runtime.tracking import Tracker
from posbench.schemes import SCHEMES
from posbench.training.checkpoint import CheckpointError
from posbench.training.job import TrainJob
from posbench.training.loop import Preempted, TrainingFailed, train

USAGE = """usage: posbench <command> [overrides...]
       posbench --version

commands:
  train    train at length L, evaluate at L..16L   posbench train scheme=alibi
  eval     re-evaluate a trained run               posbench eval run=<run folder> eval.protocol=sliding eval.stride=64
           or evaluate a pretrained checkpoint     posbench eval pretrained=<HF model folder | Hub id | .gguf file>
  report   tables and plots from runs              posbench report <folders...> [--out DIR]
  export   a Llama-block run as a HF model folder  posbench export run=<run folder> out=<new folder>

Overrides are Hydra's: key=value, group=option, -m for a sweep, --cfg job to print the config."""


class Exit(SystemExit):
    """A deliberate exit (2: refused, 1: training failed, 75: preempted) that every torchrun rank takes at the
    same point, so the ranks can leave the process group together; any other exit may be one rank's alone."""


def fail(message: str) -> None:
    """Print one error line and exit with status 2."""
    print(f"posbench: error: {message}", file=sys.stderr)
    raise Exit(2)


def register() -> None:
    """Store the schemas in Hydra's ConfigStore: ``posbench_schema`` (train), ``posbench_eval_schema`` (eval), and
    one option of the ``scheme`` group per scheme in ``SCHEMES`` now (``posbench.config.schema.scheme_schema``), replacing
    the options a previous call stored; and the resolver ``${posbench_schemes:}``, the registered scheme names
    joined by commas (``experiment=zoo`` sweeps them)."""
    OmegaConf.register_new_resolver("posbench_schemes", lambda: ",".join(SCHEMES), replace=True)
    store = ConfigStore.instance()
    store.store(name="posbench_schema", node=PosbenchConfig)
    store.store(name="posbench_eval_schema", node=eval_schema())
    store.repo.pop("scheme", None)
    for name in SCHEMES:
        store.store(group="scheme", name=name, node=scheme_schema(name))


def preflight(argv: list[str], config_name: str) -> None:
    """Compose and prepare every job of ``argv`` before Hydra starts (posbench/jobs/command.py); exit with one error line
    and status 2 on the first bad one."""
    try:
        command.prepare_all(argv, config_name)
    except command.Refused as e:
        fail(str(e))


# ---- Hydra's jobs -------------------------------------------------------------------------------------------


def _run_name(job: TrainJob, hc) -> str:
    """A training run's wandb name: its variant label (``rope+yarn×16``) and its other swept overrides (``seed=1``)."""
    swept = set(os.environ.get("POSBENCH_SWEPT", "").split(","))
    others = [o for o in hc.overrides.task if o.split("=", 1)[0] in swept and not o.startswith("scheme")]
    return ",".join([job.label, *others])


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="train", version_base="1.3")
def _train(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    # a sweep whose jobs run on this machine (joblib's workers, or this process) stops as one
    # (posbench/runtime/sweep_stop.py); a SLURM task (submitit) stops and requeues on its own
    sweep = Path(hc.sweep.dir) if multirun and "submitit" not in str(hc.launcher.get("_target_", "")) else None
    if sweep is not None:
        sweep_stop.as_worker()
        if sweep_stop.requested(sweep) is not None:
            print(f"not started, the sweep was stopped: {out_dir}", file=sys.stderr, flush=True)
            return
    try:
        _train_job(cfg, hc, out_dir, sweep)
    except Exit:
        if sweep is None:
            raise  # (a sweep's job says what failed and returns: an exit would take joblib's pool down with it)


def _train_job(cfg: DictConfig, hc, out_dir: Path, sweep: Path | None) -> None:
    """One training job in ``out_dir``: lock the folder, prepare, train, say how it ended; ``sweep``: the folder of a
    sweep that stops as one (None: a single run, or a SLURM task). Such a sweep's finished job is skipped, and a
    stopped one stops the sweep (its stop file) instead of exiting."""
    try:
        command.lock(out_dir)  # a sweep's job: its folder is named now (a single run's was taken by preflight)
    except command.Refused as e:
        fail(str(e))
    with runlock.releasing(out_dir), gpus.job_gpu(hc):  # the job's own GPU (joblib sweeps) before CUDA is touched
        flex.reset_compiled()  # the previous job's kernels of this process (a sweep) count against Dynamo's limit
        try:
            job = train_job.in_folder(command.job_for(cfg, train_job.prepare), out_dir)
        except (ConfigError, DataError) as e:
            fail(str(e))
        if sweep is not None and finished(job, out_dir):
            print(f"finished already, skipped: {out_dir}", flush=True)
            return
        if dist.rank() == 0:
            print(f"run folder: {out_dir}", flush=True)
        multirun = hc.mode == RunMode.MULTIRUN
        tracker = Tracker.from_config(job.config, out_dir, "train", name=_run_name(job, hc),
                                      sweep_dir=Path(hc.sweep.dir) if multirun else None,
                                      config={**to_dict(job.config), **({"lineage": job.lineage} if job.lineage else {})})
        try:
            train(job, tracker, sweep_stop.path(sweep) if sweep is not None else None)
        except CheckpointError as e:
            tracker.finish(exit_code=2)
            fail(str(e))
        except TrainingFailed as e:
            tracker.finish(exit_code=1)
            print(f"posbench: error: {e}", file=sys.stderr)
            if not multirun:
                raise Exit(1)  # in a sweep the other jobs go on; the report lists this run as failed
        except Preempted as e:
            tracker.finish(exit_code=e.exit_status)
            if sweep is None:
                print(f"posbench: {e}", file=sys.stderr)
                raise Exit(e.exit_status)
            sweep_stop.request(sweep, e.signum)  # (a signal of its own: the sweep stops as one)
            print(f"posbench: {e.saved}", file=sys.stderr, flush=True)
            return
        tracker.finish()
        if dist.rank() == 0:
            print(f"run folder: {out_dir}", flush=True)


def finished(job: TrainJob, out_dir: Path) -> bool:
    """Whether ``out_dir`` holds this job finished: its training state at the last step (the same config: the job's
    resume checks passed) and a complete results.json."""
    if not job.state or job.state.get("step", 0) < job.config.train.steps or not (out_dir / "results.json").is_file():
        return False
    try:
        return json.loads((out_dir / "results.json").read_text()).get("status") == "complete"
    except ValueError:
        return False


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="eval", version_base="1.3")
def _eval(cfg: DictConfig) -> None:
    with gpus.job_gpu(HydraConfig.get()):
        flex.reset_compiled()  # the previous job's kernels of this process (a sweep) count against Dynamo's limit
        try:
            job = command.job_for(cfg, lambda c: eval_job.prepare(c, HydraConfig.get().run.dir))
        except (ConfigError, DataError) as e:
            fail(str(e))
        rec = eval_job.run(job)
        tracker = Tracker.from_config(job.config, job.run_dir, "eval", name=f"{rec['label']} {rec['protocol']} {rec['split']}",
                                      config={**rec["config"], **{k: rec[k] for k in ("pretrained",) if k in rec}})
        tracker.log_eval(rec["results"])
        tracker.log_passkey(*(passkey.accuracy(rec["passkey"]["trials"], kind) for kind in ("", "transfer_"))
                            if rec.get("passkey") else (None,))
        tracker.log_context(rec.get("context"))
        tracker.finish()


class ReportCallback(Callback):
    """Hydra callback (conf/train.yaml): at the start of a multirun, the parent takes Ctrl-C and SIGTERM to stop the
    sweep as one (posbench/runtime/sweep_stop.py); at its end, write the report into the sweep folder, print its
    tables, and log the perplexity-vs-length chart and the PNGs to a wandb run of the sweep's group."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if config.hydra.job.name == "train" and "submitit" not in str(config.hydra.launcher.get("_target_", "")):
            sweep_stop.PARENT.start(Path(config.hydra.sweep.dir))  # Ctrl-C and SIGTERM stop the sweep as one

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_stop.PARENT.end()
        sweep = Path(config.hydra.sweep.dir)
        try:
            table_text, rows, images = render.write_report([sweep], sweep)
        except ReportError as e:
            render.log.warning("no report: %s", e)
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
        writable(args.out or args.folders[0], "give a folder you can write with --out DIR")
    except ConfigError as e:
        fail(str(e))
    try:
        table_text, _, _ = render.write_report(args.folders, args.out or args.folders[0])
    except ReportError as e:
        fail(str(e))
    print(f"{table_text}\n\nreport: {(args.out or args.folders[0]) / 'report.md'}")


def _export(argv: list[str]) -> None:
    try:
        print(f"exported: {export_job.export(**export_job.arguments(argv))}")
    except ConfigError as e:
        fail(str(e))


COMMANDS = {"train": (_train, "train"), "eval": (_eval, "eval")}


INTERRUPTED = {  # command → what Ctrl-C outside the training loop says after "posbench: interrupted (Ctrl-C)"
    "train": "; a training run resumes from its newest saved training state, if it has one, when run again in the "
             "same folder (hydra.run.dir=<its folder>)",
    "eval": " during posbench eval: the evaluation stopped, and an evaluation writes its eval-*.json only when it "
            "finishes; to evaluate, run the same posbench eval command again (it starts over; the run's own files "
            "are untouched)",
}


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``posbench`` console script and of ``python -m posbench``. Ctrl-C outside the training
    loop (which saves a checkpoint first: posbench/runtime/signals.py) leaves with one line (:data:`INTERRUPTED`: what to
    run again for the command interrupted) and status 130, no traceback."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        _main(argv)
    except KeyboardInterrupt as e:
        dist.finish(together=False, status=EXIT_INTERRUPTED)
        sweep = sweep_stop.PARENT.sweep_dir
        if sweep is not None:  # the second Ctrl-C of a sweep (joblib kills its jobs)
            sweep_stop.clear(sweep)
            said = (" again: the sweep quit at once, each job keeping its newest saved training state; "
                    + command.resume_hint(argv, sweep))
        else:
            said = e.advice() if isinstance(e, Interrupted) else INTERRUPTED.get(argv[0] if argv else "", "")
        print(f"posbench: interrupted (Ctrl-C){said}", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None


def _status_of(e: BaseException) -> int:
    """The exit status ``e`` ends the process with: a SystemExit's code, 130 for Ctrl-C, else 1 (a traceback)."""
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    return EXIT_INTERRUPTED if isinstance(e, KeyboardInterrupt) else 1


def _main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    if argv[0] in ("--version", "-V"):
        print(f"posbench {posbench.__version__}")
        return
    name, rest = argv[0], argv[1:]
    if name in ("report", "export"):
        return (_report if name == "report" else _export)(rest)
    if name not in COMMANDS:
        fail(f"unknown command {name!r}; choose one of: train, eval, report, export")
    task, config_name = COMMANDS[name]
    if name == "eval":
        try:
            rest = overrides.eval_argv(rest)
        except overrides.Refused as e:
            fail(str(e))
    register()
    dist.init()  # torchrun: every rank checks the same jobs, then writes one run folder (rank 0's time stamps it)
    os.environ["POSBENCH_RUN_STAMP"] = dist.broadcast(time.strftime("%Y-%m-%d/%H-%M-%S"))  # preflight's and Hydra's
    if dist.rank() > 0:  # only rank 0 writes Hydra's files and logs
        rest = [*rest, "hydra.output_subdir=null", "hydra/job_logging=disabled"]
    sys.argv = [f"posbench-{name}", *rest]
    try:
        preflight(rest, config_name)
        os.environ.setdefault(gpus.LOCK_DIR_ENV, str(gpus.default_lock_dir()))  # one GPU lock folder for a sweep
        task()
        status = command.stopped_sweep(argv)
        if status is not None:
            raise Exit(status)
    except Exit as e:  # a refused, failed or preempted run: every rank exits here with the same status
        dist.finish(status=e.code)
        raise
    except BaseException as e:  # an unforeseen error (Hydra turns it into exit 1), maybe on this rank alone: leave
        dist.finish(together=False, status=_status_of(e))  # without waiting for the others
        if isinstance(e, SystemExit) and sweep_stop.PARENT.sweep_dir is not None:
            command.broken_sweep(argv, sweep_stop.PARENT.sweep_dir)
        raise
    dist.finish()
