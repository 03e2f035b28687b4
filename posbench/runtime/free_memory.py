"""How much memory a device can give a run now, in bytes, and what was measured: a GPU's free memory, or the host's
available memory (MemAvailable, or a cgroup's remaining limit where that is smaller). posbench/model/memory.py
compares its estimate of a step with it before a run starts.

    free, what = available_bytes("cpu")   # (bytes, "MemAvailable of /proc/meminfo")
"""

from __future__ import annotations

import os

import torch


def available_bytes(device: torch.device | str) -> tuple[int, str]:
    """(bytes ``device`` can give a run now, what was measured). CUDA: the free bytes of ``torch.cuda.mem_get_info``
    plus what this process's caching allocator holds reserved but unallocated (``memory_reserved`` −
    ``memory_allocated``), which ``mem_get_info`` counts as used although this process can reuse it: a process that
    ran an earlier job (a joblib worker, a sweep's later job) keeps its blocks cached. Any other device uses host
    memory: MemAvailable of /proc/meminfo (physical memory from ``os.sysconf`` where there is none), or a cgroup's
    remaining limit where that is smaller."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # this process's, reusable
        return int(free + cached), f"free memory of {device} (torch.cuda.mem_get_info, plus the allocator's cache)"
    host = _meminfo_available() or (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory")
    limit = _cgroup_free()
    return limit if limit and limit[0] < host[0] else host


def _meminfo_available() -> tuple[int, str] | None:
    """(MemAvailable in bytes, its source) from /proc/meminfo, or None where the file or line is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable of /proc/meminfo"  # the file says kB
    except OSError:
        pass
    return None


def _cgroup_free() -> tuple[int, str] | None:
    """(this cgroup's limit minus its usage, in bytes, its source) for cgroup v2 or v1, or None without a limit."""
    v1 = "/sys/fs/cgroup/memory/memory."
    for limit, usage, stat, cache in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
            (v1 + "limit_in_bytes", v1 + "usage_in_bytes", v1 + "stat", "total_inactive_file")):
        try:
            with open(limit) as f, open(usage) as g:
                cap, used = f.read().strip(), int(g.read())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 1 << 60:  # usage counts page cache; its inactive part is reclaimable (as
            return max(0, int(cap) - used + _stat(stat, cache)), f"cgroup limit {limit}"  # docker stats reads it)
    return None


def _stat(path: str, key: str) -> int:
    """The value of ``key`` in a cgroup ``memory.stat`` file, in bytes; 0 when it is not there."""
    try:
        with open(path) as f:
            return next((int(v) for k, v in (line.split() for line in f) if k == key), 0)
    except (OSError, ValueError):
        return 0
