"""`DirectorySource`: events from append-only event files in a folder, tailed (the
package's docstring says what every source does)."""

from __future__ import annotations

import os
import time
import zlib
from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging

from official.utils.misc import atomic
from recommendation.online.sources.dead_letters import DeadLetterFile
from recommendation.online.sources.event_parsing import (
    EVENT_FILE_SUFFIXES,
    EventChunk,
    is_header,
    parse_line,
    plain_csv_events,
    plain_csv_runs,
)

# Bytes before a file's offset whose checksum a `DirectorySource` position keeps.
FINGERPRINT_BYTES = 4096


class DirectorySource:
    """Tails append-only ``*.jsonl`` (one JSON object per line) and ``*.csv``
    (``user,item,timestamp``; a header line is skipped) files in a folder.

    Files are read in name order, each from its remembered byte offset; only complete
    (newline-terminated) lines are read, so a writer may append at any pace. A line
    longer than `read_bytes` is dead-lettered (its start kept) once its end has been
    written, and reading goes on after it.

    The position is ``{"offsets": {file name: offset}, "files": {file name:
    fingerprint}, "dead_letters": count, "rewritten_files": count}``. A file's
    fingerprint recognises the file read to its offset: ``size`` (its bytes when
    read), ``crc32`` (of the `FINGERPRINT_BYTES` before the offset), ``inode`` (local
    files only) and ``version`` (1, then one more each time it was rewritten). A file
    now shorter than its offset, another inode, or changed bytes before the offset
    (checked with each read, from the same read) mean it was rewritten: it is read
    again from its start, with a warning, and counted in `rewritten_files`; its
    events' ids (``<file>:<offset>``, ``<file>#<version>:<offset>`` after a rewrite)
    stay unique, so their dead letters are recorded. A file in the position that is
    no longer in the folder is named once (``"gone"`` in its fingerprint); if it comes
    back, the same checks decide where it is read from.

    Rotation by rename (logrotate's default, ``create``): a file of the position found
    in the folder under another name (any name; by its inode, or on gs://, where a
    rename is a copy, by its size and the checksum before its offset), its own name
    gone or now another file's, is read from its offset to its end under the new name
    (``"renamed"`` in its fingerprint, so a restart goes on with it) before the new file
    of its name, which is then version + 1; one line names both, and `rotated_files`
    counts it. A renamed file that is itself an event file is then known as read to
    its end. Where the file read before is nowhere in the folder, the warning says how
    many bytes after its offset it held when last read (more may have been written).

    Args:
        directory: The folder (local or any tf.io.gfile path).
        dead_letter: Where malformed lines go.
        read_bytes: Most bytes read per file per call, and the longest line read.
    """

    def __init__(
        self, directory: str, dead_letter: DeadLetterFile, read_bytes: int = 1 << 20
    ) -> None:
        self.directory = directory
        self.dead_letter = dead_letter
        self.read_bytes = read_bytes
        self.offsets: dict[str, int] = {}
        # file -> fingerprint (class docstring); replaced, never changed in place, so
        # that the positions handed out keep theirs.
        self.files: dict[str, dict] = {}
        self.dead_letters = 0
        self.rewritten_files = 0
        self.rotated_files = 0
        self.exhausted = False  # a folder can always grow
        # file -> (offset of a long line, bytes of it scanned without finding its end)
        self._long_line_scan: dict[str, tuple[int, int]] = {}
        # file -> (size, inode) as `_note_renamed` found it in this pass, for its read
        # (taken once: a read again after a change looks again)
        self._stats: dict[str, tuple[int, int | None]] = {}

    def restore(self, position: dict | None) -> None:
        """Resumes at `position` (also the positions of earlier versions: bare offsets,
        or offsets without fingerprints)."""
        position = position or {}
        if "offsets" in position:  # no event file is named "offsets": it has no suffix
            self.offsets, self.dead_letters = dict(position["offsets"]), position["dead_letters"]
            self.files = dict(position.get("files", {}))
            self.rewritten_files = position.get("rewritten_files", 0)
            self.rotated_files = position.get("rotated_files", 0)
        else:
            self.offsets, self.dead_letters = dict(position), 0

    def commit(self, position: Any) -> None:
        """Nothing to acknowledge: the offsets in the checkpoint are the commit."""

    def _files(self) -> list[str]:
        if not tf.io.gfile.isdir(self.directory):
            return []
        return sorted(
            name
            for name in tf.io.gfile.listdir(self.directory)
            if name.endswith(EVENT_FILE_SUFFIXES)
        )

    def read(self, max_events: int, timeout: float) -> EventChunk | None:
        deadline = time.monotonic() + timeout
        while True:
            parts, ids = [], []  # (n, 3) arrays of events, and their ids
            names = self._files()
            self._stats.clear()
            self._note_renamed(names)
            self._note_gone(names)
            for name in self._in_order(names):
                # A later file only once this one has no complete line left unread:
                # events go in file order.
                if len(ids) >= max_events or not self._read_file(
                    name, max_events - len(ids), parts, ids
                ):
                    break
            if ids:
                position = {
                    "offsets": dict(self.offsets),
                    "files": dict(self.files),
                    "dead_letters": self.dead_letters,
                    "rewritten_files": self.rewritten_files,
                    "rotated_files": self.rotated_files,
                }
                events = np.concatenate(parts)
                return EventChunk(events[:, 0], events[:, 1], events[:, 2], ids, position)
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(0.05, timeout))

    def _renamed_to(self) -> dict[str, str]:
        """The files being read under a new name: new name -> the name read before."""
        return {seen["renamed"]: name for name, seen in self.files.items() if "renamed" in seen}

    def _in_order(self, names: list[str]) -> list[str]:
        """The files to read, in name order: the listed ones and those being read under
        a new name (by their old one, in its place)."""
        renamed = self._renamed_to()
        return sorted({name for name in names if name not in renamed} | set(renamed.values()))

    def _note_renamed(self, names: list[str]) -> None:
        """Finds each file of the position whose name is gone or now names another file
        (another inode) under its new name (`_find_renamed`), before any file is read:
        so that a new name that is an event file is not read from its start."""
        listed, renamed = set(names), self._renamed_to()
        for name, offset in self.offsets.items():
            seen = self.files.get(name, {})
            if "renamed" in seen or ("inode" not in seen and name in listed):
                continue  # without an inode, only the bytes before the offset tell
            if name in listed:
                try:
                    self._stats[name] = _size_and_inode(os.path.join(self.directory, name))
                except (tf.errors.NotFoundError, FileNotFoundError):
                    continue
                if self._stats[name][1] == seen["inode"]:
                    continue
            elif seen.get("gone"):
                continue
            other = self._find_renamed(name, offset, seen, set(renamed))
            if other is not None:
                self._start_renamed(name, other)
                renamed[other] = name

    def _find_renamed(self, name: str, offset: int, seen: dict, taken: set) -> str | None:
        """The entry of the folder (any name but `name` and those in `taken`) that is
        the file `name` was when read to `offset`: its inode, or where there is none
        (gs://, where a rename is a copy), its size and the bytes before the offset."""
        if "inode" not in seen and "crc32" not in seen:
            return None
        for other in sorted(tf.io.gfile.listdir(self.directory)):
            path = os.path.join(self.directory, other)
            if other == name or other in taken or other.endswith("/"):
                continue
            try:
                length, inode = _size_and_inode(path)
            except (tf.errors.NotFoundError, FileNotFoundError):
                continue
            if "inode" in seen:
                if inode == seen["inode"]:
                    return other
            elif (
                length >= max(offset, seen.get("size", 0))
                and offset
                and (_crc_before(path, offset) == seen["crc32"])
            ):
                return other
        return None

    def _start_renamed(self, name: str, other: str) -> None:
        """Reads file `name` on under its new name `other` (the position keeps it)."""
        self.files[name] = {**self.files.get(name, {}), "renamed": other}
        self.files[name].pop("gone", None)
        logging.warning(
            "events file %s in %s was renamed to %s (rotated): reading the rest of it, from "
            "byte %s, before the new file named %s",
            name,
            self.directory,
            other,
            f"{self.offsets.get(name, 0):,}",
            name,
        )

    def _finish_renamed(self, name: str, length: int, inode: int | None) -> None:
        """File `name`, read under its new name to its end, is done: its name now means
        the new file (version + 1)."""
        other, offset = self.files[name]["renamed"], self.offsets[name]
        self.rotated_files += 1
        version = self.files[name].get("version", 1) + 1
        if other.endswith(EVENT_FILE_SUFFIXES):  # an event file read to its end already
            crc = _crc_before(os.path.join(self.directory, other), offset)
            self.offsets[other] = offset
            self.files[other] = {"size": length, "crc32": crc, "version": 1}
            if inode is not None:
                self.files[other]["inode"] = inode
        self.offsets[name], self.files[name] = 0, {"version": version}
        if not tf.io.gfile.exists(os.path.join(self.directory, name)):
            self.files[name]["gone"] = True  # its new file is yet to come: nothing to say

    def _note_gone(self, names: list[str]) -> None:
        """Names once each file of the position that is no longer in the folder."""
        listed = set(names)
        for name, offset in self.offsets.items():
            seen = self.files.get(name, {})
            if "renamed" in seen:
                continue
            if name in listed and seen.get("gone"):
                self.files[name] = {key: value for key, value in seen.items() if key != "gone"}
            elif name not in listed and not seen.get("gone"):
                self.files[name] = {**seen, "gone": True}
                logging.warning(
                    "events file %s, read to byte %s, is no longer in %s: if it comes back, "
                    "it is read on from there, or from its start if it was rewritten",
                    name,
                    f"{offset:,}",
                    self.directory,
                )

    def _read_file(self, name: str, limit: int, parts: list, ids: list) -> bool:
        """Reads up to `limit` events of file `name` into `parts` (and their ids);
        returns whether every complete line written to it so far is read."""
        offset, seen = self.offsets.get(name, 0), self.files.get(name, {})
        entry = seen.get("renamed", name)
        path = os.path.join(self.directory, entry)
        try:
            length, inode = self._stats.pop(entry, None) or _size_and_inode(path)
        except (tf.errors.NotFoundError, FileNotFoundError):
            if "renamed" not in seen:
                return True  # removed since listed
            length, inode = None, None  # renamed once more, or removed
        change = None
        if length is None:
            change = f"its new name {seen['renamed']} is gone"
        elif offset > length:
            change = f"now {length:,} bytes, shorter than the {offset:,} read"
        elif inode is not None and seen.get("inode", inode) != inode:
            change = f"another file: inode {seen['inode']}, now {inode}"
        if change:
            self._renamed_or_rewritten(name, offset, seen, change)
            return self._read_file(name, limit, parts, ids)
        if length == offset and length >= seen.get("size", 0):
            if "renamed" in seen:  # read to its end under its new name
                self._finish_renamed(name, length, inode)
                return self._read_file(name, limit, parts, ids)
            return True  # nothing new, and not shortened
        start = max(0, offset - FINGERPRINT_BYTES)
        with tf.io.gfile.GFile(path, "rb") as stream:
            stream.seek(start)
            data = stream.read(offset - start + self.read_bytes)
            before, block = data[: offset - start], data[offset - start :]
            if "crc32" in seen and zlib.crc32(before) != seen["crc32"]:
                change = f"its bytes before byte {offset:,} changed"
                self._renamed_or_rewritten(name, offset, seen, change)
                return self._read_file(name, limit, parts, ids)
            end = block.rfind(b"\n") + 1  # complete lines only
            if not end and len(block) == self.read_bytes:
                self._skip_long_line(name, offset, block, stream, length, inode)
                # (a long line not written to its end yet is no complete line)
                return name in self._long_line_scan or self.offsets[name] >= length
        first, count = offset, len(ids)
        offset = self._take_lines(name, offset, block[:end], limit, parts, ids)
        self._remember(name, offset, before + block[: offset - first], length, inode)
        # Read to the block's last complete line, and the block reached the file's end.
        done = offset == first + end and first + len(block) >= length
        if done and "renamed" in seen:
            self._finish_renamed(name, length, inode)
            return self._read_file(name, limit - (len(ids) - count), parts, ids)
        return done

    def _take_lines(
        self, name: str, offset: int, lines: bytes, limit: int, parts: list, ids: list
    ) -> int:
        """Parses up to `limit` events of `lines`, complete lines from byte `offset` of
        file `name`, into `parts` (`(n, 3)` arrays) and `ids`, dead-lettering the
        malformed ones; returns the offset after the last line taken. Runs of plain
        CSV lines are converted at once (`plain_csv_runs`), the others one at a time;
        lines are looked at as far as the events still wanted reach."""
        wanted, done = len(ids) + limit, 0  # bytes of `lines` taken
        line_ends = np.flatnonzero(np.frombuffer(lines, np.uint8) == ord("\n")) + 1
        while len(ids) < wanted and done < len(lines):
            first = np.searchsorted(line_ends, done, side="right")
            window = int(line_ends[min(first + wanted - len(ids), len(line_ends)) - 1])
            runs = plain_csv_runs(lines[done:window]) if name.endswith(".csv") else []
            for start, end in [(done + a, done + b) for a, b in runs] + [(window, window)]:
                if start > done:
                    done += self._take_one_at_a_time(
                        name, offset + done, lines[done:start], wanted - len(ids), parts, ids
                    )
                if len(ids) == wanted or done < start:
                    return offset + done
                if end > start:
                    events, ends = plain_csv_events(lines[start:end], wanted - len(ids))
                    parts.append(events)
                    starts = offset + start + np.concatenate([[0], ends[:-1]])
                    ids.extend(f"{self._id_prefix(name)}:{line}" for line in starts.tolist())
                    done = start + int(ends[-1])
        return offset + done

    def _take_one_at_a_time(
        self, name: str, offset: int, lines: bytes, limit: int, parts: list, ids: list
    ) -> int:
        """`_take_lines` for lines parsed one at a time (`parse_line`): a header, blank
        lines, JSON, what is not plain; returns the bytes taken."""
        id_prefix, is_csv, first = self._id_prefix(name), name.endswith(".csv"), offset
        events = []
        for line in lines.splitlines(keepends=True):
            if len(events) == limit:
                break
            line_id = f"{id_prefix}:{offset}"
            first_csv_line = offset == 0 and is_csv
            offset += len(line)
            text = line.strip()
            if not text or (first_csv_line and is_header(text)):
                continue
            try:
                events.append(parse_line(text, is_csv))
            except ValueError as error:
                self._dead_letter(line_id, text, str(error))
                continue
            ids.append(line_id)
        parts.append(np.array(events, dtype=np.int64).reshape(-1, 3))
        return offset - first

    def _id_prefix(self, name: str) -> str:
        """What the source ids of file `name`'s lines start with (its version's)."""
        version = self.files.get(name, {}).get("version", 1)
        return name if version == 1 else f"{name}#{version}"

    def _renamed_or_rewritten(self, name: str, offset: int, seen: dict, change: str) -> None:
        """File `name`, read to `offset` (`seen`: its fingerprint), is not what its name
        holds now (`change` says how): read on under its new name if it has one in the
        folder (renamed, once more if it was already), or else from its new start."""
        other = self._find_renamed(name, offset, seen, set(self._renamed_to()))
        if other is not None:
            self._start_renamed(name, other)
        else:
            self._read_again(name, change, seen)

    def _read_again(self, name: str, change: str, seen: dict) -> None:
        """Starts file `name` over from its start: it was rewritten (`change` says how);
        `seen`: its fingerprint before."""
        self.rewritten_files += 1
        offset, version = self.offsets.get(name, 0), seen.get("version", 1) + 1
        self.offsets[name], self.files[name] = 0, {"version": version}
        self._long_line_scan.pop(name, None)
        lost = ""
        if change.startswith("another file") or "renamed" in seen:
            unread = max(0, seen.get("size", offset) - offset)
            lost = (
                f"; the file read before is nowhere in the folder: its {unread:,} bytes "
                f"after byte {offset:,} when last read, and any written since, are unread"
            )
        logging.warning(
            "events file %s in %s was rewritten (%s): reading it again from its start, as "
            "version %d of it (%d rewritten files in all)%s",
            name,
            self.directory,
            change,
            version,
            self.rewritten_files,
            lost,
        )

    def _remember(
        self, name: str, offset: int, read: bytes, length: int, inode: int | None
    ) -> None:
        """Sets file `name`'s offset and fingerprint; `read` ends at the offset."""
        fingerprint = {
            "size": length,
            "crc32": zlib.crc32(read[len(read) - min(offset, FINGERPRINT_BYTES) :]),
            "version": self.files.get(name, {}).get("version", 1),
        }
        if inode is not None:
            fingerprint["inode"] = inode
        if "renamed" in self.files.get(name, {}):  # read on under its new name
            fingerprint["renamed"] = self.files[name]["renamed"]
        self.offsets[name], self.files[name] = offset, fingerprint

    def _skip_long_line(
        self, name: str, offset: int, start: bytes, stream, length: int, inode: int | None
    ) -> None:
        """Dead-letters the line at `offset`, longer than `read_bytes`, and moves past
        it once its end is in the file; until then, remembers how far it was scanned."""
        scanned = len(start)
        if self._long_line_scan.get(name, (None, 0))[0] == offset:
            scanned = self._long_line_scan[name][1]
        stream.seek(offset + scanned)
        while True:
            block = stream.read(self.read_bytes)
            if not block:
                self._long_line_scan[name] = (offset, scanned)
                return  # its end is not written yet
            newline = block.find(b"\n")
            if newline >= 0:
                break
            scanned += len(block)
        end = offset + scanned + newline + 1
        self._long_line_scan.pop(name, None)
        reason = f"line of {end - offset:,} bytes, longer than the {self.read_bytes:,} read at once"
        self._dead_letter(f"{self._id_prefix(name)}:{offset}", start, reason)
        stream.seek(max(0, end - FINGERPRINT_BYTES))
        self._remember(name, end, stream.read(min(end, FINGERPRINT_BYTES)), max(length, end), inode)

    def _dead_letter(self, line_id: str, text: bytes, error: str) -> None:
        self.dead_letter.add(line_id, text, error)
        self.dead_letters += 1

    def close(self) -> None:
        """Nothing to release."""


def _crc_before(path: str, offset: int) -> int:
    """The checksum of file `path`'s `FINGERPRINT_BYTES` before byte `offset`."""
    start = max(0, offset - FINGERPRINT_BYTES)
    with tf.io.gfile.GFile(path, "rb") as stream:
        stream.seek(start)
        return zlib.crc32(stream.read(offset - start))


def _size_and_inode(path: str) -> tuple[int, int | None]:
    """A file's length, and its inode where the file system has one (a local path)."""
    length = tf.io.gfile.stat(path).length
    return length, os.stat(path).st_ino if atomic.is_local(path) else None
