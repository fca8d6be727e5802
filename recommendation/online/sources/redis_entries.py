"""Redis stream entries as events: their ids (``<ms>-<seq>``) and fields, the common
ones (plain integer ``user``, ``item``, ``timestamp``) converted in numpy at once."""

from __future__ import annotations

import itertools
import re

import numpy as np

from recommendation.online.sources.event_parsing import parse_event

# Events whose payload is one JSON object carry it in this Redis field.
JSON_FIELD = "json"

# A reply's values joined by commas (and one after the last) when each is plain.
_PLAIN_VALUES = re.compile(rb"(?:[0-9]{1,18},)+")


def _all_plain(flats: list) -> np.ndarray | None:
    """`(n, 3)` events of a reply whose entries are all plain (`plain_redis_events`),
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


def plain_redis_events(flats: list) -> tuple[np.ndarray, np.ndarray]:
    """`(events (n, 3) int64, plain (n,) bool)` of stream entries' flat field lists,
    converted in numpy (one entry at a time in Python cost more than training on it).

    Plain entries are the common ones: user, item and timestamp fields in that order,
    values plain non-negative decimals of at most 18 digits (so below 2**63). Whatever
    this accepts, `parse_event` accepts with the same result; the other entries (rows
    of `events` undefined) are left to `redis_event`.
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


def entry_text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def find_group(groups: list[dict], name: str) -> dict | None:
    """Group `name` in an XINFO GROUPS reply (None: it is not there)."""
    return next((group for group in groups if entry_text(group["name"]) == name), None)


def stream_id(value: str | bytes) -> tuple[int, int]:
    milliseconds, _, sequence = entry_text(value).partition("-")
    return int(milliseconds), int(sequence or 0)


def next_id(value: str) -> str:
    """The smallest stream id after `value` (an exclusive start on any Redis >= 5)."""
    milliseconds, sequence = stream_id(value)
    if sequence == 2**64 - 1:
        return f"{milliseconds + 1}-0"
    return f"{milliseconds}-{sequence + 1}"


def redis_event(flat: list) -> tuple[int, int, int]:
    """(user, item, timestamp) of a stream entry's flat ``[field, value, ...]`` list
    (the general path: `plain_redis_events` converts the common entries)."""
    fields = dict(zip(flat[::2], flat[1::2], strict=True))
    record = fields.get(JSON_FIELD.encode())
    return parse_event(record if record is not None else fields)
