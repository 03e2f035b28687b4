"""A sweep stopped as one: Ctrl-C or SIGTERM to a sweep saves every running job's progress and starts no more jobs.

Hydra's joblib launcher runs a sweep's jobs in worker processes, which joblib kills at once when its parent is
interrupted, and which a terminal's Ctrl-C reaches too (it signals the whole process group). So the parent and its
jobs share one stop file in the sweep folder (:data:`NAME`, holding the signal's name):

* the parent (:data:`PARENT`, from the multirun's start to its end) writes it at the first SIGINT or SIGTERM and goes
  on waiting for its jobs; a second Ctrl-C quits at once (joblib kills the jobs; each keeps its newest saved state);
* a job's worker process ignores Ctrl-C (:func:`as_worker`); its training loop reads the file after every step
  (``StopSignals(stop_file=…)``: posbench/runtime/signals.py), saves a training state and ends, and a job that has
  not started does not start (:func:`requested`); a job stopped by a signal of its own (a sweep run in the parent
  process, one job at a time; a SIGTERM to a worker) writes the file too (:func:`request`), so the sweep stops as one;
* at the end the CLI reads the file, says how to resume the sweep, and removes it (:func:`clear`).

    PARENT.start(sweep_dir)                  # the multirun's start (posbench/cli.py's callback), in the parent
    if requested(sweep_dir) is not None: …   # a job, before it starts
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

log = logging.getLogger("posbench")
NAME = "posbench.stop"
PARENT_ENV = "POSBENCH_SWEEP_PARENT"  # the parent's process id, inherited by its joblib workers
HANDLED = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, a scheduler's stop


def path(sweep_dir: Path) -> Path:
    """The stop file of the sweep in ``sweep_dir``."""
    return Path(sweep_dir) / NAME


def request(sweep_dir: Path, signum: int) -> None:
    """Ask every job of the sweep in ``sweep_dir`` to stop after its current step (the first request stands)."""
    target = path(sweep_dir)
    if not target.exists():
        tmp = target.with_name(f".{NAME}.{os.getpid()}")
        tmp.write_text(signal.Signals(signum).name + "\n")
        os.replace(tmp, target)


def requested(sweep_dir: Path) -> int | None:
    """The signal that stopped the sweep in ``sweep_dir``, or None while it runs on."""
    try:
        return int(signal.Signals[path(sweep_dir).read_text().strip()])
    except (OSError, KeyError):
        return None


def clear(sweep_dir: Path) -> None:
    """Remove the stop file: a sweep run again in its folder runs."""
    path(sweep_dir).unlink(missing_ok=True)


def as_worker() -> None:
    """In a job's worker process (not the sweep's parent): ignore Ctrl-C for good, so that the terminal's signal to the
    process group leaves the parent to stop the sweep (a worker interrupted between jobs would break joblib's pool,
    which then kills the other jobs at once)."""
    parent = os.environ.get(PARENT_ENV)
    if parent and int(parent) != os.getpid():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class ParentStop:
    """The sweep's parent process, from the multirun's start (:meth:`start`) to its end (:meth:`end`): the first
    SIGINT or SIGTERM writes the stop file and returns (the jobs stop after their step), a second SIGINT raises
    KeyboardInterrupt (joblib then kills the jobs). ``sweep_dir``: the running sweep's folder, kept after the end."""

    def __init__(self):
        self.sweep_dir: Path | None = None
        self.previous: dict = {}

    def start(self, sweep_dir: Path) -> None:
        self.sweep_dir = Path(sweep_dir)
        clear(self.sweep_dir)  # (a parent killed before its end left one)
        os.environ[PARENT_ENV] = str(os.getpid())
        self.previous = {s: signal.getsignal(s) for s in HANDLED}
        for signum, handler in self.previous.items():
            if handler is not signal.SIG_IGN:  # a signal ignored on purpose stays ignored (`cmd &` in a script)
                signal.signal(signum, self._note)

    def _note(self, signum, frame) -> None:
        if signum == signal.SIGINT and requested(self.sweep_dir) == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: quit now
        request(self.sweep_dir, signum)
        more = " (Ctrl-C again quits at once, each job keeping its newest saved state)" if signum == signal.SIGINT else ""
        log.warning("%s: the sweep stops: each running job saves a training state after its current step, and no "
                    "other job starts%s", signal.Signals(signum).name, more)

    def end(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}


PARENT = ParentStop()  # this process's, when it is a sweep's parent
