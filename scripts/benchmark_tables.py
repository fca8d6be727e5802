"""Hash tables at production capacities: does a table cost what it holds?

    python scripts/benchmark_tables.py --ratings ../shared/data/ml-100k/u.data

Two measurements, each against the smallest capacity in the same run (ratios: the
machine is shared):

- lookup: one training lookup of --lookup_ids ids (half held, half new) in a table
  holding --held_ids ids, with ttl eviction and lazy Adam rows, inside a tf.function;
  the median of --repeats calls at each capacity;
- stream: ``ncf-online`` over the ratings replayed as an event folder (one process per
  capacity, both tables at that capacity, ``--idle_timeout_secs 5 --seed 1``, an export
  every 2 s): events/s, peak RSS, the model_dir and export_dir bytes at the end, and
  the mean seconds of a checkpoint and of an export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from official.utils.misc import machine  # before TensorFlow: official sets its environment

# isort: split
import numpy as np
import tensorflow as tf
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replay_events  # noqa: E402  (a sibling script)

from recommendation import neumf_model  # noqa: E402
from recommendation.online.hash_embedding import HashEmbedding  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("ratings", None, "MovieLens ratings file replayed as the stream.")
flags.DEFINE_list("capacities", ["65536", "1048576", "16777216", "67108864"], "Capacities.")
flags.DEFINE_list("parts", ["lookup", "stream"], "What to measure: lookup, stream.")
flags.DEFINE_integer("held_ids", 32_768, "Ids the table holds in the lookup part.")
flags.DEFINE_integer("lookup_ids", 20_480, "Ids of each timed lookup.")
flags.DEFINE_integer("repeats", 30, "Timed lookups per capacity.")
flags.DEFINE_integer("width", 64, "Row width in the lookup part.")


def lookup_ms(capacity: int) -> float:
    """Median milliseconds of one training lookup (admission, refresh, eviction, row
    update) at `capacity`."""
    table = HashEmbedding(FLAGS.width, capacity=capacity, eviction="ttl:1000")
    optimizer = neumf_model.LazyAdam(learning_rate=0.001)
    optimizer.build([])
    table.attach_optimizer(optimizer)

    @tf.function
    def train(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(table(ids, training=True))
        table.train_rows(tape.gradient(loss, table.embeddings))

    rng = np.random.default_rng(0)
    held = np.arange(1, FLAGS.held_ids + 1, dtype=np.int64)
    for start in range(0, held.size, FLAGS.lookup_ids):
        train(tf.constant(held[start : start + FLAGS.lookup_ids]))
    fresh = 10**12  # new ids, never seen
    times = []
    for _ in range(FLAGS.repeats + 3):
        half = FLAGS.lookup_ids // 2
        ids = np.concatenate([rng.choice(held, half), np.arange(fresh, fresh + half)])
        fresh += half
        start = time.perf_counter()
        train(tf.constant(ids))
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times[3:]))


def folder_bytes(folder: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(folder)
        for name in names
    )


def stream_run(events_dir: str, capacity: int, work: str) -> dict:
    """One ncf-online process over `events_dir`; its summary plus peak RSS and bytes."""
    model_dir, export_dir = os.path.join(work, "model"), os.path.join(work, "export")
    summary_file = os.path.join(work, "summary.json")
    command = [
        sys.executable,
        "-m",
        "recommendation.online_main",
        f"--events_dir={events_dir}",
        f"--model_dir={model_dir}",
        f"--export_dir={export_dir}",
        f"--user_capacity={capacity}",
        f"--item_capacity={capacity}",
        "--idle_timeout_secs=5",
        "--seed=1",
        f"--summary_file={summary_file}",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    stderr = process.stderr.read().decode(errors="replace")
    if status != 0:
        raise SystemExit(f"error: ncf-online failed at capacity {capacity}:\n{stderr[-3000:]}")
    with open(summary_file) as file:
        summary = json.load(file)
    return {
        "events_per_second": summary["events"] / summary["seconds"],
        "peak_rss": usage.ru_maxrss * 1024,
        "model_dir_bytes": folder_bytes(model_dir),
        "export_bytes": folder_bytes(export_dir),
        "checkpoint_seconds": summary["checkpoint_seconds"],
        "export_seconds": summary["export_seconds"],
        "ids": summary["tables"]["user"]["ids"] + summary["tables"]["item"]["ids"],
    }


def main(argv: list[str]) -> None:
    del argv
    capacities = [int(value) for value in FLAGS.capacities]
    print(machine.cpu_line())
    print("command: python " + " ".join(sys.argv))
    if "lookup" in FLAGS.parts:
        print(
            f"\nlookup of {FLAGS.lookup_ids:,} ids, {FLAGS.held_ids:,} held, width "
            f"{FLAGS.width}\n\n| capacity | ms | vs {capacities[0]:,} |\n|---|---|---|"
        )
        base = None
        for capacity in capacities:
            ms = lookup_ms(capacity)
            base = base or ms
            print(f"| {capacity:,} | {ms:.2f} | {ms / base:.2f}x |", flush=True)
    if "stream" in FLAGS.parts:
        if not FLAGS.ratings:
            raise app.UsageError("--ratings is needed for the stream part")
        with tempfile.TemporaryDirectory() as work:
            events_dir = os.path.join(work, "events")
            path = FLAGS.ratings
            events = replay_events.load_events(path, replay_events.file_format_for(path, "auto"))
            replay_events.DirectoryPublisher(events_dir).publish(events)
            count = len(events)
            print(
                f"\nncf-online over {count:,} events of {FLAGS.ratings}\n\n"
                "| capacity | ids held | events/s | peak RSS MB | model_dir MB | export MB "
                "| checkpoint s | export s |\n|---|---|---|---|---|---|---|---|"
            )
            base = None
            for capacity in capacities:
                run = stream_run(events_dir, capacity, tempfile.mkdtemp(dir=work))
                base = base or run
                ratio = {k: run[k] / base[k] for k in run if k.endswith(("second", "rss", "bytes"))}
                print(
                    f"| {capacity:,} | {run['ids']:,} "
                    f"| {run['events_per_second']:,.0f} ({ratio['events_per_second']:.2f}x) "
                    f"| {run['peak_rss'] / 2**20:,.0f} ({ratio['peak_rss']:.2f}x) "
                    f"| {run['model_dir_bytes'] / 2**20:,.1f} ({ratio['model_dir_bytes']:.2f}x) "
                    f"| {run['export_bytes'] / 2**20:,.1f} ({ratio['export_bytes']:.2f}x) "
                    f"| {run['checkpoint_seconds']:.3f} | {run['export_seconds']:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    app.run(main)
