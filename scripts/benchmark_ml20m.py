"""The MLPerf ml-20m configuration end to end, stage by stage.

Runs ``ncf-main --config mlperf_ml20m`` on an ml-20m-shaped ratings
file for --train_epochs epochs (at least 2, so at least 2 training cycles, of one
epoch each as the experiment says: with one cycle the trainer's wait after the first
cycle is 0 by construction) and prints, per stage: preprocessing cold and cached
(measured here, before the run, in this process), the producer's evaluation set and
each training cycle (from its log), training examples/s and evaluation seconds per
epoch (from the benchmark log), the trainer's wait for data (at the start and after
the first cycle, against the training time), peak RSS of the trainer and of the
producer (their VmHWM, read every second), the checkpoint's size, the MLPerf
compliance log's events, and the projected wall time of the experiment's 14 epochs.

The real ml-20m is not downloadable from the machines this was written on; make the
file with ``python -m recommendation.data.synthetic_data --shape ml-20m --data_dir DIR``.

    python scripts/benchmark_ml20m.py --ratings /tmp/bench/ml-20m/ratings.csv \\
        --work_dir /tmp/bench/ml20m-run --train_epochs 2
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

from official.utils.logs import mlperf_helper
from official.utils.logs.logger import BENCHMARK_LOG_FILE
from official.utils.misc import machine
from recommendation.data import preprocessing_cache
from recommendation.data.data_preprocessing import DataConfig
from recommendation.training import experiments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLPERF_ML20M = experiments.EXPERIMENTS["mlperf_ml20m"]


class _Watch(threading.Thread):
    """Follows the trainer's log for the producer's pid and log path, and keeps the
    last peak RSS of each process and the producer log's last text (the trainer
    deletes that log when the run ends)."""

    def __init__(self, trainer_pid: int, trainer_log: str) -> None:
        super().__init__(daemon=True)
        self.trainer_pid, self.trainer_log = trainer_pid, trainer_log
        self.producer_pid: int | None = None
        self.producer_log_path: str | None = None
        self.producer_log = ""
        self.peak = {"trainer": 0, "producer": 0}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            if self.producer_pid is None:
                with open(self.trainer_log, errors="replace") as log:
                    found = re.search(
                        r"Data producer started \(pid (\d+)\); log: (\S+)", log.read()
                    )
                if found:
                    self.producer_pid, self.producer_log_path = int(found[1]), found[2]
            for name, pid in (("trainer", self.trainer_pid), ("producer", self.producer_pid)):
                rss = machine.peak_rss_bytes(pid) if pid else None
                if rss:
                    self.peak[name] = max(self.peak[name], rss)
            if self.producer_log_path:
                try:
                    with open(self.producer_log_path, errors="replace") as log:
                        self.producer_log = log.read() or self.producer_log
                except OSError:
                    pass


def _preprocessing_seconds(data_dir: str, cache_dir: str) -> tuple[float, float]:
    """Seconds to preprocess from the ratings file (no cache), then from the cache."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    # The experiment's --ml_perf is part of the cache's parameters: build the run's cache.
    config = DataConfig(dataset="ml-20m", data_dir=data_dir, cache_dir=cache_dir, ml_perf=True)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        preprocessing_cache.load_or_build(config)
        times.append(time.perf_counter() - start)
    return times[0], times[1]


def _records(path: str, kind: str) -> list[dict]:
    with open(path) as log:
        return [record for record in map(json.loads, log) if record.get("kind") == kind]


def _directory_bytes(folder: str, prefix: str) -> int:
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for name in os.listdir(folder)
        if name.startswith(prefix)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ratings", required=True, help="an ml-20m-shaped ratings.csv")
    parser.add_argument("--work_dir", required=True, help="data link, cache, model (cleared)")
    parser.add_argument("--train_epochs", type=int, default=2)
    parser.add_argument("--extra_flag", action="append", default=[], help="passed to ncf-main")
    parser.add_argument(
        "--report_only", action="store_true", help="print the table of the run in --work_dir"
    )
    args = parser.parse_args()
    if args.report_only:
        report(args.work_dir)
        return
    if args.train_epochs < 2:
        parser.error("--train_epochs must be at least 2: the wait after the first cycle needs two")
    if os.path.basename(args.ratings) != "ratings.csv":
        parser.error(f"{args.ratings} must be named ratings.csv (the ml-20m release layout)")
    data_dir = os.path.join(args.work_dir, "data")
    cache_dir = os.path.join(args.work_dir, "cache")
    model_dir = os.path.join(args.work_dir, "model")
    os.makedirs(os.path.join(data_dir, "ml-20m"), exist_ok=True)
    link = os.path.join(data_dir, "ml-20m", "ratings.csv")
    if not os.path.exists(link):
        os.symlink(os.path.abspath(args.ratings), link)

    print(machine.cpu_line())
    cold_s, cached_s = _preprocessing_seconds(data_dir, cache_dir)
    command = [
        sys.executable,
        "-m",
        "recommendation.ncf_main",
        f"--config={MLPERF_ML20M.name}",
        f"--data_dir={data_dir}",
        f"--cache_dir={cache_dir}",
        f"--model_dir={model_dir}",
        f"--benchmark_log_dir={model_dir}",
        f"--train_epochs={args.train_epochs}",
        "--clean",
        "--nomlperf_clear_caches",
        *args.extra_flag,
    ]
    print("command:", " ".join(command[1:]), flush=True)
    trainer_log = os.path.join(args.work_dir, "trainer.log")
    with open(trainer_log, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        watch = _Watch(process.pid, trainer_log)
        watch.start()
        status = process.wait()
        watch.done.set()
        watch.join()
    if status:
        with open(trainer_log, errors="replace") as log:
            tail = log.read()[-3000:]
        sys.exit(f"ncf-main exited with {status}; the end of {trainer_log}:\n{tail}")
    with open(os.path.join(args.work_dir, "producer.log"), "w") as log:
        log.write(watch.producer_log)
    with open(os.path.join(args.work_dir, "measured.json"), "w") as out:
        json.dump({"preprocessing_s": [cold_s, cached_s], "peak_rss": watch.peak}, out)
    report(args.work_dir)


def report(work_dir: str) -> None:
    """The table of a finished run in `work_dir` (what `main` measured and saved)."""
    model_dir = os.path.join(work_dir, "model")
    with open(os.path.join(work_dir, "measured.json")) as saved:
        measured = json.load(saved)
    cold_s, cached_s = measured["preprocessing_s"]
    peak = measured["peak_rss"]
    with open(os.path.join(work_dir, "producer.log"), errors="replace") as log:
        producer_log = log.read()
    benchmark_log = os.path.join(model_dir, BENCHMARK_LOG_FILE)
    epochs = _records(benchmark_log, "evaluation")
    summary = _records(benchmark_log, "summary")[-1]
    eval_set = re.search(r"Evaluation set: (\d+) users x (\d+) items in ([\d.]+) s", producer_log)
    cycles = [float(s) for s in re.findall(r"Cycle \d+: .* in ([\d.]+) s", producer_log)]
    import tensorflow as tf  # after official's import, which quiets its start-up lines

    checkpoint = os.path.basename(tf.train.latest_checkpoint(model_dir))
    checkpoint_bytes = _directory_bytes(model_dir, checkpoint + ".")
    logged = collections.Counter(
        record.key
        for record in mlperf_helper.read_log(os.path.join(model_dir, "mlperf_compliance.log"))
    )
    mlperf_events = {
        key: logged[key] for key in ("eval_accuracy", "epoch_start", "epoch_stop", "run_stop")
    }
    config_epochs = MLPERF_ML20M.values["train_epochs"]

    train_s = [record["train_seconds"] for record in epochs]
    eval_s = [record["eval_seconds"] for record in epochs]
    later_wait = summary["wait_seconds"]
    later_train = sum(train_s[1:])
    startup_s = summary["total_seconds"] - sum(train_s) - sum(eval_s) - later_wait
    projected = startup_s + config_epochs * (
        sum(train_s) / len(train_s) + sum(eval_s) / len(eval_s)
    )
    projected += (config_epochs - 1) * later_wait / max(1, len(train_s) - 1)
    rss_total = (peak["trainer"] + peak["producer"]) / 2**30
    wait_fraction = later_wait / later_train
    eval_points = int(eval_set[1]) * int(eval_set[2]) if eval_set else None

    rows = [
        ("preprocessing, cold (ratings.csv to cache)", f"{cold_s:.2f} s"),
        ("preprocessing, cached", f"{cached_s:.2f} s"),
        (
            "producer: evaluation set",
            f"{float(eval_set[3]):.1f} s ({eval_points:,} points)" if eval_set else "not in log",
        ),
    ]
    rows += [
        (f"producer: training cycle {i} (1 epoch)", f"{s:.1f} s") for i, s in enumerate(cycles)
    ]
    for record in epochs:
        rows.append(
            (
                f"epoch {record['epoch']}: training",
                f"{record['train_seconds']:.1f} s, {record['examples_per_second']:,.0f} examples/s",
            )
        )
        rows.append((f"epoch {record['epoch']}: evaluation", f"{record['eval_seconds']:.1f} s"))
    rows += [
        (
            "trainer wait for the first cycle (the eval set was ready)",
            f"{summary['first_wait_seconds']:.1f} s",
        ),
        (
            f"trainer wait after the first cycle ({len(train_s) - 1} cycles)",
            f"{later_wait:.2f} s = {wait_fraction:.2%} of their training time",
        ),
        ("peak RSS: trainer", f"{peak['trainer'] / 2**30:.2f} GiB"),
        ("peak RSS: producer", f"{peak['producer'] / 2**30:.2f} GiB"),
        ("peak RSS: trainer + producer", f"{rss_total:.2f} GiB"),
        ("checkpoint", f"{checkpoint} {checkpoint_bytes / 2**20:.0f} MiB"),
        ("MLPerf log events", ", ".join(f"{k} {v}" for k, v in mlperf_events.items())),
        ("run in all", f"{summary['total_seconds']:.1f} s for {len(train_s)} epochs"),
        (f"projected, the experiment's {config_epochs} epochs", f"{projected / 3600:.2f} h"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(
        f"best HR@10 {summary['best_hr']:.4f} (synthetic ml-20m-shaped data: not comparable "
        "with the real ml-20m's 0.635 target)"
    )


if __name__ == "__main__":
    main()
