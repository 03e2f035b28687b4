"""One training process per run folder: a lock file held for the life of the run.

``posbench train`` takes the lock of its run folder (``posbench.lock``, holding the process id and host) before it
writes anything there, and a second process that starts in the same folder stops with one line naming the folder
and the holder's process id, instead of interleaving ``metrics.jsonl`` and ``train.log`` and racing for the
checkpoint. The lock is an advisory ``fcntl.flock`` on the file: the kernel releases it when its process ends, on
every exit path (a crash and ``kill -9`` included), so a lock file left by a dead process is stale by
construction: the next run takes it over, saying so. A normal exit removes the file.

    acquire(run_dir)              # raises FolderInUse (a ValueError) when another process holds it
    with releasing(run_dir):      # released on leaving, however the block ends
        ...
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("posbench")
NAME = "posbench.lock"


class FolderInUse(ValueError):
    """Another live process holds the run folder's lock."""


HELD: dict[Path, int] = {}  # run folder → the file descriptor of the lock this process holds on it


def acquire(run_dir: Path) -> None:
    """Take the lock of ``run_dir`` (made, with its parents, when missing); a no-op when this process holds it.

    Raises:
        FolderInUse: another process holds it (the message names the folder, the holder's process id and host).
    """
    run_dir = Path(run_dir).resolve()
    if run_dir in HELD:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 256).decode(errors="replace").split() or ["?"]
            os.close(fd)
            raise FolderInUse(_in_use(run_dir, holder)) from None
        if path.exists() and path.stat().st_ino == os.fstat(fd).st_ino:
            break  # else its holder removed the file between our open and flock: lock the new one
        os.close(fd)
    stale = os.read(fd, 256).decode(errors="replace").split()
    if stale:
        log.warning("took over the lock of %s left by process %s, which has ended", run_dir, " on ".join(stale))
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    HELD[run_dir] = fd


def check_free(run_dir: Path) -> None:
    """Raise FolderInUse when another process holds the lock of ``run_dir``; create, take or change nothing (a
    shared lock tried on the existing file, if any, and dropped)."""
    path = Path(run_dir).resolve() / NAME
    if Path(run_dir).resolve() in HELD or not path.exists():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 256).decode(errors="replace").split() or ["?"]
        raise FolderInUse(_in_use(Path(run_dir).resolve(), holder)) from None
    finally:
        os.close(fd)


def _in_use(run_dir: Path, holder: list[str]) -> str:
    return (f"{run_dir} is in use by another posbench process (pid {' on '.join(holder)}); wait for it to end, or "
            "choose another run folder (hydra.run.dir=...)")


def release(run_dir: Path) -> None:
    """Remove the lock file of ``run_dir`` and release the lock, if this process holds it."""
    fd = HELD.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        Path(run_dir, NAME).unlink(missing_ok=True)  # while still held: no process can lock the old file
        os.close(fd)


@contextmanager
def releasing(run_dir: Path):
    """``with releasing(run_dir):`` releases the lock of ``run_dir`` on leaving, on every exit path, if this
    process holds it (:func:`acquire` took it before)."""
    try:
        yield
    finally:
        release(run_dir)
