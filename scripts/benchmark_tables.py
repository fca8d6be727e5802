"""Hash tables at production capacities: does a table cost what it holds?

    python scripts/benchmark_tables.py --ratings ../shared/data/ml-100k/u.data

Three measurements, each against the smallest capacity in the same run (ratios: the
machine is shared):

- lookup: one training step of a table (lazy Adam rows, inside a tf.function) on
  --lookup_ids ids: half of them the same ids every step, half new ids, which expire
  two steps later (``ttl:2``): each step refreshes, admits, expires and trains as many
  rows at every capacity, the table holding about twice --lookup_ids ids; one table
  per capacity, taking turns step by step, the median of --repeats steps of each;
- eviction: one training step of a full table at each of --full_capacities, every row
  seen twice so that none is below LFU's decay floor (the case where finding the
  lowest rows is hardest): each step admits --lookup_ids / 2 new ids (seen twice, each
  evicting a row) and sees as many held ones, under ``lfu`` and, as the baseline on
  the same steps, ``lru``; tables taking turns step by step, the median of --repeats
  steps of each, and the rows the LFU tables' refills read per step;
- stream: ``ncf-online`` over the ratings replayed as an event folder (one process per
  capacity, both tables at that capacity, ``--idle_timeout_secs 5 --seed 1``, an export
  every 2 s): events/s, peak RSS, the model_dir bytes and an export version's at the
  end, and the mean seconds of a checkpoint and of an export, of the run of median
  events/s among --rounds runs taken in turns (every other round in reverse order). The
  events/s include each process's graph tracing (a large share of a 100,000-event
  run: docs/benchmarks.md, "Hash tables at any capacity", measures it); "after
  tracing" counts from the first metric report (one a second) on;
- index: what a table's index and policy state cost per id, the part a cluster's chief
  holds of every table (`docs/cluster.md`): --index_ids ids admitted in batches of
  65,536 into an LRU table of width 1 (rows of 4 bytes, no optimiser moments), and the
  growth of this process's resident memory (VmRSS) per id. Measured first, before the
  other parts free memory this process could reuse.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import time

from official.utils.misc import machine  # before TensorFlow: official sets its environment

# isort: split
import numpy as np
import tensorflow as tf
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import online_runs  # noqa: E402  (sibling scripts)
import plots  # noqa: E402
import replay_events  # noqa: E402

from recommendation.model import (
    optimizers,
)
from recommendation.online.tables.hash_embedding import HashEmbedding  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("ratings", None, "MovieLens ratings file replayed as the stream.")
flags.DEFINE_list("capacities", ["65536", "1048576", "16777216", "67108864"], "Capacities.")
flags.DEFINE_list(
    "parts",
    ["lookup", "eviction", "stream"],
    "What to measure: lookup, eviction, stream, index.",
)
flags.DEFINE_integer("index_ids", 1_000_000, "Ids admitted in the index part.")
flags.DEFINE_list(
    "full_capacities", ["65536", "262144", "1048576", "4194304"], "Capacities of full tables."
)
flags.DEFINE_integer("lookup_ids", 20_480, "Ids of each timed lookup.")
flags.DEFINE_integer("repeats", 30, "Timed lookups per capacity.")
flags.DEFINE_integer("width", 64, "Row width in the lookup part.")
flags.DEFINE_integer(
    "rounds", 3, "Stream runs per capacity, in turns; the run of median events/s is shown."
)
flags.DEFINE_string(
    "plot_dir",
    None,
    "Also draw each part's curve there (matplotlib, the benchmark extra): tables_lookup.png, "
    "tables_eviction.png, tables_stream.png (default: no figures).",
)
flags.DEFINE_string(
    "baseline_tree",
    None,
    "Another checkout (git worktree) whose ncf-online also runs, at "
    "the first capacity, as the first row of the stream table.",
)


# The machine line above the tables and under the figures (it asks a TensorFlow process).
_cpu_line = functools.cache(machine.cpu_line)


def _plot(part: str, title: str, y_label: str, curves: dict[str, tuple[list, list]]) -> None:
    """``tables_<part>.png`` in --plot_dir (nothing without it): `curves` (label:
    (capacities, values)) on a log-2 capacity axis; the machine and its load under it."""
    if FLAGS.plot_dir:
        path = os.path.join(FLAGS.plot_dir, f"tables_{part}.png")
        x_label = "table capacity (rows)"
        load = " ".join(f"{value:.2f}" for value in os.getloadavg())
        caption = f"{_cpu_line()}; load average at the end {load}"
        plots.line_chart(
            path, title, x_label, y_label, curves, caption, log_x=True, y_from_zero=True
        )


def _training_step(table: HashEmbedding):
    """A tf.function that trains `table` (lazy Adam rows) on a batch of ids."""
    optimizer = optimizers.LazyAdam(learning_rate=0.001)
    optimizer.build([])
    table.attach_optimizer(optimizer)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def train(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(table(ids, training=True))
        table.train_rows(tape.gradient(loss, table.embeddings))

    return train


def _resident_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def index_bytes_per_id(count: int) -> tuple[float, int]:
    """Resident bytes per id of an LRU table of width 1 holding `count` ids, and the
    rows it allocated."""
    table = HashEmbedding(1, capacity=1 << count.bit_length(), eviction="lru")
    admit = tf.function(lambda ids: table.slots(ids, training=True))
    admit(tf.constant([-1], tf.int64))  # traced before the first reading
    before = _resident_mb()
    for start in range(0, count, 65_536):
        admit(tf.range(start, min(count, start + 65_536), dtype=tf.int64))
    grown = (_resident_mb() - before) * 2**20 / count
    return grown, int(table.allocated.numpy())


def _lookup_step(capacity: int):
    """One training lookup (admission, refresh, expiry, row update) of a new table of
    `capacity` rows: a function that runs the next step and returns its seconds."""
    train = _training_step(HashEmbedding(FLAGS.width, capacity=capacity, eviction="ttl:2"))

    half = FLAGS.lookup_ids // 2
    held = np.arange(1, half + 1, dtype=np.int64)
    fresh = [10**12]  # new ids, never seen

    def step() -> float:
        ids = tf.constant(np.concatenate([held, np.arange(fresh[0], fresh[0] + half)]))
        fresh[0] += half
        start = time.perf_counter()
        train(ids)
        return time.perf_counter() - start

    return step


def _evicting_step(capacity: int, policy: str):
    """One training step of a full `policy` table of `capacity` rows, every row seen
    twice: a function that runs the next step and returns its seconds."""
    table = HashEmbedding(FLAGS.width, capacity=capacity, eviction=policy)
    train = _training_step(table)
    train(tf.constant(np.repeat(np.arange(capacity, dtype=np.int64), 2)))
    half = FLAGS.lookup_ids // 2
    rng = np.random.default_rng(0)
    fresh = [10**12]

    def step() -> float:
        new = np.repeat(np.arange(fresh[0], fresh[0] + half), 2)
        fresh[0] += half
        held = table.contents()[0].numpy()[rng.integers(0, capacity, size=half)]
        ids = tf.constant(np.concatenate([new, held]))
        start = time.perf_counter()
        train(ids)
        return time.perf_counter() - start

    step.table = table
    return step


def _median_ms(steps: list) -> list[float]:
    """Median milliseconds of each step function, taking turns step by step (every
    other round in reverse order), after 5 untimed rounds."""
    times: list[list[float]] = [[] for _ in steps]
    for round_index in range(FLAGS.repeats + 5):
        order = range(len(steps)) if round_index % 2 == 0 else reversed(range(len(steps)))
        for index in order:
            times[index].append(steps[index]())
    return [1000 * float(np.median(each[5:])) for each in times]


def lookup_ms(capacities: list[int]) -> list[float]:
    """Median milliseconds of a training lookup at each capacity."""
    return _median_ms([_lookup_step(capacity) for capacity in capacities])


def eviction_table(capacities: list[int]) -> None:
    """Prints the eviction part's table (module docstring)."""
    print(
        f"\ntraining step of a full table, every row seen twice, on {FLAGS.lookup_ids:,} ids "
        f"(half new, each evicting a row), width {FLAGS.width}\n\n"
        f"| capacity | lru ms | lfu ms | lfu vs lru | lfu vs {capacities[0]:,} "
        "| rows read by lfu refills per step |\n|---|---|---|---|---|---|"
    )
    first, curves = None, {"lru": ([], []), "lfu": ([], [])}
    for capacity in capacities:
        steps = [_evicting_step(capacity, policy) for policy in ("lru", "lfu")]
        scanned = int(steps[1].table._pool.rows_scanned.numpy())
        lru, lfu = _median_ms(steps)
        per_step = (int(steps[1].table._pool.rows_scanned.numpy()) - scanned) / (FLAGS.repeats + 5)
        first = first or lfu
        for policy, ms in (("lru", lru), ("lfu", lfu)):
            curves[policy][0].append(capacity)
            curves[policy][1].append(ms)
        print(
            f"| {capacity:,} | {lru:.2f} | {lfu:.2f} | {lfu / lru:.2f}x | {lfu / first:.2f}x "
            f"| {per_step:,.0f} |",
            flush=True,
        )
        del steps
    _plot(
        "eviction",
        f"Training step of a full table on {FLAGS.lookup_ids:,} ids (half new, each evicting)",
        f"ms per step (median of {FLAGS.repeats})",
        curves,
    )


def main(argv: list[str]) -> None:
    del argv
    capacities = [int(value) for value in FLAGS.capacities]
    if FLAGS.plot_dir:
        plots.require(FLAGS.plot_dir)
    print(_cpu_line())
    print("command: python " + " ".join(sys.argv))
    if "index" in FLAGS.parts:
        grown, allocated = index_bytes_per_id(FLAGS.index_ids)
        print(
            f"\nindex and policy state of an LRU table: {FLAGS.index_ids:,} ids ({allocated:,} "
            f"rows allocated): {grown:.0f} resident bytes per id (4 of them its row)"
        )
    if "lookup" in FLAGS.parts:
        print(
            f"\ntraining step of a table on {FLAGS.lookup_ids:,} ids (half new), width "
            f"{FLAGS.width}\n\n| capacity | ms | vs {capacities[0]:,} |\n|---|---|---|"
        )
        medians = lookup_ms(capacities)
        for capacity, ms in zip(capacities, medians, strict=True):
            print(f"| {capacity:,} | {ms:.2f} | {ms / medians[0]:.2f}x |", flush=True)
        _plot(
            "lookup",
            f"Training step of a table on {FLAGS.lookup_ids:,} ids (half new), width {FLAGS.width}",
            f"ms per step (median of {FLAGS.repeats})",
            {"ttl:2 table": (capacities, medians)},
        )
    if "eviction" in FLAGS.parts:
        eviction_table([int(value) for value in FLAGS.full_capacities])
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
                "| capacity | ids held | events/s | after tracing | peak RSS MB | model_dir MB "
                "| export MB (a version) | checkpoint s | export s |\n"
                "|---|---|---|---|---|---|---|---|---|"
            )
            rows = [(str(capacity), capacity, None) for capacity in capacities]
            if FLAGS.baseline_tree:
                rows.insert(
                    0,
                    (
                        f"{capacities[0]} ({FLAGS.baseline_tree})",
                        capacities[0],
                        FLAGS.baseline_tree,
                    ),
                )
            runs: dict[str, list[dict]] = {name: [] for name, _, _ in rows}
            for turn in range(FLAGS.rounds):
                # Every other round in reverse, so that no row always runs first.
                for name, capacity, tree in rows if turn % 2 == 0 else rows[::-1]:
                    work_dir = tempfile.mkdtemp(dir=work)
                    runs[name].append(online_runs.stream_run(events_dir, capacity, work_dir, tree))
            median = {
                name: sorted(found, key=lambda run: run["events_per_second"])[len(found) // 2]
                for name, found in runs.items()
            }
            base = median[rows[0][0]]
            for name, _, _ in rows:
                run = median[name]
                ratio = {k: run[k] / base[k] for k in run if k.endswith(("second", "rss", "bytes"))}
                seconds = [
                    "-" if run[k] is None else f"{run[k]:.3f}"
                    for k in ("checkpoint_seconds", "export_seconds")
                ]
                print(
                    f"| {name} | {run['ids']:,} "
                    f"| {run['events_per_second']:,.0f} ({ratio['events_per_second']:.2f}x) "
                    f"| {run['steady_events_per_second']:,.0f} "
                    f"({ratio['steady_events_per_second']:.2f}x) "
                    f"| {run['peak_rss'] / 2**20:,.0f} ({ratio['peak_rss']:.2f}x) "
                    f"| {run['model_dir_bytes'] / 2**20:,.1f} ({ratio['model_dir_bytes']:.2f}x) "
                    f"| {run['export_bytes'] / 2**20:,.1f} ({ratio['export_bytes']:.2f}x) "
                    f"| {seconds[0]} | {seconds[1]} |",
                    flush=True,
                )
            ours = [(capacity, median[name]) for name, capacity, tree in rows if not tree]
            _plot(
                "stream",
                f"ncf-online over {count:,} events of {os.path.basename(FLAGS.ratings)}",
                f"events/s (the median of {FLAGS.rounds} runs)",
                {
                    label: ([capacity for capacity, _ in ours], [run[key] for _, run in ours])
                    for label, key in (
                        ("all events", "events_per_second"),
                        ("after tracing", "steady_events_per_second"),
                    )
                },
            )


if __name__ == "__main__":
    app.run(main)
