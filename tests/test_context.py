"""The context-use probe (posbench/evaluation/context.py): its short windows against a construction written here, the measure
against a naive computation (the full window and each short window scored by separate forward passes), copying
models whose answer is known in closed form, the sharding over ranks, the refusals, the CLI end to end and the report.
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_module
from torch.testing import assert_close

from helpers import refused, snapshot
from posbench.cli import register
from posbench.config.checks import ConfigError
from posbench.config.schema import finalize
from posbench.evaluation import context
from posbench.model.build import build_model
from posbench.report import render
from test_report import config as run_config
from test_report import write_run

V = 40


# ---- the short windows ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length, L, S", [(16, 8, 1), (16, 8, 2), (16, 8, 8), (20, 8, 4), (64, 32, 4), (9, 8, 1),
                                          (40, 16, 3)])
def test_short_windows_score_every_position_past_L_once_with_L_minus_S_plus_1_to_L_tokens(length, L, S):
    scored = []  # (position, tokens of context) from the windows
    for s, first in context.short_windows(length, L, S):
        assert 0 <= s and s + L <= length, "a short window reads past its T-window"
        scored += [(p, p - s + 1) for p in range(s + first, s + L)]
    # the construction: position p ≥ L is scored by the window starting at S·⌈(p − L + 1)/S⌉, which sees s … p
    expected = [(p, p - S * math.ceil((p - L + 1) / S) + 1) for p in range(L, length)]
    assert scored == expected
    assert all(L - S + 1 <= c <= L for _, c in scored)
    assert {c for _, c in scored} == set(range(L - S + 1, L + 1))  # every context size in the range occurs


def test_short_windows_refuse_a_stride_that_does_not_tile():
    with pytest.raises(ValueError, match="divide T − L = 8"):
        context.short_windows(16, 8, 3)
    with pytest.raises(ValueError):
        context.short_windows(8, 8, 1)  # T = L: nothing past L


def test_window_starts_are_the_consecutive_windows_or_evenly_spaced_ones():
    assert context.window_starts(100, 16).tolist() == [0, 16, 32, 48, 64, 80]
    assert context.window_starts(100, 16, cap=3).tolist() == [0, 32, 64]  # windows 0, 2, 4 of 6
    assert context.window_starts(100, 16, cap=10).tolist() == context.window_starts(100, 16).tolist()


# ---- the measure against a naive computation ------------------------------------------------------------------


def tiny_model(scheme: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model({"vocab_size": V, "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64},
                        "scheme": {"name": scheme}}).eval()


def naive_nll(model, tokens: np.ndarray, start: int, size: int) -> torch.Tensor:
    """NLL (size,) of targets tokens[start+1 : start+size+1] from inputs tokens[start : start+size], via the logits."""
    x = torch.from_numpy(tokens[start: start + size + 1].astype(np.int64))
    with torch.no_grad():
        logits = model(x[None, :-1])[0]  # (size, V)
    return F.cross_entropy(logits.double(), x[1:], reduction="none")


@pytest.mark.parametrize("scheme", ["alibi", "rope", "nope"])
@pytest.mark.parametrize("L, S, lengths", [(8, 2, [8, 16, 32]), (8, 8, [16]), (12, 3, [24])])
def test_the_difference_equals_full_minus_short_scored_separately(scheme, L, S, lengths):
    model = tiny_model(scheme)
    tokens = np.random.default_rng(1).integers(0, V, 300)
    rows = context.measure(model, tokens, L, lengths, S, batch_tokens=50)  # small batches: several passes per length
    assert [r["length"] for r in rows] == [n for n in lengths if n > L]
    n_targets = (299 // max(lengths)) * max(lengths)  # the perplexity span: a multiple of the longest length
    scored: dict[tuple[int, int], torch.Tensor] = {}  # (start, size) → naive_nll: each window's forward pass once

    def window(start: int, size: int) -> torch.Tensor:
        if (start, size) not in scored:
            scored[start, size] = naive_nll(model, tokens, start, size)
        return scored[start, size]

    for r in rows:
        T = r["length"]
        assert r["starts"] == list(range(0, n_targets - T + 1, T))
        for o, diff, full_mean, short_mean in zip(r["starts"], r["diff"], r["full"], r["short"]):
            full = window(o, T)[L:]  # positions L … T−1 with the whole window
            short = []
            for p in range(L, T):  # each position with the short window that holds it, by its own forward pass
                s = S * math.ceil((p - L + 1) / S)
                short.append(window(o + s, L)[p - s])
            short = torch.stack(short)
            assert_close(diff, (full - short).mean().item(), atol=2e-5, rtol=0)
            assert_close(full_mean, full.mean().item(), atol=2e-5, rtol=0)
            assert_close(short_mean, short.mean().item(), atol=2e-5, rtol=0)
    assert not model.training


def test_a_model_in_training_mode_is_scored_in_eval_mode_and_left_as_it_was():
    model = tiny_model("alibi")
    model.blocks[0].drop.p = 0.5  # dropout that would change every number in training mode
    tokens = np.random.default_rng(2).integers(0, V, 200)
    model.train()
    a = context.measure(model, tokens, 8, [16], 4)
    model.eval()
    assert a == context.measure(model, tokens, 8, [16], 4)
    model.train()
    context.measure(model, tokens, 8, [16], 4)
    assert model.training


# ---- models whose answer is known -------------------------------------------------------------------------------


class CopyBack(torch.nn.Module):
    """Predicts the token D positions before its target (logit 30 on it) when the window holds it, else uniform."""

    def __init__(self, distance: int):
        super().__init__()
        self.d = distance

    def forward(self, idx, targets):
        B, T = idx.shape
        logits = torch.zeros(B, T, V)
        for p in range(self.d - 1, T):  # input p predicts token p + 1, copied from input p + 1 − D
            logits[torch.arange(B), p, idx[:, p + 1 - self.d]] = 30.0
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(B, T)


@pytest.mark.parametrize("distance", [5, 6, 7, 8, 9])
def test_a_copying_model_gains_exactly_where_the_short_window_cannot_see_back(distance):
    """Text that repeats with period D: a model copying from D back is right wherever the source is in its window
    (NLL ≈ 0) and uniform elsewhere (ln V). With L = 8, S = 4 a short window gives 5…8 tokens of context, so
    (D − 5) of each 4 positions lose the source: difference −ln V · (D − 5)/4, and −ln V at D = L + 1."""
    L, S = 8, 4
    block = np.random.default_rng(3).permutation(V)[:distance]
    tokens = np.tile(block, 400 // distance + 1)[:400]
    rows = context.measure(CopyBack(distance), tokens, L, [16, 32], S)
    expected = -math.log(V) * (distance - (L - S + 1)) / S
    for r in rows:
        assert_close(r["diff"], [expected] * len(r["starts"]), atol=1e-4, rtol=0)
        assert_close(r["full"], [0.0] * len(r["starts"]), atol=1e-4, rtol=0)


def test_sharded_windows_gather_to_the_single_process_values(monkeypatch):
    """Two ranks each score every other window; gathered, they give what one process gives."""
    model, tokens = tiny_model("alibi"), np.random.default_rng(4).integers(0, V, 400)
    single = context.measure(model, tokens, 8, [16, 32], 4)
    rank1 = []
    monkeypatch.setattr(context.dist, "gather", lambda value: rank1.append(value) or [value])
    context.measure(model, tokens, 8, [16, 32], 4, rank=1, world=2)
    parts = iter(rank1)
    monkeypatch.setattr(context.dist, "gather", lambda value: [value, next(parts)])
    sharded = context.measure(model, tokens, 8, [16, 32], 4, rank=0, world=2)
    for a, b in zip(sharded, single):
        assert a["starts"] == b["starts"]
        assert_close(a["diff"], b["diff"], atol=1e-6, rtol=0)


def test_record_summarises_the_windows_with_a_bootstrap_interval():
    model, tokens = tiny_model("rope"), np.random.default_rng(5).integers(0, V, 600)
    settings = {"stride": 2, "windows": 5, "bootstrap": 400, "seed": 3}
    probe = context.record(model, tokens, settings, "validation", 8, [8, 16, 32])
    assert probe["settings"] == {**settings, "split": "validation", "train_length": 8}
    for r in probe["rows"]:
        d = np.asarray(r["per_window"])
        assert r["windows"] == len(d) == 5 and r["diff"] == pytest.approx(d.mean())
        assert r["nll_full"] - r["nll_short"] == pytest.approx(r["diff"], abs=1e-9)
        rng = np.random.default_rng([3, r["length"]])  # the documented draws: 400 resamples of the 5 windows
        means = d[rng.integers(0, 5, size=(400, 5))].mean(1)
        assert (r["ci_low"], r["ci_high"]) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])))
        assert r["ci_low"] <= r["diff"] <= r["ci_high"]
    assert "negative = uses context beyond L" in context.table(probe)


# ---- refusals ---------------------------------------------------------------------------------------------------


@pytest.fixture
def hydra_ctx():
    register()
    with initialize_config_module("posbench.conf", version_base="1.3"):
        yield


REFUSALS = [
    (["eval.context.stride=0"],
     r"eval.context.stride=0 is not allowed: it must be an integer between 1 and the train length L=128"),
    (["eval.context.stride=129"], r"eval.context.stride=129 is not allowed"),
    (["eval.probes=[context]", "eval.context.stride=5"],
     r"eval.context.stride=5 does not divide T − L = 128 at evaluation length 256 \(L=128\): .* e.g. eval.context.stride=16"),
    (["eval.probes=[context]", "train.seq_len=100"],
     r"eval.context.stride=12 \(the default, L // 8\) does not divide T − L = 100 .* e.g. eval.context.stride=10"),
    (["eval.probes=[context]", "eval.lengths=[64,128]"], r"eval.lengths=\[64, 128\] has no evaluation length above"),
    (["eval.context.windows=0"], r"eval.context.windows=0 is not allowed"),
    (["eval.context.bootstrap=0"], r"eval.context.bootstrap=0 is not allowed"),
    (["eval.context.seed=-1"], r"eval.context.seed=-1 is not allowed"),
    (["eval.probes=[contxt]"], r"eval.probes has 'contxt'; the probes: passkey, context"),
]


@pytest.mark.parametrize("overrides, message", REFUSALS, ids=[" ".join(r[0]) for r in REFUSALS])
def test_bad_context_settings_are_refused_in_one_line(overrides, message, hydra_ctx):
    with pytest.raises(ConfigError) as info:
        finalize(compose("train", overrides=overrides))
    assert "\n" not in str(info.value)
    assert re.search(message, str(info.value)), str(info.value)


def test_the_stride_defaults_to_L_over_8_and_is_checked_against_lengths_only_when_probing(hydra_ctx):
    assert finalize(compose("train", overrides=["eval.probes=[context]"])).eval.context.stride == 16
    assert finalize(compose("train", overrides=["train.seq_len=4", "eval.probes=[context]"])).eval.context.stride == 1
    with pytest.raises(ConfigError, match=r"eval.context.stride=5 does nothing without its probe: add 'eval.probes=\[context\]'"):
        finalize(compose("train", overrides=["eval.context.stride=5"]))  # not probing: a stride that would do nothing
    cfg = finalize(compose("train", overrides=["eval.probes=[passkey,context]", "eval.context.stride=32"]))
    assert list(cfg.eval.probes) == ["passkey", "context"]


# ---- end to end ---------------------------------------------------------------------------------------------------


def test_train_and_eval_record_and_print_the_context_table(run_cli, posbench_here, data_cache, tmp_path):
    run = tmp_path / "run"
    proc = run_cli("train", "debug=fast", "eval.probes=[passkey,context]", "eval.passkey.trials=2",
                   "eval.passkey.depths=[0,1]", f"hydra.run.dir={run}", f"data.cache_dir={data_cache}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = json.loads((run / "results.json").read_text())
    probe = rec["context"]
    assert probe["settings"] == {"stride": 4, "windows": None, "bootstrap": 1000, "seed": 0, "split": "validation",
                                 "train_length": 32}
    (row,) = probe["rows"]  # debug=fast: lengths 32 and 64, so T = 64 alone; max_tokens=256: 4 windows
    assert row["length"] == 64 and row["windows"] == 4 == len(row["per_window"]) and row["starts"] == [0, 64, 128, 192]
    assert "passkey" in rec and [r["length"] for r in rec["results"]] == [32, 64]
    assert "context use past L=32" in proc.stdout and f"{row['diff']:.4f}" in proc.stdout
    assert proc.stdout.index("ppl/ppl(L)") < proc.stdout.index("context use past L")  # after the perplexity table
    lines = list(csv.DictReader(open(run / "results.csv")))
    assert lines[0]["context_diff"] == "" and float(lines[1]["context_diff"]) == pytest.approx(row["diff"])

    again = run_cli("eval", f"run={run}", "eval.probes=[context]", "eval.context.stride=8", "eval.context.windows=2",
                    "eval.lengths=[32,64,128]", "eval.max_tokens=1024")
    assert again.returncode == 0, again.stdout + again.stderr
    evaluated = json.loads(next(run.glob("eval-*.json")).read_text())["context"]
    assert evaluated["settings"]["stride"] == 8 and evaluated["settings"]["train_length"] == 32  # the run's L
    # a span of 1024 targets: 16 windows of 64 and 8 of 128, two of each evenly spaced
    assert [(r["length"], r["starts"]) for r in evaluated["rows"]] == [(64, [0, 512]), (128, [0, 512])]
    assert "context use past L=32" in again.stdout

    before = snapshot(run)
    line = refused(posbench_here("eval", f"run={run}", "eval.probes=[context]", "eval.context.stride=3"), run, before)
    assert line.startswith("eval.context.stride=3 does not divide T − L = 32"), line


# ---- the report -------------------------------------------------------------------------------------------------


def with_probe(cfg: dict, diffs: dict[int, list[float]], stride: int = 4) -> dict:
    """A results record's ``context`` entry with the given per-window differences at each length."""
    rows = [{"length": n, "windows": len(d), "diff": statistics.fmean(d), "ci_low": min(d), "ci_high": max(d),
             "nll_full": 4.0 + statistics.fmean(d), "nll_short": 4.0, "per_window": d,
             "starts": [i * n for i in range(len(d))]} for n, d in diffs.items()]
    settings = {"stride": stride, "windows": None, "bootstrap": 500, "seed": 0, "split": "validation",
                "train_length": cfg["train"]["seq_len"]}
    return {"settings": settings, "rows": rows}


def test_the_report_pools_seeds_per_window_and_renders_the_table_and_plot(tmp_path):
    runs = tmp_path / "runs"
    alibi = {0: {64: [-0.2, -0.1, -0.3, -0.2], 128: [-0.4, -0.5]}, 1: {64: [-0.1, -0.1, -0.2, -0.3], 128: [-0.6, -0.3]}}
    for seed, diffs in alibi.items():
        cfg = run_config("alibi", seed)
        write_run(runs / f"alibi{seed}", cfg, context=with_probe(cfg, diffs))
    cfg = run_config("rope", 0)
    write_run(runs / "rope0", cfg, context=with_probe(cfg, {64: [0.05] * 4, 128: [0.1] * 2}))
    write_run(runs / "sinusoidal0", run_config("sinusoidal", 0))  # no probe: a perplexity row only
    out = tmp_path / "out"
    render.write_report([runs], out)
    md = (out / "report.md").read_text()
    section = md.split("## Context use past L")[1].split("\n## ")[0]
    assert "### C1. validation split, L = 32, stride 4" in section
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| |")}
    assert list(rows) == ["alibi", "rope"]  # the perplexity table's order; the row without a probe left out
    pooled = {n: statistics.fmean(statistics.fmean(v) for v in zip(alibi[0][n], alibi[1][n])) for n in (64, 128)}
    assert rows["alibi"][0].startswith(f"{pooled[64]:+.3f}".replace("-", "−") + " (")
    assert rows["alibi"][1].startswith(f"{pooled[128]:+.3f}".replace("-", "−") + " (") and rows["alibi"][2] == "2"
    assert rows["rope"][:2] == ["+0.050 (+0.050 … +0.050)", "+0.100 (+0.100 … +0.100)"]  # no spread, no interval
    assert "Negative: the model uses context beyond L" in section and "500 resamples" in section
    cells = {(c["setting"], int(c["length"])): c for c in csv.DictReader(open(out / "context.csv"))}
    assert int(cells["alibi", 64]["windows"]) == 4 and int(cells["alibi", 64]["seeds"]) == 2
    assert float(cells["alibi", 64]["ci_low"]) <= pooled[64] <= float(cells["alibi", 64]["ci_high"])
    assert (out / "context_vs_length.png").read_bytes()[:4] == b"\x89PNG"


def test_a_report_without_the_probe_has_no_context_section(tmp_path):
    runs = tmp_path / "runs"
    write_run(runs / "alibi0", run_config("alibi", 0))
    out = tmp_path / "out"
    _, _, images = render.write_report([runs], out)
    assert "Context use" not in (out / "report.md").read_text()
    assert "context_vs_length" not in images and not (out / "context.csv").exists()


def test_wandb_gets_the_difference_per_length_as_summary_values(tmp_path):
    from posbench.runtime.tracking import Tracker

    class Run:
        summary: dict = {}

    tracker = Tracker(False, tmp_path, "posbench")
    tracker.run = Run()
    tracker.log_context({"settings": {}, "rows": [{"length": 64, "diff": -0.25}, {"length": 128, "diff": 0.5}]})
    tracker.log_context(None)  # a record without the probe: nothing
    assert tracker.run.summary == {"context/diff@64": -0.25, "context/diff@128": 0.5}
