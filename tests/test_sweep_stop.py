"""A joblib sweep stopped by Ctrl-C (SIGINT to its process group, as a terminal sends it) or by SIGTERM to its parent
(a scheduler's stop) keeps every running job's progress (posbench/runtime/sweep_stop.py): each running job saves a
training state and releases its lock, the job not yet started does not start, the last line names the command with
``hydra.sweep.dir``; that command resumes the stopped jobs, starts the other and, run once more, skips them all; the
resumed sweep's results are bit-identical to an uninterrupted sweep's on CPU."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import CLI_TIMEOUT_S, cli_env, ctrl_c_as_in_a_terminal, file_states, valid_states

STEPS = 200
SWEEP = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "debug=fast", "scheme=rope,alibi,nope",
         f"train.steps={STEPS}", "train.log_every=1", "train.threads=1", "eval.lengths=[32]", "eval.max_tokens=256"]
JOBS = ("0_rope_seed0", "1_alibi_seed0", "2_nope_seed0")


def sweep(data_cache: Path, folder: Path, cwd: Path) -> subprocess.Popen:
    """The sweep into ``folder``, in a process group of its own, with Ctrl-C's default action (as a terminal's job: a
    test run in the background passes SIGINT on ignored, and posbench keeps an ignored SIGINT ignored)."""
    return subprocess.Popen([sys.executable, "-m", "posbench", "train", *SWEEP, f"data.cache_dir={data_cache}",
                             f"hydra.sweep.dir={folder}"], cwd=cwd, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=ctrl_c_as_in_a_terminal)


def training(proc: subprocess.Popen, folder: Path) -> None:
    """Wait until the sweep's first two jobs have trained 10 steps each (the third waits for a worker)."""
    deadline = time.monotonic() + CLI_TIMEOUT_S
    metrics = [folder / job / "metrics.jsonl" for job in JOBS[:2]]
    while not all(m.exists() and len(m.read_text().splitlines()) >= 10 for m in metrics):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out waiting for the jobs to train"
        time.sleep(0.02)


def outcome(folder: Path) -> dict:
    """{job: (parameter digests, perplexities)} of a finished sweep."""
    out = {}
    for job in JOBS:
        rec = json.loads((folder / job / "results.json").read_text())
        assert rec["status"] == "complete", rec
        out[job] = (rec["param_sha256"], [r["ppl"] for r in rec["results"]])
    return out


@pytest.fixture(scope="module")
def uninterrupted(data_cache, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("whole") / "sweep"
    proc = sweep(data_cache, folder, folder.parent)
    out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0, err[-3000:]
    return outcome(folder)


@pytest.mark.parametrize("how", ["SIGINT to the group", "SIGTERM to the parent"])
def test_a_stopped_sweep_keeps_its_jobs_progress_and_resumes_bit_identically(how, data_cache, tmp_path, uninterrupted):
    folder = tmp_path / "sweep"
    proc = sweep(data_cache, folder, tmp_path)
    training(proc, folder)
    if how == "SIGINT to the group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode == (130 if how.startswith("SIGINT") else 75), err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    last = err.strip().splitlines()[-1]
    said = "interrupted (Ctrl-C)" if how.startswith("SIGINT") else "stopped (SIGTERM)"
    assert last.startswith(f"posbench: {said}: the sweep's running jobs saved their training states"), last
    assert last.endswith(f"hydra.sweep.dir={folder}"), last
    for job in JOBS[:2]:  # stopped after a step, with a training state there and no lock
        steps = [json.loads(line)["step"] for line in (folder / job / "metrics.jsonl").read_text().splitlines()]
        assert valid_states(folder / job) and valid_states(folder / job)[-1] == steps[-1] < STEPS, job
        assert not (folder / job / "posbench.lock").exists(), job
        assert not (folder / job / "results.json").exists(), job
    assert not (folder / JOBS[2] / "metrics.jsonl").exists()  # not started
    assert not (folder / "posbench.stop").exists()

    command = shlex.split(last.split("hydra.sweep.dir: ", 1)[1])
    assert command[:2] == ["posbench", "train"]
    again = subprocess.run([sys.executable, "-m", "posbench", *command[1:]], cwd=tmp_path, env=cli_env(),
                           capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert again.returncode == 0, again.stderr[-3000:]
    for job in JOBS[:2]:
        assert "resumed from the checkpoint at step" in (folder / job / "train.log").read_text(), job
    assert outcome(folder) == uninterrupted

    before = file_states(folder)
    once_more = subprocess.run([sys.executable, "-m", "posbench", *command[1:]], cwd=tmp_path, env=cli_env(),
                               capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert once_more.returncode == 0, once_more.stderr[-3000:]
    assert once_more.stdout.count("finished already, skipped") == len(JOBS), once_more.stdout[-3000:]
    kept = {k: v for k, v in before.items() if k.split("/")[-1] in ("results.json", "results.csv", "metrics.jsonl")}
    assert {k: v for k, v in file_states(folder).items() if k in kept} == kept  # nothing trained or written again


def test_a_job_whose_process_dies_is_named_with_the_others_and_the_sweep_resumes(data_cache, tmp_path, uninterrupted):
    """A worker killed mid-training (SIGKILL, as the kernel's out-of-memory killer sends it): joblib kills the other
    jobs at once; after Hydra's error the last line names both running jobs' folders (each left its lock file) and the
    command with ``hydra.sweep.dir``, which resumes the sweep to the uninterrupted one's results."""
    folder = tmp_path / "sweep"
    proc = sweep(data_cache, folder, tmp_path)
    training(proc, folder)
    os.kill(int((folder / JOBS[0] / "posbench.lock").read_text().split()[0]), signal.SIGKILL)
    out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 1, err[-3000:]
    last = [line for line in err.splitlines() if line.startswith("posbench: ")][-1]  # (loky's warnings may follow)
    assert last.startswith("posbench: a job's process died and joblib stopped the sweep's other jobs at once"), last
    assert str(folder / JOBS[0]) in last and str(folder / JOBS[1]) in last and last.endswith(f"hydra.sweep.dir={folder}")
    command = shlex.split(last.split("hydra.sweep.dir: ", 1)[1])
    again = subprocess.run([sys.executable, "-m", "posbench", *command[1:]], cwd=tmp_path, env=cli_env(),
                           capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert outcome(folder) == uninterrupted
