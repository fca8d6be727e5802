"""ncf-online on two or more streams with the same flags, in one run: each stream's
steady events/s beside the first's, and where a step's time goes on each.

    python scripts/profile_online_step.py \\
        --streams ml-1m=/tmp/ml1m-events,2m-users=/tmp/stream2m \\
        --user_capacity 100000 --item_capacity 65536 --max_events 1000000

Each stream is a folder of event files (`scripts/replay_events.py --events_dir`,
`python -m recommendation.data.event_stream_data`), read up to --max_events events.
For each:

1. the input alone: the folder read, parsed and batched as the trainer's background
   thread does it (`EventStream` over `DirectorySource`), with no training: events/s;
2. timed runs: ``ncf-online`` with the flags (`online_runs.stream_run`), steady
   events/s (`online_runs.sustained_events_per_second`); the streams take turns,
   --repeats rounds, and each stream's median counts;
3. a profiled run: the same with ``--profile_steps`` over its last --profile_window
   steps but the last few (the tables at their fullest); TensorFlow's op times in it
   (summed over the executor's threads, which run ops side by side) are split by the
   step's stages (`recommendation.online.step_stages`: id lookup, admission, eviction,
   row gathers, row updates, the prequential scoring, the dense network) and given
   per step.

Then what differs between the streams: ids seen, held, admitted and evicted per step.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import sys
import tempfile
import time

from official.utils.misc import machine  # before TensorFlow: official sets its environment

# isort: split
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import online_runs  # noqa: E402  (sibling scripts)
import profile_training_step  # noqa: E402

from recommendation.data import constants  # noqa: E402
from recommendation.online import step_stages  # noqa: E402
from recommendation.online.sources import DirectorySource  # noqa: E402
from recommendation.online.sources.dead_letters import DeadLetterFile  # noqa: E402
from recommendation.online.sources.event_stream import EventStream  # noqa: E402

TAIL_STEPS = 8  # left out of the profile: the last sinks may be partial


def read_alone(events_dir: str, args, work: str) -> dict:
    """Events/s of reading, parsing and batching `events_dir` up to --max_events, and
    the distinct users and items read."""
    source = DirectorySource(events_dir, DeadLetterFile(os.path.join(work, "dead.jsonl")))
    start, events, batches = time.perf_counter(), 0, []
    for batch in EventStream(source, args.batch_size, linger_seconds=0):
        if batch is None or events >= args.max_events:
            break
        events += batch.num_events
        batches.append(batch.data)
    seconds = time.perf_counter() - start
    return {
        "events": events,
        "events_per_second": events / seconds,
        **{
            column: len(np.unique(np.concatenate([data[column] for data in batches])))
            for column in (constants.USER_COLUMN, constants.ITEM_COLUMN)
        },
    }


def stage_seconds(profile_dir: str) -> collections.Counter:
    """Op seconds of the profile in `profile_dir`, by stage."""
    (path,) = glob.glob(os.path.join(profile_dir, "plugins", "profile", "*", "*.xplane.pb"))
    stages: collections.Counter = collections.Counter()
    for name, seconds in profile_training_step.op_seconds(path).items():
        stages[step_stages.of_op(name.rpartition(":")[0])] += seconds
    return stages


def _run(events_dir: str, work: str, args, *extra: str) -> dict:
    online_runs.fresh_folder(work)
    flags = (
        f"--item_capacity={args.item_capacity}",
        f"--max_events={args.max_events}",
        f"--batch_size={args.batch_size}",
        *args.flag,
        *extra,
    )
    return online_runs.stream_run(events_dir, args.user_capacity, work, more_flags=flags)


def _differences(summary: dict) -> str:
    steps = summary["steps"]
    parts = []
    for name, table in summary["tables"].items():
        parts.append(
            f"{name}s held {table['ids']:,} of {table['capacity']:,}, admitted "
            f"{table['admitted'] / steps:,.0f} and evicted {table['evicted'] / steps:,.0f} "
            "per step"
        )
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", required=True, help="NAME=EVENTS_DIR,... (first: base)")
    parser.add_argument("--user_capacity", type=int, default=100_000)
    parser.add_argument("--item_capacity", type=int, default=65_536)
    parser.add_argument("--max_events", type=int, default=1_000_000)
    parser.add_argument("--batch_size", type=int, default=4096)
    parser.add_argument("--profile_window", type=int, default=40, help="steps profiled")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per stream")
    parser.add_argument("--flag", action="append", default=[], help="more ncf-online flags")
    parser.add_argument("--work_dir", help="where the runs go (default: a temporary folder)")
    args = parser.parse_args()
    streams = dict(item.split("=", 1) for item in args.streams.split(","))
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="profile-online-")

    inputs = {name: read_alone(path, args, work_dir) for name, path in streams.items()}
    rates: dict[str, list[float]] = {name: [] for name in streams}
    loads, summaries = [], {}
    for round_index in range(args.repeats):
        for name, path in streams.items():
            run = _run(path, os.path.join(work_dir, f"{name}-{round_index}"), args)
            rates[name].append(run["steady_events_per_second"])
            summaries[name] = run["summary"]
            loads.append(os.getloadavg()[0])
            print(f"{name} round {round_index}: {rates[name][-1]:,.0f} events/s", flush=True)
    profiles, windows = {}, {}
    for name, path in streams.items():
        last = inputs[name]["events"] // args.batch_size - TAIL_STEPS
        first = last - args.profile_window + 1
        if first < 1:
            sys.exit(f"error: {name} has too few events for --profile_window")
        work = os.path.join(work_dir, f"{name}-profile")
        _run(path, work, args, f"--profile_steps={first},{last}")
        profiles[name] = stage_seconds(os.path.join(work, "model", "profile"))
        windows[name] = f"{first}-{last}"

    print(machine.cpu_line())
    print(
        f"flags: --user_capacity={args.user_capacity} --item_capacity={args.item_capacity} "
        f"--max_events={args.max_events} --batch_size={args.batch_size} "
        f"{' '.join(args.flag)} (ncf-online's defaults "
        f"otherwise); load averages over the runs {min(loads):.2f} to {max(loads):.2f}"
    )
    base = statistics.median(rates[next(iter(streams))])
    print("\nstream | steady events/s (runs) | vs first | input alone events/s")
    print("-------+------------------------+----------+---------------------")
    for name in streams:
        median = statistics.median(rates[name])
        runs = ", ".join(f"{rate:,.0f}" for rate in rates[name])
        alone = inputs[name]["events_per_second"]
        print(f"{name} | {median:,.0f} ({runs}) | {median / base:.2f}x | {alone:,.0f}")
    steps = args.profile_window
    shown = ", ".join(f"{name} {window}" for name, window in windows.items())
    print(f"\nms per step by stage (op time over the executor's threads; steps {shown}):")
    stages = [*step_stages.STAGES, step_stages.DENSE]
    print("stage | " + " | ".join(streams))
    print("------+-" + "-|-".join("-" * len(name) for name in streams))
    for stage in [*stages, "all ops"]:
        cells = []
        for name in streams:
            value = profiles[name][stage] if stage != "all ops" else sum(profiles[name].values())
            cells.append(f"{1e3 * value / steps:.2f}")
        print(f"{stage} | " + " | ".join(cells))
    wall = " | ".join(
        f"{1e3 * args.batch_size / statistics.median(rates[name]):.2f}" for name in streams
    )
    print(f"wall ms per step (steady rate) | {wall}")
    print("\nwhat differs:")
    for name, summary in summaries.items():
        seen = inputs[name]
        print(
            f"- {name}: {summary['events']:,} events of {seen[constants.USER_COLUMN]:,} users "
            f"and {seen[constants.ITEM_COLUMN]:,} items; {_differences(summary)}"
        )
    with open(os.path.join(work_dir, "result.json"), "w") as out:
        json.dump({"rates": rates, "inputs": inputs, "profiles": profiles}, out)


if __name__ == "__main__":
    main()
