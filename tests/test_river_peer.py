"""The river peer's harness without river (scripts/peers/peer_harness.py): an event
folder read as ncf-online reads it, the protocol run chunk by chunk with a real
scorer that is not river (item popularity so far), the training examples, the result
and bad input as one error line."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, SCRIPTS_DIR

from recommendation.online import prequential
from recommendation.online.sources import DirectorySource
from recommendation.online.sources.dead_letters import DeadLetterFile

sys.path.insert(0, os.path.join(SCRIPTS_DIR, "peers"))  # as `python scripts/peers/...` has it
import peer_harness  # noqa: E402


class ItemPopularity:
    """A real baseline as a `peer_harness.Learner`: an item scores the positives it has
    had so far. Keeps what it was taught, for the tests to read."""

    def __init__(self, seed: int | None = None) -> None:
        self.positives: collections.Counter = collections.Counter()
        self.users: set[int] = set()
        self.taught: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def score(self, users: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        return np.array(
            [[self.positives[item] for item in row] for row in candidates.tolist()], np.float64
        ).reshape(candidates.shape)

    def learn(self, users: np.ndarray, items: np.ndarray, labels: np.ndarray) -> None:
        self.taught.append((users, items, labels))
        self.users.update(users.tolist())
        self.positives.update(items[labels == 1].tolist())

    def tables(self) -> dict[str, dict]:
        return {
            name: {"ids": count, "capacity": None, "admitted": count, "evicted": 0, "refused": 0}
            for name, count in (("user", len(self.users)), ("item", len(self.positives)))
        }

    def describe(self) -> dict:
        return {"model": "item popularity"}


def _stream(count: int = 60) -> np.ndarray:
    """`(count, 3)` events: 7 users, 9 items of skewed popularity, rising timestamps."""
    random = np.random.default_rng(5)
    users = random.integers(1, 8, count)
    items = 100 + np.minimum(random.geometric(0.35, count), 9)
    return np.stack([users, items, 1000 + np.arange(count)], axis=1).astype(np.int64)


def _write_folder(folder, events: np.ndarray) -> None:
    """`events` over files that each test of the reading rules: JSON lines, a CSV with
    a header, one without, a malformed line, a line still being written, and files
    that are not event files."""
    os.makedirs(folder, exist_ok=True)
    first, second, third = np.array_split(events, 3)
    with open(os.path.join(folder, "b.jsonl"), "w") as out:  # first in name order
        out.writelines(
            json.dumps({"user": int(u), "item": int(i), "timestamp": int(t)}) + "\n"
            for u, i, t in first
        )
    with open(os.path.join(folder, "c.csv"), "w") as out:
        out.write("user,item,timestamp\n")
        out.writelines(f"{u},{i},{t}\n" for u, i, t in second)
    with open(os.path.join(folder, "d.csv"), "w") as out:
        lines = [f"{u},{i},{t}\n" for u, i, t in third]
        lines.insert(1, "7,not-an-item,5\n")
        out.writelines(lines + ["\n", "8,8,8"])  # a blank line; the last still being written
    for name in ("a.txt", "a.csv.tmp"):
        with open(os.path.join(folder, name), "w") as out:
            out.write("1,2,3\n")


def _read_all(folder: peer_harness.EventFolder, chunk_events: int) -> np.ndarray:
    return np.concatenate(
        [np.stack(chunk, axis=1) for chunk in folder.chunks(chunk_events)], axis=0
    )


@pytest.mark.parametrize("chunk_events", [1, 4, 1000])
def test_the_folder_is_read_as_ncf_online_reads_it(tmp_path, chunk_events):
    events = _stream()
    _write_folder(tmp_path / "events", events)
    folder = peer_harness.EventFolder(str(tmp_path / "events"))
    assert folder.files == ["b.jsonl", "c.csv", "d.csv"]
    read = _read_all(folder, chunk_events)
    np.testing.assert_array_equal(read, events)
    assert folder.dead_letters == 1

    source = DirectorySource(str(tmp_path / "events"), DeadLetterFile(str(tmp_path / "dead")))
    chunk = source.read(len(events) + 10, timeout=0)
    assert source.read(1, timeout=0) is None
    by_ncf_online = np.stack([chunk.users, chunk.items, chunk.timestamps], axis=1)
    np.testing.assert_array_equal(read, by_ncf_online)
    assert source.dead_letters == folder.dead_letters


def _protocol() -> prequential.Prequential:
    return prequential.Prequential(every=1, negatives=3, top_k=2, window_events=16)


def _popularity_event_by_event(events: np.ndarray) -> dict:
    """The protocol run directly: the whole stream planned at once, each chosen event
    scored by the positives its candidates had before it."""
    protocol = _protocol()
    plan = protocol.plan(events[:, 0], events[:, 1], events[:, 2])
    positives: collections.Counter = collections.Counter()
    scores = np.zeros(plan.candidates.shape)
    row = 0
    for position, item in enumerate(events[:, 1].tolist()):
        if row < plan.size and plan.positions[row] == position:
            scores[row] = [positives[c] for c in plan.candidates[row].tolist()]
            row += 1
        positives[item] += 1
    protocol.record(plan, scores)
    return protocol.results()


def _chunks(events: np.ndarray, size: int):
    for start in range(0, len(events), size):
        part = events[start : start + size]
        yield part[:, 0], part[:, 1], part[:, 2]


def test_one_event_a_chunk_is_the_protocol_run_event_by_event():
    events = _stream()
    protocol = _protocol()
    timing = peer_harness.run(_chunks(events, 1), ItemPopularity(), protocol, seed=3)
    assert timing["events"] == len(events)
    results = protocol.results()
    assert results == _popularity_event_by_event(events)
    # every=1: every event after the stream's first item is scored.
    assert results["all"]["scored"] == len(events) - 1
    assert results["cold"]["scored"] + results["warm"]["scored"] == len(events) - 1
    assert [window["start"] for window in results["windows"]] == [0, 16, 32, 48]


def test_any_chunking_scores_the_same_events_against_the_same_items():
    events = _stream()
    scored = {}
    for size in (1, 7, 1000):
        protocol = _protocol()
        peer_harness.run(_chunks(events, size), ItemPopularity(), protocol, seed=3)
        results = protocol.results()
        scored[size] = [results[cohort]["scored"] for cohort in ("all", "cold", "warm")]
        scored[size] += [window["scored"] for window in results["windows"]]
    assert scored[1] == scored[7] == scored[1000]


def test_training_examples_are_each_positive_then_its_negatives():
    users, items = np.array([1, 2]), np.array([10, 11])
    negatives = np.array([[12, 10, 13], [11, 11, 14]])
    taught = peer_harness.training_examples(users, items, negatives)
    # A negative equal to its event's item is left out (10 of the first, 11 twice).
    np.testing.assert_array_equal(taught[0], [1, 1, 1, 2, 2])
    np.testing.assert_array_equal(taught[1], [10, 12, 13, 11, 14])
    np.testing.assert_array_equal(taught[2], [1, 0, 0, 1, 0])


def test_negatives_are_seeded_draws_from_the_items_seen_so_far():
    events = _stream()
    taught = {}
    for seed in (3, 3, 4):
        learner = ItemPopularity()
        peer_harness.run(_chunks(events, 8), learner, _protocol(), num_neg=4, seed=seed)
        taught.setdefault(seed, []).append(learner.taught)
    seen: set[int] = set()
    for (users, items, labels), (chunk_users, chunk_items, _) in zip(
        taught[3][0], _chunks(events, 8), strict=True
    ):
        seen.update(chunk_items.tolist())
        np.testing.assert_array_equal(items[labels == 1], chunk_items)
        np.testing.assert_array_equal(users[labels == 1], chunk_users)
        assert set(items[labels == 0].tolist()) <= seen
        event = np.cumsum(labels) - 1  # the event each example belongs to
        assert np.all(items[labels == 0] != chunk_items[event[labels == 0]])
        assert np.all(np.bincount(event, minlength=len(chunk_items)) <= 5)
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(taught[3][0], taught[3][1], strict=True))
    assert not all(
        np.array_equal(a[1], b[1]) for a, b in zip(taught[3][0], taught[4][0], strict=True)
    )


def test_the_result_has_ncf_online_summary_keys(tmp_path, capsys):
    events = _stream()
    _write_folder(tmp_path / "events", events)
    summary_file = tmp_path / "result.json"
    flags = [
        f"--events_dir={tmp_path / 'events'}",
        f"--summary_file={summary_file}",
        "--chunk_events=1",
        "--prequential_every=1",
        "--prequential_negatives=3",
        "--top_k=2",
        "--prequential_window_events=16",
        "--seed=3",
    ]
    returned = peer_harness.main(
        flags, "popularity", "Item popularity.", lambda parsed: ItemPopularity()
    )
    with open(summary_file) as stream:
        result = json.load(stream)
    assert result == json.loads(json.dumps(returned))
    assert set(result) == {
        "events",
        "seconds",
        "events_per_second",
        "steady_events_per_second",
        "peak_rss",
        "bytes_per_id",
        "tables",
        "dead_letters",
        "prequential",
        "peer",
        "settings",
    }
    assert result["events"] == len(events)
    assert result["dead_letters"] == 1
    assert result["prequential"] == _popularity_event_by_event(events)
    assert result["tables"]["user"]["ids"] == len(set(events[:, 0].tolist()))
    assert result["tables"]["item"]["ids"] == len(set(events[:, 1].tolist()))
    assert result["peak_rss"] > 0
    assert result["peer"] == {"model": "item popularity"}
    captured = capsys.readouterr()
    assert captured.out.startswith(f"popularity: {len(events)} events in ")
    assert "d.csv line 2 skipped: item must be an integer" in captured.err


def test_the_defaults_are_ncf_onlines():
    from recommendation.online_main import OnlineConfig

    config = OnlineConfig()
    flags = peer_harness.parse_flags(["--events_dir=x"], "")
    assert (
        flags.chunk_events,
        flags.num_neg,
        flags.prequential_every,
        flags.prequential_negatives,
        flags.prequential_window_events,
        flags.top_k,
    ) == (
        config.batch_size,
        config.model.num_neg,
        config.prequential_every,
        config.prequential_negatives,
        config.prequential_window_events,
        config.top_k,
    )


def test_a_peer_adds_its_own_flags_and_batch_size_is_chunk_events():
    def add_flags(flag) -> None:
        flag("--width", type=peer_harness.positive, default=3)

    flags = peer_harness.parse_flags(["--events_dir=x", "--batch_size=7"], "", add_flags)
    assert (flags.chunk_events, flags.width) == (7, 3)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--events_dir={missing}"], "is not a folder"),
        (["--events_dir={empty}"], "no *.csv or *.jsonl event files in"),
        (["--events_dir={no_events}"], "no events in"),
        (["--events_dir={empty}", "--summary_file={missing}/result.json"], "is not a folder"),
        (["--events_dir={empty}", "--chunk_events=0"], "must be positive, got 0"),
        (["--events_dir={empty}", "--num_neg=many"], "--num_neg: must be an integer, got 'many'"),
        ([], "the following arguments are required: --events_dir"),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, capsys, flags, message):
    folders = {name: str(tmp_path / name) for name in ("missing", "empty", "no_events")}
    os.makedirs(folders["empty"])
    os.makedirs(folders["no_events"])
    with open(os.path.join(folders["no_events"], "events.csv"), "w") as out:
        out.write("user,item,timestamp\nx,y,z\n")
    with pytest.raises(SystemExit) as stop:
        peer_harness.main(
            [flag.format(**folders) for flag in flags], "peer", "", lambda parsed: ItemPopularity()
        )
    assert stop.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], lines
    assert not any("Traceback" in line for line in lines)


def test_a_peers_rate_takes_positive_numbers_with_one_error_line_for_others(capsys):
    def add_flags(flag):
        flag("--learning_rate", type=peer_harness.positive_rate)

    flags = peer_harness.parse_flags(["--events_dir=x", "--learning_rate=0.05"], "", add_flags)
    assert flags.learning_rate == 0.05
    for value, message in (
        ("0", "must be positive, got 0"),
        ("fast", "must be a number, got 'fast'"),
    ):
        with pytest.raises(SystemExit):
            peer_harness.parse_flags(["--events_dir=x", f"--learning_rate={value}"], "", add_flags)
        [line] = capsys.readouterr().err.strip().splitlines()[-1:]
        assert line.startswith("error: argument --learning_rate: ") and message in line


@pytest.mark.integration
def test_the_harness_loads_without_tensorflow_or_the_project():
    """A peer's environment has numpy and its library only: the harness loads the
    project's modules by path, never through their packages."""
    blocked = ("tensorflow", "absl", "keras", "recommendation", "official", "pandas")
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({blocked!r})); "
        f"sys.path.insert(0, {os.path.join(SCRIPTS_DIR, 'peers')!r}); import peer_harness; "
        "print(peer_harness.prequential.Prequential().every)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "8"
