"""The learning-rate schedules (``train.schedule``): cosine, the default, and constant after a linear warmup (Position
Interpolation's fine-tuning, Chen et al. 2023 §3.1), against their formulas written here, and as a run logs them."""

from __future__ import annotations

import json
import math

import pytest

from helpers import refused, run_into, snapshot, train_here
from posbench.training.optim import lr_factor

LR, MIN_LR = 2e-3, 2e-4  # the defaults


def cosine(step: int, warmup: int, total: int) -> float:
    """The rate of 0-based step ``step``: (step + 1)/warmup during the warmup, then lr_min + (lr − lr_min)·(1 + cos(π·t))/2
    with t the fraction of the post-warmup steps done (Loshchilov & Hutter 2017, eq. 5, one cycle)."""
    if step < warmup:
        return LR * (step + 1) / warmup
    t = (step - warmup) / (total - warmup)
    return MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * t)) / 2


@pytest.mark.parametrize("step", [0, 3, 9, 10, 11, 50, 99])
def test_cosine_is_warmup_then_one_cosine_cycle_to_min_lr(step):
    assert LR * lr_factor(step, 10, 100, MIN_LR / LR, "cosine") == pytest.approx(cosine(step, 10, 100), rel=1e-12)


@pytest.mark.parametrize("step", [0, 1, 4, 5, 6, 99])
def test_constant_is_warmup_then_the_full_rate(step):
    expected = (step + 1) / 5 if step < 5 else 1.0
    assert lr_factor(step, 5, 100, MIN_LR / LR, "constant") == expected


def test_a_run_logs_its_schedules_rates(data_cache, trained_run, tmp_path, torch_state):
    """debug=fast (4 steps, warmup 1): the default run logs the cosine's rates, a constant one lr after step 1 (this
    one trained in this process)."""
    logged = [json.loads(line)["lr"] for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert logged == pytest.approx([cosine(s, 1, 4) for s in range(4)], rel=1e-12)
    run = tmp_path / "constant"
    assert train_here(data_cache, run, "train.schedule=constant", "train.warmup_steps=2")["status"] == "complete"
    logged = [json.loads(line)["lr"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == [LR / 2, LR, LR, LR]
    assert json.loads((run / "results.json").read_text())["config"]["train"]["schedule"] == "constant"


def test_an_unknown_schedule_is_refused(posbench_here, data_cache, existing_run):
    before = snapshot(existing_run)
    message = refused(run_into(posbench_here, data_cache, existing_run, "train.schedule=linear"), existing_run, before)
    assert "train.schedule='linear'" in message and "cosine, constant" in message
