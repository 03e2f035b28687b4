"""Where a job computes: the torch device a checked ``device`` setting names, and the CPU thread count.

Used by ``posbench train`` and ``posbench eval`` alike; the values were checked when the job's config was made
(``posbench.config.check_device``).
"""

from __future__ import annotations

import os

import torch


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU; any other name (cpu, cuda, cuda:1) as it is."""
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def set_threads(threads: int | None) -> int:
    """Set torch's CPU thread count (default: the cores this process may run on, shared among the
    processes torchrun started on this machine); return it."""
    n = threads or max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(n)
    return n
