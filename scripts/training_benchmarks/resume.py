"""--resume: a training run that --log_dir holds finished with the same flags is
reused instead of run again."""

from __future__ import annotations

import os
import sys

from training_benchmarks.harness import read_records, run_ours


def run_or_resume(args, work: str, name: str, flags: list[str]) -> float:
    """Runs ncf-main with `flags` as the run `name` (its benchmark log in work/name, its
    output in work/name.log); returns its wall seconds. With --resume, a run that
    finished before with the same flags is reused instead: its seconds are the ones its
    benchmark log measured (training and evaluation, without the process start)."""
    flags = [*flags, f"--benchmark_log_dir={work}/{name}"]
    if args.resume:
        summary = finished_run(f"{work}/{name}/benchmark.jsonl", flags)
        if summary is not None:
            print(f"--resume: {name} finished before with these flags; reused", file=sys.stderr)
            return summary["total_seconds"]
    return run_ours(flags, f"{work}/{name}.log")[0]


def finished_run(benchmark_log: str, flags: list[str]) -> dict | None:
    """The summary of the ncf-main run that wrote `benchmark_log`, if it finished after
    every run whose folder a flag names (a pre-trained part: retrained, it makes this
    run stale) and every one of `flags` holds in its run_info record; otherwise None
    (no log, a run that was stopped, a stale run, other flag values)."""
    try:
        records = read_records(benchmark_log)
        finished_at = os.path.getmtime(benchmark_log)
    except (OSError, ValueError):  # no log, or a line cut short by a kill
        return None
    for flag in flags:
        other_log = os.path.join(flag.partition("=")[2], "benchmark.jsonl")
        if os.path.isfile(other_log) and os.path.getmtime(other_log) > finished_at:
            return None
    starts = [i for i, record in enumerate(records) if record.get("kind") == "run_info"]
    if not starts:
        return None
    recorded = records[starts[-1]]["flags"]
    summaries = [r for r in records[starts[-1] :] if r.get("kind") == "summary"]
    latest = dict(_flag_setting(recorded, flag) for flag in flags)  # a later flag wins
    if not summaries or not all(
        name in recorded and _value_holds(recorded[name], value) for name, value in latest.items()
    ):
        return None
    return summaries[-1]


def _flag_setting(recorded: dict, flag: str) -> tuple[str, str]:
    """(the flag that the command-line `flag` sets, the value it gives, as text):
    ``--name=value``; ``--name`` gives true; ``--noname``, for a boolean ``name`` that
    `recorded` holds, false."""
    name, has_value, value = flag.removeprefix("--").partition("=")
    if has_value:
        return name, value
    if name not in recorded and name.startswith("no"):
        return name[2:], "false"
    return name, "true"


def _value_holds(held: object, value: str) -> bool:
    """Whether the text `value` gives `held`, a flag's value as absl records it."""
    if isinstance(held, bool):
        return value.lower() in (("true", "1") if held else ("false", "0"))
    if isinstance(held, list):
        return ",".join(map(str, held)) == value
    if isinstance(held, (int, float)):
        try:
            return float(value) == held
        except ValueError:
            return False
    return str(held) == value
