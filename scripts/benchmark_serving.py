"""Serving benchmark: top-10 recommendations per second from the exported SavedModel.

Trains NeuMF on ML-1M for one epoch with ``ncf-main`` (the tuned ML-1M model: factors
64, layers 256-256-128-64) and exports it with ``--export_onnx`` to --export_dir (an
export already there is measured as it is), then, in this process, times top-k
recommendation with the user's training items excluded:

- the SavedModel's ``recommend`` signature, one user per call (the baseline);
- ``recommend`` with each of --batch_sizes users per call;
- the ONNX export in ONNX Runtime (it has the scoring signature only): every item
  scored for --batch_sizes[0] users per call, then exclusion and top-k in numpy.

The methods take turns on the same blocks of users (--rounds blocks of
--users_per_round), so load from other work on the machine falls on each alike; each
row's top-k lists are checked against the baseline's. Last, the fastest batching
serves every user once.

    python scripts/benchmark_serving.py --ratings /work/shared/data/ml-1m/ratings.dat \
        --export_dir /tmp/ncf-serving
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from official.utils.misc import machine  # before TensorFlow: official sets its environment

# isort: split
import numpy as np
import onnxruntime
import tensorflow as tf
from training_benchmarks.harness import ml1m_data_dir

from recommendation.serving import export_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_and_export(ratings: str, work: str, export_dir: str) -> str:
    """One ncf-main epoch on ML-1M, exported to `export_dir`; returns its last line."""
    command = [
        sys.executable,
        "-m",
        "recommendation.ncf_main",
        "--dataset=ml-1m",
        f"--data_dir={ml1m_data_dir(ratings, work, 'data')}",
        f"--model_dir={os.path.join(work, 'model')}",
        "--train_epochs=1",
        "--num_eval_negatives=99",  # evaluation is not what is measured: keep it short
        "--seed=1",
        f"--export_dir={export_dir}",
        "--export_onnx",
    ]
    print("training:", " ".join(command[1:]), flush=True)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"ncf-main failed:\n{result.stderr[-3000:]}")
    return result.stdout.strip().splitlines()[-1]


def _batches(values: np.ndarray, size: int):
    for start in range(0, len(values), size):
        yield values[start : start + size]


def saved_model_method(recommend, batch_size: int, k: int):
    """users -> `(users, k)` item ids through ``recommend``, `batch_size` users a call."""
    request = dict(k=tf.constant(k), exclude_seen=tf.constant(True))

    def run(users: np.ndarray) -> np.ndarray:
        return np.concatenate(
            [
                recommend(user_id=tf.constant(batch), **request)["item_ids"].numpy()
                for batch in _batches(users, batch_size)
            ]
        )

    return run


def onnx_method(export_dir: str, batch_size: int, k: int):
    """users -> item ids: ONNX Runtime scores every item, numpy excludes and ranks."""
    session = onnxruntime.InferenceSession(
        os.path.join(export_dir, export_files.ONNX_FILE), providers=["CPUExecutionProvider"]
    )
    loaded = tf.saved_model.load(export_dir)  # for the training interactions
    offsets, train_items = loaded.train_offsets.numpy(), loaded.train_items.numpy()
    item_ids = raw_ids(export_dir, export_files.ITEM_IDS_FILE)
    user_ids = raw_ids(export_dir, export_files.USER_IDS_FILE)
    user_index = dict(zip(user_ids.tolist(), range(len(user_ids)), strict=True))

    def run(users: np.ndarray) -> np.ndarray:
        results = []
        for batch in _batches(users, batch_size):
            pairs = {
                "user_id": np.repeat(batch, len(item_ids)),
                "item_id": np.tile(item_ids, len(batch)),
            }
            (scores,) = session.run(["scores"], pairs)
            scores = scores.reshape(len(batch), len(item_ids))
            for row, raw in enumerate(batch.tolist()):
                user = user_index[raw]
                scores[row, train_items[offsets[user] : offsets[user + 1]]] = -np.inf
            best = np.argpartition(-scores, k, axis=1)[:, :k]
            order = np.argsort(-np.take_along_axis(scores, best, axis=1), axis=1, kind="stable")
            results.append(item_ids[np.take_along_axis(best, order, axis=1)])
        return np.concatenate(results)

    return run


def raw_ids(export_dir: str, name: str) -> np.ndarray:
    """An export's id map: line i of its asset file is the raw id of index i."""
    return np.loadtxt(os.path.join(export_dir, "assets", name), dtype=np.int64, ndmin=1)


def compare(methods, users: np.ndarray, rounds: int, per_round: int):
    """Rows (method, median users/s, min, max, share of top-k lists equal to the first
    method's), timed in interleaved rounds on the same users, so load from other work
    on the machine falls on every method alike."""
    for _, run in methods:
        run(users[:1])  # first-call set-up is not timed
    rates = {name: [] for name, _ in methods}
    items = {name: [] for name, _ in methods}
    for block in _batches(users[: rounds * per_round], per_round):
        for name, run in methods:
            start = time.perf_counter()
            items[name].append(run(block))
            rates[name].append(len(block) / (time.perf_counter() - start))
    reference = np.concatenate(items[methods[0][0]])
    return [
        (
            name,
            float(np.median(rates[name])),
            min(rates[name]),
            max(rates[name]),
            float(np.mean(np.all(np.concatenate(items[name]) == reference, axis=1))),
        )
        for name, _ in methods
    ]


def print_table(rows, k: int, users: int, items: int, rounds: int, per_round: int) -> None:
    print("\n" + machine.cpu_line())
    print(
        f"top-{k} lists, training items excluded ({users:,} users x {items:,} items); "
        f"{rounds} interleaved rounds of {per_round} users"
    )
    header = (
        f"{'method':<50} | {'lists/s':>7} | {'min-max':>11} | {'x baseline':>10} | same top-{k}"
    )
    print(header)
    print("-" * len(header))
    for name, rate, low, high, agree in rows:
        spread = f"{low:.0f}-{high:.0f}"
        print(
            f"{name:<50} | {rate:>7.1f} | {spread:>11} | {rate / rows[0][1]:>10.2f} | {agree:>7.1%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ratings", help="ML-1M ratings.dat (to train and export a model)")
    parser.add_argument(
        "--export_dir", required=True, help="the export to measure; made first if missing"
    )
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--users_per_round", type=int, default=128)
    parser.add_argument(
        "--batch_sizes",
        type=lambda text: [int(value) for value in text.split(",")],
        default=[4, 16, 64],
    )
    args = parser.parse_args()
    if not tf.saved_model.contains_saved_model(args.export_dir):
        if not args.ratings:
            parser.error(f"no export in {args.export_dir}: give --ratings to make one")
        with tempfile.TemporaryDirectory() as work:
            print(train_and_export(args.ratings, work, args.export_dir))
    users = raw_ids(args.export_dir, export_files.USER_IDS_FILE)
    recommend = tf.saved_model.load(args.export_dir).signatures["recommend"]
    methods = [("SavedModel recommend, 1 user/call", saved_model_method(recommend, 1, args.k))]
    for batch_size in args.batch_sizes:
        name = f"SavedModel recommend, {batch_size} users/call"
        methods.append((name, saved_model_method(recommend, batch_size, args.k)))
    if os.path.exists(os.path.join(args.export_dir, export_files.ONNX_FILE)):
        name = f"ONNX Runtime scores + numpy top-k, {args.batch_sizes[0]} users/call"
        methods.append((name, onnx_method(args.export_dir, args.batch_sizes[0], args.k)))
    rows = compare(methods, users, args.rounds, args.users_per_round)
    items = len(raw_ids(args.export_dir, export_files.ITEM_IDS_FILE))
    print_table(rows, args.k, len(users), items, args.rounds, args.users_per_round)
    # The fastest batching, timed over every user.
    best = max(rows[1 : 1 + len(args.batch_sizes)], key=lambda row: row[1])[0]
    start = time.perf_counter()
    dict(methods)[best](users)
    seconds = time.perf_counter() - start
    print(f"all {len(users):,} users, {best}: {seconds:.1f} s, {len(users) / seconds:.1f} lists/s")


if __name__ == "__main__":
    main()
