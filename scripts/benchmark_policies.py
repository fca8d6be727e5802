"""Which eviction policy to use: each policy at capacities below and at the stream's
distinct users, on a realistic stream (`recommendation.data.event_stream_data`).

    python scripts/benchmark_policies.py --num_users 2000000 --num_items 50000 \\
        --num_events 10000000

It writes the stream once (deterministic by --seed), then runs ``ncf-online`` over it
for every policy of --policies with the user table at each fraction of --fractions of
the distinct users (the item table holds every item), and prints for each run: the
prequential HR@10 (`recommendation/online/prequential.py`: 1 event in 8, over the
stream) with that of cold and warm users, the events/s, the user ids evicted and
refused, and the peak RSS.
"""

from __future__ import annotations

import os
import sys
import tempfile

from official.utils.misc import machine  # before TensorFlow: official sets its environment

# isort: split
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import online_runs  # noqa: E402  (a sibling script)

from recommendation.data import event_stream_data  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_users", 2_000_000, "Distinct users of the stream.")
flags.DEFINE_integer("num_items", 50_000, "Items of the stream.")
flags.DEFINE_integer("num_events", 10_000_000, "Events of the stream.")
flags.DEFINE_integer("seed", 0, "Seed of the stream and of the trainers.")
flags.DEFINE_list("policies", ["none", "lru", "lfu", "ttl:200"], "User-table policies.")
flags.DEFINE_list("fractions", ["0.05", "0.2", "1"], "User capacities, by distinct users.")
flags.DEFINE_float("log_every_secs", 2.0, "Metric report cadence of each run.")


def main(argv: list[str]) -> None:
    del argv
    print(machine.cpu_line())
    print("command: python " + " ".join(sys.argv))
    spec = event_stream_data.EventStreamSpec(
        num_users=FLAGS.num_users, num_items=FLAGS.num_items, num_events=FLAGS.num_events
    )
    with tempfile.TemporaryDirectory() as work:
        events_dir = os.path.join(work, "events")
        event_stream_data.write_event_files(spec, FLAGS.seed, events_dir, show_progress=True)
        print(
            f"\n{FLAGS.num_events:,} events, {FLAGS.num_users:,} users, {FLAGS.num_items:,} "
            f"items (seed {FLAGS.seed})\n\n| user capacity | policy | prequential HR@10 "
            "| cold | warm | events/s | users evicted | users refused | peak RSS MB |\n"
            "|---|---|---|---|---|---|---|---|---|"
        )
        for fraction in FLAGS.fractions:
            capacity = max(1, int(float(fraction) * FLAGS.num_users))
            for policy in FLAGS.policies:
                run = online_runs.stream_run(
                    events_dir,
                    capacity,
                    tempfile.mkdtemp(dir=work),
                    more_flags=(
                        f"--item_capacity={max(FLAGS.num_items, 2)}",
                        f"--user_evict_policy={policy}",
                        f"--log_every_secs={FLAGS.log_every_secs}",
                    ),
                )
                users = run["summary"]["tables"]["user"]
                hr = {
                    cohort: run["summary"]["prequential"][cohort]["hr"]
                    for cohort in ("all", "cold", "warm")
                }
                print(
                    f"| {capacity:,} ({fraction}) | {policy} | {hr['all']:.4f} "
                    f"| {hr['cold']:.4f} | {hr['warm']:.4f} "
                    f"| {run['events_per_second']:,.0f} | {users['evicted']:,} "
                    f"| {users['refused']:,} | {run['peak_rss'] / 2**20:,.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    app.run(main)
