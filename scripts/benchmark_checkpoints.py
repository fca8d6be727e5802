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

Then it trains one more interval, so that the folder holds a full checkpoint and a
delta after it, and times restores of them into a new model, each in a process of its
own (TensorFlow imported, the model built, then the restore timed): ``full``, the full
checkpoint (`model_dir.restore_latest`, what both trainers do), and ``full + delta``,
ncf-online's restart (`CheckpointCallback.on_train_begin`: the full checkpoint, the
delta applied, the indexes rebuilt). Beside the seconds it gives the bytes the restore
read (Linux's ``/proc/self/io`` rchar, page cache hits included) against the bytes on
disk. With --trees, the restores of other checkouts (another commit: ``git worktree
add``) take turns with this one's on the same files, --repeats rounds, and the first
of them is the baseline of the ratios:

    python scripts/benchmark_checkpoints.py --live_ids 1000000 --trees before=/tmp/before
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

from official.core import model_dir
from recommendation.data import constants, event_stream_data
from recommendation.online import callbacks, online_ncf
from recommendation.online.callback_base import Callback
from recommendation.online.sources.stream_batches import StreamBatch

FLAGS = flags.FLAGS
flags.DEFINE_integer("live_ids", 1_000_000, "Users of the stream, all held by the table.")
flags.DEFINE_integer("num_items", 50_000, "Items of the stream.")
flags.DEFINE_integer("num_events", 3_000_000, "Events of the stream trained after admission.")
flags.DEFINE_integer("capacity", 2**26, "User and item table capacity.")
flags.DEFINE_integer("batch_size", 4096, "Events per step.")
flags.DEFINE_integer("steps_between", 150, "Steps between two checkpoints.")
flags.DEFINE_integer("seed", 0, "Seed of the stream and the model.")
flags.DEFINE_list(
    "trees",
    [],
    "NAME=PATH checkouts whose restores take turns with this checkout's (the first is "
    "the baseline of the ratios).",
)
flags.DEFINE_integer("repeats", 2, "Rounds of restores (each restore's fastest is shown).")
# A restore's own process (`_restore_in`): what it restores, from where.
RESTORES = ("full", "full + delta")
flags.DEFINE_string("restore_from", None, "Checkpoint folder of a restore's own process.")
flags.DEFINE_enum("restore_kind", "full", list(RESTORES), "What a restore's process restores.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS_TREE = "this"


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


def _bytes_read() -> int:
    """The bytes this process has read (rchar: page cache hits included)."""
    with open("/proc/self/io") as stream:
        return int(next(line for line in stream if line.startswith("rchar:")).split()[1])


def _load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def _new_model():
    tf.keras.utils.set_random_seed(FLAGS.seed)
    params = online_ncf.OnlineParams(user_capacity=FLAGS.capacity, item_capacity=FLAGS.capacity)
    return online_ncf.build_rec_model(params, boost_level="O1")


def _checkpoint_callback(folder: str) -> callbacks.CheckpointCallback:
    return callbacks.CheckpointCallback(
        folder, every_steps=FLAGS.steps_between, full_every=2, keep=1
    )


def _restore_here() -> None:
    """A restore's own process: restores --restore_kind from --restore_from into a new
    model and prints its seconds, bytes read and what it restored, as JSON."""
    rec_model = _new_model()
    before, start = _bytes_read(), time.perf_counter()
    if FLAGS.restore_kind == "full":
        restored = model_dir.restore_latest(rec_model.new_checkpoint, FLAGS.restore_from)
    else:
        checkpoint = _checkpoint_callback(FLAGS.restore_from)
        checkpoint.set_rec_model(rec_model)
        checkpoint.on_train_begin()
        restored = checkpoint.restored_from
    seconds, read = time.perf_counter() - start, _bytes_read() - before
    print(json.dumps({"seconds": seconds, "bytes_read": read, "restored": restored}))


def _trees() -> dict[str, str]:
    """Checkout name -> root, the given ones first (the baseline), then this one."""
    trees = {}
    for item in FLAGS.trees:
        name, _, path = item.partition("=")
        if not path or name == THIS_TREE or not os.path.isdir(os.path.join(path, "recommendation")):
            sys.exit(
                f"error: --trees wants NAME=PATH of a checkout (name not {THIS_TREE!r}): {item}"
            )
        trees[name] = os.path.abspath(path)
    trees[THIS_TREE] = ROOT
    return trees


def _restore_in(tree: str, folder: str, kind: str) -> dict:
    """Restore `kind` of `folder` timed in a process of its own, on `tree`'s modules."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        f"--restore_from={folder}",
        f"--restore_kind={kind}",
        f"--capacity={FLAGS.capacity}",
        f"--steps_between={FLAGS.steps_between}",
        f"--seed={FLAGS.seed}",
    ]
    environment = {**os.environ, "PYTHONPATH": tree, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        command, cwd=tree, env=environment, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        sys.exit(f"error: the restore on {tree} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _restores(rec_model, saver: callbacks.CheckpointCallback, users, items, times) -> None:
    """Trains intervals of the stream again until the folder's newest checkpoint is a
    delta, then times the restores of every checkout, taking turns, and prints them."""
    interval, start = FLAGS.steps_between * FLAGS.batch_size, 0
    while not saver.deltas.manifest or not saver.deltas.manifest["deltas"]:
        part = slice(start, start + interval)
        batches = _batches(users[part], items[part], times[part], FLAGS.batch_size)
        rec_model.online_train(batches, [], sink_size=4)
        saver.act()
        saver.finish()  # a full one is written beside training: on disk before going on
        start = (start + interval) % len(users)
    manifest = saver.deltas.manifest
    on_disk = {
        "full": manifest["full_bytes"],
        "full + delta": manifest["full_bytes"] + manifest["delta_bytes"],
    }
    trees = _trees()
    runs = {(tree, kind): [] for kind in RESTORES for tree in trees}
    load = _load()
    for _ in range(FLAGS.repeats):
        for tree, kind in runs:
            runs[tree, kind].append(_restore_in(trees[tree], saver.directory, kind))
    print(
        f"\nrestored into a new model, {FLAGS.repeats} rounds (load average {load} before, "
        f"{_load()} after); the fastest of each:\n\n"
        "| restore | checkout | MB on disk | seconds | MB read | read / on disk |\n"
        "|---|---|---|---|---|---|"
    )
    fastest = {run: min(done, key=lambda one: one["seconds"]) for run, done in runs.items()}
    for (tree, kind), one in fastest.items():
        read = one["bytes_read"]
        print(
            f"| {kind} | {tree} | {on_disk[kind] / 1e6:,.1f} | {one['seconds']:.2f} | "
            f"{read / 1e6:,.1f} | {read / on_disk[kind]:.2f} |"
        )
    print("\nseconds of each round:")
    for (tree, kind), done in runs.items():
        print(f"  {kind}, {tree}: " + ", ".join(f"{one['seconds']:.2f}" for one in done))
    baseline = next(iter(trees))
    for tree in list(trees)[1:]:
        ratios = []
        for kind in RESTORES:
            ours, theirs = fastest[tree, kind], fastest[baseline, kind]
            ratios.append(
                f"{kind} {ours['seconds'] / theirs['seconds']:.2f}x the seconds and "
                f"{ours['bytes_read'] / theirs['bytes_read']:.2f}x the bytes read"
            )
        print(f"{tree} against {baseline}: " + "; ".join(ratios))


def _report_saves(rec_model, saver, changed: _ChangedRows, events: int, seconds: float) -> None:
    """The table of the checkpoints saved while the stream trained, and their medians."""
    tables = rec_model.network.user_embedding.counts(), rec_model.network.item_embedding.counts()
    print(
        f"trained {events:,} events in {seconds:.0f} s; the tables hold "
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


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.restore_from:
        _restore_here()
        return
    _trees()  # checks --trees before anything runs
    print(machine.cpu_line())
    print("command: python " + " ".join(sys.argv))
    spec = event_stream_data.EventStreamSpec(
        num_users=FLAGS.live_ids, num_items=FLAGS.num_items, num_events=FLAGS.num_events
    )
    stream = event_stream_data.generate(spec, FLAGS.seed)
    users, items = stream.users.astype(np.int64), stream.items.astype(np.int64)
    times = stream.timestamps.astype(np.int64)
    distinct, first = np.unique(users, return_index=True)
    rec_model = _new_model()
    start = time.perf_counter()
    rec_model.online_train(
        _batches(distinct, items[first], times[first], FLAGS.batch_size), [], sink_size=4
    )
    held = int(rec_model.network.user_embedding.size.numpy())
    print(f"admitted {held:,} users in {time.perf_counter() - start:.0f} s")
    with tempfile.TemporaryDirectory() as folder:
        saver = _checkpoint_callback(folder)
        changed = _ChangedRows(saver)
        start = time.perf_counter()
        rec_model.online_train(
            _batches(users, items, times, FLAGS.batch_size), [changed, saver], sink_size=4
        )
        seconds = time.perf_counter() - start
        _report_saves(rec_model, saver, changed, len(users), seconds)
        _restores(rec_model, saver, users, items, times)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    app.run(main)
