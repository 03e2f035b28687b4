"""Resume, preemption and the failure guards of the training loop.

Every CLI run is ``python -m posbench train debug=fast ...`` (L=32, batch 4) in its own run folder,
with the session's data cache (conftest's ``data_cache``: prepared once, in process, so the concurrent runs below
find it ready). In-process tests compose the config with Hydra's compose API and call ``posbench.training.loop.train``
directly; refusals other than one through a real process go through the CLI's ``main`` in this process (conftest's
``posbench_here``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# (rows, steps_of and valid_states are also imported from here by tests/test_init_from.py, with cli, start, wait_until)
from helpers import cli_env, ctrl_c_as_in_a_terminal, file_states, rows, steps_of, valid_states
from helpers import compose_train as compose
from posbench.jobs import train_job
from posbench.model import build
from posbench.training import checkpoint, states
from posbench.training import loop as train_mod

TIMEOUT = 300  # seconds: a CLI run that takes longer is a hang
EVAL = ["eval.lengths=[32,64]", "eval.max_tokens=256"]
RESUME = ["train.steps=16", "train.checkpoint_every=4", "train.threads=1", "train.log_every=1", "seed=0", *EVAL]


# ---- helpers -------------------------------------------------------------------------------------


def argv(run: Path, cache: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "posbench", "train", "debug=fast", f"hydra.run.dir={run}",
            f"data.cache_dir={cache}", *overrides]


def start(run: Path, cache: Path, *overrides: str) -> subprocess.Popen:
    """Start a training run in the background; its output goes to ``<run>.out`` beside the run folder."""
    run.parent.mkdir(parents=True, exist_ok=True)
    out = open(run.with_name(run.name + ".out"), "a")
    proc = subprocess.Popen(argv(run, cache, *overrides), cwd=run.parent, env=cli_env(), stdout=out,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=ctrl_c_as_in_a_terminal)
    out.close()
    return proc


def output(run: Path) -> str:
    return run.with_name(run.name + ".out").read_text()


def cli(run: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    run.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.run(argv(run, cache, *overrides), cwd=run.parent, env=cli_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)


def wait_until(proc: subprocess.Popen, ready, what: str, timeout: float = TIMEOUT) -> None:
    """Poll ``ready()`` every 2 ms while ``proc`` runs; fail if it exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)



def kill_and_resume(run: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    """Start a training run of ``overrides`` in ``run``, SIGKILL it once it has logged step 5 (before its 12 steps
    end, leaving valid training states), and run the same command again: the resumed run, checked to have resumed."""
    proc = start(run, cache, *overrides)
    wait_until(proc, lambda: (steps_of(run) or [0])[-1] >= 5, "step 5")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert valid_states(run) and steps_of(run)[-1] < 12
    again = cli(run, cache, *overrides)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from the checkpoint" in again.stdout + again.stderr
    return again

# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    """The session's data cache (conftest: prepared once)."""
    return data_cache


class Background:
    """A CLI run started in the background; ``result()`` waits for it and checks it succeeded."""

    def __init__(self, run: Path, cache: Path, *overrides: str):
        self.path, self.proc = run, start(run, cache, *overrides)

    def result(self) -> Path:
        assert self.proc.wait(TIMEOUT) == 0, f"{self.path} failed:\n{output(self.path)}"
        return self.path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def finished(cache, tmp_path_factory):
    """The module's reference runs, started together in the background on first use:

    * ``A``: the resume command run straight through (steps=16, checkpoint_every=4, threads=1);
    * ``run12``: checkpoint_every=4, keep_checkpoints=3, steps=12, so states at 4, 8 and 12.
    """
    runs = {"A": Background(tmp_path_factory.mktemp("uninterrupted") / "A", cache, *RESUME),
            "run12": Background(tmp_path_factory.mktemp("run12") / "run", cache, "train.steps=12",
                                "train.checkpoint_every=4", "train.keep_checkpoints=3", "train.threads=1", *EVAL)}
    yield runs
    for r in runs.values():
        r.stop()


@pytest.fixture(scope="module")
def uninterrupted(finished) -> Background:
    return finished["A"]


@pytest.fixture(scope="module")
def run12(finished) -> Path:
    run = finished["run12"].result()
    assert valid_states(run) == [4, 8, 12]
    return run


# ---- 1. kill -9 and resume: bit-identical --------------------------------------------------------


def test_killed_run_resumes_bit_identically(cache, uninterrupted, tmp_path):
    run = tmp_path / "B"
    proc = start(run, cache, *RESUME)
    # step 9's row is written after step 8's checkpoint (and its checksum) is complete
    wait_until(proc, lambda: (steps_of(run) or [0])[-1] >= 9, "step 9")
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(TIMEOUT) == -signal.SIGKILL
    killed_at, states = steps_of(run)[-1], valid_states(run)
    assert states and 8 <= states[-1] <= killed_at < 16
    print(f"\nkilled after step {killed_at}; valid checkpoints {states}; metrics rows {steps_of(run)}")

    proc = cli(run, cache, *RESUME)  # the same command in the same folder: resume=auto
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed from the checkpoint at step {states[-1]}" in proc.stdout + proc.stderr
    assert steps_of(run) == list(range(1, 17))  # rows past the checkpoint were dropped, then re-written once

    a = uninterrupted.result()
    a_rows, b_rows = rows(a), rows(run)
    assert [r["step"] for r in a_rows] == list(range(1, 17))
    for ra, rb in zip(a_rows, b_rows):
        assert (rb["step"], rb["loss"], rb["grad_norm"], rb["lr"]) == (ra["step"], ra["loss"], ra["grad_norm"], ra["lr"])
    res_a, res_b = (json.loads((r / "results.json").read_text()) for r in (a, run))
    assert [(r["length"], r["ppl"], r["nll"], r["tokens"]) for r in res_b["results"]] == \
           [(r["length"], r["ppl"], r["nll"], r["tokens"]) for r in res_a["results"]]
    assert res_b["final_loss"] == res_a["final_loss"]
    assert res_b["param_sha256"] == res_a["param_sha256"]
    assert (res_a["resumed_from"], res_b["resumed_from"]) == (None, states[-1])
    assert res_b["train_tokens"] == res_a["train_tokens"] == 16 * 4 * 32
    print("losses (A == B):", [r["loss"] for r in a_rows])
    print("ppl (A == B):", {r["length"]: r["ppl"] for r in res_a["results"]})


def test_torn_last_metrics_row_does_not_stop_a_resume(tmp_path):
    """A crash mid-write (power loss, full disk) can leave half a row at the end of metrics.jsonl."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 11)) + '{"step": 11, "lo')
    f, logged = states.metrics_file(tmp_path, 8)
    f.close()
    assert steps_of(tmp_path) == list(range(1, 9))
    assert logged == 10  # steps 9 and 10 reached wandb before the crash: not sent again
    assert path.read_text().endswith("}\n")


# ---- 2. SIGTERM: checkpoint, exit 75, re-run finishes ---------------------------------------------


def test_sigterm_saves_a_checkpoint_and_the_rerun_finishes(cache, tmp_path):
    run = tmp_path / "run"
    args = ("train.steps=40", "train.checkpoint_every=0", "train.threads=1", "train.log_every=1", *EVAL)
    proc = start(run, cache, *args)
    wait_until(proc, lambda: len(rows(run)) >= 3, "three steps")
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(TIMEOUT) == train_mod.EXIT_PREEMPTED == 75, output(run)
    stopped = steps_of(run)[-1]
    assert 3 <= stopped < 40
    assert valid_states(run) == [stopped]
    assert f"SIGTERM at step {stopped}" in output(run)
    assert "Traceback" not in output(run)
    assert not (run / "results.json").exists() and not (run / checkpoint.NAME).exists()

    proc = cli(run, cache, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((run / "results.json").read_text())
    assert res["status"] == "complete" and res["resumed_from"] == stopped
    assert steps_of(run) == list(range(1, 41))
    assert (run / checkpoint.NAME).exists()


def test_ctrl_c_saves_a_checkpoint_exits_130_and_the_rerun_resumes_bit_identically(cache, uninterrupted, tmp_path):
    """Ctrl-C (SIGINT) as SIGTERM, with the shell's status for an interrupted command (130 = 128 + SIGINT): the
    step ends, a state is saved, and the same command resumes to the same losses, perplexities and weights as
    the run that was never interrupted."""
    run = tmp_path / "run"
    proc = start(run, cache, *RESUME)
    wait_until(proc, lambda: len(rows(run)) >= 6, "six steps")  # past the checkpoint at step 4
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(TIMEOUT) == 130, output(run)
    stopped = steps_of(run)[-1]
    assert 6 <= stopped < 16 and valid_states(run)[-1] == stopped
    assert f"SIGINT at step {stopped}: checkpoint saved" in output(run)
    assert "Traceback" not in output(run) and "KeyboardInterrupt" not in output(run)
    assert not (run / "posbench.lock").exists()  # released on the way out

    again = cli(run, cache, *RESUME)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from the checkpoint at step {stopped}" in again.stdout + again.stderr
    a = uninterrupted.result()
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows(run)] == \
           [(r["step"], r["loss"], r["grad_norm"]) for r in rows(a)]
    res_a, res_b = (json.loads((r / "results.json").read_text()) for r in (a, run))
    assert [r["ppl"] for r in res_b["results"]] == [r["ppl"] for r in res_a["results"]]
    assert res_b["param_sha256"] == res_a["param_sha256"] and res_b["resumed_from"] == stopped


# ---- 3. a corrupt newest checkpoint: fall back to the previous one ---------------------------------


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-checksum"])
def test_latest_state_skips_a_corrupt_newest_checkpoint(run12, tmp_path, caplog, damage):
    shutil.copytree(run12 / checkpoint.STATES, tmp_path / checkpoint.STATES)
    newest = tmp_path / checkpoint.STATES / "step-00000012.pt"
    if damage == "truncate":
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    elif damage == "flip":
        raw = bytearray(newest.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        newest.write_bytes(bytes(raw))
    else:
        newest.with_name(newest.name + ".sha256").unlink()
    with caplog.at_level(logging.WARNING, logger="posbench"):
        state = checkpoint.latest_state(tmp_path)
    assert state is not None and state["step"] == 8
    warnings = [r for r in caplog.records if r.name == "posbench" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(newest) in warnings[0].getMessage()


def test_resume_falls_back_past_a_corrupt_checkpoint(run12, cache, tmp_path, caplog, torch_state):
    """The run's own command again, its job run in this process (what it logs captured)."""
    run = tmp_path / "run"
    shutil.copytree(run12, run)
    newest = run / checkpoint.STATES / "step-00000012.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    cfg = compose(cache, "train.steps=12", "train.checkpoint_every=4", "train.keep_checkpoints=3", "train.threads=1", *EVAL)
    with caplog.at_level(logging.INFO, logger="posbench"):
        assert train_mod.train(train_job.prepare(cfg, run))["status"] == "complete"
    text = caplog.text
    assert "step-00000012.pt is corrupt" in text
    assert "resumed from the checkpoint at step 8" in text
    assert json.loads((run / "results.json").read_text())["resumed_from"] == 8
    assert steps_of(run) == list(range(1, 13))
    assert valid_states(run) == [4, 8, 12]  # the corrupt one was re-written
    assert [r["loss"] for r in rows(run)] == [r["loss"] for r in rows(run12)]  # steps 9-12 trained again, the same


# ---- 4. a changed config is refused, without touching the run --------------------------------------


@pytest.fixture(scope="module")
def changed_config(uninterrupted, cache, tmp_path_factory):
    """The resume command with train.lr and model.d_ff changed, run in a real process in a copy of run A:
    (process, file_states before, file_states after)."""
    run = tmp_path_factory.mktemp("refused") / "run"
    shutil.copytree(uninterrupted.result(), run)
    time.sleep(0.01)  # any rewrite now gets a later mtime
    before = file_states(run)
    proc = cli(run, cache, *RESUME, "train.lr=0.001", "model.d_ff=256")
    return proc, before, file_states(run)


def test_changed_config_exits_2_with_one_line(changed_config):
    proc, _, _ = changed_config
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "train.lr" in lines[0] and "model.d_ff" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_changed_config_leaves_the_run_folder_untouched(changed_config):
    _, before, after = changed_config
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert changed == [], f"the refused run rewrote: {changed}"


@pytest.mark.parametrize("steps", [12, 18])
def test_changing_the_step_count_is_refused(steps, uninterrupted, cache, tmp_path, posbench_here):
    """train.steps is not resumable: the learning-rate schedule is a function of it, so a 16-step run
    continued as 12 or 18 steps would splice two cosine schedules. Refused, naming both numbers (checked in this
    process: the refusal through a real process is the changed config's above)."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted.result(), run)
    time.sleep(0.01)
    before = file_states(run)
    proc = posbench_here("train", "debug=fast", f"hydra.run.dir={run}", f"data.cache_dir={cache}",
                         *[o for o in RESUME if not o.startswith("train.steps=")], f"train.steps={steps}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("posbench: error: "), proc.stderr
    message = lines[0].replace(str(run), "<run>")
    assert "train.steps" in message and f"={steps}" in message and "16" in message, message
    assert file_states(run) == before


def test_changing_resumable_keys_resumes(run12, cache, tmp_path, caplog, torch_state):
    """A run stopped after its step-8 checkpoint, re-run with other resumable settings (log_every,
    keep_checkpoints): it resumes at step 8 and trains steps 9-12 exactly as the run straight through did (the job
    run in this process, what it logs captured)."""
    run = tmp_path / "run"
    shutil.copytree(run12, run)
    for name in ("step-00000012.pt", "step-00000012.pt.sha256"):
        (run / checkpoint.STATES / name).unlink()
    cfg = compose(cache, "train.steps=12", "train.checkpoint_every=4", "train.keep_checkpoints=2", "train.log_every=3",
                  "train.threads=1", *EVAL)
    with caplog.at_level(logging.INFO, logger="posbench"):
        assert train_mod.train(train_job.prepare(cfg, run))["status"] == "complete"
    assert "resumed from the checkpoint at step 8" in caplog.text
    assert json.loads((run / "results.json").read_text())["resumed_from"] == 8
    assert steps_of(run) == list(range(1, 13))
    assert [(r["loss"], r["grad_norm"]) for r in rows(run)] == [(r["loss"], r["grad_norm"]) for r in rows(run12)]
    assert valid_states(run) == [8, 12]  # keep_checkpoints=2 now


def _strict_json(path: Path) -> dict:
    """The JSON at ``path``, refusing NaN / Infinity (not JSON: other tools cannot read them)."""
    def refuse(constant):
        raise ValueError(f"{path.name} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_rerunning_a_finished_run_re_evaluates_without_training(uninterrupted, cache, tmp_path, torch_state):
    """eval.* may change on resume: a finished run folder re-evaluated at a new length, no step trained (the job
    run in this process)."""
    a = uninterrupted.result()
    run = tmp_path / "run"
    shutil.copytree(a, run)
    cfg = compose(cache, *[o for o in RESUME if not o.startswith("eval.lengths")], "eval.lengths=[32,64,128]")
    assert train_mod.train(train_job.prepare(cfg, run))["status"] == "complete"
    assert (run / "metrics.jsonl").read_text() == (a / "metrics.jsonl").read_text()
    before, after = _strict_json(a / "results.json"), _strict_json(run / "results.json")
    assert after["lengths"] == [32, 64, 128] and after["resumed_from"] == 16
    assert [(r["length"], r["ppl"]) for r in after["results"][:2]] == [(r["length"], r["ppl"]) for r in before["results"]]
    assert after["train_tokens"] == before["train_tokens"]
    assert after["final_loss"] == before["final_loss"]  # the last training loss, not NaN


def test_resume_never_starts_over_and_its_states_outrank_the_old_ones(uninterrupted, cache, tmp_path, torch_state):
    """resume=never in a folder holding states of an earlier, longer run (steps 12 and 16): the new run's
    own states must be what a later resume=auto finds, not the old run's."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted.result(), run)
    cfg = compose(cache, "train.steps=8", "train.checkpoint_every=4", "train.threads=1", "resume=never", *EVAL)
    record = train_mod.train(train_job.prepare(cfg, run))
    assert record["resumed_from"] is None
    assert steps_of(run) == list(range(1, 9))
    state = checkpoint.latest_state(run)
    found = state and (state["step"], state["config"]["train"]["steps"])
    assert found == (8, 8), f"resume=auto would continue from (step, of steps) {found}; states left: {valid_states(run)}"


# ---- 5. a non-finite loss or gradient stops the run, marked failed ---------------------------------


def _poison_at(monkeypatch, call: int, where: str) -> None:
    """Make the ``call``-th training forward pass give NaN logits (``loss``) or an infinite gradient."""
    real = build.build_model

    def build_model(spec, overrides=None):
        model = real(spec, overrides)
        calls = [0]

        def hook(module, inputs, out):
            if not module.training:
                return None
            calls[0] += 1
            if calls[0] != call:
                return None
            if where == "loss":
                return out * float("nan")
            out.register_hook(lambda g: torch.full_like(g, float("inf")))
            return None

        model.register_forward_hook(hook)
        return model

    monkeypatch.setattr(build, "build_model", build_model)


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_non_finite_step_fails_and_keeps_the_last_good_checkpoint(cache, tmp_path, monkeypatch, torch_state, where):
    cfg = compose(cache, "train.steps=8", "train.checkpoint_every=2", "train.threads=1", *EVAL)
    _poison_at(monkeypatch, 5, where)
    with pytest.raises(train_mod.TrainingFailed, match=f"non-finite {where} at step 5"):
        train_mod.train(train_job.prepare(cfg, tmp_path))
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["status"] == "failed" and res["step"] == 5 and "step 5" in res["error"]
    assert valid_states(tmp_path) == [2, 4]  # keep_checkpoints=2; step 4's checksum still matches
    assert sorted(p.name for p in (tmp_path / checkpoint.STATES).iterdir()) == [
        "step-00000002.pt", "step-00000002.pt.sha256", "step-00000004.pt", "step-00000004.pt.sha256"]
    assert checkpoint.latest_state(tmp_path)["step"] == 4
    assert not (tmp_path / checkpoint.NAME).exists()
    assert steps_of(tmp_path) == [1, 2, 3, 4]


# ---- 6. write failures and the room guard -------------------------------------------------------


def test_check_room_refuses_a_full_disk(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=1 << 20))
    with pytest.raises(checkpoint.CheckpointError, match="MiB free"):
        checkpoint.check_room(tmp_path, 1 << 20)
    checkpoint.check_room(tmp_path, 1 << 19)  # room for two files of half a MiB


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores folder permissions")
def test_check_room_refuses_a_read_only_folder(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(checkpoint.CheckpointError, match="not writable"):
            checkpoint.check_room(folder, 1)
    finally:
        folder.chmod(0o700)


def test_check_room_refuses_a_folder_it_cannot_write(tmp_path, monkeypatch):
    """The same as above for root: os.access says no."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if mode == os.W_OK else real(p, mode, **kw))
    with pytest.raises(checkpoint.CheckpointError, match="not writable"):
        checkpoint.check_room(tmp_path / "states", 1)


def _state(step: int) -> dict:
    """A small training state; like every real one it records a config (latest_state reads it back through
    config.upgrade: an empty one is all defaults)."""
    return {"format": checkpoint.FORMAT, "step": step, "model": {"w": torch.full((64, 64), float(step))}, "config": {}}


@pytest.mark.parametrize("step", [8, 4], ids=["new-step", "same-step"])
def test_failed_write_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch, step):
    first = checkpoint.save_state(tmp_path, _state(4), keep=2)
    before = file_states(tmp_path)

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", broken_save)
    with pytest.raises(checkpoint.CheckpointError, match="No space left"):
        checkpoint.save_state(tmp_path, _state(step), keep=2)
    monkeypatch.undo()
    assert file_states(tmp_path) == before  # nothing new, no temporary file left behind
    assert valid_states(tmp_path) == [4]
    state = checkpoint.latest_state(tmp_path)
    assert state["step"] == 4 and torch.equal(state["model"]["w"], _state(4)["model"]["w"])
    assert first.exists()


def test_a_different_world_size_is_refused(cache, tmp_path):
    """A state trained by 2 torchrun ranks does not resume in 1 process: the global batch, its contents and the
    effective learning rate would change mid-run. Refused, naming both; the same world size resumes."""
    from posbench.config.checks import ConfigError
    from posbench.config.schema import finalize, to_dict
    from posbench.training.states import resume_state

    cfg = finalize(compose(cache))
    state = {"format": checkpoint.FORMAT, "step": 4, "model": {"w": torch.zeros(2)}, "config": to_dict(cfg), "world_size": 2}
    checkpoint.save_state(tmp_path, state, keep=2)
    with pytest.raises(ConfigError, match=r"trained by 2 processes .* this run has 1"):
        resume_state(cfg, tmp_path)
    checkpoint.save_state(tmp_path, {**state, "step": 8, "world_size": 1}, keep=2)
    assert resume_state(cfg, tmp_path)["step"] == 8


@pytest.fixture
def usr2_at_step_3(monkeypatch):
    """SIGUSR2 sent to this process while step 3 runs (as SLURM's --signal=USR2@… would)."""
    from posbench.training import loop as train_module

    real = train_module.lr_factor

    def lr_factor(step, *args):
        if step == 2:  # the third step
            os.kill(os.getpid(), signal.SIGUSR2)
        return real(step, *args)

    monkeypatch.setattr(train_module, "lr_factor", lr_factor)


def _train_in_process(cache, run):
    from posbench.config.schema import finalize
    from posbench.jobs.train_job import prepare
    from posbench.training.loop import train

    cfg = finalize(compose(cache, "train.steps=8", "wandb.enabled=false", "train.threads=1"))
    run.mkdir()
    return train(prepare(cfg, run))


def test_sigusr2_saves_a_checkpoint_then_exits_75(cache, tmp_path, usr2_at_step_3, torch_state):
    from posbench.training.loop import Preempted

    previous = signal.signal(signal.SIGUSR2, signal.SIG_DFL)  # a plain run: no handler before posbench's
    try:
        with pytest.raises(Preempted, match="SIGUSR2 at step 3"):
            _train_in_process(cache, tmp_path / "run")
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert valid_states(tmp_path / "run") == [3]


def test_sigusr2_hands_over_to_the_handler_installed_before_after_the_checkpoint(cache, tmp_path, usr2_at_step_3,
                                                                                 torch_state):
    """Under submitit, its SIGUSR2 handler (requeue, then exit) was installed first: posbench saves the step's
    checkpoint, then calls it, so the requeued task resumes from that checkpoint."""
    calls = []

    def submitit_like(signum, frame):  # what submitit's handler does: requeue, then leave the process
        calls.append((signum, valid_states(tmp_path / "run")))
        raise SystemExit(0)

    previous = signal.signal(signal.SIGUSR2, submitit_like)
    try:
        with pytest.raises(SystemExit):
            _train_in_process(cache, tmp_path / "run")
    finally:
        restored = signal.signal(signal.SIGUSR2, previous)
    assert calls == [(signal.SIGUSR2, [3])]  # called once, after the checkpoint of step 3 was written
    assert restored is submitit_like  # posbench's own handler was removed again


# ---- a second Ctrl-C ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("every", [0, 4])
def test_a_second_ctrl_c_quits_at_once_and_says_what_a_rerun_resumes_from(cache, tmp_path, every):
    """Ctrl-C twice: no checkpoint now, exit 130, one line saying from which saved state (or from step 0) the same
    command goes on, and no half-written file; a rerun that finds no state says it starts from step 0."""
    run = tmp_path / "run"
    overrides = ["train.steps=400", f"train.checkpoint_every={every}", "train.threads=1", "train.log_every=1",
                 "train.seq_len=256", "train.batch_size=32", *EVAL]  # steps long enough to Ctrl-C during one
    proc = start(run, cache, *overrides)
    wait_until(proc, lambda: len(rows(run)) >= 6, "six steps")
    os.kill(proc.pid, signal.SIGINT)
    wait_until(proc, lambda: "stopping after the current step" in output(run), "the first Ctrl-C")
    os.kill(proc.pid, signal.SIGINT)  # (two at once would be one: a pending signal is not queued twice)
    assert proc.wait(TIMEOUT) == 130, output(run)
    last = output(run).strip().splitlines()[-1]
    saved = valid_states(run)
    assert (saved == []) if every == 0 else (saved and saved[-1] % 4 == 0), (saved, output(run))
    if every == 0:
        assert last == (f"posbench: interrupted (Ctrl-C); no training state was saved, so the run starts over from step "
                        f"0 when you run it again in the same folder (hydra.run.dir={run}) (train.checkpoint_every=N "
                        "saves one every N steps)"), output(run)
    else:
        assert last == (f"posbench: interrupted (Ctrl-C); the run resumes from its training state saved at step "
                        f"{saved[-1]} when you run it again in the same folder (hydra.run.dir={run})"), output(run)
    assert not list(run.rglob("*.tmp")) and "Traceback" not in output(run)
    if every == 0:
        again = cli(run, cache, "train.steps=2", "train.threads=1", "train.seq_len=256", *EVAL)
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"{run} holds an earlier start of this run but no training state: training from step 0" in \
            again.stdout + again.stderr


def test_an_interrupted_checkpoint_write_leaves_no_file_behind(tmp_path, monkeypatch):
    """A KeyboardInterrupt while torch.save writes (a second Ctrl-C during the save) removes the temporary file."""
    from posbench.training import checkpoint

    def interrupted(obj, f, *args, **kwargs):
        f.write(b"x" * 1000)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_state(tmp_path, {"step": 3, "model": {}}, keep=2)
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_checkpoint_whose_checksum_is_written_is_kept_when_interrupted(tmp_path, monkeypatch):
    """A Ctrl-C between the checksum's rename and the state's leaves the (whole, fsynced) state in place, so the
    checksum matches the file it names."""
    from posbench.training import checkpoint

    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the state's own rename, after the checksum's
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_state(tmp_path, {"step": 3, "model": {}}, keep=2)
    monkeypatch.setattr(checkpoint.os, "replace", real)
    state = tmp_path / checkpoint.STATES / "step-00000003.pt"
    assert state.with_name(state.name + ".sha256").read_text().strip() == checkpoint.file_sha256(state)
    assert not list(tmp_path.rglob("*.tmp"))


def test_the_second_ctrl_c_of_a_resume_never_run_says_how_to_resume():
    from posbench.runtime.signals import Interrupted

    assert Interrupted("out/run", 8, "never").advice() == (
        "; its training state saved at step 8 is resumed when you run it again in the same folder "
        "(hydra.run.dir=out/run) with resume=auto (with resume=never, the same command starts over)")
