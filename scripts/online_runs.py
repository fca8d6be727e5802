"""What the online benchmarks share: one ``ncf-online`` process over an event folder,
measured from outside (peak RSS, folder bytes) and by its summary (the table
benchmarks), a Redis of their own, the new users of a warm-up, the load average."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import redis

from official.utils.misc import machine
from recommendation.online.sources import redis_connection
from recommendation.online.sources.redis_connection import RedisOptions
from recommendation.online.state import versioned_export

ML_1M_USERS = 6_040
NEW_USER_BASE = 10_000_000  # above every ML-1M user id (1 to 6,040)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (2 cores: 2.0 is a full machine)."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_redis(work_dir: str) -> tuple[subprocess.Popen, str]:
    """A redis-server of the benchmark's own (no persistence), and its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("error: redis-server is not on PATH: apt-get install -y redis-server")
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            work_dir,
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis_client(url)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return process, url


def redis_client(redis_url: str) -> redis.Redis:
    """A client of the Redis `start_redis` started (no password: not the environment's)."""
    return redis_connection.resolve(RedisOptions(url=redis_url), environ={}).client()


def new_user_events(events: np.ndarray, count: int, seed: int) -> np.ndarray:
    """`count` (user, item, timestamp) rows of `count` new users (ids from
    NEW_USER_BASE), each with an item drawn from `events` (as often as it is rated
    there), a second apart and ending a second before the first of `events`."""
    items = np.random.default_rng(seed).choice(events[:, 1], size=count)
    users = NEW_USER_BASE + np.arange(count, dtype=np.int64)
    timestamps = events[0, 2] - count + np.arange(count, dtype=np.int64)
    return np.stack([users, items, timestamps], axis=1)


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


def _version_bytes(export_dir: str) -> float:
    """The mean bytes of the versions in `export_dir` (its publications left out)."""
    found = versioned_export.versions(export_dir)
    total = sum(folder_bytes(os.path.join(export_dir, str(version))) for version in found)
    return total / max(1, len(found))


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
        "export_bytes": _version_bytes(export_dir),
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
