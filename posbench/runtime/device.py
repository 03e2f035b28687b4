"""Where a job computes: the torch device a checked ``device`` setting names, the CPU thread count, and whether CPU
floats below 2^−126 (denormals) are flushed to zero.

Used by ``posbench train`` and ``posbench eval`` alike; the values were checked when the job's config was made
(``posbench.config.checks.check_device``).
"""

from __future__ import annotations

import contextlib
import os

import torch

_flushing = False  # this process flushes denormals for good (:func:`flush_denormals_from_now`)


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU; any other name (cpu, cuda, cuda:1) as it is."""
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def native_bf16_cpu() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX tiles), where bf16 autocast can pay."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """Training's autocast dtype for a checked ``train.precision`` on ``device``: bfloat16 for ``bf16``, and for
    ``auto`` on CUDA; None (float32, no autocast) for ``fp32`` and for ``auto`` on CPU."""
    return torch.bfloat16 if precision == "bf16" or precision == "auto" and device.type == "cuda" else None


def set_threads(threads: int | None) -> int:
    """Set torch's CPU thread count (default: the cores this process may run on, shared among the
    processes torchrun started on this machine); return it."""
    n = threads or max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(n)
    return n


def flush_denormals_from_now(device: str | torch.device) -> None:
    """On CPU, from now on in this process, float results below 2^−126 (denormals) read and written as 0. A softmax
    over a long window, or over keys a decaying bias pushes far down (KERPLE power while training, ALiBi's smallest
    slope at 8192 tokens), has many such terms, exp(s − max) < 1e−38 beside a row sum ≥ 1, and Intel CPUs take a
    slow microcode path for each one; zeroing them leaves every sum they join unchanged. The setting is per thread
    (``torch.set_flush_denormal``) and threads inherit it when they start: call this before torch's thread pool
    starts (the jobs call it where they set the thread count), or the pool's threads keep IEEE's behaviour."""
    global _flushing
    if torch.device(device).type == "cpu" and torch.set_flush_denormal(True):
        _flushing = True


@contextlib.contextmanager
def flush_denormals(device: str | torch.device):
    """:func:`flush_denormals_from_now` inside the block only, then back to IEEE behaviour; a no-op in a process
    that flushes for good."""
    on = not _flushing and torch.device(device).type == "cpu" and torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if on:
            torch.set_flush_denormal(False)
