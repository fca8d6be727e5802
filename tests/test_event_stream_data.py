"""The event-stream generator: exact size, time order, users after their arrival,
drifting heavy-tailed popularity, planted preferences, determinism, files and CLI."""

from __future__ import annotations

import csv
import dataclasses
import json
import os

import numpy as np
import pytest
from conftest import run_module, the_error_line

from recommendation.data import event_stream_data, stream_references
from recommendation.data.event_stream_data import EventStreamSpec
from recommendation.data.movielens import DataError
from recommendation.online import sources
from recommendation.online.sources.dead_letters import DeadLetterFile

SMALL = EventStreamSpec(num_users=2000, num_items=1000, num_events=50_000)
TINY = EventStreamSpec(num_users=300, num_items=100, num_events=3000)


def _rows(model: event_stream_data.EventStreamModel, user_ids: np.ndarray) -> np.ndarray:
    """Model rows (arrival order) of raw user ids."""
    by_id = np.argsort(model.user_ids)
    return by_id[np.searchsorted(model.user_ids, user_ids, sorter=by_id)]


def test_exact_count_time_order_and_users_act_after_arriving():
    events = event_stream_data.generate(SMALL, seed=1)
    model = event_stream_data.plant(SMALL, seed=1)
    assert len(events) == 50_000
    assert np.all(np.diff(events.timestamps) >= 0)
    assert events.timestamps.min() >= SMALL.start_timestamp
    assert events.timestamps.max() < SMALL.start_timestamp + SMALL.duration_seconds
    assert len(np.unique(events.users)) == SMALL.num_users
    rows = _rows(model, events.users)
    np.testing.assert_array_equal(model.user_ids[rows], events.users)
    assert np.all(events.timestamps >= model.arrivals[rows])
    assert np.all(events.timestamps <= model.arrivals[rows] + model.lifetimes[rows])
    np.testing.assert_array_equal(np.bincount(rows, minlength=SMALL.num_users), model.activity)
    # Arrivals spread over the stream: every tenth of it has newcomers.
    tenths = (model.arrivals - SMALL.start_timestamp) * 10 // SMALL.duration_seconds
    assert set(tenths.tolist()) == set(range(10))
    # Ids are spread out, not dense 0..n.
    assert events.users.min() >= 1 and events.users.max() > 1000 * SMALL.num_users
    assert events.items.min() >= 1 and events.items.max() > 1000 * SMALL.num_items


def test_activity_and_popularity_are_heavy_tailed_and_popularity_drifts():
    events = event_stream_data.generate(SMALL, seed=1)
    activity = event_stream_data.plant(SMALL, seed=1).activity
    assert np.median(activity) == 11 and activity.max() == 1609  # a few users act a lot
    per_item = np.sort(np.unique(events.items, return_counts=True)[1])[::-1]
    assert per_item[:10].sum() / len(events) > 0.2  # top 1% of items (uniform: 0.01)

    def top_items(items: np.ndarray) -> set[int]:
        ids, counts = np.unique(items, return_counts=True)
        return set(ids[np.argsort(-counts, kind="stable")[:10]].tolist())

    tenth = len(events) // 10
    assert not top_items(events.items[:tenth]) & top_items(events.items[-tenth:])
    still = event_stream_data.generate(dataclasses.replace(SMALL, popularity_drift=0.0), seed=1)
    assert len(top_items(still.items[:tenth]) & top_items(still.items[-tenth:])) >= 8


@pytest.mark.parametrize("candidates,low,high", [(8, 3.0, np.inf), (1, -0.2, 0.2)])
def test_planted_preferences_only_when_chosen_among_candidates(candidates, low, high):
    spec = dataclasses.replace(SMALL, candidates=candidates)
    events = event_stream_data.generate(spec, seed=2)
    model = event_stream_data.plant(spec, seed=2)
    users = model.planted.user_factors[_rows(model, events.users)]
    items = model.planted.item_factors[np.searchsorted(model.planted.item_ids, events.items)]
    affinity = np.mean(np.sum(users * items, axis=1))  # per pair: mean 0, std 3
    assert low < affinity < high


def test_clustered_tastes_share_their_centres_and_keep_the_affinities_spread():
    alike = dataclasses.replace(SMALL, taste_clusters=4, taste_spread=0.0)
    assert len(np.unique(event_stream_data.plant(alike, 3).planted.user_factors, axis=0)) == 4
    planted = event_stream_data.plant(dataclasses.replace(SMALL, taste_clusters=64), 3).planted
    affinity = planted.user_factors @ planted.item_factors.T
    assert 2.7 < affinity.std() < 3.3  # preference_strength, as without clusters
    own = event_stream_data.plant(SMALL, 3).planted
    assert not np.array_equal(own.user_factors, planted.user_factors)
    np.testing.assert_array_equal(own.item_factors, planted.item_factors)


def test_same_seed_same_bytes_other_seed_other_stream():
    first = event_stream_data.generate(SMALL, seed=7)
    again = event_stream_data.generate(SMALL, seed=7)
    other = event_stream_data.generate(SMALL, seed=8)
    for name in ("users", "items", "timestamps"):
        assert getattr(first, name).tobytes() == getattr(again, name).tobytes()
    assert first.items.tobytes() != other.items.tobytes()


def _read(path: str) -> tuple[str, list[bytes]]:
    with open(path, "rb") as stream:
        return stream.readline().decode(), stream.readlines()


def test_files_split_one_stream_in_time_order_and_are_reproducible(tmp_path):
    paths = event_stream_data.write_event_files(TINY, 3, str(tmp_path / "a"), num_files=3)
    assert [os.path.basename(path) for path in paths] == [
        "events-00000.csv",
        "events-00001.csv",
        "events-00002.csv",
    ]
    assert sorted(os.listdir(tmp_path / "a")) == [os.path.basename(path) for path in paths]
    headers, lines = zip(*map(_read, paths), strict=True)
    assert set(headers) == {"user,item,timestamp\n"}
    assert [len(part) for part in lines] == [1000, 1000, 1000]
    stream = event_stream_data.generate(TINY, seed=3)
    columns = zip(stream.users, stream.items, stream.timestamps, strict=True)
    expected = [f"{user},{item},{time}\n".encode() for user, item, time in columns]
    assert [line for part in lines for line in part] == expected
    again = event_stream_data.write_event_files(TINY, 3, str(tmp_path / "b"), num_files=3)
    other = event_stream_data.write_event_files(TINY, 4, str(tmp_path / "c"), num_files=3)
    for path, same, different in zip(paths, again, other, strict=True):
        with open(path, "rb") as a, open(same, "rb") as b, open(different, "rb") as c:
            data = a.read()
            assert data == b.read() and data != c.read()


def test_the_trainer_source_reads_the_files(tmp_path):
    event_stream_data.write_event_files(TINY, 5, str(tmp_path / "events"), num_files=2)
    dead = DeadLetterFile(str(tmp_path / "dead.jsonl"))
    source = sources.DirectorySource(str(tmp_path / "events"), dead)
    chunks = []
    while (chunk := source.read(1000, timeout=0)) is not None:
        chunks.append(chunk)
    stream = event_stream_data.generate(TINY, seed=5)
    for name in ("users", "items", "timestamps"):
        read = np.concatenate([getattr(chunk, name) for chunk in chunks])
        np.testing.assert_array_equal(read, getattr(stream, name))
    assert source.dead_letters == 0


@pytest.mark.parametrize(
    "spec,message",
    [
        (dataclasses.replace(TINY, num_users=0), "num_users must be positive, got 0"),
        (dataclasses.replace(TINY, num_items=-5), "num_items must be positive, got -5"),
        (dataclasses.replace(TINY, num_events=299), r"num_events \(299\) must be at least"),
        (dataclasses.replace(TINY, max_user_id=10), "max_user_id must be in"),
        (dataclasses.replace(TINY, max_item_id=2**63), "max_item_id must be in"),
        (dataclasses.replace(TINY, candidates=0), "candidates must be at least 1"),
        (dataclasses.replace(TINY, popularity_exponent=float("nan")), "popularity_exponent"),
        (dataclasses.replace(TINY, popularity_drift=-0.1), "popularity_drift must be"),
        (dataclasses.replace(TINY, activity_tail=0.01), "activity_tail must be at least"),
        (dataclasses.replace(TINY, start_timestamp=2**63 - 10), "past int64"),
        (dataclasses.replace(TINY, taste_clusters=-1), "taste_clusters must be >= 0, got -1"),
        (dataclasses.replace(TINY, taste_spread=1.5), r"taste_spread must be in \[0, 1\], got 1.5"),
    ],
)
def test_bad_sizes_are_rejected(spec, message):
    with pytest.raises(DataError, match=message):
        event_stream_data.generate(spec, seed=0)


def test_bad_file_counts_and_folders_are_rejected(tmp_path):
    for files in (0, TINY.num_events + 1):
        with pytest.raises(DataError, match=r"files must be in \[1, 3,000\]"):
            event_stream_data.write_event_files(TINY, 0, str(tmp_path / "a"), num_files=files)
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match="cannot write to .*file/events"):
        event_stream_data.write_event_files(TINY, 0, str(tmp_path / "file" / "events"))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "events-00000.csv").write_text("user,item,timestamp\n")
    with pytest.raises(DataError, match="already holds 1 event file"):
        event_stream_data.write_event_files(TINY, 0, str(tmp_path / "used"))
    with pytest.raises(DataError, match="seed must not be negative"):
        event_stream_data.write_event_files(TINY, -1, str(tmp_path / "b"))


@pytest.mark.integration
def test_cli_writes_csv_event_files(tmp_path):
    folder = tmp_path / "events"
    result = run_module(
        "recommendation.data.event_stream_data",
        f"--events_dir={folder}",
        "--num_users=300",
        "--num_items=100",
        "--num_events=3000",
        "--seed=3",
        "--files=2",
        "--taste_clusters=4",
        "--candidates=16",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wrote 3,000 events of 300 users on 100 items to 2 file(s)" in result.stdout
    # The references beside the files, as printed.
    written = json.loads((folder / stream_references.FILE_NAME).read_text())
    assert written["spec"]["taste_clusters"] == 4 and written["spec"]["candidates"] == 16
    for name in ("popularity", "oracle"):
        hr = written[name]["all"]["hr"]
        assert f"{name} reference: prequential HR@10 {hr:.4f}" in result.stdout
    rows = []
    for name in ("events-00000.csv", "events-00001.csv"):
        with open(folder / name, newline="") as stream:
            rows += list(csv.DictReader(stream))
    assert len(rows) == 3000 and list(rows[0]) == ["user", "item", "timestamp"]
    times = [int(row["timestamp"]) for row in rows]
    assert times == sorted(times)
    assert len({row["user"] for row in rows}) == 300


@pytest.mark.integration
def test_cli_refuses_bad_sizes_with_one_error_line(tmp_path):
    result = run_module(
        "recommendation.data.event_stream_data",
        f"--events_dir={tmp_path / 'events'}",
        "--num_users=300",
        "--num_events=100",
    )
    assert the_error_line(result) == (
        "error: num_events (100) must be at least num_users (300): "
        "every user arrives with at least one event"
    )
    assert not (tmp_path / "events").exists()
