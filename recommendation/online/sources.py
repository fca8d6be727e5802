"""Event sources for online training: Python iterables, tailed event files, Redis Streams.

Each source hands out (user, item, timestamp) events in chunks (`EventChunk`) and says
where it stands after each chunk (`position`, JSON-able). The trainer stores the
position of the last trained chunk in its checkpoint, gives it back with `restore`
after a restart, and calls `commit` with it once that checkpoint is durable. What
that buys:

- `IterableSource`: a re-iterable collection resumes after the events trained.
- `DirectorySource`: append-only ``*.jsonl`` / ``*.csv`` files in a folder, read in
  name order and tailed as they grow; the byte offsets are the position, so a restart
  resumes exactly after the last checkpointed event.
- `RedisSource`: a Redis stream read through a consumer group (``XREADGROUP``). Entries
  are acknowledged (``XACK``) only by `commit`, so whatever was delivered but not in a
  durable checkpoint stays pending and is delivered again after a crash: at least
  once, nothing lost. Pending entries at or before the checkpointed id (trained and
  checkpointed, but not yet acknowledged when the trainer died) are acknowledged
  without training them twice. Connection failures are retried with back-off.

Malformed events (bad JSON, missing fields, non-integer ids) never stop training:
they go to a dead-letter sink (a JSON-lines file, or a Redis stream) and are counted
in `dead_letters`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import redis
import tensorflow as tf
from absl import logging

FIELDS = ("user", "item", "timestamp")
# Events whose payload is one JSON object carry it in this Redis field.
JSON_FIELD = "json"


@dataclasses.dataclass
class EventChunk:
    """Events read in one call, and where the source stands after them.

    Attributes:
        users, items, timestamps: `(n,)` int64 arrays of the well-formed events.
        ids: Source ids of those events (stream ids, ``file:offset``, ordinals).
        position: JSON-able source position just after the chunk.
    """

    users: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray
    ids: list
    position: Any

    def __len__(self) -> int:
        return len(self.users)


def _chunk(events: list[tuple[int, int, int]], ids: list, position: Any) -> EventChunk:
    columns = np.array(events, dtype=np.int64).reshape(-1, 3)
    return EventChunk(columns[:, 0], columns[:, 1], columns[:, 2], ids, position)


def parse_event(record: Any) -> tuple[int, int, int]:
    """(user, item, timestamp) from a mapping or a JSON object text.

    Raises:
        ValueError: Saying what is wrong (bad JSON, a missing field, a non-integer).
    """
    if isinstance(record, (str, bytes)):
        try:
            record = json.loads(record)
        except json.JSONDecodeError as error:
            raise ValueError(f"bad JSON: {error}") from None
    if not isinstance(record, dict):
        raise ValueError(f"an event must be an object with {FIELDS}, got {type(record).__name__}")
    values = []
    for field in FIELDS:
        if field not in record:
            raise ValueError(f"missing field {field!r}")
        values.append(_to_int(record[field], field))
    return tuple(values)


def _to_int(value: Any, field: str) -> int:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{field} must be an integer, got {value!r}") from None


class DeadLetterFile:
    """Appends malformed events to a JSON-lines file, one object per event."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.count = 0

    def add(self, source_id: str, payload: Any, error: str) -> None:
        """Records one malformed event."""
        if self.count == 0:
            tf.io.gfile.makedirs(os.path.dirname(self.path) or ".")
        record = {"id": source_id, "error": error, "payload": _printable(payload)}
        with tf.io.gfile.GFile(self.path, "a") as out:
            out.write(json.dumps(record) + "\n")
        self.count += 1
        logging.log_every_n(logging.WARNING, "dead letter %s: %s", 100, source_id, error)


def _printable(payload: Any) -> Any:
    if isinstance(payload, bytes):
        return payload.decode("utf-8", "replace")
    if isinstance(payload, dict):
        return {_printable(k): _printable(v) for k, v in payload.items()}
    return payload


class IterableSource:
    """Events from a Python iterable of ``(user, item, timestamp)`` tuples or dicts.

    The position is the number of events consumed; after `restore`, a re-iterable
    collection (list, array) skips that many. Malformed ones go to `dead_letter`.
    """

    def __init__(self, events: Iterable, dead_letter: DeadLetterFile | None = None) -> None:
        self._events = events
        self._iterator: Iterator | None = None
        self.consumed = 0
        self.exhausted = False
        self.dead_letter = dead_letter

    @property
    def dead_letters(self) -> int:
        return self.dead_letter.count if self.dead_letter else 0

    def restore(self, position: int | None) -> None:
        self.consumed = int(position or 0)
        self._iterator = None

    def commit(self, position: Any) -> None:
        """Nothing to acknowledge: the position in the checkpoint is the commit."""

    def read(self, max_events: int, timeout: float) -> EventChunk | None:
        if self._iterator is None:
            self._iterator = iter(self._events)
            for _ in range(self.consumed):
                next(self._iterator, None)
        events, ids = [], []
        while len(events) < max_events:
            try:
                record = next(self._iterator)
            except StopIteration:
                self.exhausted = True
                break
            self.consumed += 1
            try:
                event = parse_event(record if isinstance(record, dict) else _as_record(record))
            except (ValueError, TypeError) as error:
                if self.dead_letter is None:
                    raise
                self.dead_letter.add(str(self.consumed - 1), record, str(error))
                continue
            events.append(event)
            ids.append(self.consumed - 1)
        return _chunk(events, ids, self.consumed) if events or not self.exhausted else None

    def close(self) -> None:
        """Nothing to release."""


class DirectorySource:
    """Tails append-only ``*.jsonl`` (one JSON object per line) and ``*.csv``
    (``user,item,timestamp``; a header line is skipped) files in a folder.

    Files are read in name order, each from its remembered byte offset; only complete
    (newline-terminated) lines are read, so a writer may append at any pace. The
    position maps file names to offsets.

    Args:
        directory: The folder (local or any tf.io.gfile path).
        dead_letter: Where malformed lines go.
        read_bytes: Most bytes read per file per call.
    """

    def __init__(
        self, directory: str, dead_letter: DeadLetterFile, read_bytes: int = 1 << 20
    ) -> None:
        self.directory = directory
        self.dead_letter = dead_letter
        self.read_bytes = read_bytes
        self.offsets: dict[str, int] = {}
        self.exhausted = False  # a folder can always grow

    @property
    def dead_letters(self) -> int:
        return self.dead_letter.count

    def restore(self, position: dict | None) -> None:
        self.offsets = dict(position or {})

    def commit(self, position: Any) -> None:
        """Nothing to acknowledge: the offsets in the checkpoint are the commit."""

    def _files(self) -> list[str]:
        if not tf.io.gfile.isdir(self.directory):
            return []
        return sorted(
            name
            for name in tf.io.gfile.listdir(self.directory)
            if name.endswith((".jsonl", ".csv"))
        )

    def read(self, max_events: int, timeout: float) -> EventChunk | None:
        deadline = time.monotonic() + timeout
        while True:
            events, ids = [], []
            for name in self._files():
                if len(events) >= max_events:
                    break
                self._read_file(name, max_events - len(events), events, ids)
            if events:
                return _chunk(events, ids, dict(self.offsets))
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(0.05, timeout))

    def _read_file(self, name: str, limit: int, events: list, ids: list) -> None:
        path = os.path.join(self.directory, name)
        offset = self.offsets.get(name, 0)
        if tf.io.gfile.stat(path).length <= offset:
            return
        with tf.io.gfile.GFile(path, "rb") as stream:
            stream.seek(offset)
            block = stream.read(self.read_bytes)
        end = block.rfind(b"\n") + 1  # complete lines only
        for line in block[:end].splitlines(keepends=True)[:limit]:
            line_id = f"{name}:{offset}"
            offset += len(line)
            text = line.strip()
            if not text or (name.endswith(".csv") and line_id.endswith(":0") and _is_header(text)):
                continue
            try:
                events.append(_parse_line(text, name.endswith(".csv")))
            except ValueError as error:
                self.dead_letter.add(line_id, text, str(error))
                continue
            ids.append(line_id)
        self.offsets[name] = offset

    def close(self) -> None:
        """Nothing to release."""


def _is_header(text: bytes) -> bool:
    return text.split(b",")[0].strip().lower() in (b"user", b"userid", b"user_id")


def _parse_line(text: bytes, is_csv: bool) -> tuple[int, int, int]:
    if not is_csv:
        return parse_event(text)
    return parse_event(_as_record(text.split(b",")))


def _stream_id(value: str | bytes) -> tuple[int, int]:
    text = value.decode() if isinstance(value, bytes) else value
    milliseconds, _, sequence = text.partition("-")
    return int(milliseconds), int(sequence or 0)


class RedisSource:
    """Events from a Redis stream through a consumer group, acknowledged on commit.

    Entries hold ``user``, ``item`` and ``timestamp`` fields, or one ``json`` field
    with an object of them. The position is the last entry id read. Malformed entries
    are copied to the `dead_letter_stream` (with their id and the error) and
    acknowledged with the rest.

    Args:
        client: A ``redis.Redis`` client (``redis.Redis.from_url(...)``).
        stream, group, consumer: Stream key, consumer group and this consumer's name
            (keep it across restarts: its pending entries are re-read at start).
        dead_letter_stream: Stream receiving malformed entries.
        max_backoff: Longest wait between reconnection attempts, seconds.
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str = "trainer",
        consumer: str = "trainer-0",
        dead_letter_stream: str | None = None,
        max_backoff: float = 2.0,
    ) -> None:
        # A client of its own on the same connections, whose XREADGROUP replies stay
        # raw lists: redis-py's per-entry dicts cost more than training on them.
        self.client = redis.Redis(connection_pool=client.connection_pool)
        self.client.set_response_callback("XREADGROUP", lambda reply, **options: reply)
        self.stream, self.group, self.consumer = stream, group, consumer
        self.dead_letter_stream = dead_letter_stream or f"{stream}:dead"
        self.max_backoff = max_backoff
        self.dead_letters = 0
        self.reconnects = 0
        self.exhausted = False  # a stream never ends
        self._after: tuple[int, int] | None = None
        self._pending_cursor: str | bytes | None = "0"
        self._last_read: str | None = None
        self._delivered: collections.deque = collections.deque()
        self._group_ready = False
        self._backoff = 0.0

    def restore(self, position: str | None) -> None:
        self._after = _stream_id(position) if position else None
        self._pending_cursor = "0"

    def read(self, max_events: int, timeout: float) -> EventChunk | None:
        try:
            self._ensure_group()
            entries = self._read_entries(max_events, timeout)
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as error:
            self._wait_to_reconnect(error)
            return None
        self._backoff = 0.0
        if not entries:
            return None
        return self._parse(entries)

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._group_ready = True

    def _read_entries(self, max_events: int, timeout: float) -> list:
        while self._pending_cursor is not None:
            # Delivered to this consumer before a restart and never acknowledged;
            # the cursor walks the pending list once.
            reply = self.client.xreadgroup(
                self.group, self.consumer, {self.stream: self._pending_cursor}, count=max_events
            )
            entries = self._entries(reply)
            if not entries:
                self._pending_cursor = None
                break
            self._pending_cursor = entries[-1][0]
            entries = self._skip_checkpointed(entries)
            if entries:
                return entries
        reply = self.client.xreadgroup(
            self.group,
            self.consumer,
            {self.stream: ">"},
            count=max_events,
            block=max(1, int(timeout * 1000)),
        )
        return self._entries(reply)

    def _entries(self, reply) -> list:
        """``[(id, [field, value, ...]), ...]`` of a raw XREADGROUP reply (a list of
        [stream, entries] pairs, or with some parsers a mapping)."""
        if not reply:
            return []
        return reply[self.stream.encode()] if isinstance(reply, dict) else reply[0][1]

    def _skip_checkpointed(self, entries: list) -> list:
        """Pending entries at or before the restored position were trained and
        checkpointed already: acknowledge them instead of training them twice."""
        if self._after is None:
            return entries
        done = [entry_id for entry_id, _ in entries if _stream_id(entry_id) <= self._after]
        if done:
            self.client.xack(self.stream, self.group, *done)
        return entries[len(done) :]

    def _wait_to_reconnect(self, error: Exception) -> None:
        self._backoff = min(self.max_backoff, max(0.05, self._backoff * 2))
        self.reconnects += 1
        self._group_ready = False
        # A read cut off mid-reply may have delivered entries (Redis put them in our
        # pending list) that never arrived: walk the pending list again from after
        # the last entry that did arrive.
        self._pending_cursor = self._last_read or "0"
        logging.warning("redis unavailable (%s); retrying in %.2f s", error, self._backoff)
        time.sleep(self._backoff)

    def _parse(self, entries: list) -> EventChunk:
        ids = [entry_id.decode() for entry_id, _ in entries]
        self._delivered.extend(ids)
        position = self._last_read = ids[-1]
        try:  # the common case, vectorised: user, item, timestamp fields in that order
            table = np.array([fields for _, fields in entries])
            if table.ndim == 2 and table.shape[1] == 6 and _has_plain_fields(table):
                values = table[:, 1::2].astype(np.int64)
                return EventChunk(values[:, 0], values[:, 1], values[:, 2], ids, position)
        except (ValueError, TypeError):
            pass  # uneven, missing or non-integer fields: one by one below
        events, good_ids = [], []
        for entry_id, (_, flat) in zip(ids, entries, strict=True):
            fields = dict(zip(flat[::2], flat[1::2], strict=True)) if flat else {}
            try:
                if not fields:
                    raise ValueError("the entry was deleted from the stream")
                record = fields.get(JSON_FIELD.encode())
                events.append(parse_event(record if record is not None else _decode(fields)))
                good_ids.append(entry_id)
            except ValueError as error:
                self._dead_letter(entry_id, fields, str(error))
        return _chunk(events, good_ids, position)

    def _dead_letter(self, entry_id, fields: dict | None, error: str) -> None:
        payload = json.dumps(_printable(fields or {}))
        self.client.xadd(
            self.dead_letter_stream,
            {"id": entry_id, "error": error, "payload": payload},
        )
        self.dead_letters += 1
        logging.log_every_n(logging.WARNING, "dead letter %s: %s", 100, entry_id, error)

    def commit(self, position: str | None) -> None:
        """Acknowledges every delivered entry up to `position` (the checkpointed one)."""
        if not position:
            return
        last = _stream_id(position)
        done = []
        while self._delivered and _stream_id(self._delivered[0]) <= last:
            done.append(self._delivered.popleft())
        try:
            for start in range(0, len(done), 10000):
                self.client.xack(self.stream, self.group, *done[start : start + 10000])
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as error:
            # Acknowledged with the next commit; until then they stay pending (and
            # are skipped by id after a restart), so nothing is lost.
            logging.warning("redis unavailable for XACK (%s); retried at the next commit", error)
            self._delivered.extendleft(reversed(done))

    def close(self) -> None:
        self.client.close()


def _as_record(values) -> dict:
    values = tuple(values)
    if len(values) != len(FIELDS):
        raise ValueError(f"expected (user, item, timestamp), got {values!r}")
    return dict(zip(FIELDS, values, strict=True))


def _has_plain_fields(table: np.ndarray) -> bool:
    return all(
        bool(np.all(table[:, 2 * index] == name.encode())) for index, name in enumerate(FIELDS)
    )


def _decode(fields: dict) -> dict:
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in fields.items()}
