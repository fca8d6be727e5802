"""A delta checkpoint against a full one, with the user table holding --live_ids ids.

    python scripts/benchmark_checkpoints.py --live_ids 1000000

It generates a realistic stream (`recommendation.data.event_stream_data`: users arriving
throughout with heavy-tailed activity, drifting Zipf items) of --live_ids users, first
admits every one of its users (one event each, in batches), so that the user table
holds them all, then trains the stream itself in order with a checkpoint every
--steps_between steps, full and delta in turns (``full_every=2``), through the
trainer's own `CheckpointCallback` (files and manifest flushed to disk). It prints
each checkpoint's kind, the rows changed since the one before, its bytes and seconds,
then the medians and their ratio: what a delta saves at this size and traffic.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from official.utils.misc import machine  # before TensorFlow: official sets its environment

# isort: split
import numpy as np
import tensorflow as tf
from absl import app, flags

from recommendation.data import constants, event_stream_data
from recommendation.online import callbacks, online_ncf
from recommendation.online.callback_base import Callback
from recommendation.online.stream_batches import StreamBatch

FLAGS = flags.FLAGS
flags.DEFINE_integer("live_ids", 1_000_000, "Users of the stream, all held by the table.")
flags.DEFINE_integer("num_items", 50_000, "Items of the stream.")
flags.DEFINE_integer("num_events", 3_000_000, "Events of the stream trained after admission.")
flags.DEFINE_integer("capacity", 2**26, "User and item table capacity.")
flags.DEFINE_integer("batch_size", 4096, "Events per step.")
flags.DEFINE_integer("steps_between", 150, "Steps between two checkpoints.")
flags.DEFINE_integer("seed", 0, "Seed of the stream and the model.")


def _batches(users: np.ndarray, items: np.ndarray, times: np.ndarray, size: int):
    for start in range(0, len(users), size):
        stop = start + size
        data = {
            constants.USER_COLUMN: users[start:stop],
            constants.ITEM_COLUMN: items[start:stop],
            constants.TIME_COLUMN: times[start:stop],
        }
        yield StreamBatch(data, {"offset": int(min(stop, len(users)))}, len(users[start:stop]))


class _ChangedRows(Callback):
    """Notes the kind of each checkpoint the checkpoint callback is about to save and
    each table's rows changed since the one before."""

    def __init__(self, saver: callbacks.CheckpointCallback) -> None:
        super().__init__()
        self.saver, self.saves = saver, []

    def on_train_batch_end(self, batch, logs=None) -> None:
        if self.saver.schedule.due(batch):
            network = self.rec_model.network
            rows = [
                int(tf.reduce_sum(tf.cast(t.changed[1 : int(t.size.numpy()) + 1], tf.int64)))
                for t in (network.user_embedding, network.item_embedding)
            ]
            self.saves.append(("full" if self.saver.deltas.next_is_full() else "delta", rows))


def main(argv: list[str]) -> None:
    del argv
    print(machine.cpu_line())
    print("command: python " + " ".join(sys.argv))
    spec = event_stream_data.EventStreamSpec(
        num_users=FLAGS.live_ids, num_items=FLAGS.num_items, num_events=FLAGS.num_events
    )
    stream = event_stream_data.generate(spec, FLAGS.seed)
    users, items = stream.users.astype(np.int64), stream.items.astype(np.int64)
    times = stream.timestamps.astype(np.int64)
    distinct, first = np.unique(users, return_index=True)
    tf.keras.utils.set_random_seed(FLAGS.seed)
    params = online_ncf.OnlineParams(user_capacity=FLAGS.capacity, item_capacity=FLAGS.capacity)
    rec_model = online_ncf.build_rec_model(params, boost_level="O1")
    start = time.perf_counter()
    rec_model.online_train(
        _batches(distinct, items[first], times[first], FLAGS.batch_size), [], sink_size=4
    )
    held = int(rec_model.network.user_embedding.size.numpy())
    print(f"admitted {held:,} users in {time.perf_counter() - start:.0f} s")
    with tempfile.TemporaryDirectory() as folder:
        saver = callbacks.CheckpointCallback(
            folder, every_steps=FLAGS.steps_between, full_every=2, keep=1
        )
        changed = _ChangedRows(saver)
        start = time.perf_counter()
        rec_model.online_train(
            _batches(users, items, times, FLAGS.batch_size), [changed, saver], sink_size=4
        )
        seconds = time.perf_counter() - start
    tables = rec_model.network.user_embedding.counts(), rec_model.network.item_embedding.counts()
    print(
        f"trained {len(users):,} events in {seconds:.0f} s; the tables hold "
        f"{tables[0]['ids']:,} users and {tables[1]['ids']:,} items\n"
    )
    print("| checkpoint | rows changed (users, items) | MB | seconds |\n|---|---|---|---|")
    made = {
        kind: iter(zip(saver.bytes[kind], saver.seconds[kind], strict=True)) for kind in saver.bytes
    }
    for kind, (user_rows, item_rows) in changed.saves:  # the one at the end is not listed
        size, took = next(made[kind])
        print(f"| {kind} | {user_rows:,}, {item_rows:,} | {size / 1e6:,.1f} | {took:.2f} |")
    full_mb = np.median(saver.bytes["full"]) / 1e6
    delta_mb = np.median(saver.bytes["delta"]) / 1e6
    full_s, delta_s = np.median(saver.seconds["full"]), np.median(saver.seconds["delta"])
    print(
        f"\nmedian full {full_mb:,.1f} MB in {full_s:.2f} s, delta {delta_mb:,.1f} MB in "
        f"{delta_s:.2f} s: a delta is {delta_mb / full_mb:.2f}x the bytes and "
        f"{delta_s / full_s:.2f}x the seconds of a full checkpoint"
    )


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    app.run(main)
