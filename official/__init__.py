"""Benchmark infrastructure shared by the models: flags, logs, the runner.

Importing it (every entry point does, before TensorFlow) quiets TensorFlow's INFO
lines: CPU feature notes, XLA service start-up, checkpoint timings and the like,
which otherwise come before and between the lines of ours. Warnings and errors still
show. ``TF_CPP_MIN_LOG_LEVEL=0`` brings the INFO lines back. What TensorFlow writes
while its libraries load, before any setting is read, is explained in the README.
"""

import logging
import os

from absl import logging as absl_logging


class _DropTensorFlowInfo(logging.Filter):
    """Drops INFO (and DEBUG) records logged from TensorFlow's own Python files."""

    _PACKAGE = f"{os.sep}tensorflow{os.sep}"

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or self._PACKAGE not in record.pathname


# TensorFlow's C++ logging reads this when it starts: 1 drops INFO, keeps the rest.
if os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1") != "0":
    # Its Python side logs through its own logger and, in places, through absl's.
    for _logger in (logging.getLogger("tensorflow"), absl_logging.get_absl_logger()):
        _logger.addFilter(_DropTensorFlowInfo())
