"""One GPU per job in a one-machine sweep: count the visible GPUs and hold one exclusively.

``posbench train -m hydra/launcher=joblib ...`` runs jobs in parallel worker processes, by default as
many as there are visible GPUs (``n_jobs: ${posbench_gpus:}`` in ``conf/hydra/launcher/joblib.yaml``).
Each job enters :func:`hold_gpu` before it touches CUDA: it takes an exclusive ``fcntl.flock`` on the
lock file of one free GPU, waits while every GPU is taken, and narrows ``CUDA_VISIBLE_DEVICES`` to that
GPU, so the job's ``cuda`` device is the one it holds. Two jobs never hold the same GPU at once, more jobs
than GPUs queue, and the kernel drops a dead process's locks, so a crashed job frees its GPU.

A joblib worker process runs several jobs one after another. Once CUDA is initialised in a process its
devices are fixed, so a worker whose job used CUDA is bound to that GPU: it waits for the same GPU for its
next job, and says so for the rest of its life with a shared ``flock`` on ``gpu-<id>.bound`` (taken with the
GPU; dropped at the job's end if CUDA was not initialised). A worker not bound takes a free GPU that no
other worker is bound to whenever there is one, not one a bound worker will wait for while another GPU idles;
only when every GPU is bound (more workers than GPUs, as with ``hydra.launcher.n_jobs=2`` on one GPU) does
it take any free one, and the workers bound to a GPU then take turns on it.

The lock files live in a node-local folder shared by every posbench sweep of the user on the machine,
:func:`default_lock_dir`: ``$POSBENCH_GPU_LOCK_DIR``, else ``$XDG_RUNTIME_DIR/posbench-gpus``, out of reach
of the age-based cleaners of the temp folder, else ``<tmp>/posbench-gpus-<uid>``. There is one pair of files
per device id as written in ``CUDA_VISIBLE_DEVICES`` (an index or a UUID): two sweeps started side by side
share the GPUs out too, as long as they use the same folder and name the GPUs the same way. A process that
holds or is bound to a GPU holds a shared ``flock`` on the folder too, and systemd-tmpfiles leaves a folder
so locked, and all in it, out of its age-based cleanup (tmpfiles.d(5)). Other cleaners may still delete a
lock file in use, so a lock counts only if the locked file is still the one at its path: a lock on a deleted
file guards nothing.

Importing this module calls :func:`register` (the ``${posbench_gpus:}`` resolver, and a filter for Hydra's
warning about our ``joblib`` preset): import it at the top of the module holding the Hydra task, so the
joblib workers, which import that module to unpickle the task, quiet the warning too.
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
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import ContextManager, Iterator, Optional, Sequence

import torch
from omegaconf import OmegaConf

log = logging.getLogger("posbench")
RESOLVER = "posbench_gpus"  # ${posbench_gpus:} in a config: the number of visible GPUs, at least 1
LOCK_DIR_ENV = "POSBENCH_GPU_LOCK_DIR"
_held: Optional[str] = None  # the device this process holds now (hold_gpu is re-entrant)
_last: Optional[str] = None  # the device this process held last: its CUDA context, if any, lives there
_binding: Optional[ExitStack] = None  # while bound to _last: the shared locks on its .bound file and on the folder


def visible_devices() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries (``"0"``, ``"GPU-<uuid>"``, ``"MIG-…"``).

    ``CUDA_VISIBLE_DEVICES`` when set (like CUDA, the list ends at the first empty or negative entry, so
    ``""`` and ``"-1"`` mean none); else ``"0"…"n-1"`` for the ``torch.cuda.device_count()`` GPUs,
    which asks NVML and so does not initialise CUDA (none without a CUDA build of torch).
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        devices = []
        for entry in (e.strip() for e in env.split(",")):
            if not entry or entry.startswith("-"):
                break
            devices.append(entry)
        return devices
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
    """The folder of the GPU lock files: ``$POSBENCH_GPU_LOCK_DIR``; else ``$XDG_RUNTIME_DIR/posbench-gpus`` when
    ``$XDG_RUNTIME_DIR`` is a writable folder of the user's own (``/run/user/<uid>`` under systemd); else
    ``<tmp>/posbench-gpus-<uid>``. All three are node-local, so ``flock`` works."""
    if os.environ.get(LOCK_DIR_ENV):
        return Path(os.environ[LOCK_DIR_ENV])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.stat(runtime).st_uid == os.getuid() and os.access(runtime, os.W_OK):
        return Path(runtime) / "posbench-gpus"
    return Path(tempfile.gettempdir()) / f"posbench-gpus-{os.getuid()}"


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _path(folder: Path, device: str, suffix: str) -> Path:
    return folder / f"gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', device)}{suffix}"


def _flock(path: Path, how: int):
    """The file ``path`` (made if missing), open and ``flock``-ed ``how``; None when LOCK_NB and it is taken.

    Opened again until the locked file is still the one at ``path``: a cleaner may have deleted it since it
    was opened, and another process may hold a new file of that name.
    """
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, how)
        except BlockingIOError:
            f.close()
            return None
        try:
            if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                return f
        except FileNotFoundError:
            pass
        f.close()


def _try_lock(path: Path):
    """The open lock file, locked exclusively, with this process's id in it; None when another process holds it."""
    f = _flock(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if f is not None:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
    return f


def _bound_elsewhere(folder: Path, device: str) -> bool:
    """Whether another process is bound to ``device``: holds a shared lock on its ``.bound`` file."""
    probe = _flock(_path(folder, device, ".bound"), fcntl.LOCK_EX | fcntl.LOCK_NB)
    if probe is not None:
        probe.close()
    return probe is None


def _bind(folder: Path, device: str) -> ExitStack:
    """Shared locks on ``device``'s ``.bound`` file and on ``folder`` (which keeps systemd-tmpfiles out), held
    until the returned stack is closed."""
    with ExitStack() as binding:
        fd = os.open(folder, os.O_RDONLY)
        binding.callback(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_SH)
        binding.enter_context(_flock(_path(folder, device, ".bound"), fcntl.LOCK_SH))
        return binding.pop_all()


def _take(folder: Path, candidates: list[str], fresh: bool):
    """(device, locked file) for the first free one of ``candidates``, with this process bound to it; or None.

    A ``fresh`` process (bound to no GPU) tries only the devices no other process is bound to, unless every
    one is. It chooses under an exclusive lock on ``choose.lock``, so fresh processes choose one at a time:
    none mistakes another's test of a ``.bound`` file for a binding, and each sees the bindings made before.
    """
    global _binding
    with _flock(folder / "choose.lock", fcntl.LOCK_EX) if fresh else nullcontext():
        if fresh:
            candidates = [d for d in candidates if not _bound_elsewhere(folder, d)] or candidates
        for device in candidates:
            lock = _try_lock(_path(folder, device, ".lock"))
            if lock is not None:
                if _binding is None:
                    _binding = _bind(folder, device)
                return device, lock
    return None


def _acquire(folder: Path, candidates: list[str], fresh: bool, poll_s: float, timeout_s: float | None):
    """:func:`_take` every ``poll_s`` seconds until it takes a device."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    names = ", ".join(candidates)
    waited = False
    while (taken := _take(folder, candidates, fresh)) is None:
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"no GPU of {names} came free in {timeout_s} s (locks in {folder})")
        if not waited:
            log.info("waiting for a free GPU among %s (locks in %s)", names, folder)
            waited = True
        time.sleep(poll_s)
    return taken


@contextmanager
def hold_gpu(lock_dir: str | Path | None = None, devices: Sequence[str] | None = None, poll_s: float = 0.5,
             timeout_s: float | None = None) -> Iterator[Optional[str]]:
    """Hold one of ``devices`` exclusively for the ``with`` block; yield its id (None without GPUs).

    Enter it before anything initialises CUDA. Inside the block ``CUDA_VISIBLE_DEVICES`` is the held
    device alone; on exit the lock is released and ``CUDA_VISIBLE_DEVICES`` restored. Re-entrant:
    a nested call yields the device already held. A process in which CUDA is initialised waits for the
    device it held last; another takes a device no other process is bound to while there is a free one.

    Args:
        lock_dir: folder of the per-device lock files (made if missing); default :func:`default_lock_dir`.
        devices: device ids to choose from; default :func:`visible_devices`. None or empty: nothing to hold.
        poll_s: seconds between tries while every device is taken.
        timeout_s: give up after this many seconds; None waits for ever.

    Raises:
        TimeoutError: no device came free within ``timeout_s``.
        OSError: the lock folder or a lock file cannot be made or opened.
    """
    global _held, _last, _binding
    if _held is not None:
        yield _held
        return
    devices = list(visible_devices() if devices is None else devices)
    if not devices:
        yield None
        return
    folder = Path(lock_dir) if lock_dir is not None else default_lock_dir()
    folder.mkdir(parents=True, exist_ok=True)
    bound = _last is not None and _cuda_initialised()  # CUDA is bound to that device in this process: wait for it
    candidates = [_last] if bound else sorted(devices, key=lambda d: d != _last)
    device, lock = _acquire(folder, candidates, not bound, poll_s, timeout_s)
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
        if not _cuda_initialised():  # no CUDA context here: the next job may take any GPU, so this process is not bound
            _binding.close()
            _binding = None


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
