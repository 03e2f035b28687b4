"""The benchmarks' two timers (posbench/runtime/timers.py): the wall clock around a sync, and CUDA events. Each is
checked against a known duration (a sleep of 20 ms per call; a timer of the wrong unit or loop count is off by 10× or
more, far outside the bounds); the scripts time through them and no timer of their own."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from posbench.runtime import timers

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_the_wall_clock_gives_seconds_per_call():
    calls = []

    def nap():
        calls.append(1)
        time.sleep(0.02)

    seconds = timers.wall(nap, torch.device("cpu"), loops=3)
    assert len(calls) == 3 and 0.018 <= seconds < 0.2, seconds
    assert 0.018 <= timers.per_call(nap, torch.device("cpu"), loops=2) < 0.2  # (the wall clock off CUDA)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_cuda_events_give_seconds_per_call():
    device = torch.device("cuda")
    a = torch.randn(1024, 1024, device=device)
    torch.cuda._sleep(10_000_000)  # (a warm start)
    seconds = timers.events(lambda: torch.cuda._sleep(20_000_000), loops=2)  # 20 M cycles: ~10 ms on a 2 GHz GPU
    assert 1e-3 < seconds < 0.2, seconds
    assert timers.per_call(lambda: a @ a, device, loops=3) > 0


def test_the_scripts_time_with_these_timers_alone():
    """scripts/benchmark.py and scripts/gpu_probe.py import the timers and record no CUDA event nor read the wall
    clock around a call themselves (their clocks for budgets and a run's start are not timers of a call)."""
    for name in ("benchmark.py", "gpu_probe.py"):
        text = (SCRIPTS / name).read_text()
        assert "from posbench.runtime import timers" in text, name
        assert "torch.cuda.Event(" not in text and "elapsed_time(" not in text, name
