"""Entries trimmed from a Redis stream (``MAXLEN``, ``XTRIM``) before the group read
them, counted from the stream's counters (`RedisSource` says how and when)."""

from __future__ import annotations

import time

import redis
from absl import logging

from recommendation.online.sources.redis_entries import entry_text, find_group, next_id, stream_id

# What a warning about trimmed entries advises.
TRIMMED_ADVICE = (
    "raise the stream's MAXLEN above the events added during the trainer's longest lag "
    "or stop, or shorten those (docs/operations.md: Redis Streams: lost events)"
)


def may_have_trimmed(cursor: str, first: bytes | None, pending_ids: list) -> bool:
    """Whether acknowledged entries after stream id `cursor` may have been trimmed:
    both the stream's `first` entry (None: it is empty) and this consumer's first
    pending entry after `cursor` (acknowledged ones come before it) leave room for one."""
    bounds = [stream_id(entry_id) for entry_id in (first, *pending_ids[:1]) if entry_id]
    return not bounds or min(bounds) > stream_id(next_id(cursor))


def group_entries_read(group: dict, stream: dict, accounted: int | None) -> int | None:
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
    delivered = stream_id(group["last-delivered-id"])
    if delivered == stream_id(stream["last-generated-id"]):
        return added
    if delivered == (0, 0):
        return added - stream["length"]
    known = [count for count in (group.get("entries-read"), accounted) if count is not None]
    return max(known, default=None)


class TrimCounting:
    """`RedisSource`'s counting of the entries trimmed before they were read."""

    def _check_trimmed(self) -> None:
        """Counts the entries trimmed before the group read them (class docstring)."""
        transaction = self.client.pipeline(transaction=True)  # both of one moment
        transaction.xinfo_groups(self.stream)
        transaction.xinfo_stream(self.stream)
        try:
            groups, stream = transaction.execute()
        except redis.OutOfMemoryError:
            # At maxmemory Redis refuses a MULTI whole, reads too: checked again later,
            # and the counters it compares catch up then (the refused writes say why).
            self._next_trim_check = time.monotonic() + self.trim_check_secs
            return
        except redis.ResponseError as error:
            if "no such key" not in str(error).lower():
                raise
            return  # the stream is gone: XREADGROUP says so
        self._next_trim_check = time.monotonic() + self.trim_check_secs
        group = find_group(groups, self.group)
        if group is None:
            return  # gone: XREADGROUP says so
        delivered = stream_id(group["last-delivered-id"])
        first = stream["first-entry"]
        # Entries after the last-delivered id can be missing only if the stream holds
        # none at or before it.
        behind = stream_id(stream["last-generated-id"]) > delivered and (
            not first or stream_id(first[0]) > delivered
        )
        entries_read = group_entries_read(group, stream, self._entries_read)
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
                entry_text(group["last-delivered-id"]),
                reason,
                TRIMMED_ADVICE,
            )

    def _report_lost(self, count: int, how: str) -> None:
        self.lost_events += count
        logging.warning(
            "%s entries of stream %r were %s: they are not trained (%s lost events in all); %s",
            f"{count:,}",
            self.stream,
            how,
            f"{self.lost_events:,}",
            TRIMMED_ADVICE,
        )
