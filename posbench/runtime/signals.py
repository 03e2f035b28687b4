"""Stop signals during training: SIGTERM, SIGUSR2 and Ctrl-C (SIGINT) are noted, to be acted on between steps.

The training loop (posbench/training/loop.py) runs inside :class:`StopSignals`: a stop signal is recorded, the step that is
running finishes, a checkpoint is saved and the run exits with :func:`exit_status` of the signal — 75 (EX_TEMPFAIL,
"try again": a scheduler's stop, which SLURM-style tooling requeues) for SIGTERM and SIGUSR2, 130 (128 + SIGINT,
the shell's status for a command the user interrupted, so a script or ``make`` stops too) for Ctrl-C. A second
Ctrl-C quits at once, without a checkpoint. A step can be long (a long train length, a slow machine) and Python
runs a signal handler only between operations, so a watcher thread, woken by the signal itself
(``signal.set_wakeup_fd``), says the run is waiting when the step has not finished :data:`NOTICE_AFTER_S` seconds
after the signal.

    with StopSignals() as stop:       # in the loop: stop.step_ended() after every step; stop.received → act
    StopSignals(stop_file=sweep / "posbench.stop")   # a sweep's job: its parent's stop counts as a signal
        ...
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from pathlib import Path

log = logging.getLogger("posbench")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)  # a scheduler's stop, SLURM's warning, Ctrl-C
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGUSR2 after saving a checkpoint; re-run to resume
EXIT_INTERRUPTED = 130  # 128 + SIGINT: stopped by Ctrl-C after saving a checkpoint; re-run to resume
NOTICE_AFTER_S = 5.0  # a step still running this long after a stop signal gets a notice that the run waits for it


class Interrupted(KeyboardInterrupt):
    """The second Ctrl-C of a training run: it stopped at once, without a checkpoint. ``saved``: the step of the
    newest training state in ``run_dir`` (what running it again resumes from), or None when none was saved;
    ``resume``: the run's ``resume`` setting (``never`` would start over)."""

    def __init__(self, run_dir, saved: int | None, resume: str = "auto"):
        super().__init__()
        self.run_dir, self.saved, self.resume = run_dir, saved, resume

    def advice(self) -> str:
        """What running the command again does, in a clause after "posbench: interrupted (Ctrl-C)"."""
        again = f"run it again in the same folder (hydra.run.dir={self.run_dir})"
        if self.saved is not None and self.resume == "never":
            return (f"; its training state saved at step {self.saved} is resumed when you {again} with resume=auto "
                    "(with resume=never, the same command starts over)")
        if self.saved is None:
            return (f"; no training state was saved, so the run starts over from step 0 when you {again} "
                    "(train.checkpoint_every=N saves one every N steps)")
        return f"; the run resumes from its training state saved at step {self.saved} when you {again}"


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by ``signum`` after saving a checkpoint: 130 for SIGINT, else 75."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


class StopSignals:
    """While the training loop runs, the stop signals are noted instead of killing the process.

    Attributes:
        received: the signals received, as (number, frame), in order.
        previous: the handlers installed before, by signal number (put back on exit; a SIGUSR2 handler there,
            such as submitit's requeue, is the loop's to call after its checkpoint).
    """

    def __init__(self, notice_after: float = NOTICE_AFTER_S, stop_file: Path | None = None):
        self.received: list[tuple] = []
        self.previous: dict = {}
        self.notice_after = notice_after
        self.stop_file = stop_file
        self._stepped = threading.Event()

    def step_ended(self) -> None:
        """Called by the loop after every step: a step that ends in time needs no notice. With a ``stop_file`` (a
        sweep's: posbench/runtime/sweep_stop.py), its signal counts as received once the file is there."""
        self._stepped.set()
        if self.stop_file is not None and not self.received and self.stop_file.exists():
            name = self.stop_file.read_text().strip()
            self.received.append((int(signal.Signals[name]) if name in signal.Signals.__members__ else signal.SIGTERM,
                                  None))
            log.warning("%s to the sweep: stopping after this step, to save a checkpoint", name)

    def _note(self, signum, frame) -> None:
        """The handler: records the signal, and raises KeyboardInterrupt at a second Ctrl-C. It logs nothing: it runs
        in the main thread between two bytecodes, possibly inside a logging handler's write, whose buffer a second
        write would enter again (``RuntimeError: reentrant call``); the watcher thread says it instead."""
        if signum == signal.SIGINT and any(s == signal.SIGINT for s, _ in self.received):
            raise KeyboardInterrupt  # the second Ctrl-C: quit now, without a checkpoint
        self.received.append((signum, frame))

    def _watch(self, reader: socket.socket) -> None:
        """The watcher thread: each stop signal, as soon as it arrives (its number written to the wakeup fd by the
        interpreter's C-level handler), starts a wait for the running step; once the handler has recorded it, the
        signal is said in the log (after it, never before: a second Ctrl-C must find the first recorded)."""
        said = 0  # entries of self.received said so far
        with reader:
            while data := reader.recv(64):
                if not any(b in STOP_SIGNALS for b in data):
                    continue
                self._stepped.clear()
                deadline = time.monotonic() + self.notice_after
                while len(self.received) <= said and time.monotonic() < deadline:  # (the handler has not run yet)
                    time.sleep(0.01)
                for signum, frame in self.received[said:]:
                    if frame is not None:  # (a sweep's stop file is said where it is found: step_ended)
                        more = " (Ctrl-C again quits at once, without one)" if signum == signal.SIGINT else ""
                        log.warning("%s: stopping after the current step, to save a checkpoint%s",
                                    signal.Signals(signum).name, more)
                said = len(self.received)
                if not self._stepped.wait(max(0.0, deadline - time.monotonic())):
                    log.warning("the current training step is still running %.0f s after the stop signal; the "
                                "checkpoint is saved when it ends (SIGKILL stops the run at once, without one)",
                                self.notice_after)

    def __enter__(self) -> StopSignals:
        self.previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for signum, handler in self.previous.items():
            if handler is not signal.SIG_IGN:  # a signal ignored on purpose stays ignored (`cmd &` in a script: SIGINT)
                signal.signal(signum, self._note)
        self._reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._writer, self._old_fd = writer, signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(self._reader,), daemon=True, name="posbench-stop-notice").start()
        return self

    def __exit__(self, *exc) -> None:
        signal.set_wakeup_fd(self._old_fd)
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self._writer.close()  # the watcher's recv returns b"": it ends
        self._stepped.set()
