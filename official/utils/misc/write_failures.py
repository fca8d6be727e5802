"""Writes a run outlives: serving exports, TensorBoard summaries, the benchmark log.

A full disk or a folder turned read-only under one of these must not stop training
(the model and its checkpoints are what matter), nor pass unnoticed. `WriteFailures`
guards such writes: a failed one is counted and logged in one line naming the folder,
the cause and the fix (the first at once, repeats at most every `log_every_seconds`
with the count so far), the next write is tried as if nothing happened, and the first
success after failures is logged too. Only I/O errors are caught: anything else is a
bug and stays an exception.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import tensorflow as tf
from absl import logging

from official.utils.misc import errors


class WriteFailures:
    """Counts and reports the failed writes of one output.

    Args:
        what: What is written ("the export", "TensorBoard summaries").
        folder: Where.
        flag: The flag that names the folder (the fix names it).
        log_every_seconds: Shortest interval between two lines about repeated failures.

    Attributes:
        count: Failed writes so far.
        last_failed: Whether the latest guarded write failed.
    """

    def __init__(self, what: str, folder: str, flag: str, log_every_seconds: float = 60.0) -> None:
        self.what, self.folder, self.flag = what, folder, flag
        self.log_every_seconds = log_every_seconds
        self.count = 0
        self.last_failed = False
        self._logged_at: float | None = None

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Runs the block; an I/O error in it is counted and logged, not raised."""
        try:
            yield
        except (tf.errors.OpError, OSError) as error:
            self.count += 1
            self.last_failed = True
            now = time.monotonic()
            if self._logged_at is None or now - self._logged_at >= self.log_every_seconds:
                self._logged_at = now
                logging.warning(
                    "%s; training goes on without it (%d failed so far)",
                    errors.write_failure(error, self.what, self.folder, self.flag),
                    self.count,
                )
            return
        if self.last_failed:
            logging.info(
                "%s in %s written again after %d failures", self.what, self.folder, self.count
            )
        self.last_failed = False
