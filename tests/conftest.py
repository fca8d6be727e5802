"""Shared helpers: small MovieLens-format files written into pytest's tmp_path."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterable

import pytest
import redis

# Rows of (user, item, timestamp) used by several tests: three users, 4/2/3 ratings.
TINY_ROWS = [
    (10, 500, 100),
    (10, 70000, 90),
    (10, 501, 100),
    (10, 502, 80),
    (20, 500, 5),
    (20, 503, 6),
    (30, 501, 50),
    (30, 503, 40),
    (30, 70000, 60),
]


def write_movielens(path: str, rows: Iterable[tuple[int, int, int]], kind: str) -> str:
    """Writes `rows` as a ``dat`` (::), ``u.data`` (tab) or ``csv`` (header) ratings file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lines = []
    if kind == "csv":
        lines.append("userId,movieId,rating,timestamp")
    separator = {"dat": "::", "u.data": "\t", "csv": ","}[kind]
    for user, item, timestamp in rows:
        lines.append(separator.join(str(v) for v in (user, item, 4, timestamp)))
    with open(path, "w", newline="") as out:
        out.write("\n".join(lines) + "\n")
    return path


@pytest.fixture
def tiny_ml1m(tmp_path) -> str:
    """A data_dir holding ``ml-1m/ratings.dat`` with `TINY_ROWS`; returns data_dir."""
    write_movielens(str(tmp_path / "ml-1m" / "ratings.dat"), TINY_ROWS, "dat")
    return str(tmp_path)


class RedisServer:
    """A real redis-server on a free local port, persisting to `directory` (AOF, fsync
    on every write) so that it can be killed and restarted without losing data."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.port = _free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port)

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH: install it (apt-get install -y redis-server)")
        os.makedirs(self.directory, exist_ok=True)
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                self.directory,
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        """Stops the server abruptly (SIGKILL), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def redis_server(tmp_path):
    """A started `RedisServer`, killed after the test."""
    server = RedisServer(str(tmp_path / "redis"))
    server.start()
    yield server
    server.kill()
