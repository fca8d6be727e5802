"""SIGTERM as `SystemExit`, so ``finally`` blocks and context managers still run.

A job scheduler stops a run with SIGTERM; Python's default is to die on the spot,
leaving child processes, temporary folders and half-finished logs behind.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


def raise_system_exit(signum: int, frame) -> None:
    """Signal handler: unwind like ``sys.exit(128 + signum)``, the shell's status."""
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_raises_system_exit() -> Iterator[None]:
    """While active, SIGTERM raises `SystemExit` (main thread only, where Python
    runs handlers; elsewhere it changes nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, raise_system_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
