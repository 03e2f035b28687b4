"""One GPU per job in a one-machine sweep: count the visible GPUs and hold one exclusively.

``posbench train -m hydra/launcher=joblib ...`` runs jobs in parallel worker processes, by default as
many as there are visible GPUs (``n_jobs: ${posbench_gpus:}`` in ``conf/hydra/launcher/joblib.yaml``).
Each job enters :func:`hold_gpu` before it touches CUDA: it takes an exclusive ``fcntl.flock`` on the
lock file of one free GPU, waits while every GPU is taken, and narrows ``CUDA_VISIBLE_DEVICES`` to that
GPU, so the job's ``cuda`` device is the one it holds. Two jobs never hold the same GPU at once, more jobs
than GPUs queue, and the kernel drops a dead process's locks, so a crashed job frees its GPU.

The lock files live in a node-local folder shared by every posbench sweep of the user on the machine
(``$POSBENCH_GPU_LOCK_DIR``, else ``<tmp>/posbench-gpus-<uid>``), one file per device id as written in
``CUDA_VISIBLE_DEVICES`` (an index or a UUID): two sweeps started side by side share the GPUs out too,
as long as they name them the same way.

Importing this module calls :func:`register` (the ``${posbench_gpus:}`` resolver, and a filter for Hydra's
warning about our ``joblib`` preset): import it at the top of the module holding the Hydra task, so the
joblib workers, which import that module to unpickle the task, quiet the warning too.

A joblib worker process runs several jobs one after another. Once CUDA is initialised in a process its
devices are fixed, so a worker that has used CUDA waits for the same GPU again for its next job.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import ContextManager, Iterator, Optional, Sequence

from omegaconf import OmegaConf

log = logging.getLogger("posbench")
RESOLVER = "posbench_gpus"  # ${posbench_gpus:} in a config: the number of visible GPUs, at least 1
LOCK_DIR_ENV = "POSBENCH_GPU_LOCK_DIR"
_held: Optional[str] = None  # the device this process holds now (hold_gpu is re-entrant)
_last: Optional[str] = None  # the device this process held last: its CUDA context, if any, lives there


def visible_devices() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries (``"0"``, ``"GPU-<uuid>"``, ``"MIG-…"``).

    ``CUDA_VISIBLE_DEVICES`` when set (like CUDA, the list ends at the first empty or negative entry, so
    ``""`` and ``"-1"`` mean none); else ``"0"…"n-1"`` for the ``torch.cuda.device_count()`` GPUs,
    which asks NVML and so does not initialise CUDA. An empty list without a CUDA build of torch.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        devices = []
        for entry in (e.strip() for e in env.split(",")):
            if not entry or entry.startswith("-"):
                break
            devices.append(entry)
        return devices
    try:
        import torch
    except ImportError:
        return []
    return [str(i) for i in range(torch.cuda.device_count())]


def count_gpus() -> int:
    """The number of visible GPUs, at least 1: the joblib preset's default ``n_jobs``."""
    return max(1, len(visible_devices()))


def register() -> None:
    """Register ``${posbench_gpus:}`` with OmegaConf and quiet Hydra's warning about our joblib preset (idempotent).

    Runs at import; call it again after ``OmegaConf.clear_resolvers()`` or ``warnings.resetwarnings()``.
    ``conf/hydra/launcher/joblib.yaml`` shares its name with the joblib plugin's own option, whose schema
    Hydra 1.3 merges under it (the type checks are kept) with a deprecation warning; the preset is
    complete on its own, so the warning is noise.
    """
    OmegaConf.register_new_resolver(RESOLVER, count_gpus, replace=True)
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/joblib' is validated against ConfigStore schema")


def default_lock_dir() -> Path:
    """``$POSBENCH_GPU_LOCK_DIR``, else ``<tmp>/posbench-gpus-<uid>``: node-local, so ``flock`` works."""
    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / f"posbench-gpus-{os.getuid()}")


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _try_lock(path: Path):
    """The open lock file, locked exclusively, or None when another process holds it."""
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _acquire(candidates: list[str], paths: dict, poll_s: float, timeout_s: float | None):
    """(device, locked file) for the first of ``candidates`` free, trying all every ``poll_s`` seconds."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    names, folder = ", ".join(candidates), paths[candidates[0]].parent
    waited = False
    while True:
        for device in candidates:
            lock = _try_lock(paths[device])
            if lock is not None:
                return device, lock
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"no GPU of {names} came free in {timeout_s} s (locks in {folder})")
        if not waited:
            log.info("waiting for a free GPU among %s (locks in %s)", names, folder)
            waited = True
        time.sleep(poll_s)


@contextmanager
def hold_gpu(lock_dir: str | Path | None = None, devices: Sequence[str] | None = None, poll_s: float = 0.5,
             timeout_s: float | None = None) -> Iterator[Optional[str]]:
    """Hold one of ``devices`` exclusively for the ``with`` block; yield its id (None without GPUs).

    Enter it before anything initialises CUDA. Inside the block ``CUDA_VISIBLE_DEVICES`` is the held
    device alone; on exit the lock is released and ``CUDA_VISIBLE_DEVICES`` restored. Re-entrant:
    a nested call yields the device already held.

    Args:
        lock_dir: folder of the per-device lock files (made if missing); default :func:`default_lock_dir`.
        devices: device ids to choose from; default :func:`visible_devices`. None or empty: nothing to hold.
        poll_s: seconds between tries while every device is taken.
        timeout_s: give up after this many seconds; None waits for ever.

    Raises:
        TimeoutError: no device came free within ``timeout_s``.
        OSError: the lock folder or a lock file cannot be made or opened.
    """
    global _held, _last
    if _held is not None:
        yield _held
        return
    devices = list(visible_devices() if devices is None else devices)
    if not devices:
        yield None
        return
    if _last is not None and _cuda_initialised():
        candidates = [_last]  # CUDA is bound to that device in this process: wait for it
    else:
        candidates = sorted(devices, key=lambda d: d != _last)
    folder = Path(lock_dir) if lock_dir is not None else default_lock_dir()
    folder.mkdir(parents=True, exist_ok=True)
    paths = {d: folder / f"gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', d)}.lock" for d in candidates}
    device, lock = _acquire(candidates, paths, poll_s, timeout_s)
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = device
    _held = _last = device
    log.info("holding GPU %s: CUDA_VISIBLE_DEVICES=%s until the job ends", device, device)
    try:
        yield device
    finally:
        _held = None
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
        if _cuda_initialised():
            sys.modules["torch"].cuda.empty_cache()  # hand the cached memory back before the next job takes the GPU
        lock.close()  # closing the file drops the flock


def job_gpu(hydra_cfg) -> ContextManager[Optional[str]]:
    """The GPU policy of one Hydra job: :func:`hold_gpu` under the joblib launcher, else nothing.

    ``hydra_cfg`` is the job's Hydra node (``HydraConfig.get()``). Jobs of the joblib launcher run side by
    side on one machine and each needs its own GPU. The basic launcher runs one job at a time, SLURM gives
    each job its own GPUs, and under ``torchrun`` (``LOCAL_RANK`` set) every rank picks ``cuda:LOCAL_RANK``:
    all three keep ``CUDA_VISIBLE_DEVICES`` as it is.
    """
    target = str(OmegaConf.select(hydra_cfg, "launcher._target_", default="") or "")
    if "LOCAL_RANK" in os.environ or not target.endswith("JoblibLauncher"):
        return nullcontext(None)
    return hold_gpu()


register()
