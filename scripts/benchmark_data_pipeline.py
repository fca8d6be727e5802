"""Benchmark of negative generation and the TFRecord pipeline.

For each ratings file and each --workers count (the producer's worker threads): the
time to generate one training epoch (every positive plus --num_neg negatives,
shuffled), to write it as one cycle of batch-serialised shards, and to build the
evaluation set; then, once per file, the time to read the cycle back through
`train_input_fn` in this one process. Each worker count's epoch is checked to be
byte-identical to the first's. The scaling table gives each count's speed-up over
the first, and the cores the producer would need for --target_points_per_s at the
last count's speed per worker. With --peer_log, the Model Garden's "Epoch
construction complete" times are parsed from a log of
``../shared/peer/ncf_official.sh run`` on the same data and printed beside ours.

    python scripts/benchmark_data_pipeline.py --workers 1 --workers 2 \
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

from official.utils.misc import machine
from recommendation.data import data_preprocessing, preprocessing_cache
from recommendation.data.data_preprocessing import DataConfig
from recommendation.producer import (
    data_pipeline,
    negative_sampling,
    run_folder,
    shard_writing,
    stat_utils,
)

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
    return preprocessing_cache.load_or_build(config).data


def measure(
    data: data_preprocessing.PreprocessedData,
    batch_size: int,
    num_neg: int,
    workers: int,
    work_dir: str,
) -> tuple[dict, negative_sampling.TrainingEpoch]:
    """One epoch generated, written as one cycle and the eval set built, on `workers`."""
    row = {"workers": workers, "positives": data.num_train_positives}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        start = time.perf_counter()
        exclusion = stat_utils.ExclusionIndex.from_csr(
            data.train_offsets, data.train_items, data.num_items
        )
        row["index_s"] = time.perf_counter() - start
        start = time.perf_counter()
        epoch = negative_sampling.training_epoch(
            data, exclusion, num_neg, seed=0, epoch=0, pool=pool
        )
        row["epoch_s"] = time.perf_counter() - start
        row["points"] = len(epoch.users)
        folder = os.path.join(work_dir, "cycle")
        num_batches = -(-len(epoch.users) // batch_size)
        start = time.perf_counter()
        writers = shard_writing.open_writers(folder, run_folder.NUM_SHARDS)
        shard_writing.write_shards(
            writers,
            lambda b, e=epoch: shard_writing.train_batch(e, b, batch_size),
            run_folder.train_record(batch_size),
            num_batches,
            pool,
        )
        shard_writing.close_writers(writers)
        row["write_s"] = time.perf_counter() - start
        row["cycle"] = run_folder.CycleInfo(
            0, folder, 1, num_batches, batch_size, run_folder.NUM_SHARDS
        )
        start = time.perf_counter()
        negative_sampling.eval_blocks(data, 999, seed=0, pool=pool)
        row["eval_s"] = time.perf_counter() - start
    return row, epoch


def read_seconds(cycle: run_folder.CycleInfo) -> float:
    """Seconds to read every batch of `cycle` through `train_input_fn`."""
    start = time.perf_counter()
    for _ in data_pipeline.train_input_fn(cycle):
        pass
    return time.perf_counter() - start


def _same_epoch(a: negative_sampling.TrainingEpoch, b: negative_sampling.TrainingEpoch) -> bool:
    return all(
        getattr(a, field).tobytes() == getattr(b, field).tobytes()
        for field in ("users", "items", "labels")
    )


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
        action="append",
        help="producer worker threads; repeat to compare (default: the producer's "
        f"{run_folder.DEFAULT_NUM_WORKERS} here)",
    )
    parser.add_argument("--target_points_per_s", type=float, default=40e6)
    parser.add_argument("--peer_log", help="log of the Model Garden NCF on ML-1M")
    args = parser.parse_args()
    worker_counts = args.workers or [run_folder.DEFAULT_NUM_WORKERS]
    print(machine.cpu_line())
    rows = []
    for ratings in args.ratings:
        with tempfile.TemporaryDirectory() as work_dir:
            data = _prepare(ratings, work_dir)
            first_epoch = None
            for workers in worker_counts:
                row, epoch = measure(data, args.batch_size, args.num_neg, workers, work_dir)
                row["file"] = ratings
                row["identical"] = first_epoch is None or _same_epoch(first_epoch, epoch)
                first_epoch = first_epoch or epoch
                del epoch
                rows.append(row)
            del first_epoch
            rows[-1]["read_s"] = read_seconds(rows[-1]["cycle"])
    header = (
        f"{'file':<40} {'workers':>7} {'points':>11} {'index s':>8} {'epoch s':>8} "
        f"{'Mpts/s':>7} {'write s':>8} {'eval s':>7} {'same bytes':>10}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['file'][-40:]:<40} {row['workers']:>7} {row['points']:>11,} "
            f"{row['index_s']:>8.2f} {row['epoch_s']:>8.2f} "
            f"{row['points'] / row['epoch_s'] / 1e6:>7.2f} {row['write_s']:>8.2f} "
            f"{row['eval_s']:>7.2f} {'yes' if row['identical'] else 'NO':>10}"
        )
    print()
    print("scaling (epoch = generate + write; against the first worker count):")
    for ratings in args.ratings:
        mine = [row for row in rows if row["file"] == ratings]
        base = mine[0]
        for row in mine[1:]:
            speedup = (base["epoch_s"] + base["write_s"]) / (row["epoch_s"] + row["write_s"])
            eval_speedup = base["eval_s"] / row["eval_s"]
            workers_ratio = row["workers"] / base["workers"]
            print(
                f"  {ratings[-40:]}: {row['workers']} vs {base['workers']} workers: epoch "
                f"{speedup:.2f}x (efficiency {speedup / workers_ratio:.0%}), eval set "
                f"{eval_speedup:.2f}x"
            )
        last = mine[-1]
        per_worker = last["points"] / (last["epoch_s"] + last["write_s"]) / last["workers"]
        print(
            f"  {ratings[-40:]}: {per_worker / 1e6:.2f} M points/s per worker at "
            f"{last['workers']}; {args.target_points_per_s / 1e6:.0f} M points/s would need "
            f"{args.target_points_per_s / per_worker:.1f} such cores; reading back in one "
            f"process: {last['points'] / last['read_s'] / 1e6:.2f} M points/s "
            f"({last['points'] / last['read_s'] / args.target_points_per_s:.2f}x that rate)"
        )
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
