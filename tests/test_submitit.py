"""SIGUSR2 under submitit's own machinery: a real job, submitit's real handler, its real requeue.

How the job is run, and why. ``submitit.LocalExecutor`` works offline and requeues for real: its job
entry point (``submitit.core._submit.process_job``) loads the pickled ``DelayedSubmission`` and installs
``JobEnvironment()._handle_signals(...)`` (SIGUSR2 → ``SignalHandler.checkpoint_and_try_requeue``) *before*
calling the submitted function; on SIGUSR2 that handler calls the function's ``checkpoint`` method, dumps the
``DelayedSubmission`` it returns over the job's pickle, and ``LocalJobEnvironment._requeue`` exits the task
with status 144, on which the local controller (``submitit.local._local``) starts the task again, in the
same job, from the (re-dumped) pickle. That is SLURM's ``--signal=USR2@…`` + ``--requeue`` path with
``scontrol requeue`` replaced by a process restart, so nothing needs faking (``DebugExecutor`` runs the
function in the test's own process, installs no signal handler and its ``_requeue`` does nothing; a
hand-built ``_handle_signals`` in a subprocess would have to re-implement the requeue). The submitted
callable is a ``submitit.helpers.Checkpointable``, as Hydra's submitit launcher (``hydra/launcher=slurm``)
is: its ``checkpoint`` resubmits itself with the same arguments. It runs ``posbench train …`` *in the
job's process* through ``posbench.cli.main`` (a ``submitit.helpers.CommandFunction`` would run posbench
in a child process, which submitit's handler is not installed in, so the chain under test would not
exist). The signal is a real ``os.kill(pid, SIGUSR2)`` from this test to the task's process once training
is under way; the step it is handled at is read back from what the trainer wrote (its last metrics row,
its checkpoint, and "resumed from the checkpoint at step k" in the requeued task's log).

The callable keeps a journal (one JSON line per event) beside the run: each start (pid, and which SIGUSR2
handler was installed when the function began: submitit's), and each call of ``checkpoint`` by
submitit's handler (the valid training states on disk at that moment, the last metrics row, and which
frame called the handler: posbench's trainer, after its save).
"""

from __future__ import annotations

import hashlib
import json
import linecache
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

submitit = pytest.importorskip("submitit")

from helpers import cli_env  # noqa: E402
from posbench.training import checkpoint  # noqa: E402

TIMEOUT = 300  # seconds: a job or CLI run that takes longer is a hang
STEPS = 40
ARGS = ["debug=fast", f"train.steps={STEPS}", "train.checkpoint_every=0", "train.threads=1", "train.log_every=1",
        "seed=0", "eval.lengths=[32,64]", "eval.max_tokens=256"]


# ---- helpers (pickled by value with the job's callable: the task cannot import tests/helpers.py's copies) ----


def journal(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (the job's journal, see PosbenchTrain); a last line still being written is skipped."""
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def rows(run: Path) -> list[dict]:
    """metrics.jsonl rows; a last line still being written is skipped."""
    return journal(Path(run) / "metrics.jsonl")


def valid_states(run: Path) -> list[int]:
    """Steps of the training checkpoints whose recorded checksum matches the file."""
    out = []
    for path in sorted((Path(run) / checkpoint.STATES).glob("step-*.pt")):
        sha = path.with_name(path.name + ".sha256")
        if sha.exists() and sha.read_text().strip() == hashlib.sha256(path.read_bytes()).hexdigest():
            out.append(int(path.stem.split("-")[1]))
    return out


class PosbenchTrain(submitit.helpers.Checkpointable):
    """``posbench train *argv`` in the submitit task's own process; requeued with the same argv."""

    def __init__(self, journal_path: Path, run: Path):
        self.journal_path, self.run = Path(journal_path), Path(run)

    def _note(self, **event) -> None:
        with open(self.journal_path, "a") as f:
            f.write(json.dumps(event) + "\n")

    def __call__(self, argv: list[str]) -> str:
        handler = signal.getsignal(signal.SIGUSR2)
        self._note(event="start", pid=os.getpid(), job_id=submitit.JobEnvironment().job_id,
                   usr2_handler=getattr(handler, "__qualname__", repr(handler)))
        from posbench import cli

        cli.main(["train", *argv])
        return "finished"

    def checkpoint(self, argv: list[str]):
        """Called by submitit's SignalHandler.checkpoint_and_try_requeue; records what it found on disk."""
        frame = sys._getframe()
        while frame is not None and frame.f_code.co_name != "checkpoint_and_try_requeue":
            frame = frame.f_back
        caller = frame.f_back if frame is not None else None
        self._note(event="checkpoint", pid=os.getpid(), states=valid_states(self.run),
                   last_row=(rows(self.run) or [{"step": None}])[-1]["step"],
                   handler_found=frame is not None,
                   caller=None if caller is None else {
                       "file": caller.f_code.co_filename, "function": caller.f_code.co_name,
                       "line": linecache.getline(caller.f_code.co_filename, caller.f_lineno).strip()})
        return super().checkpoint(argv)


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    """The session's data cache (conftest: prepared once), ready for the job and the reference run."""
    return data_cache


def _wait(job, what: str, ready=lambda: False, timeout: float = TIMEOUT) -> None:
    """Poll every 5 ms until ``ready()`` (or, with the default, until the job is over)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if job.done():
            assert what == "the job", f"the job ended before {what}:\n{job.stdout()}\n{job.stderr()}"
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# ---- the test ------------------------------------------------------------------------------------


def test_sigusr2_under_submitit_checkpoints_requeues_and_resumes_bit_identically(cache, tmp_path, monkeypatch):
    import cloudpickle

    monkeypatch.chdir(tmp_path)  # the job's working directory (the controller and its task inherit it)
    overrides = [*ARGS, f"data.cache_dir={cache}"]
    ref_dir, run = tmp_path / "uninterrupted", tmp_path / "job-run"
    reference = subprocess.Popen([sys.executable, "-m", "posbench", "train", *overrides, f"hydra.run.dir={ref_dir}"],
                                 env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    executor = submitit.LocalExecutor(folder=tmp_path / "submitit")
    # timeout_min: SignalHandler.has_timed_out is then False, so this is a preemption (countdown not spent);
    # the controller's own timeout signal would come after 59.5 min: the signal below is the only one
    executor.update_parameters(timeout_min=60)
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)  # the task cannot import this test module
    try:
        job = executor.submit(PosbenchTrain(tmp_path / "journal.jsonl", run), [*overrides, f"hydra.run.dir={run}"])
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    task_pid = None
    try:
        _wait(job, "three training steps", lambda: journal(tmp_path / "journal.jsonl") and len(rows(run)) >= 3)
        task_pid = journal(tmp_path / "journal.jsonl")[0]["pid"]
        os.kill(task_pid, signal.SIGUSR2)  # as SLURM's --signal=USR2@… or a preemption would
        _wait(job, "the job")
        assert job.result() == "finished"  # raises the task's traceback when it failed
    finally:
        if not job.done():
            job.cancel()  # SIGINT to the controller: it stops the task
        if task_pid is not None:
            try:
                os.kill(task_pid, signal.SIGKILL)  # (a task of this test still there after the job: gone)
            except ProcessLookupError:
                pass
        ref_out = reference.communicate(timeout=TIMEOUT)[0]
    log = job.stdout() or ""  # both attempts (submitit appends to the task's log files); its warnings are in stderr too
    print(f"\n--- the submitit task's stdout ---\n{log}\n--- its stderr ---\n{job.stderr()}")

    # 1. submitit's handler was the one installed when posbench started, in both attempts; it was called once,
    #    by posbench's trainer, after the checkpoint of the step it stopped at was written
    events = journal(tmp_path / "journal.jsonl")
    assert [e["event"] for e in events] == ["start", "checkpoint", "start"], events
    first, handled, second = events
    assert first["usr2_handler"] == second["usr2_handler"] == "SignalHandler.checkpoint_and_try_requeue"
    assert first["pid"] == handled["pid"] == task_pid != second["pid"]  # requeued: a new process, the same job
    assert first["job_id"] == second["job_id"] == job.job_id
    stopped = handled["last_row"]
    assert 3 <= stopped < STEPS
    assert handled["states"] == [stopped], handled  # checkpoint_every=0: the only state is the signal's
    caller = handled["caller"]
    assert handled["handler_found"] and caller and caller["function"] == "hand_off", handled  # (train's hand-off)
    assert Path(caller["file"]).parts[-3:] == ("posbench", "training", "loop.py"), caller
    print(f"\nsignal handled after step {stopped}; submitit's handler called from posbench/training/loop.py: {caller['line']}")

    # 2. submitit's log: the signal caught, the checkpoint method called, the task requeued (exit 144, restart);
    #    the requeued task resumed from that checkpoint
    order = [f"step {stopped}/{STEPS} loss", "Caught signal SIGUSR2", "this job is preempted", "Calling checkpoint",
             f"Requeued job {job.job_id} (3 remaining timeouts)", f"resumed from the checkpoint at step {stopped}",
             "Job completed successfully"]
    where = [log.find(s) for s in order]
    assert -1 not in where and where == sorted(where), dict(zip(order, where))
    assert job.state == "FINISHED"

    # 3. the requeued run, resumed in the same folder, ends bit-identical to an uninterrupted one
    assert reference.returncode == 0, ref_out
    a_rows, b_rows = rows(ref_dir), rows(run)
    assert [r["step"] for r in a_rows] == [r["step"] for r in b_rows] == list(range(1, STEPS + 1))
    for ra, rb in zip(a_rows, b_rows):
        keys = ("step", "loss", "grad_norm", "lr")
        assert [rb[k] for k in keys] == [ra[k] for k in keys]
    res_a, res_b = (json.loads((r / "results.json").read_text()) for r in (ref_dir, run))
    assert res_b["status"] == "complete"
    assert [(r["length"], r["ppl"], r["nll"], r["tokens"]) for r in res_b["results"]] == \
           [(r["length"], r["ppl"], r["nll"], r["tokens"]) for r in res_a["results"]]
    assert (res_b["final_loss"], res_b["param_sha256"]) == (res_a["final_loss"], res_a["param_sha256"])
    assert (res_a["resumed_from"], res_b["resumed_from"]) == (None, stopped)
    print("ppl (uninterrupted == requeued):", {r["length"]: r["ppl"] for r in res_b["results"]})
