"""EventStream: full batches of a source's events, a partial one once the source is
quiet, None while it stays quiet, and the source position after each batch."""

from __future__ import annotations

import itertools

import numpy as np

from recommendation.data import constants
from recommendation.online import sources
from recommendation.online.sources.event_parsing import EventChunk
from recommendation.online.sources.event_stream import EventStream


class _Scripted:
    """A source that hands out its chunks one read at a time (None: nothing to read
    yet), then nothing; it records what it is told."""

    exhausted = False

    def __init__(self, *script: EventChunk | None) -> None:
        self.script = list(script)
        self.restored, self.committed = [], []

    def read(self, max_events: int, timeout: float) -> EventChunk | None:
        return self.script.pop(0) if self.script else None

    def restore(self, position) -> None:
        self.restored.append(position)

    def commit(self, position) -> None:
        self.committed.append(position)


def _chunk(users: list[int], position: str) -> EventChunk:
    events = np.array(users, np.int64)
    return EventChunk(events, events + 100, events, [f"id{u}" for u in users], position)


def test_full_batches_then_the_rest_when_the_source_ends():
    source = sources.IterableSource([(user, user + 100, user) for user in range(10)])
    batches = list(EventStream(source, batch_size=4, linger_seconds=0.0))
    assert [batch.num_events for batch in batches] == [4, 4, 2]
    assert [batch.position["consumed"] for batch in batches] == [4, 8, 10]
    assert [batch.ids for batch in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    users = np.concatenate([batch.data[constants.USER_COLUMN] for batch in batches])
    items = np.concatenate([batch.data[constants.ITEM_COLUMN] for batch in batches])
    assert users.tolist() == list(range(10)) and items.tolist() == list(range(100, 110))


def test_a_quiet_source_gets_a_partial_batch_then_none_until_events_come():
    source = _Scripted(_chunk([1], "a"), _chunk([2], "b"), None, None, _chunk([3, 4, 5, 6], "c"))
    stream = iter(EventStream(source, batch_size=4, linger_seconds=60.0))
    first, idle, full = itertools.islice(stream, 3)
    # The two chunks before the source went quiet wait for each other, not for more.
    assert first.data[constants.USER_COLUMN].tolist() == [1, 2]
    assert (first.position, first.ids) == ("b", ["id1", "id2"])
    assert idle is None
    assert full.data[constants.USER_COLUMN].tolist() == [3, 4, 5, 6] and full.position == "c"
    assert next(stream) is None  # quiet again; a stream that is not exhausted goes on


def test_a_batch_is_cut_once_it_has_lingered_even_while_events_keep_coming():
    source = _Scripted(_chunk([1], "a"), _chunk([2], "b"))
    stream = iter(EventStream(source, batch_size=4, linger_seconds=0.0))
    assert [batch.position for batch in itertools.islice(stream, 2)] == ["a", "b"]


def test_restore_and_commit_reach_the_source():
    source = _Scripted()
    stream = EventStream(source, batch_size=4)
    stream.restore({"offset": 3})
    stream.commit({"offset": 7})
    assert (source.restored, source.committed) == ([{"offset": 3}], [{"offset": 7}])
