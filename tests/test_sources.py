"""Event sources: parsing, dead letters, tailed files, and Redis Streams on a real server."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import zlib

import numpy as np
import pytest
import redis
from absl import logging as absl_logging
from absl.testing import parameterized
from conftest import RedisServer

from recommendation.online import sources
from recommendation.online.sources import (
    dead_letters,
    event_parsing,
    files,
    redis_entries,
    redis_source,
)
from recommendation.online.sources.dead_letters import DeadLetterFile


class ParseEventTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("mapping", {"user": 1, "item": 2, "timestamp": 3}, (1, 2, 3)),
        ("json_text", '{"user": 1, "item": 2, "timestamp": 3}', (1, 2, 3)),
        ("byte_strings", {"user": b"10", "item": b" 2 ", "timestamp": b"-3"}, (10, 2, -3)),
        ("byte_keys", {b"user": b"+4", b"item": b"007", b"timestamp": b"0"}, (4, 7, 0)),
        ("sequence", (5, 6, 7), (5, 6, 7)),
        ("numpy_ints", np.array([8, 9, 10], np.int64), (8, 9, 10)),
        ("largest_ids", {"user": 2**63 - 1, "item": 0, "timestamp": 2**63 - 1}, (2**63 - 1, 0)),
        ("oldest_timestamp", {"user": 1, "item": 2, "timestamp": -(2**63)}, (1, 2, -(2**63))),
    )
    def test_good(self, record, expected):
        self.assertEqual(event_parsing.parse_event(record)[: len(expected)], expected)

    @parameterized.named_parameters(
        ("bad_json", '{"user": 1, "item": ', "bad JSON"),
        ("not_an_object", "[1, 2, 3]", "an object"),
        ("missing_field", {"user": 1, "item": 2}, "missing field 'timestamp'"),
        ("text_id", {"user": "alice", "item": 2, "timestamp": 3}, "user must be an integer"),
        ("float_id", {"user": 1, "item": 2.5, "timestamp": 3}, "item must be an integer"),
        ("boolean_id", {"user": True, "item": 2, "timestamp": 3}, "user must be an integer"),
        ("none_id", {"user": None, "item": 2, "timestamp": 3}, "user must be an integer"),
        (
            "overflowing_text",
            {"user": b"99999999999999999999999", "item": 1, "timestamp": 1},
            "user 99999999999999999999999 is outside",
        ),
        (
            "overflowing_json",
            '{"user": 1, "item": 18446744073709551616, "timestamp": 1}',
            "item 18446744073709551616 is outside",
        ),
        (
            "just_past_int64",
            {"user": 2**63, "item": 1, "timestamp": 1},
            "user 9223372036854775808 is outside",
        ),
        ("negative_id", {"user": 1, "item": -1, "timestamp": 1}, "item -1 is outside"),
        ("reserved_key", {"user": -(2**63), "item": 1, "timestamp": 1}, "user .* is outside"),
        (
            "timestamp_past_int64",
            {"user": 1, "item": 1, "timestamp": -(2**63) - 1},
            "timestamp .* is outside",
        ),
        (
            "nan",
            '{"user": 1, "item": 2, "timestamp": NaN}',
            "timestamp must be an integer, got nan",
        ),
        (
            "infinity",
            '{"user": 1, "item": 2e400, "timestamp": 3}',
            "item must be an integer, got inf",
        ),
        ("thousands_of_digits", '{"user": ' + "9" * 5000 + "}", "bad JSON"),
        ("deep_nesting", "[" * 100_000, "bad JSON"),
        ("invalid_utf8_json", b'{"user": "\xff"}', "bad JSON"),
        (
            "invalid_utf8_value",
            {"user": b"\xff1", "item": 2, "timestamp": 3},
            "user must be an integer",
        ),
        (
            "non_ascii_digits",
            {"user": "\u0661\u0662", "item": 2, "timestamp": 3},
            "user must be an integer",
        ),
        ("underscores", {"user": b"1_000", "item": 2, "timestamp": 3}, "user must be an integer"),
        ("nul_byte", {"user": b"5\x00", "item": 2, "timestamp": 3}, "user must be an integer"),
        ("wrong_arity", (1, 2), "expected \\(user, item, timestamp\\)"),
        ("not_a_record", 42, "an event must be an object"),
    )
    def test_malformed(self, record, message):
        with self.assertRaisesRegex(ValueError, message):
            event_parsing.parse_event(record)

    def test_a_huge_text_is_refused_with_a_short_reason(self):
        with self.assertRaises(ValueError) as raised:
            event_parsing.parse_event({"user": "7" * 1_000_000, "item": 1, "timestamp": 1})
        reason = str(raised.exception)
        assert reason.startswith("user must be an integer, got '7777") and len(reason) < 200


def _read_all(source, chunk: int = 4) -> tuple[list, object]:
    events, position = [], None
    while True:
        found = source.read(chunk, timeout=0.05)
        if found is None:
            return events, position
        events += list(zip(found.users.tolist(), found.items.tolist(), strict=True))
        position = found.position


def _records(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_iterable_source_resumes_after_the_restored_position(tmp_path):
    events = [(1, 10, 0), (2, 20, 1), ("x", 30, 2), (3, 30, 3), (4, 40, 4)]
    dead = DeadLetterFile(str(tmp_path / "dead.jsonl"))
    source = sources.IterableSource(events, dead)
    first = source.read(2, 0.0)
    assert first.users.tolist() == [1, 2]
    assert first.position == {"consumed": 2, "dead_letters": 0}
    rest, position = _read_all(source)
    assert rest == [(3, 30), (4, 40)] and source.exhausted
    assert position == {"consumed": 5, "dead_letters": 1} and source.dead_letters == 1
    again = sources.IterableSource(events, DeadLetterFile(str(tmp_path / "dead2.jsonl")))
    again.restore(first.position)
    assert _read_all(again)[0] == [(3, 30), (4, 40)] and again.dead_letters == 1
    legacy = sources.IterableSource(events, dead)
    legacy.restore(3)  # a checkpoint of the earlier format: the bare count
    assert _read_all(legacy)[0] == [(3, 30), (4, 40)]


def test_iterable_source_without_a_dead_letter_sink_raises_on_bad_events():
    with pytest.raises(ValueError, match="user must be an integer"):
        sources.IterableSource([("x", 1, 2)]).read(5, 0.0)


def test_iterable_source_dead_letters_what_is_no_event_at_all(tmp_path):
    dead = DeadLetterFile(str(tmp_path / "dead.jsonl"))
    events = [object(), (1, 2**64, 3), {"user": float("nan"), "item": 1, "timestamp": 1}, (4, 5, 6)]
    source = sources.IterableSource(events, dead)
    assert _read_all(source)[0] == [(4, 5)] and source.dead_letters == 3
    reasons = [record["error"] for record in _records(dead.path)]
    assert "an event must be an object" in reasons[0]
    assert "item 18446744073709551616 is outside" in reasons[1]
    assert "user must be an integer, got nan" in reasons[2]


def test_dead_letters_are_recorded_once_per_event_across_restarts(tmp_path):
    path = str(tmp_path / "dead" / "letters.jsonl")
    first = DeadLetterFile(path)
    assert first.add("a.jsonl:0", b"x", "bad JSON") and first.add("a.jsonl:10", b"y", "bad")
    assert first.add("b.csv:5", b"z", "bad")
    restarted = DeadLetterFile(path)  # the same events read again after a crash
    assert not restarted.add("a.jsonl:0", b"x", "bad JSON")
    assert not restarted.add("a.jsonl:10", b"y", "bad")
    assert restarted.add("a.jsonl:20", b"w", "bad") and not restarted.add("b.csv:5", b"z", "bad")
    assert [record["id"] for record in _records(path)] == [
        "a.jsonl:0",
        "a.jsonl:10",
        "b.csv:5",
        "a.jsonl:20",
    ]


def test_a_dead_letter_torn_by_a_crash_is_recorded_again_on_a_line_of_its_own(tmp_path):
    path = tmp_path / "dead.jsonl"
    path.write_text('{"id": "a.jsonl:0", "error": "e", "payload": "x"}\n{"id": "a.jsonl:7", "err')
    sink = DeadLetterFile(str(path))
    assert not sink.add("a.jsonl:0", b"x", "e")
    assert sink.add("a.jsonl:7", b"y", "e") and sink.add("a.jsonl:9", b"z", "e")
    lines = path.read_text().splitlines()
    assert lines[1] == '{"id": "a.jsonl:7", "err'  # the torn part, alone
    assert [json.loads(line)["id"] for line in lines[2:]] == ["a.jsonl:7", "a.jsonl:9"]


def test_dead_letters_keep_the_reason_and_the_start_of_a_huge_payload(tmp_path):
    sink = DeadLetterFile(str(tmp_path / "dead.jsonl"))
    sink.add("a.jsonl:0", b"9" * 5_000_000, "user must be an integer")
    (record,) = _records(sink.path)
    assert record["error"] == "user must be an integer"
    assert record["payload"].startswith("9" * 100)
    assert len(record["payload"]) < dead_letters.MAX_PAYLOAD_CHARS + 100


def _append(path, text: str | bytes) -> None:
    with open(path, "ab" if isinstance(text, bytes) else "a") as out:
        out.write(text)


def _fingerprint(path, version: int = 1) -> dict:
    """What a `DirectorySource` position holds of local file `path` read to its end."""
    data = open(path, "rb").read()
    return {
        "size": len(data),
        "crc32": zlib.crc32(data[-sources.FINGERPRINT_BYTES :]),
        "version": version,
        "inode": os.stat(path).st_ino,
    }


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
    (record,) = _records(dead.path)
    assert record["id"].startswith("b.jsonl:") and "integer" in record["error"]
    _append(folder / "a.csv", "0,300\n4,40,400\n")  # the open line completes, one more arrives
    more, position = _read_all(source)
    assert more == [(3, 30), (4, 40)]
    assert position == {
        "offsets": {name: os.path.getsize(folder / name) for name in ("a.csv", "b.jsonl")},
        "files": {name: _fingerprint(folder / name) for name in ("a.csv", "b.jsonl")},
        "dead_letters": 1,
        "rewritten_files": 0,
        "rotated_files": 0,
    }
    restarted = sources.DirectorySource(str(folder), DeadLetterFile(str(tmp_path / "d2")))
    restarted.restore(position)
    _append(folder / "b.jsonl", '{"user": 6, "item": 60, "timestamp": 600}\n')
    assert _read_all(restarted)[0] == [(6, 60)] and restarted.dead_letters == 1
    legacy = sources.DirectorySource(str(folder), DeadLetterFile(str(tmp_path / "d3")))
    legacy.restore(position["offsets"])  # a checkpoint of the earlier format: bare offsets
    _append(folder / "a.csv", "7,70,700\n")
    assert _read_all(legacy)[0] == [(7, 70), (6, 60)]


@pytest.mark.parametrize("max_events", [1, 2, 3, 7])
def test_directory_events_come_in_file_order_whatever_the_read_size(tmp_path, max_events):
    """A header, a blank line and a dead letter do not count against a read's events,
    and a later file is read only once the one before has no complete line left: a
    read of 7 used to stop inside c.csv after its header and go on to d.csv."""
    folder = tmp_path / "events"
    folder.mkdir()
    _append(folder / "b.jsonl", '{"user": 1, "item": 1, "timestamp": 1}\n{"user": "bad"}\n')
    _append(folder / "c.csv", "user,item,timestamp\n" + "".join(f"2,{i},{i}\n" for i in range(8)))
    _append(folder / "d.csv", "\n3,0,0\n3,1,1\n")
    source = sources.DirectorySource(str(folder), DeadLetterFile(str(tmp_path / "dead.jsonl")))
    chunks = []
    while (chunk := source.read(max_events, 0.0)) is not None:
        chunks.append(list(zip(chunk.users.tolist(), chunk.items.tolist(), strict=True)))
    assert [len(chunk) for chunk in chunks[:-1]] == [max_events] * (len(chunks) - 1)
    assert [event for chunk in chunks for event in chunk] == [
        (1, 1),
        *((2, i) for i in range(8)),
        (3, 0),
        (3, 1),
    ]
    # A file longer than one read's bytes is read to its end before the next.
    big = sources.DirectorySource(str(folder), DeadLetterFile(str(tmp_path / "d2")), read_bytes=64)
    order = []
    while (chunk := big.read(100, 0.0)) is not None:
        order += chunk.users.tolist()
    assert order == [1] + [2] * 8 + [3, 3]


PLAIN_LINE = b"12,3400,978300760\n"


@pytest.mark.parametrize(
    "line, plain",
    [
        (PLAIN_LINE, True),
        (b"007,1,0\r\n", True),  # leading zeros, CRLF
        (b"9" * 18 + b",1,1\n", True),
        (b"9" * 19 + b",1,1\n", False),  # past 18 digits
        (b"1,2,-3\n", False),  # a negative timestamp: the general path takes it
        (b"+1,2,3\n", False),
        (b" 1,2,3\n", False),
        (b"1,2,3 \n", False),
        (b"1,2\n", False),
        (b"1,2,3,4\n", False),
        (b"\n", False),  # a blank line
        (b"1,2,3\r4,5,6\n", False),  # a lone CR ends a line too
        ("١,2,3\n".encode(), False),  # an Arabic digit
        (b"user,item,timestamp\n", False),
    ],
)
def test_plain_csv_lines_convert_at_once_as_line_by_line_parsing_does(line, plain):
    """Runs of plain CSV lines are found from a line's start, and converted at once
    with the values `parse_line` gives each line, up to `limit` lines; a line that is
    not plain is left out of every run, to be read on its own."""
    block = PLAIN_LINE + line + PLAIN_LINE
    runs = event_parsing.plain_csv_runs(block)
    assert runs == ([(0, len(block))] if plain else [(0, 18), (18 + len(line), len(block))])
    if plain:
        events, ends = event_parsing.plain_csv_events(block, 100)
        expected = [event_parsing.parse_line(text.strip(), True) for text in block.splitlines()]
        assert [tuple(event) for event in events.tolist()] == expected
        assert ends.tolist() == [18, 18 + len(line), len(block)]
    events, ends = event_parsing.plain_csv_events(3 * PLAIN_LINE, 2)
    assert events.tolist() == [[12, 3400, 978300760]] * 2 and ends.tolist() == [18, 36]


def test_directory_csv_reads_the_same_events_and_ids_at_once_as_line_by_line(tmp_path, monkeypatch):
    """A CSV file of plain lines with a header and odd lines among them, read at every
    read size and chunk: the events, their ids (``file:offset``) and dead letters are
    those of its lines parsed one at a time, and only the lines that are not plain
    are parsed so."""
    folder = tmp_path / "events"
    folder.mkdir()
    lines = [b"user,item,timestamp\n"] + [b"%d,%d,%d\n" % (i, 7 * i, 100 + i) for i in range(60)]
    odd = [b"\n", b"5,5,-5\r\n", b"x,1,1\n", b" 6,6,6\n"]
    lines[20:20] = odd
    data = b"".join(lines)
    _append(folder / "a.csv", data)
    expected, offset = [], 0
    for line in lines:
        if offset and line.strip() and not line.startswith(b"x"):
            expected.append((event_parsing.parse_line(line.strip(), True), f"a.csv:{offset}"))
        offset += len(line)
    one_at_a_time = []

    def parse_line(text, is_csv):
        one_at_a_time.append(text)
        return event_parsing.parse_line(text, is_csv)

    monkeypatch.setattr(files, "parse_line", parse_line)
    for read_bytes, chunk in ((64, 3), (1 << 20, 7), (1 << 20, 1000)):
        dead = DeadLetterFile(str(tmp_path / f"dead-{read_bytes}-{chunk}.jsonl"))
        source = sources.DirectorySource(str(folder), dead, read_bytes=read_bytes)
        read, one_at_a_time[:] = [], []
        while (found := source.read(chunk, 0.0)) is not None:
            columns = (found.users, found.items, found.timestamps)
            events = zip(*(column.tolist() for column in columns), strict=True)
            read += list(zip(events, found.ids, strict=True))
        assert read == expected and source.offsets == {"a.csv": len(data)}
        assert [record["id"] for record in _records(dead.path)] == [f"a.csv:{data.index(b'x,1')}"]
        assert sorted(set(one_at_a_time)) == sorted(line.strip() for line in odd if line.strip())


def test_directory_source_waits_quietly_for_a_missing_folder(tmp_path):
    source = sources.DirectorySource(str(tmp_path / "later"), DeadLetterFile(str(tmp_path / "d")))
    assert source.read(10, 0.05) is None


def _bad_lines_folder(tmp_path):
    folder = tmp_path / "events"
    folder.mkdir()
    _append(
        folder / "a.jsonl",
        '{"user": 1, "item": 10, "timestamp": 1}\n'
        '{"user": 99999999999999999999999, "item": 1, "timestamp": 1}\n'
        '{"user": 2, "item": 20, "timestamp": NaN}\n'
        '{"user": -4, "item": 20, "timestamp": 2}\n'
        + ("[" * 100_000)
        + "\n"
        + '{"user": 2, "item": 20, "timestamp": 2}\n',
    )
    _append(folder / "b.csv", b"3,30,3\n9223372036854775808,1,1\n\xff\xfe,1,1\n4,40,4\n")
    return folder


def test_directory_lines_that_cannot_be_examples_are_dead_lettered_and_reading_goes_on(tmp_path):
    folder = _bad_lines_folder(tmp_path)
    dead = DeadLetterFile(str(tmp_path / "dead.jsonl"))
    source = sources.DirectorySource(str(folder), dead)
    events, position = _read_all(source, chunk=100)
    assert sorted(events) == [(1, 10), (2, 20), (3, 30), (4, 40)]
    assert source.dead_letters == 6 and position["dead_letters"] == 6
    reasons = {record["id"]: record["error"] for record in _records(dead.path)}
    assert [key.split(":")[0] for key in reasons] == ["a.jsonl"] * 4 + ["b.csv"] * 2
    reasons = list(reasons.values())
    assert "user 99999999999999999999999 is outside" in reasons[0]
    assert "timestamp must be an integer, got nan" in reasons[1]
    assert "user -4 is outside" in reasons[2] and "bad JSON" in reasons[3]
    assert "user 9223372036854775808 is outside" in reasons[4]
    assert "user must be an integer" in reasons[5]


def test_directory_dead_letters_once_and_counts_the_total_over_restarts(tmp_path):
    folder = _bad_lines_folder(tmp_path)
    path = str(tmp_path / "dead.jsonl")
    crashed = sources.DirectorySource(str(folder), DeadLetterFile(path))
    _read_all(crashed, chunk=100)  # dead-lettered, then killed before any checkpoint
    again = sources.DirectorySource(str(folder), DeadLetterFile(path))
    again.restore(None)
    first, position = _read_all(again, chunk=100)
    assert len(first) == 4 and again.dead_letters == 6 and len(_records(path)) == 6
    _append(folder / "b.csv", "x,1,1\n5,50,5\n")
    after_checkpoint = sources.DirectorySource(str(folder), DeadLetterFile(path))
    after_checkpoint.restore(position)
    assert _read_all(after_checkpoint)[0] == [(5, 50)]
    assert after_checkpoint.dead_letters == 7 and len(_records(path)) == 7


def test_a_line_longer_than_a_read_is_dead_lettered_once_its_end_is_written(tmp_path):
    folder = tmp_path / "events"
    folder.mkdir()
    dead = DeadLetterFile(str(tmp_path / "dead.jsonl"))
    source = sources.DirectorySource(str(folder), dead, read_bytes=64)
    long_line = '{"user": 1, "item": 2, "timestamp": 3, "note": "' + "n" * 300
    _append(folder / "a.jsonl", '{"user": 1, "item": 10, "timestamp": 1}\n' + long_line)
    assert _read_all(source)[0] == [(1, 10)]  # the long line is still being written
    assert source.dead_letters == 0
    _append(folder / "a.jsonl", '"}\n{"user": 2, "item": 20, "timestamp": 2}\n')
    events, position = _read_all(source)
    assert events == [(2, 20)] and source.dead_letters == 1
    assert position["offsets"]["a.jsonl"] == os.path.getsize(folder / "a.jsonl")
    (record,) = _records(dead.path)
    assert record["id"] == "a.jsonl:40" and record["payload"] == long_line[:64]
    assert f"line of {len(long_line) + 3} bytes, longer than the 64 read at once" in record["error"]


# ---------------------------------------------------------------------------
# Event files that change under the trainer (real files, changed in place, replaced,
# cut short or removed between two reads of one source, or of two across a restart)


def _csv_lines(users) -> str:
    return "".join(f"{user},{user},{user}\n" for user in users)


def _users(events) -> list[int]:
    return [user for user, _ in events]


def _copy_truncate(path, new: str) -> None:
    """logrotate's copytruncate: the file copied aside (a name the source ignores) and
    emptied in place (the same inode), then the writer's next events."""
    shutil.copyfile(path, f"{path}.1")
    os.truncate(path, 0)
    _append(path, new)


def _replace(path, new: str) -> None:
    """A new file under the same name (another inode), as ``mv new a.csv`` leaves."""
    with open(f"{path}.new", "w") as out:
        out.write(new)
    os.replace(f"{path}.new", path)


def _overwrite(path, new: str) -> None:
    """The file rewritten in place (the same inode), as ``cat new > a.csv`` does."""
    with open(path, "w") as out:
        out.write(new)


def _shorten(path, new: str) -> None:
    """The file cut short, to the length of `new` (its first lines)."""
    os.truncate(path, len(new))


def _file_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("events file")]


def _rewritten(
    folder, name: str, change: str, version: int, count: int, read_to: int | None = None
) -> str:
    """The warning of a rewritten file; `read_to`: the offset of a replaced one (another
    inode), read to its end, which is nowhere in the folder."""
    text = (
        f"events file {name} in {folder} was rewritten ({change}): reading it again from "
        f"its start, as version {version} of it ({count} rewritten files in all)"
    )
    if read_to is None:
        return text
    return (
        f"{text}; the file read before is nowhere in the folder: its 0 bytes after byte "
        f"{read_to:,} when last read, and any written since, are unread"
    )


@pytest.mark.parametrize(
    "rewrite, new_users, change",
    [
        (_copy_truncate, range(100, 110), "now 128 bytes, shorter than the 368 read"),
        (_replace, range(100, 150), "another file: inode {old}, now {new}"),
        (_overwrite, range(100, 150), "its bytes before byte 368 changed"),
        (_shorten, range(10, 20), "now 98 bytes, shorter than the 368 read"),
    ],
)
def test_a_file_rewritten_while_the_trainer_was_stopped_is_read_again_from_its_start(
    tmp_path, caplog, rewrite, new_users, change
):
    """The checkpointed offset of a file rewritten since (rotated by copy and truncate,
    replaced, overwritten, cut short) means nothing in it: the restarted source reads it
    again from its start, says so once, and counts it."""
    folder = tmp_path / "events"
    folder.mkdir()
    path = folder / "a.csv"
    _append(path, "bad,1,1\n" + _csv_lines(range(10, 50)))  # 368 bytes
    dead_path = str(tmp_path / "dead.jsonl")
    first = sources.DirectorySource(str(folder), DeadLetterFile(dead_path))
    events, position = _read_all(first, chunk=100)
    assert _users(events) == list(range(10, 50)) and position["offsets"] == {"a.csv": 368}
    old_inode = os.stat(path).st_ino
    rewrite(path, "bad,2,2\n" + _csv_lines(new_users))
    caplog.clear()
    restarted = sources.DirectorySource(str(folder), DeadLetterFile(dead_path))
    restarted.restore(position)
    chunk = restarted.read(100, 0.05)
    assert chunk.users.tolist() == list(new_users)
    assert chunk.ids[0] == "a.csv#2:8"  # the rewritten file's ids are its own
    change = change.format(old=old_inode, new=os.stat(path).st_ino)
    replaced = 368 if change.startswith("another file") else None
    assert _file_warnings(caplog) == [_rewritten(folder, "a.csv", change, 2, 1, replaced)]
    assert restarted.rewritten_files == 1 == chunk.position["rewritten_files"]
    assert chunk.position["offsets"] == {"a.csv": os.path.getsize(path)}
    assert chunk.position["files"] == {"a.csv": _fingerprint(path, version=2)}
    # Its bad line is a dead letter of its own, though at the offset of the old one's.
    assert [record["id"] for record in _records(dead_path)] == ["a.csv:0", "a.csv#2:0"]
    assert restarted.dead_letters == 2
    _append(path, _csv_lines([7]))
    assert _read_all(restarted)[0] == [(7, 7)] and len(_file_warnings(caplog)) == 1


def test_a_position_of_an_earlier_format_still_sees_a_file_shorter_than_its_offset(
    tmp_path, caplog
):
    """3,000 events read, the file rotated by copy and truncate and 1,000 written: from
    a position of an earlier format too (bare offsets, or offsets alone) the 1,000 are
    read, not skipped."""
    folder = tmp_path / "events"
    folder.mkdir()
    _append(folder / "a.csv", _csv_lines(range(3000)))
    offset = os.path.getsize(folder / "a.csv")
    _copy_truncate(folder / "a.csv", _csv_lines(range(5000, 6000)))
    for position in ({"a.csv": offset}, {"offsets": {"a.csv": offset}, "dead_letters": 4}):
        caplog.clear()
        source = sources.DirectorySource(str(folder), DeadLetterFile(str(tmp_path / "d")))
        source.restore(position)
        assert _users(_read_all(source, chunk=400)[0]) == list(range(5000, 6000))
        change = (
            f"now {os.path.getsize(folder / 'a.csv'):,} bytes, shorter than the {offset:,} read"
        )
        assert _file_warnings(caplog) == [_rewritten(folder, "a.csv", change, 2, 1)]
        assert source.rewritten_files == 1


def test_a_file_rewritten_under_a_running_trainer_is_read_again_from_its_start(tmp_path, caplog):
    folder = tmp_path / "events"
    folder.mkdir()
    path = folder / "a.csv"
    _append(path, _csv_lines(range(30)))
    _append(folder / "b.csv", _csv_lines(range(200, 205)))
    source = sources.DirectorySource(str(folder), DeadLetterFile(str(tmp_path / "dead")))
    assert _users(_read_all(source, chunk=100)[0]) == [*range(30), *range(200, 205)]
    read_to = os.path.getsize(path)
    _copy_truncate(path, _csv_lines(range(100, 105)))  # shorter than what was read
    assert source.read(100, 0.05).ids == [f"a.csv#2:{offset}" for offset in range(0, 60, 12)]
    _append(path, _csv_lines([105, 106]))
    assert _users(_read_all(source)[0]) == [105, 106]  # tailed on, not read again
    inode, read_to_2 = os.stat(path).st_ino, os.path.getsize(path)
    _replace(path, _csv_lines(range(300, 340)))  # longer than what was read
    assert _users(_read_all(source, chunk=100)[0]) == list(range(300, 340))
    read_to_3 = os.path.getsize(path)
    _overwrite(path, _csv_lines(range(400, 450)))  # longer again, and the same inode
    events, position = _read_all(source, chunk=100)
    assert _users(events) == list(range(400, 450))
    assert _file_warnings(caplog) == [
        _rewritten(folder, "a.csv", f"now 60 bytes, shorter than the {read_to} read", 2, 1),
        _rewritten(
            folder,
            "a.csv",
            f"another file: inode {inode}, now {os.stat(path).st_ino}",
            3,
            2,
            read_to_2,
        ),
        _rewritten(folder, "a.csv", f"its bytes before byte {read_to_3} changed", 4, 3),
    ]
    assert read_to_2 < read_to_3
    assert source.rewritten_files == 3 == position["rewritten_files"]
    assert position["files"] == {
        "a.csv": _fingerprint(path, version=4),
        "b.csv": _fingerprint(folder / "b.csv"),
    }


def test_a_file_gone_from_the_folder_is_named_once_and_read_on_if_it_comes_back(tmp_path, caplog):
    folder = tmp_path / "events"
    folder.mkdir()
    path = folder / "a.csv"
    _append(path, _csv_lines(range(10)))
    _append(folder / "b.csv", _csv_lines([100]))
    source = sources.DirectorySource(str(folder), DeadLetterFile(str(tmp_path / "dead")))
    assert len(_read_all(source)[0]) == 11
    read_to = os.path.getsize(path)
    os.rename(path, tmp_path / "aside.csv")  # out of the folder
    for _ in range(3):  # three polls, one warning
        assert source.read(10, 0.0) is None
    gone = (
        f"events file a.csv, read to byte {read_to}, is no longer in {folder}: if it comes "
        "back, it is read on from there, or from its start if it was rewritten"
    )
    assert _file_warnings(caplog) == [gone]
    _append(folder / "b.csv", _csv_lines([101]))
    chunk = source.read(10, 0.05)
    assert chunk.users.tolist() == [101] and chunk.position["offsets"]["a.csv"] == read_to
    assert chunk.position["files"]["a.csv"]["gone"] is True
    caplog.clear()
    restarted = sources.DirectorySource(str(folder), DeadLetterFile(str(tmp_path / "dead")))
    restarted.restore(chunk.position)
    assert restarted.read(10, 0.0) is None and not _file_warnings(caplog)  # named once
    os.rename(tmp_path / "aside.csv", path)  # back, and written on
    _append(path, _csv_lines([10, 11]))
    events, position = _read_all(restarted)
    assert _users(events) == [10, 11] and not _file_warnings(caplog)
    assert position["files"]["a.csv"] == _fingerprint(path) and restarted.rewritten_files == 0


# ---------------------------------------------------------------------------
# Redis (a real server from the redis_server fixture)


def _publish(client, stream: str, events) -> list[bytes]:
    pipe = client.pipeline()
    for user, item, timestamp in events:
        pipe.xadd(stream, {"user": user, "item": item, "timestamp": timestamp})
    return pipe.execute()


def _pending(client, stream="events", group="trainer") -> int:
    return client.xpending(stream, group)["pending"]


PLAIN = [b"user", b"12", b"item", b"3400", b"timestamp", b"978300760"]


@pytest.mark.parametrize(
    "flat, plain",
    [
        (PLAIN, True),
        ([b"user", b"007", b"item", b"1", b"timestamp", b"0"], True),  # leading zeros
        ([b"user", b"9" * 18, b"item", b"1", b"timestamp", b"1"], True),
        ([b"user", b"9" * 19, b"item", b"1", b"timestamp", b"1"], False),  # past 18 digits
        ([b"user", b"12\x00", b"item", b"1", b"timestamp", b"1"], False),  # numpy drops it
        ([b"user", b"\x0012", b"item", b"1", b"timestamp", b"1"], False),
        ([b"user", b"", b"item", b"1", b"timestamp", b"1"], False),
        ([b"user", b" 12", b"item", b"1", b"timestamp", b"1"], False),
        ([b"user", "١٢".encode(), b"item", b"1", b"timestamp", b"1"], False),  # Arabic digits
        ([b"user", b"-1", b"item", b"1", b"timestamp", b"1"], False),
        ([b"user", b"1,2", b"item", b"1", b"timestamp", b"1"], False),  # a comma inside
        (["user", "12", "item", "1", "timestamp", "1"], False),  # texts, not bytes
        ([b"item", b"1", b"user", b"12", b"timestamp", b"1"], False),  # another field order
        ([b"json", b'{"user": 1, "item": 2, "timestamp": 3}', b"a", b"b", b"c", b"d"], False),
    ],
)
def test_plain_redis_entries_convert_in_numpy_as_the_general_path_does(flat, plain):
    """The vectorised conversion of a reply takes only what `parse_event` takes, with
    the same values, whether the reply is all of one kind (converted as one text) or
    mixed (entry by entry in a table); the rest (and a reply it cannot lay out as a
    table) goes to the general path, entry by entry."""
    events, converted = redis_entries.plain_redis_events([PLAIN, flat, PLAIN])
    assert converted.tolist() == [True, plain, True]
    fields = dict(zip(flat[::2], flat[1::2], strict=True))
    if plain:
        assert tuple(events[1]) == event_parsing.parse_event(fields)
    alike, converted = redis_entries.plain_redis_events([flat, flat])
    assert converted.tolist() == [plain, plain]
    if plain:
        assert [tuple(row) for row in alike.tolist()] == [event_parsing.parse_event(fields)] * 2
    assert tuple(events[0]) == tuple(events[2]) == (12, 3400, 978300760)
    for odd in (None, [b"user", b"1"], PLAIN + [b"extra", b"1"]):  # deleted, short, long
        assert not redis_entries.plain_redis_events([PLAIN, odd])[1].any()


def test_redis_a_commit_inside_a_reply_acknowledges_up_to_its_position(redis_server):
    """Replies are acknowledged whole, but a position within one (no checkpoint makes
    such a position) acknowledges exactly the entries up to it, the rest later."""
    client = redis_server.client()
    ids = _publish(client, "events", [(u, u, u) for u in range(6)])
    source = redis_source.RedisSource(redis_server.client(), "events")
    assert len(source.read(6, 0.1)) == 6
    source.commit({"id": ids[3].decode(), "dead_letters": 0})
    pending = client.xpending_range("events", "trainer", "-", "+", 10)
    assert [entry["message_id"] for entry in pending] == ids[4:]
    source.commit({"id": ids[5].decode(), "dead_letters": 0})
    assert _pending(client) == 0


def test_redis_source_acknowledges_only_on_commit(redis_server):
    client = redis_server.client()
    _publish(client, "events", [(u, u * 10, u) for u in range(10)])
    source = redis_source.RedisSource(redis_server.client(), "events")
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
    crashed = redis_source.RedisSource(redis_server.client(), "events")
    checkpointed = crashed.read(5, 0.1)  # trained and checkpointed, never acknowledged
    crashed.read(5, 0.1)  # trained after the checkpoint: lost with the process
    restarted = redis_source.RedisSource(redis_server.client(), "events")
    restarted.restore(checkpointed.position)
    events, _ = _read_all(restarted, chunk=3)
    assert [user for user, _ in events] == list(range(5, 12))  # 0-4 not trained twice
    assert _pending(client) == 7  # 0-4 acknowledged at once; the rest on the next commit


def _publish_malformed(client) -> list[bytes]:
    """One good entry, then one of each way an entry can fail, then another good one."""
    client.xadd("events", {"user": 1, "item": 2, "timestamp": 3})
    bad = [
        {"json": "{not json"},
        {"user": 7, "item": 8},
        {"user": "seven", "item": 8, "timestamp": 9},
        {"user": "99999999999999999999999", "item": 1, "timestamp": 1},
        {"json": '{"user": 1, "item": 18446744073709551616, "timestamp": 1}'},
        {"user": 1, "item": -5, "timestamp": 1},
        {"json": '{"user": 1, "item": 2, "timestamp": NaN}'},
        {"user": 1, "item": 2.5, "timestamp": 1},
        {"user": "1" * 200_000, "item": 1, "timestamp": 1},
        {"user": b"\xff\xfe", "item": 1, "timestamp": 1},
        {b"\xffuser": 1, "item": 1, "timestamp": 1},
        {"json": "[" * 100_000},
    ]
    ids = [client.xadd("events", fields) for fields in bad]
    client.xadd("events", {"json": '{"user": 4, "item": 5, "timestamp": 6}'})
    return ids


def test_redis_malformed_entries_go_to_the_dead_letter_stream(redis_server):
    client = redis_server.client()
    bad_ids = _publish_malformed(client)
    client.xadd("events", {"user": 10, "item": 11, "timestamp": 12})
    source = redis_source.RedisSource(redis_server.client(), "events")
    chunk = source.read(100, 0.1)
    assert chunk.users.tolist() == [1, 4, 10] and len(chunk.ids) == 3
    assert source.dead_letters == 12 == chunk.position["dead_letters"]
    dead = client.xrange("events:dead")
    assert [entry_id for entry_id, _ in dead] == bad_ids  # keyed by the entry's own id
    assert [fields[b"id"] for _, fields in dead] == bad_ids
    errors = [fields[b"error"].decode() for _, fields in dead]
    expected = [
        "bad JSON",
        "missing field 'timestamp'",
        "user must be an integer, got 'seven'",
        "user 99999999999999999999999 is outside",
        "item 18446744073709551616 is outside",
        "item -5 is outside",
        "timestamp must be an integer, got nan",
        "item must be an integer, got '2.5'",
        "user must be an integer, got '1111",
        "user must be an integer, got b'\\xff\\xfe'",
        "missing field 'user'",
        "bad JSON",
    ]
    for error, start in zip(errors, expected, strict=True):
        assert error.startswith(start), (error, start)
    assert max(len(fields[b"payload"]) for _, fields in dead) < dead_letters.MAX_PAYLOAD_CHARS + 100
    source.commit(chunk.position)
    assert _pending(client) == 0  # dead letters are acknowledged with the rest


def test_redis_an_id_beyond_int64_among_plain_entries_is_dead_lettered(redis_server):
    client = redis_server.client()
    _publish(client, "events", [(1, 1, 1), (99999999999999999999999, 1, 1), (2, 2, 2)])
    source = redis_source.RedisSource(redis_server.client(), "events")
    chunk = source.read(10, 0.1)
    assert chunk.users.tolist() == [1, 2] and source.dead_letters == 1


def test_redis_dead_letters_once_and_counts_the_total_over_restarts(redis_server):
    client = redis_server.client()
    bad_ids = _publish_malformed(client)
    crashed = redis_source.RedisSource(redis_server.client(), "events")
    assert len(crashed.read(100, 0.1)) == 2  # dead-lettered, killed before a checkpoint
    again = redis_source.RedisSource(redis_server.client(), "events")
    again.restore(None)
    chunk = again.read(100, 0.1)
    assert len(chunk) == 2 and again.dead_letters == 12
    assert [entry_id for entry_id, _ in client.xrange("events:dead")] == bad_ids
    again.commit(chunk.position)
    newer = client.xadd("events", {"user": "x", "item": 1, "timestamp": 1})
    _publish(client, "events", [(5, 5, 5)])
    after_checkpoint = redis_source.RedisSource(redis_server.client(), "events")
    after_checkpoint.restore(chunk.position)
    assert after_checkpoint.read(100, 0.1).users.tolist() == [5]
    assert after_checkpoint.dead_letters == 13
    assert [entry_id for entry_id, _ in client.xrange("events:dead")] == [*bad_ids, newer]


def test_redis_a_connection_lost_while_dead_lettering_reads_the_reply_again(redis_server):
    client = redis_server.client()
    _publish(client, "events", [(1, 1, 1)])
    client.xadd("events", {"user": "bad", "item": 1, "timestamp": 1})
    _publish(client, "events", [(2, 2, 2)])
    source = redis_source.RedisSource(redis_server.client(), "events", max_backoff=0.05)
    dead_letter_writes = source.client.xadd

    def lose_the_connection_once(*args, **kwargs):
        source.client.xadd = dead_letter_writes
        raise redis.ConnectionError("connection lost")

    source.client.xadd = lose_the_connection_once
    assert source.read(10, 0.1) is None and source.reconnects == 1
    events, position = _read_all(source)
    assert events == [(1, 1), (2, 2)]  # nothing lost, nothing twice
    assert source.dead_letters == 1 and client.xlen("events:dead") == 1
    source.commit(position)
    assert _pending(client) == 0


def test_redis_a_dead_letter_stream_keyed_otherwise_still_gets_every_dead_letter(redis_server):
    client = redis_server.client()
    client.xadd("events:dead", {"id": "?", "error": "older", "payload": ""}, id="99999999999999-0")
    bad = client.xadd("events", {"user": "bad", "item": 1, "timestamp": 1})
    source = redis_source.RedisSource(redis_server.client(), "events")
    source.read(10, 0.1)
    assert [fields[b"id"] for _, fields in client.xrange("events:dead")] == [b"?", bad]


def test_redis_restores_a_position_of_the_earlier_format(redis_server):
    client = redis_server.client()
    _publish(client, "events", [(u, u, u) for u in range(4)])
    crashed = redis_source.RedisSource(redis_server.client(), "events")
    checkpointed = crashed.read(2, 0.1)
    restarted = redis_source.RedisSource(redis_server.client(), "events")
    restarted.restore(checkpointed.position["id"])  # a bare entry id
    assert [user for user, _ in _read_all(restarted)[0]] == [2, 3]
    counts = redis_source.RedisSource(redis_server.client(), "events")
    counts.restore({"id": checkpointed.position["id"], "dead_letters": 3})  # no lost events
    assert (counts.dead_letters, counts.lost_events) == (3, 0)


def test_redis_source_rides_out_a_server_restart(redis_server):
    client = redis_server.client()
    _publish(client, "events", [(u, u, u) for u in range(5)])
    source = redis_source.RedisSource(redis_server.client(), "events", max_backoff=0.2)
    assert source.read(5, 0.1).users.tolist() == [0, 1, 2, 3, 4]
    redis_server.kill()
    assert source.read(5, 0.1) is None  # no error: it waits and retries
    assert source.reconnects == 1  # one read, one failed attempt (and its wait)
    redis_server.start()
    _publish(redis_server.client(), "events", [(u, u, u) for u in range(5, 8)])
    events, position = _read_all(source)
    assert [user for user, _ in events] == [5, 6, 7]
    source.commit(position)
    assert _pending(redis_server.client()) == 0


def _info_logs(caplog) -> None:
    """Captures absl's info lines too, whatever an earlier test in this process set
    (saving a SavedModel puts absl's verbosity at warnings)."""
    absl_logging.set_verbosity(absl_logging.INFO)
    caplog.set_level(logging.INFO, logger="absl")


def _memory_lines(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "for memory" in r.getMessage() or "accepts writes again" in r.getMessage()
    ]


def test_redis_writes_refused_for_memory_are_waited_out_and_nothing_is_lost(redis_server, caplog):
    """Redis at maxmemory under noeviction refuses XGROUP CREATE and XADD (not reads,
    not XACK): a group that exists is read on after a reconnect, a reply whose dead
    letter is refused is read again once it is written, a new group waits to be made;
    each wait said once, its end said, its time counted; every event once."""
    _info_logs(caplog)
    client = redis_server.client()
    where = f"Redis at 127.0.0.1:{redis_server.port}"
    _publish(client, "events", [(1, 1, 1), (2, 2, 2), (3, 3, 3)])
    # (Its trim check at every read: a MULTI that Redis refuses whole at maxmemory.)
    source = redis_source.RedisSource(
        redis_server.client(), "events", max_backoff=0.05, trim_check_secs=0
    )
    assert source.read(3, 0.1).users.tolist() == [1, 2, 3]
    _publish(client, "events", [(4, 4, 4)])
    bad = client.xadd("events", {"user": "bad", "item": 1, "timestamp": 1})
    _publish(client, "events", [(5, 5, 5)])
    redis_server.kill()  # the source reconnects: XGROUP CREATE again
    assert source.read(10, 0.1) is None and source.reconnects == 1
    redis_server.start()
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)  # any use is above it
    other = redis_source.RedisSource(redis_server.client(), "events", group="other")
    deadline = time.monotonic() + 60  # (a loaded machine: the reconnect takes its time)
    while source.memory.refusing is None or other.memory.refusing is None:
        assert time.monotonic() < deadline, "no write refused for memory"
        assert other.read(10, 0.1) is None  # no group, and none can be made
        assert source.read(10, 0.1) is None  # its group is there; the dead letter is not
    assert source.reconnects == 1 and client.xlen("events:dead") == 0
    source.commit(source._position())  # XACK is no refused write
    client.config_set("maxmemory", 0)
    events, position = _read_all(source)
    assert events == [(4, 4), (5, 5)] and source.dead_letters == 1
    assert [entry_id for entry_id, _ in client.xrange("events:dead")] == [bad]
    source.commit(position)
    assert _pending(client) == 0
    assert [user for user, _ in _read_all(other)[0]] == [1, 2, 3, 4, 5]
    lines = _memory_lines(caplog)
    expected = [
        f"{where} refuses writes for memory (XGROUP CREATE: its used memory is above",
        f"{where} refuses writes for memory (XADD of a dead letter: its used memory",
        f"{where} accepts writes again, after",
        f"{where} accepts writes again, after",
    ]
    assert len(lines) == 4 and all(map(str.startswith, lines, expected)), lines
    assert source.memory_wait_seconds > 0 and other.memory_wait_seconds > 0


def test_redis_a_stream_deleted_and_made_again_under_the_trainer_is_read_from_its_start(
    redis_server, caplog
):
    """Its ids restart below the last one read (here: given by the producer), its group
    is gone: said once, the loss uncounted, the new stream read from its start, each
    entry once, and acknowledged by a commit."""
    client = redis_server.client()
    _publish(client, "events", [(1, 1, 1), (2, 2, 2)])
    source = redis_source.RedisSource(redis_server.client(), "events", trim_check_secs=0)
    first = source.read(10, 0.1)
    assert first.users.tolist() == [1, 2]
    client.delete("events")
    for user in (3, 4, 5):
        client.xadd("events", {"user": user, "item": user, "timestamp": user}, id=f"0-{user}")
    assert source.read(10, 0.1) is None
    events, position = _read_all(source)
    assert events == [(3, 3), (4, 4), (5, 5)] and position["id"] == "0-5"
    assert position["lost_events_exact"] is False and source.lost_events == 0
    gone = [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()]
    assert len(gone) == 1 and f"after {first.ids[-1]}, the last the trainer read" in gone[0]
    source.commit(position)
    assert _pending(client) == 0


def test_entries_delivered_in_a_reply_lost_to_a_dropped_connection_are_read_again(
    redis_server,
):
    client = redis_server.client()
    _publish(client, "events", [(u, u, u) for u in range(5)])
    source = redis_source.RedisSource(redis_server.client(), "events", max_backoff=0.2)
    assert source.read(2, 0.1).users.tolist() == [0, 1]
    # Redis hands 2 and 3 to this consumer, but the reply never reaches the source.
    client.xreadgroup("trainer", "trainer-0", {"events": ">"}, count=2)
    redis_server.kill()
    assert source.read(5, 0.1) is None
    redis_server.start()
    events, _ = _read_all(source)
    assert [user for user, _ in events] == [2, 3, 4]  # nothing lost, nothing twice


@pytest.mark.integration
def test_the_test_redis_server_moves_off_a_port_taken_before_its_first_start(tmp_path):
    """The suite's workers draw free ports side by side: one taken between the draw and
    the first start must not fail the test using the server; a restart keeps its port."""
    server = RedisServer(str(tmp_path / "redis"))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", server.port))
        squatter.listen()
        taken = server.port
        server.start()
        try:
            assert server.port != taken and server.client().ping()
            moved_to = server.port
            server.kill()
            server.start()  # clients hold the URL: the same port again
            assert server.port == moved_to and server.client().ping()
        finally:
            server.kill()


# ---------------------------------------------------------------------------
# Redis: entries trimmed before the trainer read them (real MAXLEN trimming, on a
# server without stream counters, Redis 6.2, and one with them, Valkey 9: Redis 7's)


def _publish_capped(client, users, maxlen: int) -> None:
    """Adds an event per user as a producer capping the stream does (XADD MAXLEN, exact:
    ``~`` trims whole nodes of ~100 entries, none of so short a stream)."""
    for user in users:
        fields = {"user": user, "item": user, "timestamp": user}
        client.xadd("events", fields, maxlen=maxlen, approximate=False)


def _counts_entries(client) -> bool:
    """Whether the server keeps stream counters (Redis >= 7: entries-added)."""
    return "entries-added" in client.xinfo_stream("events")


def _trim_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "trimmed" in r.getMessage()]


ADVICE = (
    "raise the stream's MAXLEN above the events added during the trainer's longest lag "
    "or stop, or shorten those (docs/operations.md: Redis Streams: lost events)"
)


def _cannot_count(last_read: str) -> str:
    return (
        f"stream 'events' was trimmed past {last_read}, the last entry the trainer's "
        "consumer group read: entries added after it, if any, were trimmed before the "
        "trainer read them, and cannot be counted (this Redis keeps no stream counters "
        f"(Redis >= 7 does)), so lost events leave them out; {ADVICE}"
    )


def test_redis_entries_trimmed_while_the_trainer_was_stopped_are_counted_once(
    each_redis_server, caplog
):
    client = each_redis_server.client()
    _publish(client, "events", [(u, u, u) for u in range(10)])
    first = redis_source.RedisSource(each_redis_server.client(), "events")
    trained = first.read(4, 0.1)
    first.commit(trained.position)  # 0-3 trained and checkpointed; then it stops
    _publish_capped(client, range(10, 30), maxlen=5)  # 4-24 trimmed unread
    caplog.clear()
    restarted = redis_source.RedisSource(each_redis_server.client(), "events")
    restarted.restore(trained.position)
    events, position = _read_all(restarted, chunk=10)
    assert [user for user, _ in events] == list(range(25, 30))
    if _counts_entries(client):
        assert _trim_warnings(caplog) == [
            "21 entries of stream 'events' were trimmed before the trainer read them: "
            f"they are not trained (21 lost events in all); {ADVICE}"
        ]
        assert restarted.lost_events == 21 == position["lost_events"]
    else:
        assert _trim_warnings(caplog) == [_cannot_count(trained.position["id"])]
        assert restarted.lost_events == 0 == position["lost_events"]
    restarted.commit(position)
    lost = restarted.lost_events
    _publish_capped(client, range(30, 32), maxlen=5)  # trims only entries read
    caplog.clear()
    again = redis_source.RedisSource(each_redis_server.client(), "events")
    again.restore(position)  # the total travels in the position, and is not counted twice
    events, position = _read_all(again, chunk=10)
    again.close()
    assert [user for user, _ in events] == [30, 31]
    assert again.lost_events == lost == position["lost_events"] and not _trim_warnings(caplog)


def test_redis_a_restart_from_a_checkpoint_before_the_trimmed_entries_counts_them_again(
    valkey_server,
):
    """Killed after reading past trimmed entries and before its next checkpoint, the
    trainer restarts from a position that does not count them: they are counted again
    (the group's counter, not this process, says how many it skipped)."""
    client = valkey_server.client()
    _publish(client, "events", [(u, u, u) for u in range(10)])
    first = redis_source.RedisSource(valkey_server.client(), "events")
    checkpointed = first.read(4, 0.1)
    first.commit(checkpointed.position)
    _publish_capped(client, range(10, 30), maxlen=5)
    crashed = redis_source.RedisSource(valkey_server.client(), "events")
    crashed.restore(checkpointed.position)
    assert len(_read_all(crashed)[0]) == 5 and crashed.lost_events == 21  # then killed
    restarted = redis_source.RedisSource(valkey_server.client(), "events")
    restarted.restore(checkpointed.position)
    events, _ = _read_all(restarted)  # 25-29 again, from the pending list
    assert [user for user, _ in events] == list(range(25, 30))
    assert restarted.lost_events == 21
    _publish_capped(client, [30], maxlen=5)
    assert restarted.read(10, 0.1).position["lost_events"] == 21  # the next chunk's


def test_redis_a_loss_the_counters_cannot_tell_is_reported_uncounted(valkey_server, caplog):
    """Redis forgets a group's entries-read once it reads past an entry deleted with
    XDEL; restored from a position of the earlier format (no count of its own either),
    the source cannot count what was trimmed, and says so."""
    client = valkey_server.client()
    ids = _publish(client, "events", [(u, u, u) for u in range(10)])
    first = redis_source.RedisSource(valkey_server.client(), "events")
    assert len(first.read(3, 0.1)) == 3
    client.xdel("events", ids[5])
    chunk = first.read(4, 0.1)
    first.commit(chunk.position)
    client.xtrim("events", maxlen=1, approximate=False)  # 8 trimmed unread
    caplog.clear()
    restarted = redis_source.RedisSource(valkey_server.client(), "events")
    restarted.restore({"id": chunk.position["id"], "dead_letters": 0})
    assert _read_all(restarted)[0] == [(9, 9)]
    assert _trim_warnings(caplog) == [
        _cannot_count(ids[7].decode()).replace(
            "this Redis keeps no stream counters (Redis >= 7 does)",
            "the group's entries-read is unknown: entries deleted with XDEL, or XGROUP SETID",
        )
    ]
    assert restarted.lost_events == 0


def test_redis_entries_trimmed_between_reads_are_counted(each_redis_server, caplog):
    client = each_redis_server.client()
    ids = _publish(client, "events", [(u, u, u) for u in range(8)])
    source = redis_source.RedisSource(each_redis_server.client(), "events", trim_check_secs=0)
    assert source.read(8, 0.1).users.tolist() == list(range(8))
    _publish_capped(client, range(8, 20), maxlen=4)  # 8-15 trimmed before the next read
    caplog.clear()
    chunk = source.read(10, 0.1)
    assert chunk.users.tolist() == [16, 17, 18, 19]
    if _counts_entries(client):
        assert _trim_warnings(caplog) == [
            "8 entries of stream 'events' were trimmed before the trainer read them: "
            f"they are not trained (8 lost events in all); {ADVICE}"
        ]
        assert source.lost_events == 8 == chunk.position["lost_events"]
    else:
        assert _trim_warnings(caplog) == [_cannot_count(ids[7].decode())]
        assert source.lost_events == 0 == chunk.position["lost_events"]


def test_redis_entries_skipped_between_two_checks_are_counted_by_the_next(valkey_server):
    """A check every few seconds: entries trimmed and skipped by a read between two
    checks are counted by the next one (the last: at close, for the run's summary)."""
    client = valkey_server.client()
    _publish(client, "events", [(u, u, u) for u in range(8)])
    source = redis_source.RedisSource(valkey_server.client(), "events", trim_check_secs=3600)
    assert source.read(8, 0.1).users.tolist() == list(range(8))  # checked before it
    _publish_capped(client, range(8, 20), maxlen=4)
    assert source.read(10, 0.1).users.tolist() == [16, 17, 18, 19]  # not checked
    assert source.lost_events == 0
    source.close()
    assert source.lost_events == 8


def test_redis_pending_entries_trimmed_before_training_are_lost_not_dead_letters(
    each_redis_server, caplog
):
    client = each_redis_server.client()
    _publish(client, "events", [(u, u, u) for u in range(10)])
    crashed = redis_source.RedisSource(each_redis_server.client(), "events")
    checkpointed = crashed.read(2, 0.1)
    crashed.commit(checkpointed.position)
    assert len(crashed.read(4, 0.1)) == 4  # 2-5 delivered, then the trainer is killed
    client.xtrim("events", maxlen=6, approximate=False)  # 0-3 trimmed: 2 and 3 pending
    caplog.clear()
    restarted = redis_source.RedisSource(each_redis_server.client(), "events")
    restarted.restore(checkpointed.position)
    events, position = _read_all(restarted, chunk=10)
    restarted.close()
    assert [user for user, _ in events] == list(range(4, 10))
    assert restarted.dead_letters == 0 and client.xlen("events:dead") == 0
    assert _trim_warnings(caplog) == [
        "2 entries of stream 'events' were delivered to the trainer and trimmed before "
        f"training: they are not trained (2 lost events in all); {ADVICE}"
    ]
    assert restarted.lost_events == 2 == position["lost_events"]
    restarted.commit(position)
    assert _pending(client) == 0  # acknowledged with the rest


def test_redis_a_trainer_keeping_up_with_a_capped_stream_loses_nothing(each_redis_server, caplog):
    """MAXLEN trims only entries already read: nothing lost, nothing reported."""
    client = each_redis_server.client()
    source = redis_source.RedisSource(each_redis_server.client(), "events", trim_check_secs=0)
    trained = []
    for start in range(0, 30, 3):
        _publish_capped(client, range(start, start + 3), maxlen=5)
        chunk = source.read(10, 0.1)
        trained += chunk.users.tolist()
        source.commit(chunk.position)
    assert trained == list(range(30)) and source.lost_events == 0
    assert not _trim_warnings(caplog)
    # All read, then exactly MAXLEN more: the stream's first entry is after the last
    # one read, and is its successor. Redis 7 counters tell; without them, it may not be.
    last_read = chunk.ids[-1]
    _publish_capped(client, range(30, 35), maxlen=5)
    assert _read_all(source, chunk=10)[0] == [(u, u) for u in range(30, 35)]
    source.close()
    assert source.lost_events == 0
    expected = [] if _counts_entries(client) else [_cannot_count(last_read)]
    assert _trim_warnings(caplog) == expected


# ---------------------------------------------------------------------------
# Redis: a restore before entries the group delivered since (a damaged newest checkpoint
# makes the trainer fall back to an older one, whose later entries were acknowledged)


def _acknowledged_past_the_restored_position(server) -> tuple[list[bytes], dict]:
    """12 events: 0-3 and 4-7 trained, each checkpointed and acknowledged, 8-9 trained
    and pending when the trainer died; returns the entry ids and the position of the
    first checkpoint, the one a restore falls back to when the second is damaged."""
    client = server.client()
    ids = _publish(client, "events", [(u, u, u) for u in range(12)])
    crashed = redis_source.RedisSource(server.client(), "events")
    restored = crashed.read(4, 0.1)
    crashed.commit(restored.position)
    crashed.commit(crashed.read(4, 0.1).position)
    assert len(crashed.read(2, 0.1)) == 2 and _pending(client) == 2
    return ids, restored.position


def _uncounted(restored: str, end: bytes, because: str) -> str:
    return (
        f"stream 'events' was trimmed past {restored}, the position restored, before the "
        f"trainer read again the entries after it (up to {end.decode()}): any of them "
        f"trimmed are in no model and cannot be counted ({because}), so lost events is a "
        f"lower bound from now on; {ADVICE}"
    )


NO_COUNTERS = "this Redis keeps no stream counters (Redis >= 7 does)"


def test_redis_a_restore_before_acknowledged_entries_reads_them_again(each_redis_server, caplog):
    """The entries after the restored position are read again, acknowledged or pending,
    once each and in order, before new ones; a commit acknowledges them as usual."""
    ids, restored = _acknowledged_past_the_restored_position(each_redis_server)
    client = each_redis_server.client()
    source = redis_source.RedisSource(each_redis_server.client(), "events")
    source.restore(restored)
    chunks = []
    while (chunk := source.read(3, 0.1)) is not None:
        chunks.append(chunk)
    assert [chunk.users.tolist() for chunk in chunks] == [[4, 5, 6], [7, 8, 9], [10, 11]]
    assert [entry_id for chunk in chunks for entry_id in chunk.ids] == [
        entry_id.decode() for entry_id in ids[4:]
    ]
    assert _pending(client) == 4  # 8-11, until a commit
    source.commit(chunks[1].position)
    assert _pending(client) == 2
    source.commit(chunks[2].position)
    source.close()
    assert _pending(client) == 0
    assert (source.lost_events, source.lost_events_exact) == (0, True)
    assert chunks[2].position["lost_events_exact"] is True and not _trim_warnings(caplog)


def test_redis_a_restore_while_redis_refuses_writes_for_memory_waits_then_reads_again(
    redis_server, caplog
):
    """At maxmemory Redis refuses a MULTI whole, the reads of the entries to read again
    too: the restored trainer says so once and waits, then reads them as usual."""
    ids, restored = _acknowledged_past_the_restored_position(redis_server)
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    _info_logs(caplog)
    source = redis_source.RedisSource(redis_server.client(), "events", max_backoff=0.05)
    source.restore(restored)
    for _ in range(3):
        assert source.read(3, 0.1) is None
    client.config_set("maxmemory", 0)
    events, _ = _read_all(source, chunk=3)
    assert [user for user, _ in events] == list(range(4, 12))
    where = f"Redis at 127.0.0.1:{redis_server.port}"
    lines = _memory_lines(caplog)
    expected = [
        f"{where} refuses writes for memory (MULTI of the entries to read again after a",
        f"{where} accepts writes again, after",
    ]
    assert len(lines) == 2 and all(map(str.startswith, lines, expected)), lines
    assert source.memory_wait_seconds > 0


def test_redis_entries_gone_from_those_read_again_are_counted_where_the_counters_tell(
    each_redis_server, caplog
):
    ids, restored = _acknowledged_past_the_restored_position(each_redis_server)
    client = each_redis_server.client()
    client.xtrim("events", minid=ids[9], approximate=False)  # 4-7 acknowledged, 8 pending
    caplog.clear()
    source = redis_source.RedisSource(each_redis_server.client(), "events")
    source.restore(restored)
    events, position = _read_all(source, chunk=3)
    source.commit(position)
    source.close()
    assert [user for user, _ in events] == [9, 10, 11]
    assert _pending(client) == 0  # the pending entry trimmed too
    pending_lost = (
        "1 entries of stream 'events' were delivered to the trainer and trimmed before "
        f"training: they are not trained (1 lost events in all); {ADVICE}"
    )
    if _counts_entries(client):
        assert _trim_warnings(caplog) == [
            pending_lost,
            "4 entries of stream 'events' were trimmed or deleted before the restored "
            f"trainer read them again: they are not trained (5 lost events in all); {ADVICE}",
        ]
        assert source.lost_events == 5 == position["lost_events"]
        assert source.lost_events_exact and position["lost_events_exact"]
    else:
        warning = _uncounted(restored["id"], ids[9], NO_COUNTERS)
        assert _trim_warnings(caplog) == [pending_lost, warning]
        assert source.lost_events == 1 == position["lost_events"]
        assert not source.lost_events_exact and not position["lost_events_exact"]
    restarted = redis_source.RedisSource(each_redis_server.client(), "events")
    restarted.restore(position)  # both travel in the position
    assert (restarted.lost_events, restarted.lost_events_exact) == (
        source.lost_events,
        source.lost_events_exact,
    )


def test_redis_a_connection_lost_while_reading_again_goes_on_where_it_was(redis_server):
    ids, restored = _acknowledged_past_the_restored_position(redis_server)
    source = redis_source.RedisSource(redis_server.client(), "events", max_backoff=0.2)
    source.restore(restored)
    assert source.read(2, 0.1).users.tolist() == [4, 5]
    redis_server.kill()
    assert source.read(2, 0.1) is None and source.reconnects == 1
    redis_server.start()
    events, position = _read_all(source, chunk=2)
    assert [user for user, _ in events] == [6, 7, 8, 9, 10, 11]  # nothing lost, nothing twice
    source.commit(position)
    assert _pending(redis_server.client()) == 0


def test_redis_a_position_of_an_earlier_format_reads_again_but_cannot_count(valkey_server, caplog):
    ids, restored = _acknowledged_past_the_restored_position(valkey_server)
    client = valkey_server.client()
    client.xtrim("events", minid=ids[6], approximate=False)  # 4 and 5 were acknowledged
    caplog.clear()
    source = redis_source.RedisSource(valkey_server.client(), "events")
    source.restore(restored["id"])  # a bare entry id: no count of the entries read
    events, position = _read_all(source, chunk=10)
    assert [user for user, _ in events] == list(range(6, 12))
    because = "the position restored holds no count of the entries read"
    assert _trim_warnings(caplog) == [_uncounted(restored["id"], ids[9], because)]
    assert (source.lost_events, position["lost_events_exact"]) == (0, False)


def test_redis_a_group_that_does_not_exist_starts_at_the_restored_position(redis_server):
    """The group deleted, or the stream moved to a server without it: nothing after the
    restored position was delivered to it, and what is before it was trained."""
    client = redis_server.client()
    ids = _publish(client, "events", [(u, u, u) for u in range(6)])
    source = redis_source.RedisSource(redis_server.client(), "events")
    source.restore({"id": ids[2].decode(), "dead_letters": 0, "lost_events": 0})
    assert [user for user, _ in _read_all(source)[0]] == [3, 4, 5]


def _rename_rotate(path, renamed: str, new: str) -> None:
    """logrotate's default (``create``): the file renamed, then a new one of its name."""
    os.rename(path, path.parent / renamed)
    _append(path, new)


def _ids(path, name: str, start: int = 0) -> list[str]:
    """The source ids of file `path`'s lines from byte `start` on, as `name`'s."""
    offsets = np.cumsum([0] + [len(line) for line in open(path, "rb")])[:-1]
    return [f"{name}:{offset}" for offset in offsets.tolist() if offset >= start]


def _renamed_warning(folder, name: str, renamed: str, offset: int) -> str:
    return (
        f"events file {name} in {folder} was renamed to {renamed} (rotated): reading the rest "
        f"of it, from byte {offset:,}, before the new file named {name}"
    )


def _read_then_rename(tmp_path, read: range, tail: range, renamed: str, new: range):
    """`read` events read from ``a.csv``, then `tail` appended, the file renamed to
    `renamed` and `new` written to a new ``a.csv``: the folder, the new file's path, the
    source that read and its position."""
    folder = tmp_path / "events"
    folder.mkdir()
    path = folder / "a.csv"
    _append(path, _csv_lines(read))
    source = sources.DirectorySource(str(folder), DeadLetterFile(str(tmp_path / "dead")))
    _, position = _read_all(source, chunk=100)
    _append(path, _csv_lines(tail))
    _rename_rotate(path, renamed, _csv_lines(new))
    return folder, path, source, position


@pytest.mark.parametrize("renamed", ["a.csv.1", "a-1.csv"])  # the second an event file too
@pytest.mark.parametrize("stopped", [True, False])
def test_a_file_rotated_by_rename_is_read_to_its_end_before_the_new_one(
    tmp_path, caplog, renamed, stopped
):
    """30 events read, 10 more appended, the file renamed and 5 written to a new one of
    its name: the 10 are read (once, under the old name's ids), then the 5; one line
    names both files. A renamed file that is an event file is not read from its start
    (`a-1.csv` sorts before `a.csv`)."""
    caplog.clear()
    folder, path, source, position = _read_then_rename(
        tmp_path, range(30), range(30, 40), renamed, range(100, 105)
    )
    read_to = position["offsets"]["a.csv"]
    if stopped:
        source = sources.DirectorySource(str(folder), DeadLetterFile(str(tmp_path / "dead")))
        source.restore(position)
    ids, users = [], []
    while (chunk := source.read(4, 0.05)) is not None:  # the tail takes 3 reads
        ids, users, position = ids + chunk.ids, users + chunk.users.tolist(), chunk.position
    assert users == [*range(30, 40), *range(100, 105)]
    tail = _ids(folder / renamed, "a.csv", start=read_to)
    assert ids == tail + _ids(path, "a.csv#2")
    assert _file_warnings(caplog) == [_renamed_warning(folder, "a.csv", renamed, read_to)]
    assert (source.rotated_files, source.rewritten_files) == (1, 0)
    assert position["rotated_files"] == 1 and "renamed" not in position["files"]["a.csv"]
    _append(path, _csv_lines([106]))
    assert _read_all(source)[0] == [(106, 106)]  # tailed on; nothing read again
    if renamed.endswith(".csv"):
        assert source.offsets[renamed] == os.path.getsize(folder / renamed)


def test_a_restart_in_the_middle_of_a_renamed_files_tail_goes_on_under_its_new_name(
    tmp_path, caplog
):
    """Stopped after part of a renamed file's tail, and renamed once more meanwhile
    (``a.csv.1`` -> ``a.csv.2``): the rest of the tail, then the new file, each once."""
    folder, path, source, position = _read_then_rename(
        tmp_path, range(10), range(10, 20), "a.csv.1", range(100, 103)
    )
    read_to = position["offsets"]["a.csv"]
    chunk = source.read(4, 0.05)
    assert chunk.users.tolist() == [10, 11, 12, 13]
    assert chunk.position["files"]["a.csv"]["renamed"] == "a.csv.1"
    os.rename(folder / "a.csv.1", folder / "a.csv.2")
    restarted = sources.DirectorySource(str(folder), DeadLetterFile(str(tmp_path / "dead")))
    restarted.restore(chunk.position)
    ids, users = [], []
    while (more := restarted.read(100, 0.05)) is not None:
        ids, users = ids + more.ids, users + more.users.tolist()
    assert users == [*range(14, 20), *range(100, 103)]
    assert ids == _ids(folder / "a.csv.2", "a.csv", start=read_to)[4:] + _ids(path, "a.csv#2")
    assert restarted.rotated_files == 1
    went_on_from = chunk.position["offsets"]["a.csv"]
    assert _file_warnings(caplog)[-1] == _renamed_warning(folder, "a.csv", "a.csv.2", went_on_from)
