"""Atomic writes of files and folders through `tf.io.gfile` (local paths and ``gs://``).

A reader sees a file or a folder whole or not at all: it is written under a temporary
name beside its destination and renamed into place only once complete. Every
temporary name follows one scheme, ``[.]<name>.<kind>-<pid>-<token>`` (hidden, with
the dot, for files and for folders unless asked otherwise):

- kind ``tmp``: being written (files for a folder, `add_files`, too), or being
  deleted (`remove_folder`);
- kind ``old``: a folder that `replace_folder` moved aside to make room for its new
  contents, until those are in place.

The pid names the writer, so what a killed writer left is attributed to it: once its
process is gone, the next writer of the same destination (or `remove_leftovers`)
deletes its temporaries and puts a folder it moved aside back if nothing took its
place; what a running writer holds is left alone. Liveness is judged on this host: a
writer on another host sharing a ``gs://`` folder counts as dead unless its pid runs
here too.

On ``gs://`` a rename is a copy and a delete: a file still appears whole (one object),
a folder does not (its objects are copied one by one, in name order), so readers of a
folder there trust a marker file written last rather than the folder's presence.
`replace_folder` and `remove_folder` take the names of a folder's markers: on a local
path they change nothing (the rename is atomic; markers travel with the folder); on
``gs://`` the markers are held back and written last, once every other file is in
place, and removed first when a folder is replaced or removed. `add_files`, which adds
files to a folder one rename each, renames its markers last wherever it writes.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence

import tensorflow as tf
from absl import logging

_TEMP, _ASIDE = "tmp", "old"
_LEFTOVER = re.compile(r"(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]+")

# Temporary paths this process is using now: its own pid is running, but a leftover
# under it is stale (a process before it had the same pid) unless listed here.
_in_use: set[str] = set()
_in_use_lock = threading.Lock()


def is_local(path: str) -> bool:
    """Whether `path` is on this machine's file system (no ``scheme://``): there a
    rename is atomic and plain `open` works; on ``gs://`` neither holds."""
    return "://" not in path


def write_file(path: str, data: bytes | str, durable: bool = False) -> None:
    """Writes `data` (str as UTF-8) to `path`, replacing it atomically; `durable`: on
    disk (a local file flushed before its rename, and the folder after it) on return.

    Raises:
        tf.errors.OpError, OSError: The write failed; `path` is as it was and no
            temporary file is left.
    """
    write_files({path: data}, durable)


def write_files(contents: Mapping[str, bytes | str], durable: bool = False) -> None:
    """Writes several files that belong together (path -> data, str as UTF-8); with
    `durable`, local ones are on disk when it returns (as `write_file`).

    Every file is written to its temporary name before any is renamed into place, so
    a failure while writing (a full disk) leaves all of them as they were; the renames
    follow in order. A dead writer's temporaries of these paths are removed first.

    Raises:
        tf.errors.OpError, OSError: A write or rename failed; no temporary file is left.
    """
    temps = {path: _temp_path(path, _TEMP, hidden=True) for path in contents}
    with _using(*temps.values()):
        try:
            for path in contents:
                remove_leftovers(os.path.dirname(path) or ".", os.path.basename(path))
            for path, data in contents.items():
                with tf.io.gfile.GFile(temps[path], "wb") as out:
                    out.write(data.encode() if isinstance(data, str) else data)
                if durable and is_local(path):
                    flush(temps[path])
            for path, temp in temps.items():
                tf.io.gfile.rename(temp, path, overwrite=True)
                if durable and is_local(path):
                    flush(os.path.dirname(path) or ".")
        finally:
            for temp in temps.values():
                if tf.io.gfile.exists(temp):
                    tf.io.gfile.remove(temp)


@contextlib.contextmanager
def replace_folder(path: str, hidden: bool = True, markers: Sequence[str] = ()) -> Iterator[str]:
    """Yields a temporary folder (not yet created) to write `path`'s new contents into;
    when the block ends normally it takes the place of `path`.

    An existing `path` is moved aside, replaced and then deleted; if the replacement
    fails it is put back, and if the process dies between the two renames the next
    writer puts it back. An exception in the block leaves `path` as it was and deletes
    the temporary folder. A dead writer's leftovers of `path` are cleaned up first.

    On ``gs://`` a rename is a copy object by object, so `path` can be seen partial
    whatever is done, and nothing is moved aside (a folder put back would be no more
    trustworthy than a partial one). There the `markers` the block wrote are held back
    and written last, in order (each one object, whole); an existing `path` loses its
    markers (last one first) before it is deleted and the new contents copied in, so
    a reader that trusts the markers never trusts a partial folder.

    Args:
        path: The destination folder.
        hidden: Temporary names start with a dot: for a folder others list (an export
            base that servers poll), not for one beside a folder the user named, where
            a leftover should be seen.
        markers: Names (relative to the folder) of files whose presence tells readers
            that the folder is complete, in the order they are to be written.
    """
    path = path.rstrip("/")
    remove_leftovers(os.path.dirname(path) or ".", os.path.basename(path), hidden)
    temp = _temp_path(path, _TEMP, hidden)
    with _using(temp):
        try:
            yield temp
            if not is_local(path):
                _replace_in_object_store(temp, path, markers)
            elif tf.io.gfile.exists(path):
                aside = _temp_path(path, _ASIDE, hidden)
                with _using(aside):
                    tf.io.gfile.rename(path, aside)
                    try:
                        tf.io.gfile.rename(temp, path)
                    finally:
                        _settle_aside(aside, path)
            else:
                tf.io.gfile.rename(temp, path)
        finally:
            if tf.io.gfile.exists(temp):
                tf.io.gfile.rmtree(temp)


@contextlib.contextmanager
def add_files(path: str, markers: Sequence[str] = ()) -> Iterator[str]:
    """Yields a temporary folder (created) to write new files for folder `path` into;
    when the block ends normally they join `path` (created if missing), each renamed
    into place, whole; the `markers` last, in order.

    Unlike `replace_folder`, the files already in `path` stay: a name it holds keeps
    its file, except a marker, which is replaced. An exception in the block leaves
    `path` as it was; a writer that dies while renaming leaves some files in place but
    never a marker before them, so a reader that trusts the markers never trusts a
    folder missing files (on ``gs://`` too: a file's rename there copies one object).
    The temporary folder is deleted at the end, or by the next writer of `path` once
    its writer is gone.

    Args:
        path: The destination folder.
        markers: Names of files directly in it whose presence tells readers that it is
            complete, in the order they are to be written.
    """
    path = path.rstrip("/")
    remove_leftovers(os.path.dirname(path) or ".", os.path.basename(path))
    temp = _temp_path(path, _TEMP, hidden=True)
    with _using(temp):
        try:
            tf.io.gfile.makedirs(temp)
            yield temp
            names = [name.rstrip("/") for name in tf.io.gfile.listdir(temp)]
            last = [name for name in markers if name in names]
            tf.io.gfile.makedirs(path)
            for name in [name for name in names if name not in markers] + last:
                destination = os.path.join(path, name)
                if name in markers or not tf.io.gfile.exists(destination):
                    tf.io.gfile.rename(os.path.join(temp, name), destination, overwrite=True)
        finally:
            if tf.io.gfile.exists(temp):
                tf.io.gfile.rmtree(temp)


def remove_folder(path: str, hidden: bool = True, markers: Sequence[str] = ()) -> None:
    """Deletes folder `path` so that it vanishes at once: it is renamed to a temporary
    name first (a listing never shows it half-deleted), then deleted; a writer that
    dies in between leaves a temporary for the next one to remove.

    On ``gs://``, where that rename would be a copy, no more atomic than the delete,
    its `markers` (`replace_folder`) are removed first, last one first, so readers
    stop trusting it at once, and then the folder is deleted in place.
    """
    path = path.rstrip("/")
    if not is_local(path):
        _remove_markers(path, markers)
        _rmtree_if_there(path)
        return
    doomed = _temp_path(path, _TEMP, hidden)
    with _using(doomed):
        tf.io.gfile.rename(path, doomed)
        tf.io.gfile.rmtree(doomed)


def remove_leftovers(folder: str, name: str | None = None, hidden: bool = True) -> None:
    """Cleans up what writers that no longer run left in `folder` (for destination
    `name` only, if given): their temporaries are deleted, and a folder moved aside is
    put back if nothing took its place (else deleted).

    Args:
        folder: Where to look.
        name: Only leftovers of this destination; None: all of them.
        hidden: Which names to look for (`replace_folder`'s flag; files are hidden).
    """
    if not tf.io.gfile.isdir(folder):
        return
    prefix = "." if hidden else ""
    for entry in tf.io.gfile.listdir(folder):
        entry = entry.rstrip("/")  # gs:// lists folders with a slash
        match = _LEFTOVER.fullmatch(entry[len(prefix) :]) if entry.startswith(prefix) else None
        if match is None or (name is not None and match["name"] != name):
            continue
        path = os.path.join(folder, entry)
        if _writer_running(int(match["pid"]), path):
            continue
        if match["kind"] == _ASIDE:
            _settle_aside(path, os.path.join(folder, match["name"]))
        else:
            logging.info("Removing %s, left by an interrupted write", path)
            _delete(path)


def _replace_in_object_store(temp: str, path: str, markers: Sequence[str]) -> None:
    """`replace_folder` on gs://: old markers off, old folder deleted, new contents
    copied in, new markers written last."""
    held = _hold_back(temp, markers)
    _remove_markers(path, markers)
    _rmtree_if_there(path)
    # overwrite: TensorFlow's GCS client caches that a folder exists (for seconds) and
    # would refuse the rename onto the one just deleted.
    tf.io.gfile.rename(temp, path, overwrite=True)
    for name, data in held.items():
        write_file(os.path.join(path, name), data)


def flush(path: str) -> None:
    """Flushes a local file or folder (its entries) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _rmtree_if_there(path: str) -> None:
    """Deletes folder `path` if it still exists (a folder of markers only vanished
    with them; a cached answer may still say it exists)."""
    try:
        tf.io.gfile.rmtree(path)
    except tf.errors.NotFoundError:
        pass


def _hold_back(folder: str, markers: Sequence[str]) -> dict[str, bytes]:
    """Takes the `markers` present in `folder` out of it; returns their contents."""
    held = {}
    for name in markers:
        marker = os.path.join(folder, name)
        if tf.io.gfile.exists(marker):
            with tf.io.gfile.GFile(marker, "rb") as stream:
                held[name] = stream.read()
            tf.io.gfile.remove(marker)
    return held


def _remove_markers(folder: str, markers: Sequence[str]) -> None:
    for name in reversed(list(markers)):
        marker = os.path.join(folder, name)
        if tf.io.gfile.exists(marker):
            tf.io.gfile.remove(marker)


def _temp_path(path: str, kind: str, hidden: bool) -> str:
    folder, name = os.path.split(path)
    prefix = "." if hidden else ""
    return os.path.join(folder, f"{prefix}{name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def _using(*paths: str) -> Iterator[None]:
    """Marks `paths` as this process's work in progress while the block runs."""
    with _in_use_lock:
        _in_use.update(paths)
    try:
        yield
    finally:
        with _in_use_lock:
            _in_use.difference_update(paths)


def _settle_aside(aside: str, path: str) -> None:
    """Puts the folder moved aside back if nothing took its place, else deletes it."""
    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(aside)
    else:
        logging.info("Restoring %s, moved aside by an interrupted write", path)
        tf.io.gfile.rename(aside, path)


def _delete(path: str) -> None:
    if tf.io.gfile.isdir(path):
        tf.io.gfile.rmtree(path)
    else:
        tf.io.gfile.remove(path)


def _writer_running(pid: int, path: str) -> bool:
    """Whether the writer that left `path` still runs on this host."""
    if pid == os.getpid():
        with _in_use_lock:
            return path in _in_use
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
