"""`IterableSource`: events from a Python iterable, for tests, notebooks and replays of
a collection (the package's docstring says what every source does)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from recommendation.online.sources.dead_letters import DeadLetterFile
from recommendation.online.sources.event_parsing import EventChunk, parse_event


def _chunk(events: list[tuple[int, int, int]], ids: list, position: Any) -> EventChunk:
    columns = np.array(events, dtype=np.int64).reshape(-1, 3)
    return EventChunk(columns[:, 0], columns[:, 1], columns[:, 2], ids, position)


class IterableSource:
    """Events from a Python iterable of ``(user, item, timestamp)`` tuples or dicts.

    The position is ``{"consumed": events consumed, "dead_letters": count}``; after
    `restore`, a re-iterable collection (list, array) skips that many. Malformed ones
    go to `dead_letter` (without one, they raise).
    """

    def __init__(self, events: Iterable, dead_letter: DeadLetterFile | None = None) -> None:
        self._events = events
        self._iterator: Iterator | None = None
        self.consumed = 0
        self.dead_letters = 0
        self.exhausted = False
        self.dead_letter = dead_letter

    def restore(self, position: dict | int | None) -> None:
        """Resumes after `position` (also the bare count of earlier versions)."""
        if isinstance(position, dict):
            self.consumed, self.dead_letters = position["consumed"], position["dead_letters"]
        else:
            self.consumed, self.dead_letters = int(position or 0), 0
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
                event = parse_event(record)
            except ValueError as error:
                if self.dead_letter is None:
                    raise
                self.dead_letter.add(str(self.consumed - 1), record, str(error))
                self.dead_letters += 1
                continue
            events.append(event)
            ids.append(self.consumed - 1)
        if not events and self.exhausted:
            return None
        return _chunk(events, ids, {"consumed": self.consumed, "dead_letters": self.dead_letters})

    def close(self) -> None:
        """Nothing to release."""
