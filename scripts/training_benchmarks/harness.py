"""What every training suite shares: running our trainer and the peer, reading what they
logged, and the machine line above each table."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from official.utils.misc import machine  # no TensorFlow import
from recommendation.data import constants  # nor here
from recommendation.training import experiments  # nor here

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The MLPerf model's flags, which the Model Garden NCF takes too.
MLPERF_MODEL = experiments.as_arguments(experiments.MLPERF_MODEL)


def machine_line(peer: str | None) -> str:
    """The machine a table's runs ran on: this CPU, and the peer's, when there is one."""
    return machine.cpu_line() + ("; the peer's the same" if peer else "")


def run_ours(args: list[str], log_path: str, tree: str = ROOT) -> tuple[float, str]:
    """Runs ncf-main of the checkout `tree`; returns (wall seconds, its output). Exits
    with the end of its log if it fails (bad flags included: ncf-main's checks decide)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        status = subprocess.run(
            [sys.executable, "-m", "recommendation.ncf_main", *args],
            cwd=tree,
            env={**os.environ, "PYTHONPATH": tree},
            stdout=log,
            stderr=subprocess.STDOUT,
        ).returncode
    with open(log_path) as log:
        output = log.read()
    if status:
        tail = "".join(output.splitlines(keepends=True)[-10:])
        sys.exit(f"ncf-main exited with status {status}; the end of {log_path}:\n{tail}")
    return time.perf_counter() - start, output


def run_peer(
    peer: str, args: list[str], log_path: str, timeout: float, stop_at_hr: float | None = None
) -> tuple[float, str]:
    """Runs the Model Garden NCF; returns (seconds, log).

    It is killed after `timeout` s, or as soon as its log shows an epoch with HR@10 >=
    `stop_at_hr` (its own early stop watches a metric its Keras path no longer logs).
    """
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            ["bash", peer, "run", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **peer_process(),
        )
        while process.poll() is None and time.perf_counter() - start < timeout:
            time.sleep(1)
            if stop_at_hr is not None and max(peer_hit_rates(log_path), default=0) >= stop_at_hr:
                break
        seconds = time.perf_counter() - start
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
    with open(log_path) as log:
        return seconds, log.read()


def peer_process() -> dict:
    """Where and how every peer command runs (subprocess keywords). Its package is also
    called `official`: away from this checkout, and without PYTHONPATH, which can name
    one of ours (a run from a worktree) and so put our `official` before the peer's.
    The rest of the environment is ours, TF_ENABLE_ONEDNN_OPTS included (set when this
    module imported `official`): the peer's TensorFlow runs the same kernels as ours."""
    return {
        "cwd": tempfile.gettempdir(),
        "env": {name: value for name, value in os.environ.items() if name != "PYTHONPATH"},
    }


def peer_hit_rates(log_path: str) -> list[float]:
    """Per-epoch HR@10 of the peer: its Keras log prints the sum and count of hits."""
    with open(log_path, errors="replace") as log:
        pairs = re.findall(r"val_hr_sum: ([\d.e+-]+) - val_hr_count: ([\d.e+-]+)", log.read())
    return [float(hits) / max(float(count), 1e-9) for hits, count in pairs]


def ml1m_data_dir(ratings: str, work: str, name: str) -> str:
    """A fresh data dir holding a link to `ratings` as ml-1m/ratings.dat (no cache)."""
    data_dir = os.path.join(work, name)
    os.makedirs(os.path.join(data_dir, "ml-1m"))
    os.symlink(os.path.abspath(ratings), os.path.join(data_dir, "ml-1m", "ratings.dat"))
    return data_dir


def sampled_negatives(dataset: str) -> int:
    """Sampled evaluation negatives of `dataset`: the NCF split's 99, the MLPerf
    protocol's 999."""
    if dataset.startswith("ncf-"):
        return constants.NCF_EVAL_NEGATIVES
    return constants.NUM_EVAL_NEGATIVES


def mean_and_sd(values) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    values = list(values)
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def read_records(path: str) -> list[dict]:
    """The records of an ncf-main benchmark log (JSON lines)."""
    with open(path) as log:
        return [json.loads(line) for line in log]


def last_summary(path: str) -> dict:
    """The summary record of the last run that an ncf-main benchmark log holds."""
    return [record for record in read_records(path) if record.get("kind") == "summary"][-1]
