"""How entry points end on bad input and on stop signals: one line, the right status.

A user who points a flag at a read-only folder, fills a disk or presses Ctrl-C should
read one line saying what happened and what to do, not a traceback, and get a status
a script can test: 1 for an error, 128 + the signal number for a signal.
"""

from __future__ import annotations

import contextlib
import errno
import re
import sys
from collections.abc import Iterator

import tensorflow as tf

from official.core import signals


def os_message(error: Exception) -> str:
    """An OS or TensorFlow I/O error's message without the graph nodes and op names
    TensorFlow wraps it in ("/m/ckpt-5_temp/...; No space left on device")."""
    if isinstance(error, OSError):
        return f"{error.filename}: {error.strerror}" if error.filename else str(error)
    message = getattr(error, "message", None) or str(error)
    # Eager ops end theirs with "[Op:<op>] name: <op name, often empty>".
    return re.sub(r"\{\{[^}]*\}\}|\[Op:\w+\]( name:.*)?", "", message).strip().splitlines()[0]


def _os_reason(error: Exception) -> str:
    """Just the operating system's words in an I/O error ("No space left on device")."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return os_message(error).rsplit(";", 1)[-1].strip()


def is_full_disk(error: Exception) -> bool:
    """Whether an I/O error says the disk (or the user's quota) is full."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(error, tf.errors.ResourceExhaustedError)


def write_failure(error: Exception, what: str, folder: str, flag: str) -> str:
    """The one-line message for a failed write of `what` into `folder`: the folder, the
    problem (a full disk, a read-only or forbidden folder) and the fix, free space or
    `flag` pointing to a folder that can be written."""
    if is_full_disk(error):
        return (
            f"cannot write {what} in {folder}: no space left on the device; free space "
            f"there or pass {flag} with a folder on a disk with room"
        )
    return (
        f"cannot write {what} in {folder}: {_os_reason(error)}; pass {flag} with a writable folder"
    )


@contextlib.contextmanager
def exit_on_user_errors(*user_errors: type[Exception]) -> Iterator[None]:
    """Turns `user_errors` (whose messages say what to do), I/O errors and
    `signals.Interrupted` into one line on stderr and the exit status; everything else
    (a TensorFlow op's invalid argument among it) stays a traceback, since it is a bug
    to report. (Signals become `Interrupted` only inside `signals.stop_on_signals`.)"""
    try:
        yield
    except signals.Interrupted as stop:
        print(f"{stop}: {stop.kept or 'nothing was kept'}", file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)
    except user_errors as error:
        sys.exit(f"error: {error}")
    except (OSError, tf.errors.OpError) as error:
        if _is_bug(error):
            raise
        sys.exit(f"error: {os_message(error)}")


def _is_bug(error: Exception) -> bool:
    """Whether a TensorFlow error came from an op of the program's own computation
    (an index out of range, shapes that do not fit) rather than from a file, a disk
    or a path: those come from the file system calls, not from an op."""
    if not isinstance(error, (tf.errors.InvalidArgumentError, tf.errors.InternalError)):
        return False
    message = getattr(error, "message", None) or str(error)
    return message.startswith("Graph execution error") or "[Op:" in message
