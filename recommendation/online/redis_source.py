"""`RedisSource`: events from a Redis stream through a consumer group (``XREADGROUP``),
acknowledged (``XACK``) only once a durable checkpoint holds them (`sources` says what
every source does, and what acknowledging on commit buys).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import re
import time

import numpy as np
import redis
from absl import logging

from recommendation.online import group_claim, redis_connection
from recommendation.online.dead_letters import payload_text
from recommendation.online.event_parsing import EventChunk, parse_event

# Events whose payload is one JSON object carry it in this Redis field.
JSON_FIELD = "json"

# Every command a `RedisSource` sends (and the PING that checks the connection first),
# as ACL rules name them: what a Redis ACL user of the trainer must be allowed.
COMMANDS = (
    "ping",
    "xgroup|create",
    "xreadgroup",
    "xack",
    "xinfo|groups",
    "xinfo|stream",
    "xrange",
    "xpending",
    "xadd",
    "multi",
    "exec",
)

# Connection failures that retrying heals (a server restarting, a network gone for a
# while); a refused password is none (`RedisSource`).
_RECONNECTABLE = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


# A reply's values joined by commas (and one after the last) when each is plain.
_PLAIN_VALUES = re.compile(rb"(?:[0-9]{1,18},)+")


def _all_plain(flats: list) -> np.ndarray | None:
    """`(n, 3)` events of a reply whose entries are all plain (`_plain_redis_events`),
    converted as one text; None for any other reply. The common reply, at a fraction
    of the cost of the entry-by-entry table (list operations in C, no object array)."""
    count = len(flats)
    try:
        if set(map(len, flats)) != {6}:
            return None
    except TypeError:  # a deleted entry (None)
        return None
    fields = list(itertools.chain.from_iterable(flats))
    for offset, name in enumerate((b"user", b"item", b"timestamp")):
        if fields[2 * offset :: 6].count(name) != count:
            return None
    try:
        text = b",".join(fields[1::2]) + b","
    except TypeError:  # values that are not bytes
        return None
    if not _PLAIN_VALUES.fullmatch(text):
        return None
    values = np.fromstring(text, np.int64, sep=",")
    # A value holding a comma would be two numbers: then the count is off.
    return values.reshape(-1, 3) if len(values) == 3 * count else None


def _plain_redis_events(flats: list) -> tuple[np.ndarray, np.ndarray]:
    """`(events (n, 3) int64, plain (n,) bool)` of stream entries' flat field lists,
    converted in numpy (one entry at a time in Python cost more than training on it).

    Plain entries are the common ones: user, item and timestamp fields in that order,
    values plain non-negative decimals of at most 18 digits (so below 2**63). Whatever
    this accepts, `parse_event` accepts with the same result; the other entries (rows
    of `events` undefined) are left to `_redis_event`.
    """
    count = len(flats)
    events = _all_plain(flats)
    if events is not None:
        return events, np.ones(count, bool)
    events = np.zeros((count, 3), np.int64)
    try:
        table = np.array(flats, dtype=object).reshape(count, 6)
    except ValueError:  # deleted entries (None), other field counts
        return events, np.zeros(count, bool)
    plain = (table[:, 0] == b"user") & (table[:, 2] == b"item") & (table[:, 4] == b"timestamp")
    values = table[:, 1::2].ravel()
    try:
        lengths = np.fromiter(map(len, values), np.int64, count=values.size)
        text = values.astype(bytes)
    except (TypeError, UnicodeEncodeError):  # values that are not bytes
        return events, np.zeros(count, bool)
    # Numpy drops trailing NUL bytes from its strings: a changed length is such a value.
    digits = (lengths <= 18) & (np.char.str_len(text) == lengths) & np.char.isdigit(text)
    plain &= digits.reshape(count, 3).all(axis=1)
    events[plain] = text.reshape(count, 3)[plain].astype(np.int64)
    return events, plain


def redis_entry_id(position: dict | str | None) -> str | None:
    """The last entry id a `RedisSource` position holds (earlier versions stored the
    bare id; None: nothing read yet)."""
    return position["id"] if isinstance(position, dict) else position


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _stream_id(value: str | bytes) -> tuple[int, int]:
    milliseconds, _, sequence = _text(value).partition("-")
    return int(milliseconds), int(sequence or 0)


def _next_id(value: str) -> str:
    """The smallest stream id after `value` (an exclusive start on any Redis >= 5)."""
    milliseconds, sequence = _stream_id(value)
    if sequence == 2**64 - 1:
        return f"{milliseconds + 1}-0"
    return f"{milliseconds}-{sequence + 1}"


def _may_have_trimmed(cursor: str, first: bytes | None, pending_ids: list) -> bool:
    """Whether acknowledged entries after stream id `cursor` may have been trimmed:
    both the stream's `first` entry (None: it is empty) and this consumer's first
    pending entry after `cursor` (acknowledged ones come before it) leave room for one."""
    bounds = [_stream_id(entry_id) for entry_id in (first, *pending_ids[:1]) if entry_id]
    return not bounds or min(bounds) > _stream_id(_next_id(cursor))


def _redis_event(flat: list) -> tuple[int, int, int]:
    """(user, item, timestamp) of a stream entry's flat ``[field, value, ...]`` list
    (the general path: `_plain_redis_events` converts the common entries)."""
    fields = dict(zip(flat[::2], flat[1::2], strict=True))
    record = fields.get(JSON_FIELD.encode())
    return parse_event(record if record is not None else fields)


# What a warning about trimmed entries advises.
_TRIMMED_ADVICE = (
    "raise the stream's MAXLEN above the events added during the trainer's longest lag "
    "or stop, or shorten those (docs/operations.md: Redis Streams: lost events)"
)


def _group_entries_read(group: dict, stream: dict, accounted: int | None) -> int | None:
    """How many entries had been added to the stream up to the group's last-delivered
    id (XINFO GROUPS and XINFO STREAM replies; None: unknown, as on Redis < 7).

    Exact where that id is the last one added, or the group has read nothing (it starts
    at the first entry); else the group's entries-read, or `accounted` (what the source
    made of the counter before) when that is higher: Redis before 8.0 and Valkey before
    8.0.3 do not advance entries-read past the entries a group skips, so there the
    skipped entries are counted later (once the group is behind the first entry again,
    or has read the last one).
    """
    added = stream.get("entries-added")
    if added is None:
        return None
    delivered = _stream_id(group["last-delivered-id"])
    if delivered == _stream_id(stream["last-generated-id"]):
        return added
    if delivered == (0, 0):
        return added - stream["length"]
    known = [count for count in (group.get("entries-read"), accounted) if count is not None]
    return max(known, default=None)


@dataclasses.dataclass
class _Replay:
    """The entries after a restored position up to the group's last-delivered id
    (`end`), read again before new ones (`RedisSource`)."""

    end: str
    # Entries ever added to the stream up to `end` (None: unknown, for the reason given).
    entries_read: int | None
    uncounted_because: str | None
    # Whether entries acknowledged before may have been trimmed (`_may_have_trimmed`):
    # a loss that unknown counters cannot tell.
    trimmed_into: bool = False
    # Whether a pending entry was read again: all entries delivered after it are
    # pending too (a commit acknowledges the entries up to its position).
    past_pending: bool = False


class RedisSource:
    """Events from a Redis stream through a consumer group, acknowledged on commit.

    Entries hold ``user``, ``item`` and ``timestamp`` fields, or one ``json`` field
    with an object of them. The position is ``{"id": last entry id read,
    "dead_letters": count, "lost_events": count, "lost_events_exact": bool,
    "entries_read": count or None}``.
    Malformed entries are copied to the `dead_letter_stream` under their own entry id
    (with an ``id`` field, the error and the payload), which makes that copy
    idempotent: Redis refuses a second entry with the same id. They are acknowledged
    with the rest.

    A stream capped with ``MAXLEN`` (or ``XTRIM``) drops its oldest entries whether
    the group read them or not: those trimmed before the trainer read them are never
    trained. `lost_events` counts them (the total over restarts, like `dead_letters`),
    and each time some are found a warning says how many. Two ways to lose them:

    - Trimmed before delivery. The consumer group skips them without a trace, so the
      stream's counters tell (XINFO GROUPS and XINFO STREAM, in one transaction, before
      the first read of new entries, then every `trim_check_secs` on the read path,
      and at `close`): the group's ``entries-read`` is the number of entries ever
      added up to its last-delivered id, ``entries-added`` the number ever added.
      Entries it skipped since the last check make its entries-read run ahead of what
      this source received (``entries_read`` in the position: what it has accounted
      for, so that a restart from an older checkpoint counts again what that
      checkpoint had not); entries trimmed ahead of it (the stream's first entry is
      after its last-delivered id) are entries-added - entries-read - length. The
      first entry being after the last-delivered id is no loss by itself: it may be
      the next one. Redis before 7 keeps no such counters: a warning then says that
      entries may have been trimmed and cannot be counted, and `lost_events` leaves
      them out. A group that has read nothing yet starts at the stream's first entry:
      what was trimmed before is not counted. Entries deleted with XDEL before they
      were read are counted with the trimmed ones, where the counters tell.
    - Trimmed after delivery, before training (after a crash, the pending entries
      re-read come back without fields): counted, and acknowledged with the rest.
    - Trimmed after delivery and before a restore reads them again (below).

    Connection failures and timeouts are retried with back-off (`max_backoff`); a
    refused password (`redis.AuthenticationError`, which redis-py counts among the
    connection errors) is raised instead, since trying the same one again cannot heal
    it. Errors are logged without the password (`redis_connection.error_text`).

    Where a loss may have happened that cannot be counted, `lost_events_exact` turns
    False (for good: it travels in the position) and `lost_events` is a lower bound.

    A restored position before the group's last-delivered id means that the entries
    between were delivered after the checkpoint restored: pending (the trainer
    stopped before its next checkpoint) or acknowledged to a newer checkpoint that
    could not be restored (damaged). They are read again with XRANGE, in chunks of at
    most a read's events, in id order with this consumer's pending entries among them
    (each once), before any new entry; they are acknowledged by the commit of a
    checkpoint that holds them, as usual. Those no longer in the stream are counted
    in `lost_events` where the counters tell (the group's entries-read at the start,
    less the position's ``entries_read`` and the entries read again); without counters
    (Redis < 7, or a position of an earlier format), a warning says that some may have
    been lost uncounted where the stream was trimmed into the acknowledged ones (those
    before this consumer's first pending entry). A group that does not exist is
    created at the restored position (nothing after it was delivered).

    Args:
        client: A ``redis.Redis`` client (`redis_connection.RedisAccess.client`).
        stream, group, consumer: Stream key, consumer group and this consumer's name
            (keep it across restarts: its pending entries are re-read at start).
        dead_letter_stream: Stream receiving malformed entries.
        claim: This model's claim of the group (`group_claim`), checked before each
            acknowledgement and released at `close`; None: the group is shared.
        max_backoff: Longest wait between reconnection attempts, seconds.
        trim_check_secs: Seconds between checks for trimmed entries (one round trip).
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str = "trainer",
        consumer: str = "trainer-0",
        dead_letter_stream: str | None = None,
        max_backoff: float = 2.0,
        trim_check_secs: float = 5.0,
        claim: group_claim.GroupClaim | None = None,
    ) -> None:
        # A client of its own on the same connections, whose XREADGROUP and XRANGE
        # replies stay raw lists: redis-py's per-entry dicts cost more than training on
        # them.
        self.client = redis.Redis(connection_pool=client.connection_pool)
        for command in ("XREADGROUP", "XRANGE"):
            self.client.set_response_callback(command, lambda reply, **options: reply)
        self.stream, self.group, self.consumer = stream, group, consumer
        self.dead_letter_stream = dead_letter_stream or f"{stream}:dead"
        self.max_backoff = max_backoff
        self.trim_check_secs = trim_check_secs
        self.claim = claim
        self.dead_letters = 0
        self.lost_events = 0
        self.lost_events_exact = True
        self.reconnects = 0
        self.exhausted = False  # a stream never ends
        # Entries ever added to the stream up to the last one read, less those trimmed
        # before they were read and not counted yet (None: unknown, as on Redis < 7).
        self._entries_read: int | None = None
        self._next_trim_check = 0.0
        self._restored: str | None = None  # the entry id of the position restored
        self._after: tuple[int, int] | None = None  # the same, parsed
        self._replay_due = False  # whether to look for entries to read again
        self._replay: _Replay | None = None
        self._pending_cursor: str | bytes | None = "0"
        self._last_read: str | None = None
        # (newest entry id, entry ids) of each reply delivered and not yet acknowledged.
        self._delivered: collections.deque = collections.deque()
        self._group_ready = False
        self._backoff = 0.0

    def restore(self, position: dict | str | None) -> None:
        """Resumes after `position` (also the positions of earlier versions: the bare
        entry id, no lost events)."""
        entry_id = redis_entry_id(position)
        counts = position if isinstance(position, dict) else {}
        self.dead_letters = counts.get("dead_letters", 0)
        self.lost_events = counts.get("lost_events", 0)
        self.lost_events_exact = counts.get("lost_events_exact", True)
        self._entries_read = counts.get("entries_read")
        self._restored = entry_id or None
        self._after = _stream_id(entry_id) if entry_id else None
        self._replay_due, self._replay = bool(entry_id), None
        self._pending_cursor = "0"

    def acl_rules(self) -> str:
        """The ACL rules that allow a Redis user everything this source sends."""
        keys = (self.stream, self.dead_letter_stream)
        if self.claim is None:
            return redis_connection.acl_rules(COMMANDS, keys)
        return redis_connection.acl_rules(COMMANDS + group_claim.COMMANDS, (*keys, self.claim.key))

    def read(self, max_events: int, timeout: float) -> EventChunk | None:
        try:
            self._ensure_group()
            entries = self._read_entries(max_events, timeout)
            chunk = self._parse(entries) if entries else None
        except redis.AuthenticationError:
            raise
        except _RECONNECTABLE as error:
            self._wait_to_reconnect(error)
            return None
        self._backoff = 0.0
        return chunk

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            start = self._last_read or self._restored or "0"
            self.client.xgroup_create(self.stream, self.group, id=start, mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._group_ready = True

    def _read_entries(self, max_events: int, timeout: float) -> list:
        if self._replay_due:
            self._plan_replay()
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
            if entries and self._replay is not None:
                self._pending_cursor = None  # read again in order, with the entries around
                break
            if entries:
                return entries
        if self._replay is not None:
            entries = self._replayed_entries(max_events)
            if entries:
                return entries
        if time.monotonic() >= self._next_trim_check:
            self._check_trimmed()
        reply = self.client.xreadgroup(
            self.group,
            self.consumer,
            {self.stream: ">"},
            count=max_events,
            block=max(1, int(timeout * 1000)),
        )
        return self._entries(reply)

    def _plan_replay(self) -> None:
        """After a restore: the entries to read again, if the group delivered any after
        the restored position (class docstring)."""
        transaction = self.client.pipeline(transaction=True)  # both of one moment
        transaction.xinfo_groups(self.stream)
        transaction.xinfo_stream(self.stream)
        groups, stream = transaction.execute()
        self._replay_due = False
        group = next((g for g in groups if _text(g["name"]) == self.group), None)
        if group is None or _stream_id(group["last-delivered-id"]) <= self._after:
            return
        if "entries-added" not in stream:
            uncounted_because = "this Redis keeps no stream counters (Redis >= 7 does)"
        elif self._entries_read is None:
            uncounted_because = "the position restored holds no count of the entries read"
        elif group.get("entries-read") is None:
            uncounted_because = (
                "the group's entries-read is unknown: entries deleted with XDEL, or XGROUP SETID"
            )
        else:
            uncounted_because = None
        entries_read = None if uncounted_because else _group_entries_read(group, stream, None)
        self._replay = _Replay(_text(group["last-delivered-id"]), entries_read, uncounted_because)
        logging.info(
            "reading again the entries of stream %r after %s, the position restored, up to "
            "%s, the last one delivered to the trainer's consumer group",
            self.stream,
            self._restored,
            self._replay.end,
        )

    def _replayed_entries(self, max_events: int) -> list:
        """The next entries to read again, in id order: those in the stream and this
        consumer's pending ones no longer in it (without fields); [] once done."""
        replay, cursor = self._replay, self._last_read or self._restored
        last = _stream_id(replay.end)
        if _stream_id(cursor) >= last:
            self._finish_replay()
            return []
        start = _next_id(cursor)
        transaction = self.client.pipeline(transaction=True)
        transaction.xrange(self.stream, start, replay.end, count=max_events)
        transaction.xpending_range(
            self.stream, self.group, start, replay.end, max_events, consumername=self.consumer
        )
        if replay.entries_read is None:
            transaction.xinfo_stream(self.stream)
        found, pending, *stream = transaction.execute()
        # A full reply may stop short of the other's last entry: up to the lower of them.
        pending_ids = [entry["message_id"] for entry in pending]
        for ids in ([entry_id for entry_id, _ in found], pending_ids):
            if len(ids) == max_events:
                last = min(last, _stream_id(ids[-1]))
        pending_ids = [entry_id for entry_id in pending_ids if _stream_id(entry_id) <= last]
        if stream and not replay.past_pending:
            first = stream[0]["first-entry"]
            replay.trimmed_into |= _may_have_trimmed(cursor, first and first[0], pending_ids)
        replay.past_pending |= bool(pending_ids)
        entries = [entry for entry in found if _stream_id(entry[0]) <= last]
        present = {entry_id for entry_id, _ in entries}
        gone = [(entry_id, None) for entry_id in pending_ids if entry_id not in present]
        if gone:
            entries = sorted(entries + gone, key=lambda entry: _stream_id(entry[0]))
        if not entries:
            self._finish_replay()
        return entries

    def _finish_replay(self) -> None:
        """Counts the entries to read again that were no longer in the stream, or says
        that some may have been and cannot be counted."""
        replay, self._replay = self._replay, None
        if replay.entries_read is not None:
            missing = max(0, replay.entries_read - self._entries_read)
            self._entries_read += missing
            if missing:
                self._report_lost(
                    missing, "trimmed or deleted before the restored trainer read them again"
                )
        elif replay.trimmed_into:
            self.lost_events_exact = False
            logging.warning(
                "stream %r was trimmed past %s, the position restored, before the trainer "
                "read again the entries after it (up to %s): any of them trimmed are in no "
                "model and cannot be counted (%s), so lost events is a lower bound from now "
                "on; %s",
                self.stream,
                self._restored,
                replay.end,
                replay.uncounted_because,
                _TRIMMED_ADVICE,
            )

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
        logging.warning(
            "redis unavailable (%s); retrying in %.2f s",
            redis_connection.error_text(error, self.client),
            self._backoff,
        )
        time.sleep(self._backoff)

    def _parse(self, entries: list) -> EventChunk:
        """Converts entries and dead-letters the malformed ones; the source's state
        changes only once all of that is done (a dropped connection midway makes the
        whole reply be read again, from the pending list)."""
        ids = [entry_id.decode() for entry_id, _ in entries]
        events, good = _plain_redis_events([flat for _, flat in entries])
        dead = trimmed = 0
        for index in np.flatnonzero(~good):
            flat = entries[index][1]
            if flat is None:  # a pending entry trimmed since it was delivered
                trimmed += 1
                continue
            try:
                events[index] = _redis_event(flat)
            except ValueError as error:
                self._dead_letter(ids[index], flat, str(error))
                dead += 1
                continue
            good[index] = True
        self.dead_letters += dead
        if trimmed:
            self._report_lost(trimmed, "delivered to the trainer and trimmed before training")
        if self._entries_read is not None:
            self._entries_read += len(ids)
        self._delivered.append((_stream_id(ids[-1]), ids))
        self._last_read = ids[-1]
        good_ids = ids if not dead + trimmed else [ids[i] for i in np.flatnonzero(good)]
        events = events[good]
        return EventChunk(events[:, 0], events[:, 1], events[:, 2], good_ids, self._position())

    def _position(self) -> dict:
        return {
            "id": self._last_read,
            "dead_letters": self.dead_letters,
            "lost_events": self.lost_events,
            "lost_events_exact": self.lost_events_exact,
            "entries_read": self._entries_read,
        }

    def _check_trimmed(self) -> None:
        """Counts the entries trimmed before the group read them (class docstring)."""
        transaction = self.client.pipeline(transaction=True)  # both of one moment
        transaction.xinfo_groups(self.stream)
        transaction.xinfo_stream(self.stream)
        groups, stream = transaction.execute()
        self._next_trim_check = time.monotonic() + self.trim_check_secs
        group = next((g for g in groups if _text(g["name"]) == self.group), None)
        if group is None:
            return  # gone: XREADGROUP says so
        delivered = _stream_id(group["last-delivered-id"])
        first = stream["first-entry"]
        # Entries after the last-delivered id can be missing only if the stream holds
        # none at or before it.
        behind = _stream_id(stream["last-generated-id"]) > delivered and (
            not first or _stream_id(first[0]) > delivered
        )
        entries_read = _group_entries_read(group, stream, self._entries_read)
        lost = 0
        if entries_read is not None and self._entries_read is not None:
            lost = max(0, entries_read - self._entries_read)  # skipped since the last check
        if behind and entries_read is not None:
            ahead = max(0, stream["entries-added"] - entries_read - stream["length"])
            lost += ahead
            entries_read += ahead  # what the group's counter says once it reads on
        self._entries_read = entries_read
        if lost:
            self._report_lost(lost, "trimmed before the trainer read them")
        elif behind and entries_read is None and delivered != (0, 0):
            self.lost_events_exact = False
            reason = (
                "this Redis keeps no stream counters (Redis >= 7 does)"
                if "entries-added" not in stream
                else "the group's entries-read is unknown: entries deleted with XDEL, or "
                "XGROUP SETID"
            )
            logging.warning(
                "stream %r was trimmed past %s, the last entry the trainer's consumer "
                "group read: entries added after it, if any, were trimmed before the "
                "trainer read them, and cannot be counted (%s), so lost events leave "
                "them out; %s",
                self.stream,
                _text(group["last-delivered-id"]),
                reason,
                _TRIMMED_ADVICE,
            )

    def _report_lost(self, count: int, how: str) -> None:
        self.lost_events += count
        logging.warning(
            "%s entries of stream %r were %s: they are not trained (%s lost events in all); %s",
            f"{count:,}",
            self.stream,
            how,
            f"{self.lost_events:,}",
            _TRIMMED_ADVICE,
        )

    def _dead_letter(self, entry_id: str, flat: list, error: str) -> None:
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        letter = {"id": entry_id, "error": error, "payload": payload_text(fields)}
        try:
            self.client.xadd(self.dead_letter_stream, letter, id=entry_id)
        except redis.ResponseError as refused:
            if "equal or smaller" not in str(refused):
                raise
            if self.client.xrange(self.dead_letter_stream, entry_id, entry_id):
                return  # recorded before a restart
            # The stream holds entries under other ids (written by something else):
            # record this one under a new id rather than not at all.
            logging.warning("%s is not keyed by entry id", self.dead_letter_stream)
            self.client.xadd(self.dead_letter_stream, letter)
        logging.log_every_n(logging.WARNING, "dead letter %s: %s", 100, entry_id, error)

    def commit(self, position: dict | str | None) -> None:
        """Acknowledges every delivered entry up to `position` (the checkpointed one)."""
        entry_id = redis_entry_id(position)
        if not entry_id:
            return
        last = _stream_id(entry_id)
        done: list[str] = []
        # Whole replies at a time (each entry's id parsed only in a reply that the
        # position cuts, which a checkpoint's position never does).
        while self._delivered and self._delivered[0][0] <= last:
            done += self._delivered.popleft()[1]
        if self._delivered:
            newest, ids = self._delivered[0]
            cut = bisect.bisect_right(ids, last, key=_stream_id)
            if cut:
                done += ids[:cut]
                self._delivered[0] = (newest, ids[cut:])
        try:
            if self.claim is not None:
                self.claim.check()  # another model's group now: acknowledge nothing
            for start in range(0, len(done), 10000):
                self.client.xack(self.stream, self.group, *done[start : start + 10000])
        except redis.AuthenticationError:
            raise
        except _RECONNECTABLE as error:
            # Acknowledged with the next commit; until then they stay pending (and
            # are skipped by id after a restart), so nothing is lost.
            logging.warning(
                "redis unavailable for XACK (%s); retried at the next commit",
                redis_connection.error_text(error, self.client),
            )
            self._delivered.appendleft((_stream_id(done[-1]), done))

    def close(self) -> None:
        """Counts what was trimmed since the last check (so that the run's summary has
        it), then closes the connections."""
        if self._group_ready and self._pending_cursor is None and self._replay is None:
            try:
                self._check_trimmed()
            except redis.RedisError as error:
                logging.warning(
                    "could not check %r for trimmed entries (%s)",
                    self.stream,
                    redis_connection.error_text(error, self.client),
                )
        if self.claim is not None:
            self.claim.release()
        self.client.close()
