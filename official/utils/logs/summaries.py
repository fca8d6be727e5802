"""TensorBoard scalars of both trainers, written so that a failed write never stops a run.

A summary writer flushes its events to a file in the run's folder; on a full disk or a
folder that became read-only that flush raises, inside whichever ``tf.summary`` call
filled its queue. Training must outlive its diagnostics: each write here is flushed at
once and guarded by `WriteFailures` (counted, logged, retried at the next write).
"""

from __future__ import annotations

from collections.abc import Mapping

import tensorflow as tf

from official.utils.misc.write_failures import WriteFailures


class ScalarSummaries:
    """Scalars for TensorBoard in `folder` (None: written nowhere).

    Args:
        folder: The event files' folder.
        flag: The flag naming it, for the message of a failed write.
    """

    def __init__(self, folder: str | None, flag: str = "--model_dir") -> None:
        self.folder = folder
        self.failures = WriteFailures("TensorBoard summaries", folder or "", flag)
        self._writer: tf.summary.SummaryWriter | None = None

    def write(self, step: int, values: Mapping[str, float]) -> None:
        """Writes `values` (name -> number) at `step` and flushes them."""
        if self.folder is None:
            return
        with self.failures.guard():
            if self._writer is None:
                self._writer = tf.summary.create_file_writer(self.folder)
            with self._writer.as_default(step=step):
                for name, value in values.items():
                    tf.summary.scalar(name, value)
            self._writer.flush()
