"""SIGINT and SIGTERM as an orderly stop, raised only where stopping is safe.

A scheduler stops a job with SIGTERM, a person with Ctrl-C (SIGINT). Python's own
handling dies on the spot (SIGTERM: no cleanup, the producer process orphaned) or
raises KeyboardInterrupt at whatever bytecode the main thread is on, TensorFlow's own
Python code included. Unwinding from inside TensorFlow's call machinery while its
threads still run the graph and tf.data's readers is what occasionally tore a
stopped run down with a segmentation fault.

Here a signal only records itself. It becomes `Interrupted` at a safe point:

- `check()`, which long loops call between units of work (between graph calls,
  while polling for data);
- at once, inside `interruptible()` sections, which hold only code that may stop
  anywhere (numpy preprocessing, downloads, sleeps).

`Interrupted` then unwinds through the ``finally`` blocks and context managers
(producer stopped, run folder removed, logs closed) to the entry point, which says
what was kept and exits with the shell's status, 128 + the signal number. A second
signal during that clean-up is noted and ignored: the clean-up finishes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from absl import logging

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A stop signal arrived; raised at a safe point.

    Attributes:
        signum: The signal.
        kept: What the run has kept for a resume, filled in by whoever knows
            (e.g. "checkpoint DIR/ckpt-120, 3 of 10 epochs done").
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.kept = ""

    @property
    def exit_code(self) -> int:
        """The status a shell reports for a process ended by this signal."""
        return 128 + self.signum


class _State:
    """The process's one stop request (signals are delivered to the main thread)."""

    pending: int | None = None
    raised = False
    interruptible_depth = 0


def _handle(signum: int, frame) -> None:
    if _State.raised:
        logging.warning("%s: already stopping; finishing the clean-up", signal.Signals(signum).name)
        return
    if _State.pending is None:
        logging.warning(
            "%s: stopping at the next safe point (after the current step)",
            signal.Signals(signum).name,
        )
    _State.pending = signum
    if _State.interruptible_depth:
        check()


def check() -> None:
    """Raises `Interrupted` if a stop signal arrived (call between units of work)."""
    if _State.pending is not None and not _State.raised:
        _State.raised = True
        raise Interrupted(_State.pending)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Installs the handlers for SIGINT and SIGTERM while active (main thread only,
    where Python runs signal handlers; elsewhere it changes nothing). A signal the
    process was started ignoring (``nohup``, a background job) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        signum: signal.signal(signum, _handle)
        for signum in STOP_SIGNALS
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    _State.pending, _State.raised = None, False
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _State.pending, _State.raised = None, False


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """A section that may stop anywhere: a signal raises `Interrupted` at once (and
    one that arrived before it raises on entry)."""
    check()
    _State.interruptible_depth += 1
    try:
        yield
    finally:
        _State.interruptible_depth -= 1
