"""How entry points end on bad input and on stop signals: one line, the right status.

A user who points a flag at a read-only folder, fills a disk or presses Ctrl-C should
read one line saying what happened and what to do, not a traceback, and get a status
a script can test: 1 for an error, 128 + the signal number for a signal.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import NoReturn

import tensorflow as tf
from absl import flags

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
        line, failure = f"error: {error}", error
    except (OSError, tf.errors.OpError) as error:
        if _is_bug(error):
            raise
        line, failure = f"error: {os_message(error)}", error
    else:
        return
    exit_with(line, failure)


def exit_with(line: str, failure: BaseException | None = None) -> NoReturn:
    """Ends the process with `line` as the last thing it prints, status 1. What the
    `failure` (and the errors it was raised in) left behind in their frames is released
    first, quietly: an abandoned checkpoint restore says so as it is freed ("an object
    ... is being deleted with unrestored values"), which after the line would bury it."""
    with quiet_tensorflow_warnings():
        while failure is not None:
            traceback.clear_frames(failure.__traceback__)
            failure = failure.__cause__ or failure.__context__
        gc.collect()
    print(line, file=sys.stderr, flush=True)
    sys.exit(1)


@contextlib.contextmanager
def quiet_tensorflow_warnings() -> Iterator[None]:
    """TensorFlow's Python warnings are dropped while active (errors still show)."""
    tf_logger = logging.getLogger("tensorflow")
    level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tf_logger.setLevel(level)


def command_line_parser(
    parse: Callable[[list[str]], list[str]] = flags.FLAGS, scrub: Callable[[str], str] = str
) -> Callable[[list[str]], list[str]]:
    """`app.run`'s ``flags_parser``: `parse` (absl's, by default), where a bad flag or an
    argument that is not a flag ends as any user error does, with one `error:` line
    last (`scrub` masks what it must not show) rather than absl's usage hint."""

    def parser(argv: list[str]) -> list[str]:
        try:
            rest = parse(argv)
        except flags.Error as error:
            # absl gives each failed check a line of its own; one line says them all.
            problems = "; ".join(
                line.strip().rstrip(".") for line in str(error).splitlines() if line.strip()
            )
            exit_with(f"error: {scrub(problems)} (--helpshort lists the flags)")
        if len(rest) > 1:
            exit_with(
                f"error: unexpected arguments: {' '.join(rest[1:])} (every option is a "
                "--flag; --helpshort lists them)"
            )
        return rest

    return parser


def _is_bug(error: Exception) -> bool:
    """Whether a TensorFlow error came from an op of the program's own computation
    (an index out of range, shapes that do not fit) rather than from a file, a disk
    or a path: those come from the file system calls, not from an op."""
    if not isinstance(error, (tf.errors.InvalidArgumentError, tf.errors.InternalError)):
        return False
    message = getattr(error, "message", None) or str(error)
    return message.startswith("Graph execution error") or "[Op:" in message
