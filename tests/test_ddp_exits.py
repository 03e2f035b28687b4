"""Two CPU ranks (gloo) that stop early: every rank leaves together with the documented status.

The two processes are started the way torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
set), but by the test itself, so each rank's own exit status is seen (torchrun reports a failed worker's
status in its summary and exits 1 itself). Nothing is killed from outside: a NaN or a SIGTERM is injected by a
few lines of Python that run in one rank before ``posbench train``. Also here: per-rank dropout streams
that resume bit-identically, and a resume under another world size with the explicit override.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import cli_env, free_port, train_here
from posbench.training import checkpoint

TIMEOUT = 180  # seconds: longer is a hang (a rank waiting in a collective for one that left)
COMMON = ["debug=fast", "train.threads=1", "eval.lengths=[32,64]", "eval.max_tokens=256", "train.log_every=1"]

# Runs in a rank before posbench: on rank INJECT_RANK, at step INJECT_STEP, a NaN loss or a SIGTERM, or a full
# disk; on rank LEAVE_HANGS, a teardown of the process group that hangs; and on every rank, a line on stderr when it
# trains a tokenizer and when it leaves the process group.
PRELUDE = textwrap.dedent("""
    import os, signal, sys
    import torch
    from posbench.model import build
    from posbench.training import checkpoint
    from posbench.training import loop as train
    what, at, who = os.environ["INJECT"], int(os.environ["INJECT_STEP"]), int(os.environ["INJECT_RANK"])
    if int(os.environ["RANK"]) == who:
        if what == "sigterm":
            real = train.lr_factor
            def lr_factor(step, *args):
                if step == at - 1:
                    os.kill(os.getpid(), signal.SIGTERM)
                return real(step, *args)
            train.lr_factor = lr_factor
        elif what == "nan":
            real, calls = build.build_model, [0]
            def build_model(*args, **kwargs):
                model = real(*args, **kwargs)
                def hook(module, inputs, out):
                    if module.training:
                        calls[0] += 1
                        if calls[0] == at:
                            return out * float("nan")
                model.register_forward_hook(hook)
                return model
            build.build_model = build_model
        elif what == "bug":  # an error posbench does not foresee, on this rank alone
            real = train.lr_factor
            def lr_factor(step, *args):
                if step == at - 1:
                    raise RuntimeError("injected bug")
                return real(step, *args)
            train.lr_factor = lr_factor
        elif what == "no-room":  # rank 0 alone checks the checkpoint folder
            def check_room(folder, nbytes):
                raise checkpoint.CheckpointError(f"{str(folder)!r} has 0 MiB free (injected)")
            checkpoint.check_room = check_room
    from posbench.data import cache as data
    train_tokenizer = data.train_tokenizer
    def counted(*args, **kwargs):
        print("posbench-test: training the tokenizer", file=sys.stderr, flush=True)
        return train_tokenizer(*args, **kwargs)
    data.train_tokenizer = counted
    leave = torch.distributed.destroy_process_group
    def destroy(*args, **kwargs):
        print("posbench-test: left the process group", file=sys.stderr, flush=True)
        if os.environ.get("LEAVE_HANGS") == os.environ["RANK"]:  # torch's teardown hanging on this rank
            import time
            time.sleep(600)
        return leave(*args, **kwargs)
    if os.environ.get("LEAVE_HANGS"):
        from posbench.runtime import dist
        dist.LEAVE_TIMEOUT_S = 3.0
    torch.distributed.destroy_process_group = destroy
    from posbench.cli import main
    main(sys.argv[1:])
""")


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    """The session's data cache (conftest: prepared once)."""
    return data_cache


def ranks(run: Path, cache: Path, *overrides: str, world: int = 2, inject: tuple = ("none", 0, 0),
          leave_hangs: int | None = None):
    """Start ``world`` ranks of ``posbench train`` into ``run``; return their CompletedProcess-like results.
    ``leave_hangs``: the rank whose torch.distributed teardown hangs (see PRELUDE)."""
    port = free_port()
    procs = []
    for r in range(world):
        env = {**cli_env(OMP_NUM_THREADS="1"), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "INJECT": inject[0], "INJECT_STEP": str(inject[1]),
               "INJECT_RANK": str(inject[2]), "LEAVE_HANGS": "" if leave_hangs is None else str(leave_hangs)}
        cmd = [sys.executable, "-c", PRELUDE, "train", *COMMON, f"hydra.run.dir={run}", f"data.cache_dir={cache}",
               *overrides]
        procs.append(subprocess.Popen(cmd, cwd=run.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            p.kill()
    return out


def left_together(procs) -> bool:
    """Every rank left the process group (destroy_process_group) and none printed a traceback."""
    return all("left the process group" in p.stderr and "Traceback" not in p.stderr for p in procs)


def states(run: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in (run / checkpoint.STATES).glob("step-*.pt"))


def test_a_nan_on_one_rank_fails_both_with_status_1(cache, tmp_path):
    run = tmp_path / "run"
    procs = ranks(run, cache, "train.steps=6", "train.checkpoint_every=2", inject=("nan", 3, 1))
    assert [p.returncode for p in procs] == [1, 1], [p.stderr[-1500:] for p in procs]
    assert "non-finite loss at step 3" in procs[0].stderr
    assert left_together(procs), [p.stderr[-1500:] for p in procs]
    res = json.loads((run / "results.json").read_text())
    assert res["status"] == "failed" and res["step"] == 3
    assert states(run) == [2]


def test_sigterm_on_one_rank_stops_both_with_status_75(cache, tmp_path):
    run = tmp_path / "run"
    procs = ranks(run, cache, "train.steps=6", inject=("sigterm", 3, 1))
    assert [p.returncode for p in procs] == [75, 75], [p.stderr[-1500:] for p in procs]
    assert "SIGTERM at step 3" in procs[0].stderr
    assert left_together(procs), [p.stderr[-1500:] for p in procs]
    assert states(run) == [3]
    again = ranks(run, cache, "train.steps=6")
    assert [p.returncode for p in again] == [0, 0], [p.stderr[-1500:] for p in again]
    assert json.loads((run / "results.json").read_text())["resumed_from"] == 3


def test_an_error_on_rank_0_alone_stops_every_rank_with_status_2(cache, tmp_path):
    """Rank 0 alone checks the checkpoint folder; when it refuses, the other rank must not wait for it in a
    collective until the process group times out: both exit 2 with the message."""
    procs = ranks(tmp_path / "run", cache, "train.steps=4", inject=("no-room", 0, 0))
    assert [p.returncode for p in procs] == [2, 2], [p.stderr[-1500:] for p in procs]
    assert all("0 MiB free (injected)" in p.stderr for p in procs)
    assert left_together(procs), [p.stderr[-1500:] for p in procs]


def test_an_unforeseen_error_on_one_rank_does_not_leave_the_other_waiting(cache, tmp_path):
    """A bug on rank 1 alone: it exits 1 (Hydra's report of the error) without waiting in a barrier for rank 0,
    which is inside a collective; rank 0's collective then fails on the lost peer and it exits 1 too."""
    procs = ranks(tmp_path / "run", cache, "train.steps=6", inject=("bug", 3, 1))
    assert [p.returncode for p in procs] == [1, 1], [p.stderr[-1500:] for p in procs]
    assert "injected bug" in procs[1].stderr


@pytest.mark.parametrize(("inject", "status", "hangs"), [(("none", 0, 0), 0, 0), (("nan", 3, 0), 1, 1)])
def test_a_rank_whose_teardown_hangs_still_exits_with_its_status(cache, tmp_path, inject, status, hangs):
    """torch.distributed's teardown can hang after the last barrier (rarely: seen once in CI, on gloo): a rank
    still leaving dist.LEAVE_TIMEOUT_S (here 3 s) after it began says so and exits with the status it was leaving
    with — 0 after a finished run, 1 after a NaN — and the other rank exits as it would have."""
    procs = ranks(tmp_path / "run", cache, "train.steps=4", inject=inject, leave_hangs=hangs)
    assert [p.returncode for p in procs] == [status, status], [p.stderr[-1500:] for p in procs]
    said = [p.stderr.count("still leaving the process group 3 s after it began") for p in procs]
    assert said == [int(r == hangs) for r in range(2)], [p.stderr[-1500:] for p in procs]
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["status"] == ("failed" if status else "complete")


def test_two_ranks_on_a_cold_cache_build_it_once(tmp_path):
    """Both ranks run the pre-flight check and the trainer; on an empty cache the corpus (BPE tokenizer and
    token ids) is still built once, by whichever process came first, and read by the others."""
    cold = tmp_path / "cold-cache"
    procs = ranks(tmp_path / "run", cold, "train.steps=2")
    assert [p.returncode for p in procs] == [0, 0], [p.stderr[-1500:] for p in procs]
    assert sum(p.stderr.count("training the tokenizer") for p in procs) == 1


def test_checks_every_k_steps_still_report_the_exact_step(cache, tmp_path):
    """train.sync_every=4: the NaN of step 3 is found at the sync after step 4, and reported as step 3;
    a SIGTERM during step 2 is acted on at that sync: the checkpoint is of step 4, and says so."""
    nan = ranks(tmp_path / "nan", cache, "train.steps=8", "train.sync_every=4", inject=("nan", 3, 0))
    assert [p.returncode for p in nan] == [1, 1], [p.stderr[-1500:] for p in nan]
    assert "non-finite loss at step 3" in nan[0].stderr
    assert [json.loads(line)["step"] for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    stop = ranks(tmp_path / "stop", cache, "train.steps=8", "train.sync_every=4", inject=("sigterm", 2, 1))
    assert [p.returncode for p in stop] == [75, 75], [p.stderr[-1500:] for p in stop]
    assert "SIGTERM at step 4" in stop[0].stderr
    assert states(tmp_path / "stop") == [4]


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_dropout_streams_differ_across_ranks_and_resume_bit_identically(cache, tmp_path):
    """With dropout, each rank draws its own masks (its RNG state differs from rank 0's), every rank's state is
    in the checkpoint, and a run stopped at step 3 and resumed logs the losses of the run that was not stopped."""
    args = ("train.steps=6", "model.dropout=0.1", "train.checkpoint_every=3", "train.keep_checkpoints=1")
    straight = ranks(tmp_path / "straight", cache, *args)
    assert [p.returncode for p in straight] == [0, 0], [p.stderr[-1500:] for p in straight]
    state = torch.load(tmp_path / "straight" / checkpoint.STATES / "step-00000006.pt", weights_only=False)
    by_rank = state["rng_by_rank"]
    assert len(by_rank) == 2 and not torch.equal(by_rank[0]["torch"], by_rank[1]["torch"])
    stopped = tmp_path / "stopped"
    assert [p.returncode for p in ranks(stopped, cache, *args, inject=("sigterm", 3, 0))] == [75, 75]
    assert [p.returncode for p in ranks(stopped, cache, *args)] == [0, 0]
    assert _losses(stopped) == _losses(tmp_path / "straight")


def test_another_world_size_resumes_only_when_asked_and_is_recorded(cache, tmp_path, posbench_here, torch_state):
    """Two ranks stopped at step 3; the same command in one process is refused (checked in this process), and with
    resume_any_world_size=true its job (trained in this process) resumes and records both world sizes."""
    run = tmp_path / "run"
    assert [p.returncode for p in ranks(run, cache, "train.steps=6", inject=("sigterm", 3, 0))] == [75, 75]
    refused = posbench_here("train", *COMMON, f"hydra.run.dir={run}", f"data.cache_dir={cache}", "train.steps=6")
    assert refused.returncode == 2 and "trained by 2 processes" in refused.stderr
    assert "resume_any_world_size=true" in refused.stderr
    allowed = posbench_here("train", *COMMON, f"hydra.run.dir={run}", f"data.cache_dir={cache}", "train.steps=6",
                            "resume_any_world_size=true")
    assert allowed.returncode == 0, allowed.stderr[-1500:]
    resumed = train_here(cache, run, *COMMON[1:], "train.steps=6", "resume_any_world_size=true")  # (COMMON[0]: debug=fast)
    assert resumed["status"] == "complete"
    res = json.loads((run / "results.json").read_text())
    assert res["world_sizes"] == [[0, 2], [3, 1]] and res["world_size"] == 1
