"""What a run folder holds up against: a lone training state that is corrupt, a run started over in it
(``resume=never``), a second process that wants it while a run holds it (posbench/runtime/runlock.py), a folder that cannot
be written, and a save interrupted half-way.

A refusal keeps the contract of test_refusals.py (helpers.refused): exit status 2, stderr one line
``posbench: error: ...`` naming the value and the fix, no traceback, and the folder given left as it was; it is
checked in this process (conftest's ``posbench_here``) unless another process is part of the story.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import CLI_TIMEOUT_S, cli_env, refused, run_into, snapshot, train_here
from posbench.runtime import runlock

# ---- 2. a run folder whose only training state is corrupt -----------------------------------------------------


def test_a_lone_corrupt_state_stops_the_run_and_changes_nothing(posbench_here, data_cache, existing_run, torch_state):
    (state,) = (existing_run / "checkpoints").glob("step-*.pt")
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    before = snapshot(existing_run)
    message = refused(run_into(posbench_here, data_cache, existing_run), existing_run, before)
    assert f"<run>/checkpoints/{state.name} is corrupt" in message and "resume=never" in message

    again = run_into(posbench_here, data_cache, existing_run, "resume=never")  # the way out the message offers
    assert again.returncode == 0, again.stderr[-2000:]  # not refused; and the job trains:
    assert train_here(data_cache, existing_run, "resume=never")["status"] == "complete"


def test_starting_over_sets_the_old_models_outputs_aside(data_cache, existing_run, torch_state):
    """resume=never in a finished folder: the old model's results and re-evaluations move to superseded/, so a
    report of the folder shows the new model only, never the two mixed. (Trained and reported in this process.)"""
    from posbench.report import render

    old_eval = existing_run / "eval-rope-nonoverlapping-validation-1.json"
    shutil.copy(existing_run / "results.json", old_eval)
    old_sha = (existing_run / "results.json").read_bytes()
    assert train_here(data_cache, existing_run, "resume=never", "seed=1")["status"] == "complete"
    (aside,) = (existing_run / "superseded").iterdir()
    assert {p.name for p in aside.iterdir()} >= {"results.json", "results.csv", "checkpoint.pt", old_eval.name}
    assert (aside / "results.json").read_bytes() == old_sha and not old_eval.exists()
    assert (existing_run / "results.json").read_bytes() != old_sha  # the new model's, seed 1
    assert render.write_report([existing_run], existing_run.parent / "report")[1]  # (its rows: nothing to report is an error)
    assert "1 results from runs with seeds [1]" in (existing_run.parent / "report" / "report.md").read_text()


# ---- 3. two processes, one run folder -------------------------------------------------------------------------


def _popen(run: Path, data_cache: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "posbench", "train", "debug=fast", f"hydra.run.dir={run}",
                             f"data.cache_dir={data_cache}", *overrides], cwd=run.parent, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _metric_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [int(line.split('"step": ')[1].split(",")[0]) for line in lines if line.endswith("}")]


def test_a_second_process_in_a_folder_in_use_stops_naming_the_folder_and_the_other_pid(run_cli, data_cache,
                                                                                          tmp_path):
    run = tmp_path / "run"
    first = _popen(run, data_cache, "train.steps=100000", "train.threads=1")
    try:
        deadline = time.monotonic() + CLI_TIMEOUT_S
        while len(_metric_steps(run)) < 2:
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.05)
        second = run_into(run_cli, data_cache, run, "train.steps=100000", "train.threads=1")
        out = second.stdout + second.stderr
        assert second.returncode == 2 and "Traceback" not in out, out[-2000:]
        (line,) = second.stderr.strip().splitlines()
        assert line.startswith("posbench: error: ") and str(run) in line and f"pid {first.pid}" in line
        steps = _metric_steps(run)
        assert steps == sorted(set(steps))  # one writer: no step twice
    finally:
        first.kill()
        first.wait()
    assert (run / runlock.NAME).read_text().split()[0] == str(first.pid)  # left by a killed process: stale

    third = run_into(run_cli, data_cache, run, "resume=never")
    assert third.returncode == 0, third.stderr[-2000:]
    assert f"took over the lock of {run} left by process {first.pid}" in third.stdout + third.stderr
    assert not (run / runlock.NAME).exists()  # released at the end
    assert (third.stdout + third.stderr).count(f"run folder: {run}") == 2  # printed at the start and at the end


def test_the_lock_is_exclusive_between_processes_and_released_with_its_file(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from posbench.runtime import runlock; "
                               f"runlock.acquire({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, env=cli_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(runlock.FolderInUse, match=f"pid {holder.pid} "):
            runlock.acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    runlock.acquire(tmp_path)  # the holder is dead: its lock went with it
    runlock.acquire(tmp_path)  # re-entrant in one process
    assert (tmp_path / runlock.NAME).read_text().split()[0] == str(os.getpid())
    runlock.release(tmp_path)
    assert not (tmp_path / runlock.NAME).exists()


# ---- 4. a folder that cannot be written ----------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "train -m", "eval", "report"])
def test_a_read_only_folder_is_refused_before_anything_is_written(command, posbench_here, trained_run, data_cache,
                                                                   tmp_path, monkeypatch):
    """A folder this process may not write, as a read-only mount or another user's folder would be; root ignores
    permissions, so posbench is told by os.access, which it asks."""
    ro = tmp_path / "ro"
    shutil.copytree(trained_run, ro / "run")
    before = snapshot(ro)
    real, root = os.access, os.path.realpath(ro)
    monkeypatch.setattr(os, "access", lambda p, m, **k: False if m & os.W_OK and os.path.realpath(p).startswith(root)
                        else real(p, m, **k))
    args = {"train": ["train", "debug=fast", f"hydra.run.dir={ro / 'new'}", f"data.cache_dir={data_cache}"],
            "train -m": ["train", "-m", "debug=fast", "seed=0,1", f"hydra.sweep.dir={ro / 'sweep'}",
                         f"data.cache_dir={data_cache}"],
            "eval": ["eval", f"run={ro / 'run'}"],
            "report": ["report", ro / "run"]}[command]
    message = refused(posbench_here(*args), ro, before)
    assert "cannot write to <run>" in message and ("DIR" in message or "copy" in message), message


# ---- 5. found in review: the lock before the states, a checksum before its file ---------------------------------


def test_a_folder_in_use_is_named_before_its_training_states_are_read(posbench_here, data_cache, existing_run):
    """While another process holds the folder, its states may be mid-write: the refusal must be "in use", not a
    verdict on states read at a bad moment (here: a lone state that reads as corrupt)."""
    (state,) = (existing_run / "checkpoints").glob("step-*.pt")
    state.write_bytes(state.read_bytes()[:100])
    holder = subprocess.Popen([sys.executable, "-c", "import time; from posbench.runtime import runlock; "
                               f"runlock.acquire({str(existing_run)!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, env=cli_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(existing_run)
        message = refused(run_into(posbench_here, data_cache, existing_run), existing_run, before)
        assert message.startswith("<run> is in use by another posbench process") and f"pid {holder.pid}" in message
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("at", ["step-00000008.pt", "step-00000008.pt.sha256"])
def test_an_interrupted_save_leaves_no_state_that_reads_as_corrupt(at, tmp_path, monkeypatch):
    """A second Ctrl-C (or kill -9) between the state's rename and its checksum's used to leave a file without a
    checksum: a lone state that stops the next run. The checksum is written first now: whichever rename is
    interrupted, the new state is either whole or absent."""
    from posbench.training import checkpoint

    checkpoint.save_state(tmp_path, {"step": 4, "config": {}}, keep=2)
    real = os.replace

    def interrupted(src, dst):
        if str(dst).endswith(at):
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_state(tmp_path, {"step": 8, "config": {}}, keep=2)
    monkeypatch.setattr(os, "replace", real)
    assert checkpoint.latest_state(tmp_path)["step"] == 4
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt")) == ["step-00000004.pt"]
