"""The suite's own rule: a test that starts a process or sends a signal carries the
`integration` marker (conftest fails one that does not)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import conftest
import pytest


def test_an_unmarked_test_that_starts_a_process_fails_naming_the_marker():
    with pytest.raises(pytest.fail.Exception) as failed:
        subprocess.Popen([sys.executable, "-c", "pass"])
    assert str(failed.value) == (
        "tests/test_conftest.py::"
        "test_an_unmarked_test_that_starts_a_process_fails_naming_the_marker calls "
        "Popen.__init__: mark it @pytest.mark.integration (it starts a process or sends a "
        "signal)"
    )
    with pytest.raises(pytest.fail.Exception, match=r" calls os\.kill: mark it"):
        os.kill(os.getpid(), signal.SIGCONT)  # harmless, were it sent
    os.kill(os.getpid(), 0)  # a liveness probe sends nothing: allowed


@pytest.mark.integration
def test_a_marked_test_starts_processes_and_sends_signals():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
    os.kill(os.getpid(), signal.SIGCONT)


class _Collected:
    """What the collection hook reads and calls of a collected test."""

    def __init__(self, *fixturenames: str) -> None:
        self.fixturenames = ["request", "tmp_path", *fixturenames]
        self.markers: list[str] = []

    def add_marker(self, marker) -> None:
        self.markers.append(marker.name)


def test_a_test_asking_for_a_server_is_marked_integration():
    items = [
        _Collected("redis_server"),
        _Collected(),
        _Collected("each_redis_server"),
        _Collected("gcs"),
    ]
    conftest.pytest_collection_modifyitems(items)
    marked = [["integration"], [], ["integration"], ["integration"]]
    assert [item.markers for item in items] == marked


@pytest.mark.integration
def test_the_suites_summary_is_the_last_thing_it_prints():
    """TensorFlow's loading lines (CUDA, oneDNN, CPU features) come before any setting
    is read; pytest captures the start of a session and printed them after its
    summary. Loaded quietly (`quiet_loading`), nothing follows the summary."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "1", "tests/test_stat_utils.py"],
        cwd=conftest.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 0 and " passed in " in lines[-1], lines[-10:]
