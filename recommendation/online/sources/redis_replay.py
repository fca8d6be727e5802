"""After a restore, the entries a Redis consumer group delivered after the restored
position (pending, or acknowledged to a newer checkpoint that could not be restored),
read again before new ones (`RedisSource` says how)."""

from __future__ import annotations

import dataclasses

import redis
from absl import logging

from recommendation.online.sources import redis_connection
from recommendation.online.sources.redis_entries import entry_text, find_group, next_id, stream_id
from recommendation.online.sources.redis_trims import (
    TRIMMED_ADVICE,
    group_entries_read,
    may_have_trimmed,
)

# What Redis refuses for memory when the entries after a restored position are looked
# up (`redis_connection.MemoryWait`), as it is said.
_REPLAY = "MULTI of the entries to read again after a restore"


@dataclasses.dataclass
class Replay:
    """The entries after a restored position up to the group's last-delivered id
    (`end`), read again before new ones (`RedisSource`)."""

    end: str
    # Entries ever added to the stream up to `end` (None: unknown, for the reason given).
    entries_read: int | None
    uncounted_because: str | None
    # Whether entries acknowledged before may have been trimmed (`may_have_trimmed`):
    # a loss that unknown counters cannot tell.
    trimmed_into: bool = False
    # Whether a pending entry was read again: all entries delivered after it are
    # pending too (a commit acknowledges the entries up to its position).
    past_pending: bool = False


class Redelivery:
    """`RedisSource`'s reading again of the entries after a restored position."""

    def _plan_replay(self) -> None:
        """After a restore: the entries to read again, if the group delivered any after
        the restored position (class docstring)."""
        transaction = self.client.pipeline(transaction=True)  # both of one moment
        transaction.xinfo_groups(self.stream)
        transaction.xinfo_stream(self.stream)
        groups, stream = self._execute(transaction)
        self._replay_due = False
        group = find_group(groups, self.group)
        if group is None or stream_id(group["last-delivered-id"]) <= self._after:
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
        entries_read = None if uncounted_because else group_entries_read(group, stream, None)
        self._replay = Replay(
            entry_text(group["last-delivered-id"]), entries_read, uncounted_because
        )
        logging.info(
            "reading again the entries of stream %r after %s, the position restored, up to "
            "%s, the last one delivered to the trainer's consumer group",
            self.stream,
            self._restored,
            self._replay.end,
        )

    def _execute(self, transaction) -> list:
        """`transaction`'s replies; one Redis refuses for memory is waited out (a MULTI
        is refused whole at maxmemory, reads too: `RedisSource.read` waits)."""
        try:
            replies = transaction.execute()
        except redis.OutOfMemoryError:
            raise redis_connection.RefusedForMemory(_REPLAY) from None
        self.memory.succeeded(_REPLAY)
        return replies

    def _replayed_entries(self, max_events: int) -> list:
        """The next entries to read again, in id order: those in the stream and this
        consumer's pending ones no longer in it (without fields); [] once done."""
        replay, cursor = self._replay, self._last_read or self._restored
        last = stream_id(replay.end)
        if stream_id(cursor) >= last:
            self._finish_replay()
            return []
        start = next_id(cursor)
        transaction = self.client.pipeline(transaction=True)
        transaction.xrange(self.stream, start, replay.end, count=max_events)
        transaction.xpending_range(
            self.stream, self.group, start, replay.end, max_events, consumername=self.consumer
        )
        if replay.entries_read is None:
            transaction.xinfo_stream(self.stream)
        found, pending, *stream = self._execute(transaction)
        # A full reply may stop short of the other's last entry: up to the lower of them.
        pending_ids = [entry["message_id"] for entry in pending]
        for ids in ([entry_id for entry_id, _ in found], pending_ids):
            if len(ids) == max_events:
                last = min(last, stream_id(ids[-1]))
        pending_ids = [entry_id for entry_id in pending_ids if stream_id(entry_id) <= last]
        if stream and not replay.past_pending:
            first = stream[0]["first-entry"]
            replay.trimmed_into |= may_have_trimmed(cursor, first and first[0], pending_ids)
        replay.past_pending |= bool(pending_ids)
        entries = [entry for entry in found if stream_id(entry[0]) <= last]
        present = {entry_id for entry_id, _ in entries}
        gone = [(entry_id, None) for entry_id in pending_ids if entry_id not in present]
        if gone:
            entries = sorted(entries + gone, key=lambda entry: stream_id(entry[0]))
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
                TRIMMED_ADVICE,
            )
