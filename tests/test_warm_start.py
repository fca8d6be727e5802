"""The suite's warm starts (tests/warm_start.py): a child forked from a starter runs a
module as ``python -m`` runs it, and exits as it exits; what a starter cannot start is
exec'd."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import warm_start

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def probe_is_warm(monkeypatch):
    """tests/warm_probe.py started as the project's modules are."""
    monkeypatch.setattr(warm_start, "_PACKAGES", (*warm_start._PACKAGES, "warm_probe"))


def _run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "warm_probe", *args],
        capture_output=True,
        text=True,
        cwd=TESTS,
        timeout=120,
        **kwargs,
    )


def _started_both_ways(*args: str, **kwargs) -> tuple:
    """The same command warm, then exec'd."""
    warm = _run(*args, **kwargs)
    warm_start.enabled = False
    try:
        cold = _run(*args, **kwargs)
    finally:
        warm_start.enabled = True
    return warm, cold


@pytest.mark.integration
def test_a_warm_child_sees_what_an_execd_one_sees_but_its_parent(probe_is_warm, tmp_path):
    env = {**os.environ, "REDIS_PASSWORD": "read-at-run-time"}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    warm, cold = _started_both_ways("report", "a b", "--flag=1", input="on stdin", env=env)
    assert (warm.returncode, warm.stderr) == (cold.returncode, cold.stderr) == (3, "to stderr\n")
    warm_seen, cold_seen = json.loads(warm.stdout), json.loads(cold.stdout)
    # Exec'd, the probe is this process's child; warm, its starter's.
    assert cold_seen.pop("parent") == os.getpid() != warm_seen.pop("parent")
    assert cold_seen.pop("tf_log_level") is None  # the probe imports nothing
    assert warm_seen.pop("tf_log_level") == "1"  # what `official` set in the starter
    assert (
        warm_seen
        == cold_seen
        == {
            "argv": [os.path.join(TESTS, "warm_probe.py"), "report", "a b", "--flag=1"],
            "cwd": TESTS,
            "path0": TESTS,
            "stdin": "on stdin",
            "password": "read-at-run-time",
            "name": "__main__",
            "session": False,
        }
    )
    assert json.loads(_run("report", start_new_session=True).stdout)["session"]


@pytest.mark.integration
def test_a_warm_child_exits_as_an_execd_one_does(probe_is_warm):
    warm, cold = _started_both_ways("raise")
    assert warm.returncode == cold.returncode == 1
    assert warm.stderr.splitlines()[-1] == cold.stderr.splitlines()[-1]
    assert warm.stderr.splitlines()[-1] == "ValueError: raised by the probe"
    for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
        statuses = []
        for warm in (True, False):
            warm_start.enabled = warm
            try:
                child = subprocess.Popen(
                    [sys.executable, "-m", "warm_probe", "sleep"],
                    cwd=TESTS,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
            finally:
                warm_start.enabled = True
            with child:
                assert child.stdout.readline() == b"sleeping\n"
                assert child.poll() is None
                child.send_signal(sig)
                statuses.append(child.wait(timeout=60))
        # Python ends itself by SIGINT after an uncaught KeyboardInterrupt.
        assert statuses == [-sig, -sig]


@pytest.mark.integration
def test_what_a_starter_cannot_start_is_execd(probe_is_warm):
    """Not a module of the project (or not `-m`), a shell, or a test marked cold_start:
    the command is exec'd, a child of this process."""
    code = "import os; print(os.getppid())"
    assert (
        int(subprocess.run([sys.executable, "-c", code], capture_output=True).stdout) == os.getpid()
    )
    warm_start.enabled = False
    try:
        assert json.loads(_run("report").stdout)["parent"] == os.getpid()
    finally:
        warm_start.enabled = True
    assert json.loads(_run("report").stdout)["parent"] != os.getpid()
