"""JSON-lines benchmark log: run information first, then one record per event.

Written by the chief only; each line is a complete JSON object flushed at once, so
a reader (or a crash) never sees half a record. A write that fails (a full disk) is
counted and logged, and the run goes on (`WriteFailures`).
"""

from __future__ import annotations

import json
import os
import platform
import time

import keras
import numpy as np
import tensorflow as tf

from official.utils.misc.write_failures import WriteFailures

BENCHMARK_LOG_FILE = "benchmark.jsonl"


class BenchmarkLogger:
    """Appends JSON records to ``<log_dir>/benchmark.jsonl``; a no-op without log_dir."""

    def __init__(self, log_dir: str | None) -> None:
        self.path = os.path.join(log_dir, BENCHMARK_LOG_FILE) if log_dir else None
        self.failures = WriteFailures("the benchmark log", log_dir or "", "--benchmark_log_dir")
        if self.path:
            tf.io.gfile.makedirs(log_dir)

    def log(self, kind: str, **values) -> None:
        if self.path is None:
            return
        record = {"kind": kind, "time": time.time(), **values}
        with self.failures.guard():
            with tf.io.gfile.GFile(self.path, "a") as out:
                out.write(json.dumps(record, default=_jsonable, sort_keys=True) + "\n")

    def log_run_info(
        self, flag_values: dict, test_id: str | None = None, preset: dict | None = None
    ) -> None:
        """Records flags, library versions and the hardware the run used; `preset`
        names the flags whose values came from a preset rather than the user."""
        self.log(
            "run_info",
            test_id=test_id,
            flags=flag_values,
            preset=preset or {},
            versions={
                "tensorflow": tf.__version__,
                "keras": keras.__version__,
                "numpy": np.__version__,
                "python": platform.python_version(),
            },
            hardware={
                "cpu": platform.processor() or platform.machine(),
                "cpu_cores": os.cpu_count(),
                "gpus": [gpu.name for gpu in tf.config.list_physical_devices("GPU")],
            },
        )


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)
