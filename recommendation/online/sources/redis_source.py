"""`RedisSource`: events from a Redis stream through a consumer group (``XREADGROUP``),
acknowledged (``XACK``) only once a durable checkpoint holds them (`sources` says what
every source does, and what acknowledging on commit buys).
"""

from __future__ import annotations

import bisect
import collections
import time

import numpy as np
import redis
from absl import logging

from recommendation.online.sources import group_claim, redis_connection
from recommendation.online.sources.dead_letters import payload_text
from recommendation.online.sources.event_parsing import EventChunk
from recommendation.online.sources.redis_entries import (
    find_group,
    plain_redis_events,
    redis_entry_id,
    redis_event,
    stream_id,
)
from recommendation.online.sources.redis_replay import Redelivery, Replay
from recommendation.online.sources.redis_trims import TrimCounting

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
# The writes Redis refuses for memory (`redis_connection.MemoryWait`), as it names them.
_GROUP, _DEAD_LETTER, _ACKNOWLEDGEMENT = "XGROUP CREATE", "XADD of a dead letter", "XACK"


class RedisSource(Redelivery, TrimCounting):
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

    Writes refused for memory (Redis at ``maxmemory`` under ``noeviction``) are waited
    out (`redis_connection.MemoryWait`, `memory_wait_seconds`): a consumer group that
    exists is read without creating it, a reply whose dead letter is refused is read
    again from the pending list until it is written (nothing is acknowledged without
    its dead letter), acknowledgements are retried at the next commit.

    Connection failures and timeouts are retried with back-off (`max_backoff`); a
    refused password (`redis.AuthenticationError`, which redis-py counts among the
    connection errors) is raised instead, since trying the same one again cannot heal
    it. Errors are logged without the password (`redis_connection.error_text`).

    Where a loss may have happened that cannot be counted, `lost_events_exact` turns
    False (for good: it travels in the position) and `lost_events` is a lower bound.

    A stream (or its group) deleted while the trainer runs is said once: what it held
    after the last entry read cannot be counted (`lost_events_exact` turns False), and
    the stream as it is then is read from its start through a group made anew.

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
        self.memory = redis_connection.MemoryWait(client)
        self.exhausted = False  # a stream never ends
        # Entries ever added to the stream up to the last one read, less those trimmed
        # before they were read and not counted yet (None: unknown, as on Redis < 7).
        self._entries_read: int | None = None
        self._next_trim_check = 0.0
        self._restored: str | None = None  # the entry id of the position restored
        self._after: tuple[int, int] | None = None  # the same, parsed
        self._replay_due = False  # whether to look for entries to read again
        self._replay: Replay | None = None
        self._pending_cursor: str | bytes | None = "0"
        self._last_read: str | None = None
        # (newest entry id, entry ids) of each reply delivered and not yet acknowledged.
        self._delivered: collections.deque = collections.deque()
        self._group_ready = False
        self._backoff = 0.0

    @property
    def memory_wait_seconds(self) -> float:
        """Seconds spent while Redis refused writes for memory."""
        return self.memory.seconds

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
        self._after = stream_id(entry_id) if entry_id else None
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
        except redis_connection.RefusedForMemory as refused:
            self.memory.refused(str(refused))
            self._wait_to_read_again()
            return None
        except redis.ResponseError as error:
            if not str(error).startswith("NOGROUP"):
                raise
            self._group_gone()
            return None
        self._backoff = 0.0
        return chunk

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            start = self._last_read or self._restored or "0"
            self.client.xgroup_create(self.stream, self.group, id=start, mkstream=True)
        except redis.OutOfMemoryError:
            # Refused before Redis looks: the group may be there (after a reconnect).
            if not self._group_exists():
                raise redis_connection.RefusedForMemory(_GROUP) from None
            self._group_ready = True
            return
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self.memory.succeeded(_GROUP)
        self._group_ready = True

    def _group_gone(self) -> None:
        """The stream, or its group, was deleted while the trainer ran (XREADGROUP
        answers NOGROUP): what it held after the last entry read is lost uncounted, and
        the stream as it is now is read from its start through a group made anew."""
        logging.warning(
            "consumer group %r of Redis stream %r is gone (the stream was deleted, or the "
            "group destroyed, while the trainer ran): the entries it held after %s, the "
            "last the trainer read, cannot be counted (lost events leave them out); "
            "reading the stream as it is now from its start",
            self.group,
            self.stream,
            self._last_read or "none",
        )
        self.lost_events_exact = False
        self._group_ready = False
        # Nothing of the old stream is acknowledged, skipped or read again: ids restart.
        self._last_read = self._restored = self._after = self._replay = None
        self._replay_due, self._pending_cursor = False, "0"
        self._entries_read = None
        self._delivered.clear()

    def _group_exists(self) -> bool:
        try:
            groups = self.client.xinfo_groups(self.stream)
        except redis.ResponseError:  # no stream
            return False
        return find_group(groups, self.group) is not None

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
        done = [entry_id for entry_id, _ in entries if stream_id(entry_id) <= self._after]
        if done:
            self.client.xack(self.stream, self.group, *done)
        return entries[len(done) :]

    def _wait_to_reconnect(self, error: Exception) -> None:
        self.reconnects += 1
        self._group_ready = False
        logging.warning(
            "redis unavailable (%s); retrying in %.2f s",
            redis_connection.error_text(error, self.client),
            self._wait_to_read_again(),
        )

    def _wait_to_read_again(self) -> float:
        """Backs off before the next read, which begins where the last whole reply
        ended; returns the wait."""
        self._backoff = min(self.max_backoff, max(0.05, self._backoff * 2))
        # A read cut off mid-reply, or a reply not parsed to its end, may have delivered
        # entries (Redis put them in our pending list) not taken: walk the pending list
        # again from after the last entry that was.
        self._pending_cursor = self._last_read or "0"
        time.sleep(self._backoff)
        return self._backoff

    def _parse(self, entries: list) -> EventChunk:
        """Converts entries and dead-letters the malformed ones; the source's state
        changes only once all of that is done (a dropped connection midway makes the
        whole reply be read again, from the pending list)."""
        ids = [entry_id.decode() for entry_id, _ in entries]
        events, good = plain_redis_events([flat for _, flat in entries])
        dead = trimmed = 0
        for index in np.flatnonzero(~good):
            flat = entries[index][1]
            if flat is None:  # a pending entry trimmed since it was delivered
                trimmed += 1
                continue
            try:
                events[index] = redis_event(flat)
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
        self._delivered.append((stream_id(ids[-1]), ids))
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

    def _dead_letter(self, entry_id: str, flat: list, error: str) -> None:
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        letter = {"id": entry_id, "error": error, "payload": payload_text(fields)}
        try:
            self.client.xadd(self.dead_letter_stream, letter, id=entry_id)
            self.memory.succeeded(_DEAD_LETTER)
        except redis.OutOfMemoryError:
            raise redis_connection.RefusedForMemory(_DEAD_LETTER) from None
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
        last = stream_id(entry_id)
        done: list[str] = []
        # Whole replies at a time (each entry's id parsed only in a reply that the
        # position cuts, which a checkpoint's position never does).
        while self._delivered and self._delivered[0][0] <= last:
            done += self._delivered.popleft()[1]
        if self._delivered:
            newest, ids = self._delivered[0]
            cut = bisect.bisect_right(ids, last, key=stream_id)
            if cut:
                done += ids[:cut]
                self._delivered[0] = (newest, ids[cut:])
        try:
            if self.claim is not None:
                self.claim.check()  # another model's group now: acknowledge nothing
            for start in range(0, len(done), 10000):
                self.client.xack(self.stream, self.group, *done[start : start + 10000])
            self.memory.succeeded(_ACKNOWLEDGEMENT)
        except redis.AuthenticationError:
            raise
        except redis.OutOfMemoryError:
            self.memory.refused(_ACKNOWLEDGEMENT)  # retried at the next commit
            self._delivered.appendleft((stream_id(done[-1]), done))
        except _RECONNECTABLE as error:
            # Acknowledged with the next commit; until then they stay pending (and
            # are skipped by id after a restart), so nothing is lost.
            logging.warning(
                "redis unavailable for XACK (%s); retried at the next commit",
                redis_connection.error_text(error, self.client),
            )
            self._delivered.appendleft((stream_id(done[-1]), done))

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
