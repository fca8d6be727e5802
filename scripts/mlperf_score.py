"""MLPerf v0.5 score of a set of runs, from their compliance logs (either format).

    python scripts/mlperf_score.py LOG_DIR

One row a log in LOG_DIR: the time from ``run_start`` to ``run_stop``, whether the run
converged (``run_stop`` says success), its last ``eval_accuracy`` (HR@10) and
``eval_target``. Then the v0.5 score, the mean time of the converged runs without the
fastest and the slowest (so at least three must converge), and the convergence rate.
Times come from the logs' own timestamps, so runs can be scored after the fact.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from official.utils.logs import mlperf_helper


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """What the score needs from one log."""

    name: str
    seconds: float | None  # run_start to run_stop; None if either is missing
    converged: bool
    last_accuracy: float | None
    target: float | None
    evaluations: int


def summarize(path: str) -> RunSummary | None:
    """The run in `path`, or None if it holds no compliance lines."""
    records = mlperf_helper.read_log(path)
    if not records:
        return None
    times = {record.key: record.time_s for record in records if record.key.startswith("run_")}
    stops = [record for record in records if record.key == "run_stop"]
    accuracies = [_number(r.value) for r in records if r.key == "eval_accuracy"]
    targets = [_number(r.value) for r in records if r.key == "eval_target"]
    seconds = None
    if "run_start" in times and "run_stop" in times:
        seconds = times["run_stop"] - times["run_start"]
    return RunSummary(
        name=os.path.basename(path),
        seconds=seconds,
        converged=bool(stops) and _succeeded(stops[-1]),
        last_accuracy=accuracies[-1] if accuracies else None,
        target=targets[-1] if targets else None,
        evaluations=len(accuracies),
    )


def _number(value) -> float:
    """A v0.5 ``{"epoch", "value"}`` value or a plain mllog number."""
    return float(value["value"] if isinstance(value, dict) else value)


def _succeeded(run_stop: mlperf_helper.LogRecord) -> bool:
    if isinstance(run_stop.value, dict):  # v0.5: {"success": bool}
        return bool(run_stop.value.get("success"))
    return run_stop.metadata.get("status") == mlperf_helper.SUCCESS


def v05_score(seconds: list[float]) -> float | None:
    """Mean of the times without the fastest and the slowest (None if fewer than 3)."""
    if len(seconds) < 3:
        return None
    kept = sorted(seconds)[1:-1]
    return sum(kept) / len(kept)


def table(runs: list[RunSummary]) -> str:
    """The runs as a Markdown table, then the score and the convergence rate."""

    def show(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        "| log | run_start to run_stop (s) | converged | last HR@10 | target | evaluations |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for run in runs:
        lines.append(
            f"| {run.name} | {show(run.seconds, '.2f')} | {'yes' if run.converged else 'no'} "
            f"| {show(run.last_accuracy, '.4f')} | {show(run.target, '.4f')} "
            f"| {run.evaluations} |"
        )
    converged = [run.seconds for run in runs if run.converged and run.seconds is not None]
    score = v05_score(converged)
    lines.append("")
    if score is None:
        lines.append(f"MLPerf v0.5 score: n/a (needs 3 converged runs, has {len(converged)})")
    else:
        kept = len(converged) - 2
        lines.append(
            f"MLPerf v0.5 score: {score:.2f} s (mean of {kept} converged run"
            f"{'s' if kept > 1 else ''} after dropping the fastest and the slowest)"
        )
    rate = len(converged) / len(runs)
    lines.append(f"convergence rate: {len(converged)}/{len(runs)} ({rate:.0%})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log_dir", help="folder of compliance logs, one per run")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.log_dir):
        print(f"error: {args.log_dir} is not a folder of compliance logs", file=sys.stderr)
        return 1
    paths = [
        os.path.join(args.log_dir, name)
        for name in sorted(os.listdir(args.log_dir))
        if not name.endswith(mlperf_helper.PART_SUFFIX)
        and os.path.isfile(os.path.join(args.log_dir, name))
    ]
    runs = [run for run in map(summarize, paths) if run is not None]
    if not runs:
        print(f"error: no compliance logs in {args.log_dir}", file=sys.stderr)
        return 1
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
