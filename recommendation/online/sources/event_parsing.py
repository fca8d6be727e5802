"""Events as training examples: `parse_event`, the one conversion every source uses,
the lines of event files (`EVENT_FILE_SUFFIXES`, `is_header`, `parse_line`, and
`plain_csv_runs` of the common ones, converted at once), and
`EventChunk`, the events a source hands out in one read. No TensorFlow: the peer
harnesses read event folders by these rules too.

User and item ids must be integers in [0, 2**63 - 1] (`MAX_ID`; negative int64 values
are refused because the hash tables reserve two of them), timestamps any int64. What
`parse_event` refuses (bad JSON, a missing field, a wrong type, NaN, an id out of
range, a huge or undecodable text) is refused with one short reason, which the
sources record with the event as a dead letter (`dead_letters`).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import re
from typing import Any

import numpy as np

FIELDS = ("user", "item", "timestamp")
# Event files: one JSON object a line, or ``user,item,timestamp`` lines.
EVENT_FILE_SUFFIXES = (".jsonl", ".csv")
# The accepted range of user and item ids (timestamps: any int64).
MAX_ID = 2**63 - 1
_INT64_MIN = -(2**63)
# Longest integer text read (an int64 needs 20 characters; padding aside, more is no id).
_MAX_INTEGER_TEXT = 32
_INTEGER = re.compile(r"[+-]?[0-9]+")
# A run of complete CSV lines that are plain events: three non-negative decimals of at
# most 18 digits (below 2**63) and nothing else, each line ending in a newline.
_PLAIN_CSV_RUN = re.compile(rb"^(?:[0-9]{1,18},[0-9]{1,18},[0-9]{1,18}\r?\n)+", re.MULTILINE)
# Dead letters keep this much of the reason.
_MAX_REASON_CHARS = 300


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


def parse_event(record: Any) -> tuple[int, int, int]:
    """(user, item, timestamp) from a mapping (str or bytes keys), a JSON object text or
    a (user, item, timestamp) sequence: the one conversion every source uses.

    Raises:
        ValueError: Saying what is wrong, whatever it is (bad JSON, not an object, a
            missing field, a non-integer, an id out of range, an undecodable text).
    """
    try:
        return _parse_event(record)
    except ValueError as error:
        raise ValueError(shorten(str(error), _MAX_REASON_CHARS)) from None
    except (TypeError, OverflowError, RecursionError) as error:
        raise ValueError(shorten(f"{type(error).__name__}: {error}", _MAX_REASON_CHARS)) from None


def _parse_event(record: Any) -> tuple[int, int, int]:
    if isinstance(record, (str, bytes)):
        try:
            record = json.loads(record)
        except (ValueError, RecursionError) as error:  # JSONDecodeError, bad UTF-8, depth
            raise ValueError(f"bad JSON: {type(error).__name__}: {error}") from None
    elif isinstance(record, (tuple, list, np.ndarray)):  # not from JSON: objects only there
        if len(record) != len(FIELDS):
            raise ValueError(f"expected (user, item, timestamp), got {_short_repr(record)}")
        record = dict(zip(FIELDS, record, strict=True))
    if not isinstance(record, dict):
        raise ValueError(f"an event must be an object with {FIELDS}, got {type(record).__name__}")
    user = _to_int(_field(record, "user"), "user", 0, MAX_ID)
    item = _to_int(_field(record, "item"), "item", 0, MAX_ID)
    return user, item, _to_int(_field(record, "timestamp"), "timestamp", _INT64_MIN, MAX_ID)


def is_header(text: bytes) -> bool:
    """Whether `text`, a CSV event file's first line, is its header (skipped)."""
    return text.split(b",")[0].strip().lower() in (b"user", b"userid", b"user_id")


def parse_line(text: bytes, is_csv: bool) -> tuple[int, int, int]:
    """(user, item, timestamp) from an event file's line (`parse_event`'s checks)."""
    return parse_event(text.split(b",") if is_csv else text)


def plain_csv_runs(lines: bytes) -> list[tuple[int, int]]:
    """The `(start, end)` byte spans of `lines` (complete CSV lines) that are runs of
    plain event lines, each from a line's start: their events convert at once
    (`plain_csv_events`), the other lines one at a time (`parse_line`)."""
    return [match.span() for match in _PLAIN_CSV_RUN.finditer(lines)]


def plain_csv_events(run: bytes, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `limit` events of `run` (a span of `plain_csv_runs`) converted at once,
    in numpy: `(events (n, 3) int64, line ends (n,))`, each line's end the offset just
    after its newline. `parse_line` gives each line the same values; one line at a
    time in Python cost more than training on it."""
    ends = np.flatnonzero(np.frombuffer(run, np.uint8) == ord("\n"))[:limit] + 1
    run = run[: ends[-1]] if len(ends) else b""
    values = np.fromstring(run.replace(b"\r", b"").replace(b"\n", b","), np.int64, sep=",")
    return values.reshape(-1, 3), ends


def _field(record: dict, name: str) -> Any:
    for key in (name, name.encode()):
        if key in record:
            return record[key]
    raise ValueError(f"missing field {name!r}")


def _to_int(value: Any, field: str, low: int, high: int) -> int:
    """`value` as an int in [low, high]: ints (not booleans) and decimal texts only."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise ValueError(f"{field} must be an integer, got {_short_repr(value)}") from None
    if isinstance(value, str):
        text = value.strip()
        if len(text) > _MAX_INTEGER_TEXT or not _INTEGER.fullmatch(text):
            raise ValueError(f"{field} must be an integer, got {_short_repr(value)}")
        number = int(text)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
    else:  # floats (NaN and infinities too), booleans, None, containers
        raise ValueError(f"{field} must be an integer, got {_short_repr(value)}")
    if not low <= number <= high:
        raise ValueError(f"{field} {shorten(str(number), 40)} is outside [{low}, {high}]")
    return number


def shorten(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, saying how long it was: a reason or payload
    stays one readable line whatever the event held."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def _short_repr(value: Any) -> str:
    return shorten(repr(value), 60)
