"""Benchmark of negative generation and the TFRecord pipeline.

For each ratings file: training points generated per second for one epoch (every
positive plus --num_neg negatives, shuffled), the time to write that epoch as one
cycle of batch-serialised shards and to read it back through `train_input_fn`, and
the time to build the evaluation set. With --peer_log, the Model Garden's "Epoch
construction complete" times are parsed from a log of
``../shared/peer/ncf_official.sh run`` on the same data and printed beside ours.

    python scripts/benchmark_data_pipeline.py \
        --ratings ../shared/data/ml-1m/ratings.dat --ratings /tmp/bench/ml-20m/ratings.csv
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import statistics
import tempfile
import time

from recommendation import data_async_generation as generation
from recommendation import data_pipeline, data_preprocessing, run_folder, stat_utils
from recommendation.data_preprocessing import DataConfig

_DATASET_BY_FILE = {"ratings.dat": "ml-1m", "ratings.csv": "ml-20m", "u.data": "ml-100k"}


def _prepare(ratings: str, work_dir: str) -> data_preprocessing.PreprocessedData:
    """Links `ratings` into the registry layout and preprocesses it (cached)."""
    dataset = _DATASET_BY_FILE[os.path.basename(ratings)]
    data_dir = os.path.join(work_dir, "data")
    os.makedirs(os.path.join(data_dir, dataset), exist_ok=True)
    link = os.path.join(data_dir, dataset, os.path.basename(ratings))
    if not os.path.exists(link):
        os.symlink(os.path.abspath(ratings), link)
    config = DataConfig(dataset=dataset, data_dir=data_dir)
    return data_preprocessing.load_or_build(config).data


def measure(ratings: str, batch_size: int, num_neg: int, workers: int, work_dir: str) -> dict:
    data = _prepare(ratings, work_dir)
    row = {"file": ratings, "positives": data.num_train_positives}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        start = time.perf_counter()
        exclusion = stat_utils.ExclusionIndex.from_csr(
            data.train_offsets, data.train_items, data.num_items
        )
        row["index_s"] = time.perf_counter() - start
        start = time.perf_counter()
        epoch = generation.training_epoch(data, exclusion, num_neg, seed=0, epoch=0, pool=pool)
        row["epoch_s"] = time.perf_counter() - start
        row["points"] = len(epoch.users)
        folder = os.path.join(work_dir, "cycle")
        num_batches = -(-len(epoch.users) // batch_size)
        start = time.perf_counter()
        writers = generation.open_writers(folder, run_folder.NUM_SHARDS)
        generation.write_shards(
            writers,
            lambda b, e=epoch: generation.train_batch(e, b, batch_size),
            run_folder.train_record(batch_size),
            num_batches,
            pool,
        )
        generation.close_writers(writers)
        row["write_s"] = time.perf_counter() - start
        del epoch
        info = run_folder.CycleInfo(0, folder, 1, num_batches, batch_size, run_folder.NUM_SHARDS)
        start = time.perf_counter()
        for _ in data_pipeline.train_input_fn(info):
            pass
        row["read_s"] = time.perf_counter() - start
        start = time.perf_counter()
        generation.eval_blocks(data, 999, seed=0)
        row["eval_s"] = time.perf_counter() - start
    return row


def peer_epoch_seconds(log_path: str) -> list[float]:
    """ "Epoch construction complete. Time: X seconds" values from a Model Garden log."""
    with open(log_path, errors="replace") as log:
        return [
            float(value)
            for value in re.findall(
                r"Epoch construction complete\. Time: ([\d.]+) seconds", log.read()
            )
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--ratings",
        action="append",
        required=True,
        help="ratings.dat (ML-1M), ratings.csv (ml-20m shape) or u.data",
    )
    parser.add_argument("--batch_size", type=int, default=65536)
    parser.add_argument("--num_neg", type=int, default=4)
    parser.add_argument(
        "--workers",
        type=int,
        default=run_folder.DEFAULT_NUM_WORKERS,
    )
    parser.add_argument("--peer_log", help="log of the Model Garden NCF on ML-1M")
    args = parser.parse_args()
    rows = []
    for ratings in args.ratings:
        with tempfile.TemporaryDirectory() as work_dir:
            rows.append(measure(ratings, args.batch_size, args.num_neg, args.workers, work_dir))
    header = (
        f"{'file':<45} {'points':>11} {'index s':>8} {'epoch s':>8} {'Mpts/s':>7} "
        f"{'write s':>8} {'read s':>7} {'read Mpts/s':>11} {'eval s':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['file'][-45:]:<45} {row['points']:>11,} {row['index_s']:>8.2f} "
            f"{row['epoch_s']:>8.2f} {row['points'] / row['epoch_s'] / 1e6:>7.2f} "
            f"{row['write_s']:>8.2f} {row['read_s']:>7.2f} "
            f"{row['points'] / row['read_s'] / 1e6:>11.2f} {row['eval_s']:>7.2f}"
        )
    ml20m = [row for row in rows if row["points"] > 50e6]
    for row in ml20m:
        verdict = "met" if row["epoch_s"] < 60 else "NOT met"
        print(f"target: ml-20m-shaped epoch in under 60 s: {row['epoch_s']:.1f} s ({verdict})")
    if args.peer_log:
        peer = peer_epoch_seconds(args.peer_log)
        ours = next(row for row in rows if row["points"] < 50e6)
        median = statistics.median(peer)
        print(
            f"Model Garden epoch construction on ML-1M: median {median:.2f} s over "
            f"{len(peer)} epochs; ours {ours['epoch_s']:.2f} s "
            f"({median / ours['epoch_s']:.1f}x faster)"
        )


if __name__ == "__main__":
    main()
