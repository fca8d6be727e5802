"""Event sources: parsing, dead letters, tailed files, and Redis Streams on a real server."""

from __future__ import annotations

import json
import os

import pytest
from absl.testing import parameterized

from recommendation.online import sources
from recommendation.online.sources import DeadLetterFile


class ParseEventTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("mapping", {"user": 1, "item": 2, "timestamp": 3}, (1, 2, 3)),
        ("json_text", '{"user": 1, "item": 2, "timestamp": 3}', (1, 2, 3)),
        ("byte_strings", {"user": b"10", "item": b"-2", "timestamp": b"3"}, (10, -2, 3)),
        ("large_ids", {"user": 2**40, "item": 2**62, "timestamp": 0}, (2**40, 2**62, 0)),
    )
    def test_good(self, record, expected):
        self.assertEqual(sources.parse_event(record), expected)

    @parameterized.named_parameters(
        ("bad_json", '{"user": 1, "item": ', "bad JSON"),
        ("not_an_object", "[1, 2, 3]", "an object"),
        ("missing_field", {"user": 1, "item": 2}, "missing field 'timestamp'"),
        ("text_id", {"user": "alice", "item": 2, "timestamp": 3}, "user must be an integer"),
        ("float_id", {"user": 1, "item": 2.5, "timestamp": 3}, "item must be an integer"),
        ("boolean_id", {"user": True, "item": 2, "timestamp": 3}, "user must be an integer"),
    )
    def test_malformed(self, record, message):
        with self.assertRaisesRegex(ValueError, message):
            sources.parse_event(record)


def _read_all(source, chunk: int = 4) -> tuple[list, object]:
    events, position = [], None
    while True:
        found = source.read(chunk, timeout=0.05)
        if found is None:
            return events, position
        events += list(zip(found.users.tolist(), found.items.tolist(), strict=True))
        position = found.position


def test_iterable_source_resumes_after_the_restored_position(tmp_path):
    events = [(1, 10, 0), (2, 20, 1), ("x", 30, 2), (3, 30, 3), (4, 40, 4)]
    dead = DeadLetterFile(str(tmp_path / "dead.jsonl"))
    source = sources.IterableSource(events, dead)
    first = source.read(2, 0.0)
    assert first.users.tolist() == [1, 2] and first.position == 2
    rest, position = _read_all(source)
    assert rest == [(3, 30), (4, 40)] and position == 5 and source.exhausted
    assert source.dead_letters == 1
    again = sources.IterableSource(events, DeadLetterFile(str(tmp_path / "dead2.jsonl")))
    again.restore(first.position)
    assert _read_all(again)[0] == [(3, 30), (4, 40)]


def test_iterable_source_without_a_dead_letter_sink_raises_on_bad_events():
    with pytest.raises(ValueError, match="user must be an integer"):
        sources.IterableSource([("x", 1, 2)]).read(5, 0.0)


def _append(path, text: str) -> None:
    with open(path, "a") as out:
        out.write(text)


def test_directory_source_tails_files_and_resumes_from_offsets(tmp_path):
    folder = tmp_path / "events"
    folder.mkdir()
    dead = DeadLetterFile(str(tmp_path / "dead.jsonl"))
    _append(folder / "a.csv", "user,item,timestamp\n1,10,100\n2,20,200\n3,3")  # last line open
    _append(folder / "b.jsonl", '{"user": 5, "item": 50, "timestamp": 500}\n{"user": "bad"}\n')
    _append(folder / "notes.txt", "ignored\n")
    source = sources.DirectorySource(str(folder), dead)
    events, position = _read_all(source)
    assert events == [(1, 10), (2, 20), (5, 50)]
    assert source.dead_letters == 1
    record = json.loads(open(dead.path).read())
    assert record["id"].startswith("b.jsonl:") and "integer" in record["error"]
    _append(folder / "a.csv", "0,300\n4,40,400\n")  # the open line completes, one more arrives
    more, position = _read_all(source)
    assert more == [(3, 30), (4, 40)]
    assert position["a.csv"] == os.path.getsize(folder / "a.csv")
    restarted = sources.DirectorySource(str(folder), DeadLetterFile(str(tmp_path / "d2")))
    restarted.restore(position)
    _append(folder / "b.jsonl", '{"user": 6, "item": 60, "timestamp": 600}\n')
    assert _read_all(restarted)[0] == [(6, 60)]


def test_directory_source_waits_quietly_for_a_missing_folder(tmp_path):
    source = sources.DirectorySource(str(tmp_path / "later"), DeadLetterFile(str(tmp_path / "d")))
    assert source.read(10, 0.05) is None


# ---------------------------------------------------------------------------
# Redis (a real server from the redis_server fixture)


def _publish(client, stream: str, events) -> list[bytes]:
    pipe = client.pipeline()
    for user, item, timestamp in events:
        pipe.xadd(stream, {"user": user, "item": item, "timestamp": timestamp})
    return pipe.execute()


def _pending(client, stream="events", group="trainer") -> int:
    return client.xpending(stream, group)["pending"]


def test_redis_source_acknowledges_only_on_commit(redis_server):
    client = redis_server.client()
    _publish(client, "events", [(u, u * 10, u) for u in range(10)])
    source = sources.RedisSource(redis_server.client(), "events")
    first = source.read(4, 0.1)
    second = source.read(4, 0.1)
    assert first.users.tolist() == [0, 1, 2, 3] and second.users.tolist() == [4, 5, 6, 7]
    assert _pending(client) == 8
    source.commit(first.position)
    assert _pending(client) == 4
    source.commit(second.position)
    assert _pending(client) == 0
    assert source.read(10, 0.1).users.tolist() == [8, 9]


def test_redis_redelivers_uncommitted_events_after_a_restart(redis_server):
    client = redis_server.client()
    _publish(client, "events", [(u, u, u) for u in range(12)])
    crashed = sources.RedisSource(redis_server.client(), "events")
    checkpointed = crashed.read(5, 0.1)  # trained and checkpointed, never acknowledged
    crashed.read(5, 0.1)  # trained after the checkpoint: lost with the process
    restarted = sources.RedisSource(redis_server.client(), "events")
    restarted.restore(checkpointed.position)
    events, _ = _read_all(restarted, chunk=3)
    assert [user for user, _ in events] == list(range(5, 12))  # 0-4 not trained twice
    assert _pending(client) == 7  # 0-4 acknowledged at once; the rest on the next commit


def test_redis_malformed_entries_go_to_the_dead_letter_stream(redis_server):
    client = redis_server.client()
    client.xadd("events", {"user": 1, "item": 2, "timestamp": 3})
    client.xadd("events", {"json": '{"user": 4, "item": 5, "timestamp": 6}'})
    client.xadd("events", {"json": "{not json"})
    client.xadd("events", {"user": 7, "item": 8})
    client.xadd("events", {"user": "seven", "item": 8, "timestamp": 9})
    client.xadd("events", {"user": 10, "item": 11, "timestamp": 12})
    source = sources.RedisSource(redis_server.client(), "events")
    chunk = source.read(10, 0.1)
    assert chunk.users.tolist() == [1, 4, 10] and len(chunk.ids) == 3
    assert source.dead_letters == 3
    dead = client.xrange("events:dead")
    errors = [fields[b"error"].decode() for _, fields in dead]
    assert "bad JSON" in errors[0] and "missing field" in errors[1] and "integer" in errors[2]
    source.commit(chunk.position)
    assert _pending(client) == 0  # dead letters are acknowledged with the rest


def test_redis_source_rides_out_a_server_restart(redis_server):
    client = redis_server.client()
    _publish(client, "events", [(u, u, u) for u in range(5)])
    source = sources.RedisSource(redis_server.client(), "events", max_backoff=0.2)
    assert source.read(5, 0.1).users.tolist() == [0, 1, 2, 3, 4]
    redis_server.kill()
    assert source.read(5, 0.1) is None  # no error: it waits and retries
    assert source.reconnects >= 1
    redis_server.start()
    _publish(redis_server.client(), "events", [(u, u, u) for u in range(5, 8)])
    events, position = _read_all(source)
    assert [user for user, _ in events] == [5, 6, 7]
    source.commit(position)
    assert _pending(redis_server.client()) == 0


def test_entries_delivered_in_a_reply_lost_to_a_dropped_connection_are_read_again(
    redis_server,
):
    client = redis_server.client()
    _publish(client, "events", [(u, u, u) for u in range(5)])
    source = sources.RedisSource(redis_server.client(), "events", max_backoff=0.2)
    assert source.read(2, 0.1).users.tolist() == [0, 1]
    # Redis hands 2 and 3 to this consumer, but the reply never reaches the source.
    client.xreadgroup("trainer", "trainer-0", {"events": ">"}, count=2)
    redis_server.kill()
    assert source.read(5, 0.1) is None
    redis_server.start()
    events, _ = _read_all(source)
    assert [user for user, _ in events] == [2, 3, 4]  # nothing lost, nothing twice
