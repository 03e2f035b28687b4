"""One run on two CPU processes: ``torchrun --nproc_per_node=2 -m posbench train`` with gloo.

Checks that the ranks write one run folder, keep identical parameters, see different batches, and
that the sharded, all-reduced evaluation gives the perplexities of a plain single-process evaluation
of the saved checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from helpers import cli_env, free_port
from posbench.data import cache as token_cache
from posbench.data.batches import get_batch
from posbench.evaluation.perplexity import evaluate
from posbench.model import build
from posbench.training import checkpoint

TIMEOUT = 300
STEPS = 6
LENGTHS, MAX_TOKENS = [32, 64], 256


def _env() -> dict:
    """The environment of a rank: helpers.cli_env with one OpenMP thread (two ranks share the cores). (Also imported
    by tests/test_init_from.py.)"""
    return cli_env(OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    """The session's data cache (conftest: prepared once)."""
    return data_cache


@pytest.fixture(scope="module")
def ddp(cache, tmp_path_factory):
    """A finished two-process run, started from an empty folder without hydra.run.dir, so the ranks must
    agree on the one time-stamped run folder themselves."""
    cwd = tmp_path_factory.mktemp("ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "posbench", "train", "debug=fast", f"data.cache_dir={cache}",
           f"train.steps={STEPS}", "train.threads=1", f"eval.lengths=[{','.join(map(str, LENGTHS))}]",
           f"eval.max_tokens={MAX_TOKENS}"]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return cwd, proc


def test_one_run_folder_for_both_ranks(ddp):
    cwd, _ = ddp
    assert [p.name for p in cwd.iterdir()] == ["outputs"]
    runs = [p for p in (cwd / "outputs").glob("*/*") if p.is_dir()]
    assert len(runs) == 1, runs
    run = runs[0]
    assert run.name.endswith("_rope")
    assert (run / "results.json").exists() and (run / checkpoint.NAME).exists()
    assert (run / ".hydra" / "config.yaml").exists()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # rank 0 alone writes


def _run(ddp) -> Path:
    cwd, _ = ddp
    return next(p for p in (cwd / "outputs").glob("*/*") if p.is_dir())


def test_parameters_stay_identical_across_ranks(ddp):
    res = json.loads((_run(ddp) / "results.json").read_text())
    assert res["status"] == "complete"
    assert res["world_size"] == 2
    assert len(res["param_sha256"]) == 2 and res["param_sha256"][0] == res["param_sha256"][1]
    assert res["train_tokens"] == STEPS * 4 * 32 * 2  # batch 4 × L 32 per rank


def test_final_loss_is_the_logged_mean_over_ranks(ddp):
    run = _run(ddp)
    res = json.loads((run / "results.json").read_text())
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == STEPS
    assert res["final_loss"] == last["loss"]  # not rank 0's own loss on its own batch


def test_sharded_evaluation_matches_a_single_process(ddp):
    run = _run(ddp)
    res = json.loads((run / "results.json").read_text())
    state = checkpoint.read(run / checkpoint.NAME)
    model = build.model_from(state)
    config = state["config"]
    corpus = token_cache.prepare(**config["data"])
    e = config["eval"]
    assert (list(e["lengths"]), e["max_tokens"]) == (LENGTHS, MAX_TOKENS)
    rows = evaluate(model, corpus.tokens[e["split"]], LENGTHS, e["protocol"], e["stride"], e["max_tokens"],
                    e["batch_tokens"], "cpu")
    assert [r["length"] for r in res["results"]] == LENGTHS
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in res["results"]]
    for name in ("ppl", "nll"):
        torch.testing.assert_close(torch.tensor([r[name] for r in rows], dtype=torch.float64),
                                   torch.tensor([r[name] for r in res["results"]], dtype=torch.float64),
                                   rtol=1e-6, atol=0)


def test_each_rank_gets_its_own_batches():
    tokens = np.arange(5000, dtype=np.uint16)
    x0, y0 = get_batch(tokens, step=3, seed=0, batch_size=4, seq_len=32, rank=0)
    x1, y1 = get_batch(tokens, step=3, seed=0, batch_size=4, seq_len=32, rank=1)
    assert x0.shape == x1.shape == (4, 32) and x0.dtype == torch.int64
    assert not torch.equal(x0, x1)
    assert torch.equal(y0[:, :-1], x0[:, 1:]) and torch.equal(y1[:, :-1], x1[:, 1:])
    again, _ = get_batch(tokens, step=3, seed=0, batch_size=4, seq_len=32, rank=1)
    assert torch.equal(again, x1)  # a pure function of (seed, step, rank): a resumed rank sees the same batch
    other_step, _ = get_batch(tokens, step=4, seed=0, batch_size=4, seq_len=32, rank=1)
    assert not torch.equal(other_step, x1)


def test_torchrun_eval_shards_windows_and_writes_once(ddp):
    run = _run(ddp)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "posbench", "eval", f"run={run}", f"eval.lengths=[{','.join(map(str, LENGTHS))}]",
           f"eval.max_tokens={MAX_TOKENS}", "threads=1"]
    proc = subprocess.run(cmd, cwd=run.parent, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    written = sorted(p.name for p in run.glob("eval-*.json"))
    assert written == ["eval-rope-nonoverlapping-validation-1.json"]  # rank 0 alone writes
    ev = json.loads((run / written[0]).read_text())
    base = json.loads((run / "results.json").read_text())
    assert ev["world_size"] == 2
    assert [r["tokens"] for r in ev["results"]] == [r["tokens"] for r in base["results"]]  # each target once
    assert_close(torch.tensor([r["ppl"] for r in ev["results"]], dtype=torch.float64),
                 torch.tensor([r["ppl"] for r in base["results"]], dtype=torch.float64), rtol=1e-6, atol=0)
