"""Stop signals: raised only at safe points, once, with the shell's exit status."""

from __future__ import annotations

import os
import signal

import pytest

from official.core import signals


@pytest.mark.integration
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_waits_for_the_next_safe_point(signum):
    with signals.stop_on_signals():
        os.kill(os.getpid(), signum)  # Python runs the handler before the next line
        reached = True  # outside an interruptible section: nothing raised here
        with pytest.raises(signals.Interrupted) as stopped:
            signals.check()
    assert reached
    assert stopped.value.signum == signum and stopped.value.exit_code == 128 + signum
    assert str(stopped.value) == f"stopped by {signal.Signals(signum).name}"


@pytest.mark.integration
def test_an_interruptible_section_stops_at_once():
    lines_run = []
    with signals.stop_on_signals(), pytest.raises(signals.Interrupted):
        with signals.interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            lines_run.append("after the signal")
    assert lines_run == []


@pytest.mark.integration
def test_a_signal_before_an_interruptible_section_raises_on_entry():
    with signals.stop_on_signals():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(signals.Interrupted), signals.interruptible():
            pytest.fail("the section ran although a stop was pending")


@pytest.mark.integration
def test_signals_during_the_clean_up_are_ignored():
    cleaned_up = []
    with signals.stop_on_signals(), pytest.raises(signals.Interrupted) as stopped:
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            signals.check()
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while cleaning up
            signals.check()  # does not raise again
            with signals.interruptible():
                cleaned_up.append(True)
    assert cleaned_up == [True] and stopped.value.signum == signal.SIGTERM


@pytest.mark.integration
def test_handlers_are_restored_and_nothing_is_pending_afterwards():
    previous = signal.getsignal(signal.SIGTERM)
    with signals.stop_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is previous
    signals.check()  # the stop belonged to the section that ended


@pytest.mark.integration
def test_a_signal_the_process_ignores_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as nohup starts a process
    try:
        with signals.stop_on_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            signals.check()  # nothing pending
    finally:
        signal.signal(signal.SIGINT, previous)
