"""One ``ncf-online`` process over an event folder, measured from outside (peak RSS,
folder bytes) and by its summary: what the table benchmarks run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from official.utils.misc import machine


def folder_bytes(folder: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(folder)
        for name in names
    )


def fresh_folder(folder: str) -> None:
    """An empty `folder` (a run of an earlier invocation would be resumed)."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)


def sustained_events_per_second(summary: dict) -> float:
    """ncf-online's steady events/s, counted as the peer harnesses count theirs: from
    the first sink ending 1 s into the run (start-up and tracing before it) to the last
    (the wait for more events after it left out), at the grain of sinks whatever the
    report cadence (``steady_events_per_second``, `callbacks.MetricLogger`). A
    checkout whose summary lacks it (--trees) is read from its metric reports, the
    first to the last before the stop: run it with 1-s reports."""
    if summary.get("steady_events_per_second"):
        return summary["steady_events_per_second"]
    history = [h for h in summary["history"] if h["events"] > 0]
    if len(history) > 2:
        history = history[:-1]
    if len(history) < 2:
        return summary["events"] / summary["seconds"]
    first, last = history[0], history[-1]
    return (last["events"] - first["events"]) / (last["seconds"] - first["seconds"])


def stream_run(
    events_dir: str,
    capacity: int,
    work: str,
    tree: str | None = None,
    more_flags: tuple[str, ...] = (),
) -> dict:
    """One ncf-online process (of this checkout or `tree`, with `more_flags`) over
    `events_dir`; its summary plus peak RSS and bytes."""
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
        "--log_every_secs=1",
        "--seed=1",
        f"--summary_file={summary_file}",
        *more_flags,
    ]
    with tempfile.TemporaryFile() as stderr_file:
        env = dict(os.environ, PYTHONPATH=tree) if tree else None
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=stderr_file, cwd=tree, env=env
        )
        # VmHWM, polled: a child's rusage counts its parent's memory at the fork.
        peak = 0
        while process.poll() is None:
            peak = max(peak, machine.peak_rss_bytes(process.pid) or 0)
            time.sleep(0.05)
        stderr_file.seek(0)
        stderr = stderr_file.read().decode(errors="replace")
    if process.returncode != 0:
        raise SystemExit(f"error: ncf-online failed at capacity {capacity}:\n{stderr[-3000:]}")
    with open(summary_file) as file:
        summary = json.load(file)
    return {
        "events_per_second": summary["events"] / summary["seconds"],
        "steady_events_per_second": sustained_events_per_second(summary),
        "peak_rss": peak,
        "model_dir_bytes": folder_bytes(model_dir),
        # A version's bytes: how many versions are kept at the end varies with timing.
        "export_bytes": folder_bytes(export_dir) / max(1, len(os.listdir(export_dir))),
        # Of a full checkpoint (a checkout before deltas: of any checkpoint).
        "checkpoint_seconds": (
            summary["checkpoints"]["full"]["seconds"]
            if "checkpoints" in summary
            else summary.get("checkpoint_seconds")
        ),
        "export_seconds": summary.get("export_seconds"),
        "ids": summary["tables"]["user"]["ids"] + summary["tables"]["item"]["ids"],
        "summary": summary,
    }
