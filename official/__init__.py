"""Benchmark infrastructure shared by the models: flags, logs, the runner.

Importing it (every entry point does, before TensorFlow) quiets TensorFlow's INFO
lines: CPU feature notes, XLA service start-up, checkpoint timings and the like,
which otherwise come before and between the lines of ours. Warnings and errors still
show. ``TF_CPP_MIN_LOG_LEVEL=0`` brings the INFO lines back. What TensorFlow writes
while its libraries load, before any setting is read, is explained in
docs/getting-started.md.

It also turns on TensorFlow's oneDNN kernels on every x86-64 CPU (see below).
"""

import logging
import os
import platform

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

# TensorFlow runs its oneDNN kernels by default only on x86 CPUs with AVX512-VNNI,
# AVX512-BF16, AVX-VNNI or AMX (DefaultOneDnnPolicy, tensorflow/core/util/util.cc).
# Elsewhere, on AVX2 CPUs such as AMD's Zen 3, its matmuls run on Eigen kernels built
# without FMA, and the MLPerf-size training step is markedly slower (docs/benchmarks.md,
# "oneDNN and bf16 on an AVX2 CPU"). TensorFlow reads this once, when it loads (set later, it
# does nothing); a value the user set wins (0 turns oneDNN off).
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
