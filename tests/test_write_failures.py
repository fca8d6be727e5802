"""Writes a run outlives: TensorBoard summaries and the benchmark log that cannot be
written are counted and logged, never raised, and written again once they can be."""

from __future__ import annotations

import errno
import glob
import json
import logging
import re

import pytest
from absl import logging as absl_logging

from official.utils.logs.logger import BENCHMARK_LOG_FILE, BenchmarkLogger
from official.utils.logs.summaries import ScalarSummaries
from official.utils.misc.write_failures import WriteFailures
from recommendation.training import reporting


@pytest.fixture
def info_logs(caplog):
    absl_logging.set_verbosity(absl_logging.INFO)
    caplog.set_level(logging.INFO, logger="absl")
    return caplog


def _messages(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_tensorboard_summaries_that_cannot_be_written_are_counted_then_written(tmp_path, info_logs):
    blocker = tmp_path / "model"
    blocker.write_text("a file where the folder should be")
    summaries = ScalarSummaries(str(blocker / "run"))
    summaries.write(1, {"loss": 0.5})
    summaries.write(2, {"loss": 0.4})
    assert summaries.failures.count == 2 and summaries.failures.last_failed
    [warning] = [m for m in _messages(info_logs) if "TensorBoard" in m]
    assert re.fullmatch(
        rf"cannot write TensorBoard summaries in {blocker / 'run'}: .*not a directory; pass "
        r"--model_dir with a writable folder; training goes on without it \(1 failed so far\)",
        warning,
    )
    blocker.unlink()
    summaries.write(3, {"loss": 0.3})
    assert summaries.failures.count == 2 and not summaries.failures.last_failed
    assert glob.glob(str(blocker / "run" / "events.out.tfevents.*"))
    assert f"TensorBoard summaries in {blocker / 'run'} written again after 2 failures" in (
        _messages(info_logs)
    )


def test_benchmark_log_records_that_cannot_be_written_are_counted_and_the_rest_kept(tmp_path):
    logger = BenchmarkLogger(str(tmp_path))
    logger.log("run_info", flags={})
    path = tmp_path / BENCHMARK_LOG_FILE
    path.rename(tmp_path / "kept")
    path.mkdir()  # appending to a folder fails
    logger.log("evaluation", epoch=0)
    assert logger.failures.count == 1
    path.rmdir()
    (tmp_path / "kept").rename(path)
    logger.log("summary", best_hr=0.5)
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()]
    assert kinds == ["run_info", "summary"] and logger.failures.count == 1


def test_repeated_failures_are_logged_at_most_once_a_period_with_the_count(caplog):
    failures = WriteFailures("the export", "/exports", "--export_dir", log_every_seconds=3600)
    for _ in range(3):
        with failures.guard():
            raise OSError(errno.ENOSPC, "No space left on device")
    assert failures.count == 3
    assert _messages(caplog) == [
        "cannot write the export in /exports: no space left on the device; free space there "
        "or pass --export_dir with a folder on a disk with room; training goes on without it "
        "(1 failed so far)"
    ]
    # Anything but an I/O error is a bug: it is raised.
    with pytest.raises(ZeroDivisionError):
        with failures.guard():
            _ = 1 / 0


def test_the_final_line_says_which_writes_failed():
    summary = {
        "best_hr": 0.5,
        "best_ndcg": 0.25,
        "best_epoch": 1,
        "epochs": 2,
        "time_to_target_s": None,
        "examples_per_second": 1000.0,
        "total_seconds": 12.0,
        "failed_tensorboard_writes": 2,
        "failed_benchmark_log_writes": 0,
    }
    assert reporting.summary_line(summary, 10) == (
        "best HR@10=0.5000 NDCG@10=0.2500 (epoch 1), 2 epochs, target not reached, 1,000 "
        "training examples/s, 12.0 s in all (2 TensorBoard writes failed: see the warnings)"
    )
    summary["failed_tensorboard_writes"] = 0
    assert reporting.summary_line(summary, 10).endswith("12.0 s in all")
