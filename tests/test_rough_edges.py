"""Rough edges a new user hits: stop signals, a corrupt lone training state, two runs in one folder, inputs that
used to end in a traceback or a misleading message, and what ``posbench train`` prints.

A refusal keeps the contract of test_refusals.py: exit status 2, stderr one line ``posbench: error: ...`` naming
the value and the fix, no traceback, and the folder given left as it was. Ctrl-C through a real process, with a
bit-identical resume, is in test_resume.py beside SIGTERM.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CLI_TIMEOUT_S, cli_env
from test_refusals import refused, run_into, snapshot

from posbench import runlock
from posbench.signals import EXIT_INTERRUPTED, EXIT_PREEMPTED, StopSignals, exit_status

# ---- 1. stop signals ------------------------------------------------------------------------------------------


def test_exit_status_is_130_for_ctrl_c_and_75_for_a_schedulers_stop():
    assert (exit_status(signal.SIGINT), EXIT_INTERRUPTED) == (130, 128 + signal.SIGINT)
    assert exit_status(signal.SIGTERM) == exit_status(signal.SIGUSR2) == EXIT_PREEMPTED == 75


def test_a_stop_signal_is_noted_and_a_second_ctrl_c_quits_at_once():
    before = signal.getsignal(signal.SIGINT)
    with StopSignals(notice_after=60) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs at the next bytecode
        assert [s for s, _ in stop.received] == [signal.SIGINT]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGINT) is before  # the handlers from before are back


def _notices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]


def test_a_step_still_running_after_a_stop_signal_gets_a_notice(caplog):
    with caplog.at_level(logging.WARNING, logger="posbench"), StopSignals(notice_after=0.2):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.8)  # the step that never ends
    assert len(_notices(caplog)) == 1 and "the checkpoint is saved when it ends" in _notices(caplog)[0]


def test_a_step_that_ends_in_time_gets_no_notice(caplog):
    with caplog.at_level(logging.WARNING, logger="posbench"), StopSignals(notice_after=0.4) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        stop.step_ended()
        time.sleep(0.8)
    assert _notices(caplog) == [] and [s for s, _ in stop.received] == [signal.SIGTERM]


# ---- 2. a run folder whose only training state is corrupt -----------------------------------------------------


def test_a_lone_corrupt_state_stops_the_run_and_changes_nothing(run_cli, data_cache, existing_run):
    (state,) = (existing_run / "checkpoints").glob("step-*.pt")
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    before = snapshot(existing_run)
    message = refused(run_into(run_cli, data_cache, existing_run), existing_run, before)
    assert f"<run>/checkpoints/{state.name} is corrupt" in message and "resume=never" in message

    again = run_into(run_cli, data_cache, existing_run, "resume=never")  # the way out the message offers
    assert again.returncode == 0, again.stderr[-2000:]


def test_starting_over_sets_the_old_models_outputs_aside(run_cli, data_cache, existing_run):
    """resume=never in a finished folder: the old model's results and re-evaluations move to superseded/, so a
    report of the folder shows the new model only, never the two mixed."""
    old_eval = existing_run / "eval-rope-nonoverlapping-validation-1.json"
    shutil.copy(existing_run / "results.json", old_eval)
    old_sha = (existing_run / "results.json").read_bytes()
    proc = run_into(run_cli, data_cache, existing_run, "resume=never", "seed=1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (aside,) = (existing_run / "superseded").iterdir()
    assert {p.name for p in aside.iterdir()} >= {"results.json", "results.csv", "checkpoint.pt", old_eval.name}
    assert (aside / "results.json").read_bytes() == old_sha and not old_eval.exists()
    assert (existing_run / "results.json").read_bytes() != old_sha  # the new model's, seed 1
    report = run_cli("report", existing_run, "--out", existing_run.parent / "report")
    assert report.returncode == 0 and "1 results from runs with seeds [1]" in (existing_run.parent / "report" /
                                                                                "report.md").read_text()


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
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from posbench import runlock; "
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


# ---- 6. a step that cannot fit in memory --------------------------------------------------------------------


def test_a_step_that_cannot_fit_in_memory_is_refused_with_the_figures(run_cli, data_cache, existing_run):
    """Terabytes of activations (100k tokens × 1024 sequences): no machine here has them; refused in seconds, not
    after an hour of swapping. The estimate itself is checked against measurement in test_memory.py."""
    before = snapshot(existing_run)
    message = refused(run_into(run_cli, data_cache, existing_run, "train.seq_len=100000", "train.batch_size=1024",
                               "eval.lengths=[64]"), existing_run, before)
    assert message.startswith("train.seq_len=100000 × train.batch_size=1024: a training step needs about ")
    assert "TiB" in message and "available" in message and "lower train.seq_len or train.batch_size" in message


# ---- 4 and 5. inputs that used to end in a traceback or a misleading message --------------------------------

BAD = {
    # id: (overrides, substrings the message must hold, substrings it must not)
    "negative-seed": (["seed=-1"], ["seed=-1", ">= 0"], []),
    "nan-lr": (["train.lr=nan"], ["train.lr=nan", "finite"], ["min_lr"]),
    "inf-lr": (["train.lr=inf"], ["train.lr=inf", "finite"], ["min_lr"]),
    "nan-weight-decay": (["train.weight_decay=nan"], ["train.weight_decay=nan"], []),
    "lengths-out-of-order": (["eval.lengths=[64,32]"], ["eval.lengths=[64, 32]", "increasing", "[32,64]"], []),
    "lengths-repeated": (["eval.lengths=[32,32]"], ["eval.lengths=[32, 32]", "without repeats", "[32]"], []),
    "stride-without-sliding": (["eval.stride=16"], ["eval.stride=16", "eval.protocol=sliding"], []),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_value_is_refused_with_one_line_and_the_run_folder_untouched(case, run_cli, data_cache, existing_run):
    overrides, found, absent = BAD[case]
    before = snapshot(existing_run)
    message = refused(run_into(run_cli, data_cache, existing_run, *overrides), existing_run, before)
    assert all(s in message for s in found), message
    assert not any(s in message for s in absent), message


@pytest.mark.parametrize("content", [b"caf\xe9 au lait\n" * 50, b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 50],
                         ids=["latin-1", "binary"])
def test_a_text_file_that_is_not_utf8_is_named_with_the_fix(content, run_cli, data_cache, existing_run, tmp_path):
    bad, good = tmp_path / "plays.txt", tmp_path / "valid.txt"
    bad.write_bytes(content)
    good.write_text("a plain line of text\n" * 50)
    before = snapshot(existing_run)
    message = refused(run_into(run_cli, data_cache, existing_run, "data=text", f"data.train_files=[{bad}]",
                               f"data.validation_files=[{good}]"), existing_run, before)
    first_bad = next(i for i, byte in enumerate(content) if byte >= 0x80)  # 0xe9 at 3; 0x89 at 0
    assert str(bad) in message and f"byte 0x{content[first_bad]:02x} at offset {first_bad}" in message
    assert "UTF-8" in message and "iconv" in message


def test_multirun_with_cfg_is_one_line_not_hydras_traceback(run_cli, tmp_path):
    proc = run_cli("train", "-m", "debug=fast", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert "--cfg" in line and "-m" in line and "posbench train <overrides> --cfg job" in line
    assert list(tmp_path.iterdir()) == []


def test_report_out_that_is_a_file_is_refused(run_cli, trained_run, tmp_path):
    out = tmp_path / "report.md"
    out.write_text("mine\n")
    proc = run_cli("report", trained_run, "--out", out)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert str(out) in line and "--out" in line and out.read_text() == "mine\n"


# A folder this process may not write, as a read-only mount or another user's folder would be; root ignores
# permissions, so the subprocess is told by os.access, which posbench asks.
READ_ONLY = ("import os, sys; real = os.access; ro = os.path.realpath(sys.argv.pop(1)); "
             "os.access = lambda p, m, **k: False if m & os.W_OK and os.path.realpath(p).startswith(ro) "
             "else real(p, m, **k); from posbench.cli import main; main(sys.argv[1:])")


def _as_read_only(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", READ_ONLY, str(folder), *map(str, args)], cwd=folder.parent,
                          env=cli_env(), capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


@pytest.mark.parametrize("command", ["train", "train -m", "eval", "report"])
def test_a_read_only_folder_is_refused_before_anything_is_written(command, trained_run, data_cache, tmp_path):
    ro = tmp_path / "ro"
    shutil.copytree(trained_run, ro / "run")
    before = snapshot(ro)
    args = {"train": ["train", "debug=fast", f"hydra.run.dir={ro / 'new'}", f"data.cache_dir={data_cache}"],
            "train -m": ["train", "-m", "debug=fast", "seed=0,1", f"hydra.sweep.dir={ro / 'sweep'}",
                         f"data.cache_dir={data_cache}"],
            "eval": ["eval", f"run={ro / 'run'}"],
            "report": ["report", ro / "run"]}[command]
    message = refused(_as_read_only(ro, *args), ro, before)
    assert "cannot write to <run>" in message and ("DIR" in message or "copy" in message), message


# ---- found in review: the lock before the states, a checksum before its file, the memory check's switch -------


def test_a_folder_in_use_is_named_before_its_training_states_are_read(run_cli, data_cache, existing_run):
    """While another process holds the folder, its states may be mid-write: the refusal must be "in use", not a
    verdict on states read at a bad moment (here: a lone state that reads as corrupt)."""
    (state,) = (existing_run / "checkpoints").glob("step-*.pt")
    state.write_bytes(state.read_bytes()[:100])
    holder = subprocess.Popen([sys.executable, "-c", "import time; from posbench import runlock; "
                               f"runlock.acquire({str(existing_run)!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, env=cli_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(existing_run)
        message = refused(run_into(run_cli, data_cache, existing_run), existing_run, before)
        assert message.startswith("<run> is in use by another posbench process") and f"pid {holder.pid}" in message
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("at", ["step-00000008.pt", "step-00000008.pt.sha256"])
def test_an_interrupted_save_leaves_no_state_that_reads_as_corrupt(at, tmp_path, monkeypatch):
    """A second Ctrl-C (or kill -9) between the state's rename and its checksum's used to leave a file without a
    checksum: a lone state that stops the next run. The checksum is written first now: whichever rename is
    interrupted, the new state is either whole or absent."""
    from posbench import checkpoint

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


def test_check_memory_false_skips_the_memory_check(data_cache, monkeypatch):
    from hydra import compose, initialize_config_module

    from posbench import memory, train_job
    from posbench.cli import register
    from posbench.config import ConfigError

    monkeypatch.setattr(memory, "available_bytes", lambda device: (1 << 20, "a 1 MiB test machine"))
    register()
    with initialize_config_module("posbench.conf", version_base="1.3"):
        cfg, off = (compose("train", overrides=["debug=fast", f"data.cache_dir={data_cache}", *extra])
                    for extra in ([], ["train.check_memory=false"]))
    with pytest.raises(ConfigError, match=r"a 1 MiB test machine.*train\.check_memory=false"):
        train_job.prepare(cfg)
    assert train_job.prepare(off).config.train.check_memory is False


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
def test_a_gpu_trained_run_can_be_evaluated_on_a_machine_without_cuda(run_cli, trained_run, tmp_path):
    """A run's recorded train.device is history: posbench eval checks its own device (default auto), not the one
    the run was trained on, so a run trained on a GPU is re-evaluated on a laptop."""
    import json

    import torch

    run = tmp_path / "gpu-run"
    shutil.copytree(trained_run, run)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    state["config"]["train"]["device"] = "cuda"
    torch.save(state, run / "checkpoint.pt")
    proc = run_cli("eval", f"run={run}", "eval.lengths=[32,64]", "eval.max_tokens=256")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (record,) = run.glob("eval-*.json")
    rec = json.loads(record.read_text())
    assert rec["config"]["train"]["device"] == "cuda" and rec["device"] == "cpu"
