"""posbench/runtime/signals.py: the exit statuses of a stopped run, and StopSignals, which notes a stop signal for the
training loop (a second Ctrl-C quits at once) and warns when the step it waits for runs long.

Ctrl-C and SIGTERM through a real process, with a bit-identical resume, are in test_resume.py.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from posbench.runtime.signals import EXIT_INTERRUPTED, EXIT_PREEMPTED, StopSignals, exit_status


def test_exit_status_is_130_for_ctrl_c_and_75_for_a_schedulers_stop():
    assert (exit_status(signal.SIGINT), EXIT_INTERRUPTED) == (130, 128 + signal.SIGINT)
    assert exit_status(signal.SIGTERM) == exit_status(signal.SIGUSR2) == EXIT_PREEMPTED == 75


def wait_for(done, seconds: float = 10.0) -> None:
    """Sleep in short steps until ``done()`` or ``seconds`` pass (a signal's handler runs at the next bytecode of
    the main thread, which a loaded machine may delay past a fixed sleep)."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_stop_signal_is_noted_and_a_second_ctrl_c_quits_at_once():
    # Python's own Ctrl-C handler to start from: pytest started as a background job (`… &` in a script) inherits
    # SIGINT ignored, and StopSignals leaves an ignored signal ignored
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        before = signal.getsignal(signal.SIGINT)
        with StopSignals(notice_after=60) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            wait_for(lambda: stop.received)
            assert [s for s, _ in stop.received] == [signal.SIGINT]
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                wait_for(lambda: False)  # the KeyboardInterrupt ends the wait
        assert signal.getsignal(signal.SIGINT) is before  # the handlers from before are back
    finally:
        signal.signal(signal.SIGINT, outer)


def _notices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]


def test_a_step_still_running_after_a_stop_signal_gets_a_notice(caplog):
    with caplog.at_level(logging.WARNING, logger="posbench"), StopSignals(notice_after=0.2):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.8)  # the step that never ends
    assert len(_notices(caplog)) == 1 and "the checkpoint is saved when it ends" in _notices(caplog)[0]


def test_a_step_that_ends_in_time_gets_no_notice(caplog):
    with caplog.at_level(logging.WARNING, logger="posbench"), StopSignals(notice_after=0.4) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: stop.received)
        time.sleep(0.05)  # the watcher thread starts its wait for the step (it clears the step's flag first)
        stop.step_ended()
        time.sleep(0.8)
    assert _notices(caplog) == [] and [s for s, _ in stop.received] == [signal.SIGTERM]
