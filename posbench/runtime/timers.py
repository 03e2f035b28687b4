"""Two timers for benchmarks, and when to use each (scripts/benchmark.py, scripts/gpu_probe.py):

* :func:`wall` — wall-clock seconds around a sync: everything the host waits for, launches, syncs and Python
  included. The only timer on CPU; on CUDA the one for a whole training or evaluation step, where the host's work
  is part of what a run pays.
* :func:`events` — CUDA events recorded on the stream before and after the calls: the GPU's time between them,
  without the host's overhead once the first launch is queued. The one for kernels on CUDA, where a sync around each
  call would cost as much as a small kernel.

    seconds = per_call(fn, device, loops=10)   # events on CUDA, wall elsewhere; seconds per call of fn
"""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall(fn, device: torch.device, loops: int = 1) -> float:
    """Seconds per call of ``fn`` over ``loops`` calls, by the wall clock between a sync before and a sync after."""
    sync(device)
    start = time.perf_counter()
    for _ in range(loops):
        fn()
    sync(device)
    return (time.perf_counter() - start) / loops


def events(fn, loops: int = 1) -> float:
    """Seconds per call of ``fn`` over ``loops`` calls, by CUDA events around them on the current stream (CUDA only)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(loops):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / loops  # (elapsed_time: milliseconds)


def per_call(fn, device: torch.device, loops: int = 1) -> float:
    """:func:`events` on CUDA, :func:`wall` elsewhere: seconds per call of ``fn``."""
    return events(fn, loops) if device.type == "cuda" else wall(fn, device, loops)
