"""scripts/benchmark.py end to end at tiny sizes: it runs, prints its table and writes its JSON, whose figures
are positive numbers. Nothing here is timed or held to a target: the speed targets live in the benchmark."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"
TINY = ["--d-model", "16", "--layers", "1", "--heads", "2", "--vocab", "64", "--seq-len", "4", "--batch", "2",
        "--threads", "1", "--steps", "1", "--warmup", "1", "--repeats", "1"]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_benchmark_writes_json_with_positive_ratios(tmp_path):
    out = tmp_path / "bench.json"
    # nope (the baseline) is added; 64 = 16L is where a bias scheme's evaluation targets apply
    args = [*TINY, "--schemes", "alibi", "rope", "--lengths", "4", "64", "--out", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "targets met" in proc.stdout and "alibi step / rope step" in proc.stdout

    r = json.loads(out.read_text())
    assert set(r) == {"machine", "settings", "matmul_ceiling_gflops", "matmul_seconds_all", "ceiling_matmul", "flops", "train",
                      "alibi_step_x_rope", "eval", "targets", "all_targets_met", "source_changed"}
    assert r["machine"]["threads"] == 1 and r["machine"]["torch"] == torch.__version__
    assert {"cpu", "device", "dtype", "source"} <= set(r["machine"]) and positive(r["machine"]["cpu_share_in_training"])
    assert r["flops"]["per_token"] > 6 * r["flops"]["n_params"] > 0
    schemes = ["nope", "alibi", "rope"]
    assert list(r["train"]) == list(r["eval"]) == schemes
    figures = [r["matmul_ceiling_gflops"], r["alibi_step_x_rope"]]
    for s in schemes:
        t = r["train"][s]
        figures += [t["step_seconds"], t["tokens_per_s"], t["gflops"], t["ceiling_fraction"], t["step_x_nope"]]
        assert set(r["eval"][s]) == {"4", "64"}
        for e in r["eval"][s].values():
            figures += [e["seconds"], e["nope_seconds"], e["time_x_nope"], e["mem_x_nope"]]
            assert isinstance(e["peak_growth_bytes"], int) and e["peak_growth_bytes"] >= 0
    assert all(positive(x) for x in figures), figures
    assert r["train"]["nope"]["step_x_nope"] == 1.0 and r["eval"]["nope"]["64"]["time_x_nope"] == 1.0

    # the ceiling target for each scheme, ALiBi's step against RoPE's, ALiBi's time and memory at 16L (no 64L here)
    where = sorted((t["scheme"], t.get("length", 0)) for t in r["targets"])
    assert where == [("alibi", 0), ("alibi", 0), ("alibi", 64), ("alibi", 64), ("nope", 0), ("rope", 0)]
    assert all(positive(t["value"]) and positive(t["limit"]) and isinstance(t["met"], bool) for t in r["targets"])
    assert r["all_targets_met"] == all(t["met"] for t in r["targets"])
    assert isinstance(r["source_changed"], bool)


def test_scaled_and_contextual_cases(tmp_path):
    """A ``rope+ssmax`` case (model.attn_scale=ssmax) and CoPE run, CoPE without an evaluation target, and a misspelt
    scaling is refused by the argument parser."""
    out = tmp_path / "bench.json"
    args = [*TINY, "--schemes", "rope+ssmax", "cope", "--lengths", "4", "64", "--out", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert list(r["train"]) == ["nope", "rope+ssmax", "cope"]
    assert "cope: contextual kernel" in proc.stdout
    assert not [t for t in r["targets"] if t["scheme"] == "cope" and t.get("length")]  # no evaluation target
    bad = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--schemes", "rope+logn"], capture_output=True, text=True)
    assert bad.returncode == 2 and "'rope+logn'" in bad.stderr
