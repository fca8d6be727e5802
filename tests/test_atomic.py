"""Atomic writes: whole or not at all, through failures, kills and running writers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tensorflow as tf

from official.utils.misc import atomic

# A child that dies (SIGKILL) on the nth call of a gfile function, as a killed writer.
_CHILD = """
import os, signal, sys
import tensorflow as tf
from official.utils.misc import atomic

def die_on(name, nth):
    real, calls = getattr(tf.io.gfile, name), []
    def dying(*args, **kwargs):
        calls.append(args)
        if len(calls) == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    setattr(tf.io.gfile, name, dying)

path = sys.argv[1]
"""


def _killed_writer(code: str, path) -> None:
    """Runs `code` (after `_CHILD`, with `path`) in a process that must die by SIGKILL."""
    result = subprocess.run(
        [sys.executable, "-c", _CHILD + textwrap.dedent(code), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]


def _read(path) -> str:
    with open(path) as stream:
        return stream.read()


def _fail_writes(monkeypatch, failing_name: str = "") -> None:
    """Makes gfile writes to names containing `failing_name` write a few bytes, then raise
    (a full disk)."""

    class FailingGFile(tf.io.gfile.GFile):
        def write(self, data):
            if failing_name in self.name:
                super().write(data[:2])
                self.flush()
                raise OSError(28, "No space left on device")
            super().write(data)

    monkeypatch.setattr(tf.io.gfile, "GFile", FailingGFile)


@pytest.fixture
def running_pid():
    """The pid of a process that runs until the test ends."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield process.pid
    process.kill()
    process.wait()


@pytest.fixture
def dead_pid() -> int:
    """A pid that belongs to no process."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def test_write_file_replaces_a_file_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "summary.json"
    atomic.write_file(str(path), "first")
    atomic.write_file(str(path), b"second \xc2\xb0")
    atomic.write_file(str(path), "third °")
    assert _read(path) == "third °"
    assert os.listdir(tmp_path) == ["summary.json"]


def test_a_failed_write_leaves_the_file_as_it_was_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    path.write_text("earlier")
    _fail_writes(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        atomic.write_file(str(path), "a longer text that does not fit")
    assert _read(path) == "earlier"
    assert os.listdir(tmp_path) == ["summary.json"]


def test_files_that_belong_together_are_all_written_before_any_is_renamed(tmp_path, monkeypatch):
    (tmp_path / "arrays.npz").write_text("old arrays")
    (tmp_path / "metadata.json").write_text("old metadata")
    _fail_writes(monkeypatch, failing_name="metadata.json")  # the second file: disk full
    with pytest.raises(OSError, match="No space left"):
        atomic.write_files(
            {
                str(tmp_path / "arrays.npz"): b"new arrays",
                str(tmp_path / "metadata.json"): "new metadata",
            }
        )
    assert _read(tmp_path / "arrays.npz") == "old arrays"
    assert _read(tmp_path / "metadata.json") == "old metadata"
    assert sorted(os.listdir(tmp_path)) == ["arrays.npz", "metadata.json"]


@pytest.mark.integration
def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    path = tmp_path / "log.txt"
    path.write_text("earlier")
    _killed_writer('die_on("rename", 1)\natomic.write_file(path, "never in place")', path)
    leftovers = [name for name in os.listdir(tmp_path) if name != "log.txt"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".log.txt.tmp-")
    assert _read(path) == "earlier"
    atomic.write_file(str(path), "later")
    assert os.listdir(tmp_path) == ["log.txt"] and _read(path) == "later"


@pytest.mark.integration
def test_a_running_writers_temporaries_are_left_alone(tmp_path, running_pid, dead_pid):
    running = tmp_path / f".log.txt.tmp-{running_pid}-0badcafe"
    dead = tmp_path / f".log.txt.tmp-{dead_pid}-0badcafe"
    earlier = tmp_path / f".log.txt.tmp-{os.getpid()}-0badcafe"  # a process before this one
    other = tmp_path / f".other.txt.tmp-{dead_pid}-0badcafe"  # another destination's
    for leftover in (running, dead, earlier, other):
        leftover.write_text("half")
    atomic.write_file(str(tmp_path / "log.txt"), "text")
    assert sorted(os.listdir(tmp_path)) == sorted(["log.txt", running.name, other.name])
    with atomic.replace_folder(str(tmp_path / "folder")) as temp:
        os.makedirs(temp)
        atomic.remove_leftovers(str(tmp_path))  # this process's own work in progress stays
        assert os.path.isdir(temp)
    assert sorted(os.listdir(tmp_path)) == sorted(["folder", "log.txt", running.name])


def _write_folder(path, text: str) -> None:
    os.makedirs(path)
    (path / "contents.txt").write_text(text)


def test_replace_folder_swaps_the_new_folder_in_whole(tmp_path):
    _write_folder(tmp_path / "export", "earlier")
    with atomic.replace_folder(str(tmp_path / "export")) as temp:
        assert os.path.dirname(temp) == str(tmp_path)
        assert os.path.basename(temp).startswith(".export.tmp-")
        os.makedirs(temp)
        (Path(temp) / "part.txt").write_text("new")
        assert os.listdir(tmp_path / "export") == ["contents.txt"]  # readers see the old one
    assert os.listdir(tmp_path) == ["export"]
    assert os.listdir(tmp_path / "export") == ["part.txt"]
    with atomic.replace_folder(str(tmp_path / "new"), hidden=False) as temp:
        assert os.path.basename(temp).startswith("new.tmp-")  # visible beside a user's folder
        os.makedirs(temp)
    assert sorted(os.listdir(tmp_path)) == ["export", "new"]


def test_a_failure_in_the_block_or_the_swap_keeps_the_earlier_folder(tmp_path, monkeypatch):
    _write_folder(tmp_path / "export", "earlier")
    with (
        pytest.raises(RuntimeError, match="injected"),
        atomic.replace_folder(str(tmp_path / "export")) as temp,
    ):
        _write_folder(Path(temp), "half")
        raise RuntimeError("injected")
    assert os.listdir(tmp_path) == ["export"]
    assert _read(tmp_path / "export/contents.txt") == "earlier"
    real_rename = tf.io.gfile.rename

    def failing_rename(source, destination, overwrite=False):
        if ".tmp-" in source:  # the new folder into place, after the old one moved aside
            raise tf.errors.UnavailableError(None, None, "injected rename failure")
        real_rename(source, destination, overwrite)

    monkeypatch.setattr(tf.io.gfile, "rename", failing_rename)
    with (
        pytest.raises(tf.errors.UnavailableError),
        atomic.replace_folder(str(tmp_path / "export")) as temp,
    ):
        _write_folder(Path(temp), "new")
    assert os.listdir(tmp_path) == ["export"]
    assert _read(tmp_path / "export/contents.txt") == "earlier"


@pytest.mark.integration
def test_a_folder_moved_aside_by_a_killed_swap_is_put_back(tmp_path):
    _write_folder(tmp_path / "export", "earlier")
    _killed_writer(
        """
        die_on("rename", 2)  # the first moves the old folder aside, the second swaps
        with atomic.replace_folder(path) as temp:
            tf.io.gfile.makedirs(temp)
        """,
        tmp_path / "export",
    )
    assert "export" not in os.listdir(tmp_path) and len(os.listdir(tmp_path)) == 2
    atomic.remove_leftovers(str(tmp_path), "export")
    assert os.listdir(tmp_path) == ["export"]
    assert _read(tmp_path / "export/contents.txt") == "earlier"


@pytest.mark.integration
def test_a_folder_left_by_a_writer_killed_in_the_block_is_removed(tmp_path):
    _write_folder(tmp_path / "export", "earlier")
    _killed_writer(
        """
        with atomic.replace_folder(path, hidden=False) as temp:
            tf.io.gfile.makedirs(temp)
            os.kill(os.getpid(), signal.SIGKILL)
        """,
        tmp_path / "export",
    )
    assert len(os.listdir(tmp_path)) == 2
    with atomic.replace_folder(str(tmp_path / "export"), hidden=False) as temp:
        _write_folder(Path(temp), "later")
    assert os.listdir(tmp_path) == ["export"]
    assert _read(tmp_path / "export/contents.txt") == "later"


def test_added_files_join_a_folder_whole_the_markers_last_and_its_files_stay(tmp_path, monkeypatch):
    folder = tmp_path / "ml-1m"
    _write_folder(folder, "the user's own")
    (folder / "ratings.dat").write_text("old ratings")
    with pytest.raises(RuntimeError, match="injected"), atomic.add_files(str(folder)) as temp:
        (Path(temp) / "ratings.dat").write_text("half")
        raise RuntimeError("injected")
    assert os.listdir(tmp_path) == ["ml-1m"] and _read(folder / "ratings.dat") == "old ratings"
    renamed, real_rename = [], tf.io.gfile.rename

    def recording_rename(source, destination, overwrite=False):
        renamed.append(os.path.basename(destination))
        real_rename(source, destination, overwrite)

    monkeypatch.setattr(tf.io.gfile, "rename", recording_rename)
    with atomic.add_files(str(folder), markers=("ratings.dat",)) as temp:
        assert os.path.basename(temp).startswith(f".ml-1m.tmp-{os.getpid()}-")
        for name in ("ratings.dat", "contents.txt", "README"):
            (Path(temp) / name).write_text("new")
        assert sorted(os.listdir(folder)) == ["contents.txt", "ratings.dat"]  # none yet
    assert renamed == ["README", "ratings.dat"]  # the marker last; contents.txt stays
    assert [_read(folder / name) for name in ("contents.txt", "ratings.dat", "README")] == [
        "the user's own",
        "new",
        "new",
    ]
    assert os.listdir(tmp_path) == ["ml-1m"]


@pytest.mark.integration
def test_a_removed_folder_vanishes_at_once_even_if_the_removal_is_killed(tmp_path):
    _write_folder(tmp_path / "10", "version 10")
    _write_folder(tmp_path / "20", "version 20")
    _killed_writer('die_on("rmtree", 1)\natomic.remove_folder(path)', tmp_path / "10")
    names = os.listdir(tmp_path)
    assert "10" not in names and "20" in names and len(names) == 2
    atomic.remove_leftovers(str(tmp_path))
    assert os.listdir(tmp_path) == ["20"]  # finished, never put back


@pytest.mark.integration
def test_files_through_a_gfile_filesystem(dead_pid):
    # TensorFlow's in-memory filesystem stands for gs:// here (its folder renames do not
    # move the files inside, so it takes no folders).
    base = f"ram://atomic_test_{os.getpid()}"
    tf.io.gfile.makedirs(base)
    with tf.io.gfile.GFile(f"{base}/.a.json.tmp-{dead_pid}-0badcafe", "w") as leftover:
        leftover.write("half")
    atomic.write_file(f"{base}/a.json", "1")
    atomic.write_file(f"{base}/a.json", "2")
    assert tf.io.gfile.listdir(base) == ["a.json"]
    with tf.io.gfile.GFile(f"{base}/a.json") as stream:
        assert stream.read() == "2"
