"""Preprocessing: filtering, indexing, time order, holdout, the NCF split and the cache."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import time
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from conftest import TINY_ROWS, write_movielens

from recommendation.data import (
    data_preprocessing,
    movielens,
    preprocessing_cache,
    ratings_readers,
    synthetic_data,
)
from recommendation.data.data_preprocessing import DataConfig
from recommendation.data.movielens import DataError
from recommendation.data.ratings_readers import RawRatings


def _raw(rows) -> RawRatings:
    users, items, times = (np.array(column, dtype=np.int64) for column in zip(*rows, strict=True))
    return RawRatings(users, items, times)


def test_hand_computed_split():
    # User 20 has 2 < 3 ratings and is dropped; ids are indexed in order of first
    # appearance; user 10's two ratings at t=100 keep file order, so 501 is held out.
    data = data_preprocessing.preprocess(_raw(TINY_ROWS), min_num_ratings=3)
    np.testing.assert_array_equal(data.user_ids, [10, 30])
    np.testing.assert_array_equal(data.item_ids, [500, 70000, 501, 502, 503])
    np.testing.assert_array_equal(data.train_offsets, [0, 3, 5])
    np.testing.assert_array_equal(data.train_items, [3, 1, 0, 4, 2])
    np.testing.assert_array_equal(data.eval_items, [2, 1])
    np.testing.assert_array_equal(data.train_users(), [0, 0, 0, 1, 1])
    assert data.train_items.dtype == np.int32 and data.eval_negatives is None


def test_every_user_filtered_out():
    with pytest.raises(DataError, match="every user has fewer than 5 ratings.*--min_num_ratings"):
        data_preprocessing.preprocess(_raw(TINY_ROWS), min_num_ratings=5)


def _random_ratings(seed: int, num_rows: int = 5000) -> RawRatings:
    rng = np.random.default_rng(seed)
    users = rng.integers(1, 60, num_rows)
    users[rng.choice(num_rows, 40, replace=False)] = rng.integers(100, 120, 40)  # few each
    items = rng.integers(1, 400, num_rows) * 7
    times = rng.integers(0, 30, num_rows)  # many same-second ties
    return RawRatings(users, items, times)


def _reference_order(raw: RawRatings, ml_perf: bool, min_num_ratings: int) -> pd.DataFrame:
    """The Model Garden's pandas steps, after keeping only the latest (by time, then file
    order) of each repeated (user, item) pair."""
    frame = pd.DataFrame({"user": raw.users, "item": raw.items, "timestamp": raw.timestamps})
    latest = frame.sort_values("timestamp", kind="stable").duplicated(["user", "item"], keep="last")
    frame = frame[~latest.sort_index()]
    frame = frame.groupby("user").filter(lambda ratings: len(ratings) >= min_num_ratings)
    if ml_perf:
        frame = frame.sort_values(by="timestamp")
        return frame.sort_values(["user", "timestamp"], kind="mergesort")
    return frame.sort_values(["user", "timestamp"], kind="stable")


@pytest.mark.parametrize("min_num_ratings", [2, 5])  # 5 drops some of the sparse users
@pytest.mark.parametrize("ml_perf", [False, True])
def test_holdout_matches_the_reference_sort(ml_perf, min_num_ratings):
    raw = _random_ratings(seed=3)
    data = data_preprocessing.preprocess(raw, min_num_ratings=min_num_ratings, ml_perf=ml_perf)
    reference = _reference_order(raw, ml_perf, min_num_ratings)
    assert data.num_users == reference["user"].nunique() < len(np.unique(raw.users))
    last = reference.groupby("user", sort=False).tail(1)
    expected = dict(zip(last["user"], last["item"], strict=True))
    held_out = data.item_ids[data.eval_items]
    assert held_out.tolist() == [expected[user] for user in data.user_ids]
    trained = reference.drop(last.index)
    for user_index in range(data.num_users):
        items = trained[trained["user"] == data.user_ids[user_index]]["item"].to_numpy()
        start, stop = data.train_offsets[user_index : user_index + 2]
        np.testing.assert_array_equal(data.item_ids[data.train_items[start:stop]], items)


def test_ml_perf_order_differs_only_among_ties():
    raw = _random_ratings(seed=4)
    plain = data_preprocessing.preprocess(raw, min_num_ratings=2)
    mlperf = data_preprocessing.preprocess(raw, min_num_ratings=2, ml_perf=True)
    assert not np.array_equal(plain.eval_items, mlperf.eval_items)  # ties resolved differently
    np.testing.assert_array_equal(plain.train_offsets, mlperf.train_offsets)


@pytest.mark.parametrize(
    "rows,held_out,trained",
    [
        ([(1, 5, 1), (1, 6, 2), (1, 5, 9), (1, 7, 3)], 5, [6, 7]),
        # Same time: the later line is the latest, so 5 follows 6 in the split.
        ([(1, 5, 4), (1, 6, 4), (1, 5, 4), (1, 7, 1)], 5, [7, 6]),
        # User 2 has two lines but one distinct item: below min_num_ratings=2.
        ([(1, 5, 1), (2, 8, 1), (1, 6, 2), (2, 8, 2)], 6, [5]),
    ],
)
def test_repeated_pairs_keep_the_latest(rows, held_out, trained, caplog):
    data = data_preprocessing.preprocess(_raw(rows), min_num_ratings=2)
    assert data.item_ids[data.eval_items].tolist() == [held_out]
    assert data.item_ids[data.train_items].tolist() == trained
    assert "Dropped 1 repeated (user, item) pairs, keeping the latest of each" in caplog.text


def test_repeated_pairs_without_timestamps_keep_the_last_line():
    raw = RawRatings(np.array([1, 1, 1, 1]), np.array([5, 6, 5, 7]), None)
    data = data_preprocessing.preprocess(raw, min_num_ratings=2)
    assert data.item_ids[data.eval_items].tolist() == [7]
    assert data.item_ids[data.train_items].tolist() == [6, 5]


def test_repeated_pair_rows_by_hand():
    users, items = np.array([0, 0, 1, 0, 1, 0]), np.array([1, 2, 1, 1, 1, 1])
    # Pair (0, 1): rows 0 and 3 at t=5 (row 3 is later in the file), row 5 at t=4.
    times = np.array([5, 3, 2, 5, 1, 4])
    rows = data_preprocessing.repeated_pair_rows(users, items, 2, 3, times)
    assert rows.tolist() == [0, 4, 5]
    assert data_preprocessing.repeated_pair_rows(users, items, 2, 3).tolist() == [0, 2, 3]
    # Keys past 32 bits take the int64 path.
    assert data_preprocessing.repeated_pair_rows(users, items, 2**20, 2**20).tolist() == [0, 2, 3]


def test_ncf_split_is_used_as_given():
    split = ratings_readers.NcfSplitFiles(
        train_users=np.array([1, 0, 0]),
        train_items=np.array([3, 1, 2]),
        test_users=np.array([0, 1]),
        test_items=np.array([0, 1]),
        test_negatives=np.array([[3, 3], [2, 0]]),
        sources=("a", "b", "c"),
    )
    data = data_preprocessing.from_ncf_split(split)
    np.testing.assert_array_equal(data.train_offsets, [0, 2, 3])
    np.testing.assert_array_equal(data.train_items, [1, 2, 3])
    np.testing.assert_array_equal(data.eval_negatives, [[3, 3], [2, 0]])
    assert (data.num_users, data.num_items) == (2, 4)


def test_ncf_split_rejects_items_outside_training_range():
    split = ratings_readers.NcfSplitFiles(
        np.array([0, 1]),
        np.array([0, 1]),
        np.array([0, 1]),
        np.array([0, 5]),
        np.array([[0], [1]]),
        ("a", "b", "c"),
    )
    with pytest.raises(DataError, match="test file has item ids outside"):
        data_preprocessing.from_ncf_split(split)


def test_ncf_split_drops_test_pairs_and_repeats_from_training(caplog):
    split = ratings_readers.NcfSplitFiles(
        train_users=np.array([0, 0, 0, 1, 0, 1, 1]),
        train_items=np.array([0, 2, 1, 1, 2, 0, 1]),
        test_users=np.array([0, 1]),
        test_items=np.array([2, 0]),
        test_negatives=np.array([[1], [2]]),
        sources=("train", "test", "negative"),
    )
    data = data_preprocessing.from_ncf_split(split)
    np.testing.assert_array_equal(data.train_offsets, [0, 2, 3])
    np.testing.assert_array_equal(data.train_items, [0, 1, 1])
    np.testing.assert_array_equal(data.eval_items, [2, 0])
    assert "Dropped 3 training pairs of train that are their user's test pair" in caplog.text
    assert "Dropped 1 repeated training pairs of train" in caplog.text


# ---------------------------------------------------------------------------
# Repeated pairs, through every source


# TINY_ROWS plus repeats: user 10's held-out 501 also at t=20, user 30's 503 three times,
# user 20's 500 twice (two distinct items: dropped at min_num_ratings=3).
REPEATED_ROWS = TINY_ROWS + [(10, 501, 20), (30, 503, 40), (30, 503, 45), (20, 500, 7)]
# Raw user -> (training items in time order, held-out item).
REPEATED_SPLIT = {10: ([502, 70000, 500], 501), 30: ([503, 501], 70000)}


def _split_by_raw_id(data) -> dict[int, tuple[list[int], int]]:
    return {
        int(data.user_ids[user]): (
            data.item_ids[data.train_items[start:stop]].tolist(),
            int(data.item_ids[data.eval_items[user]]),
        )
        for user, (start, stop) in enumerate(
            zip(data.train_offsets[:-1], data.train_offsets[1:], strict=True)
        )
    }


def _write_source(kind: str, root) -> DataConfig:
    """Writes `REPEATED_ROWS` (or an NCF split with the same faults) as `kind` reads it."""
    if kind in ("dat", "u.data", "csv"):
        dataset = {"dat": "ml-1m", "u.data": "ml-100k", "csv": "ml-latest-small"}[kind]
        info = movielens.dataset_info(dataset)
        write_movielens(movielens.ratings_path(str(root), info), REPEATED_ROWS, kind)
        return DataConfig(dataset=dataset, data_dir=str(root), min_num_ratings=3)
    if kind.startswith("generic"):
        frame = pd.DataFrame(REPEATED_ROWS, columns=["user_id", "item_id", "timestamp"])
        path = root / "clicks.parquet"
        if kind == "generic-csv":
            path = root / "clicks.csv"
            frame.to_csv(path, index=False)
        else:
            frame.to_parquet(path)
        source = ratings_readers.GenericSource(str(path))
        return DataConfig(dataset="generic", data_dir=str(root), min_num_ratings=3, generic=source)
    if kind == "synthetic":
        spec = synthetic_data.SyntheticSpec(num_users=50, num_items=60, num_ratings=1500)
        return DataConfig(dataset="synthetic", data_dir=str(root), synthetic=spec, seed=4)
    folder = root / "ncf"
    folder.mkdir()
    # User 0's test pair (0, 2) is also a training line; (1, 0) is repeated.
    (folder / "ml-1m.train.rating").write_text("0\t0\t5\n0\t2\t4\n0\t1\t5\n1\t0\t5\n1\t0\t3\n")
    (folder / "ml-1m.test.rating").write_text("0\t2\t5\t1\n1\t1\t5\t1\n")
    (folder / "ml-1m.test.negative").write_text("(0,2)\t1\n(1,1)\t2\n")
    return DataConfig(dataset="ncf-ml-1m", data_dir=str(root))


@pytest.mark.parametrize(
    "kind", ["dat", "u.data", "csv", "generic-csv", "generic-parquet", "synthetic", "ncf"]
)
def test_no_held_out_item_is_a_training_item(kind, tmp_path):
    data = preprocessing_cache.load_or_build(_write_source(kind, tmp_path)).data
    users = data.train_users()
    assert not np.any(data.train_items == data.eval_items[users])
    pairs = users.astype(np.int64) * data.num_items + data.train_items
    assert len(np.unique(pairs)) == len(pairs)  # no repeated training pair either
    if kind == "synthetic":  # drawn without replacement: every line is kept
        assert data.num_train_positives + data.num_users == 1500
    elif kind == "ncf":
        assert _split_by_raw_id(data) == {0: ([0, 1], 2), 1: ([0], 1)}
    else:
        assert _split_by_raw_id(data) == REPEATED_SPLIT


# ---------------------------------------------------------------------------
# The cache


def _config(data_dir: str, **overrides) -> DataConfig:
    return DataConfig(dataset="ml-1m", data_dir=data_dir, min_num_ratings=3, **overrides)


def _assert_same_data(left, right):
    for field in dataclasses.fields(left):
        a, b = getattr(left, field.name), getattr(right, field.name)
        assert (a is None and b is None) or np.array_equal(a, b), field.name


def test_cache_is_built_then_reused(tiny_ml1m):
    first = preprocessing_cache.load_or_build(_config(tiny_ml1m))
    second = preprocessing_cache.load_or_build(_config(tiny_ml1m))
    assert (first.from_cache, first.reason) == (False, "no cache yet")
    assert second.from_cache
    _assert_same_data(first.data, second.data)
    folder = os.path.join(tiny_ml1m, "ml-1m")
    assert sorted(os.listdir(folder)) == ["ncf_cache.json", "ncf_cache.npz", "ratings.dat"]


def test_cache_survives_a_touch_but_not_an_edit(tiny_ml1m):
    preprocessing_cache.load_or_build(_config(tiny_ml1m))
    path = os.path.join(tiny_ml1m, "ml-1m", "ratings.dat")
    os.utime(path, (time.time() + 5, time.time() + 5))
    assert preprocessing_cache.load_or_build(_config(tiny_ml1m)).from_cache
    with open(path, "a") as out:
        out.write("30::504::4::70\n")
    result = preprocessing_cache.load_or_build(_config(tiny_ml1m))
    assert result.reason == f"source {path} changed"
    assert result.data.item_ids[result.data.eval_items].tolist() == [501, 504]


def test_cache_rebuilt_on_parameter_change_and_age(tiny_ml1m):
    preprocessing_cache.load_or_build(_config(tiny_ml1m))
    changed = preprocessing_cache.load_or_build(_config(tiny_ml1m, ml_perf=True))
    assert changed.reason == "parameters changed"
    aged = preprocessing_cache.load_or_build(_config(tiny_ml1m, ml_perf=True, cache_max_age_sec=0))
    assert aged.reason == "cache is older than its maximum age"


def test_corrupt_cache_is_rebuilt_with_a_warning(tiny_ml1m, caplog):
    built = preprocessing_cache.load_or_build(_config(tiny_ml1m))
    with open(built.cache_path, "r+b") as cache:
        cache.truncate(os.path.getsize(built.cache_path) // 2)
    result = preprocessing_cache.load_or_build(_config(tiny_ml1m))
    assert result.reason == "cache was corrupt" and not result.from_cache
    assert "is corrupt" in caplog.text
    _assert_same_data(built.data, result.data)
    assert preprocessing_cache.load_or_build(_config(tiny_ml1m)).from_cache


_BROKEN_ARRAY = b"\x93NUMPY\x01\x00" + b"a header numpy cannot parse"


def test_a_stale_cache_is_judged_by_its_metadata_alone(tiny_ml1m):
    """Only the metadata member is read first: garbage arrays in a stale cache go unread."""
    built = preprocessing_cache.load_or_build(_config(tiny_ml1m))
    with zipfile.ZipFile(built.cache_path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    with zipfile.ZipFile(built.cache_path, "w") as archive:
        for name, contents in members.items():
            archive.writestr(name, contents if name == "metadata.npy" else _BROKEN_ARRAY)
    stale = preprocessing_cache.load_or_build(_config(tiny_ml1m, ml_perf=True))
    assert stale.reason == "parameters changed"


def test_cache_of_format_1_is_rebuilt(tiny_ml1m):
    """Format 1 kept repeated (user, item) pairs: such a cache may train on held-out items."""
    built = preprocessing_cache.load_or_build(_config(tiny_ml1m))
    with zipfile.ZipFile(built.cache_path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    metadata = json.loads(str(np.load(io.BytesIO(members["metadata.npy"]))))
    metadata["format_version"] = 1
    packed = io.BytesIO()
    np.save(packed, np.array(json.dumps(metadata)))
    members["metadata.npy"] = packed.getvalue()
    with zipfile.ZipFile(built.cache_path, "w") as archive:
        for name, contents in members.items():
            archive.writestr(name, contents)
    assert preprocessing_cache.load_or_build(_config(tiny_ml1m)).reason == "cache format changed"


def _fail_writes(monkeypatch, error: Exception, partly: bool = False) -> None:
    """Makes every gfile write raise `error` (after writing a few bytes if `partly`), as a
    read-only mount or a full disk does; real ones need root to set up."""

    class FailingGFile(tf.io.gfile.GFile):
        def write(self, data):
            if partly:
                super().write(data[:16])
                self.flush()
            raise error

    monkeypatch.setattr(tf.io.gfile, "GFile", FailingGFile)


def test_read_only_data_dir_reads_its_cache_and_names_cache_dir_to_rebuild(tiny_ml1m, monkeypatch):
    folder = os.path.join(tiny_ml1m, "ml-1m")
    built = preprocessing_cache.load_or_build(_config(tiny_ml1m))
    listing, cache_bytes = sorted(os.listdir(folder)), Path(built.cache_path).read_bytes()
    _fail_writes(
        monkeypatch, tf.errors.PermissionDeniedError(None, None, "x; Read-only file system")
    )
    assert preprocessing_cache.load_or_build(_config(tiny_ml1m)).from_cache
    with pytest.raises(DataError) as raised:
        preprocessing_cache.load_or_build(_config(tiny_ml1m, ml_perf=True))  # stale: rebuild
    assert str(raised.value) == (
        f"cannot write the preprocessing cache in {folder}: Read-only file system; "
        "pass --cache_dir with a writable folder"
    )
    assert sorted(os.listdir(folder)) == listing
    assert Path(built.cache_path).read_bytes() == cache_bytes


@pytest.mark.parametrize(
    "error",
    [
        tf.errors.ResourceExhaustedError(None, None, "x; No space left on device"),
        OSError(errno.ENOSPC, "No space left on device"),
    ],
    ids=["gfile", "oserror"],
)
def test_full_disk_names_the_folder_and_leaves_no_temporary_file(
    tiny_ml1m, tmp_path, monkeypatch, error
):
    cache_dir = tmp_path / "cache"
    _fail_writes(monkeypatch, error, partly=True)
    with pytest.raises(DataError) as raised:
        preprocessing_cache.load_or_build(_config(tiny_ml1m, cache_dir=str(cache_dir)))
    assert str(raised.value) == (
        f"cannot write the preprocessing cache in {cache_dir}: no space left on the device; "
        "free space there or pass --cache_dir with a folder on a disk with room"
    )
    assert os.listdir(cache_dir) == []


def test_bad_source_writes_no_cache(tmp_path):
    write_movielens(str(tmp_path / "ml-1m" / "ratings.dat"), TINY_ROWS[:2], "dat")
    with pytest.raises(DataError, match="every user has fewer than 3"):
        preprocessing_cache.load_or_build(_config(str(tmp_path)))
    assert os.listdir(tmp_path / "ml-1m") == ["ratings.dat"]


def test_cache_dir_keeps_the_data_dir_untouched(tiny_ml1m, tmp_path):
    cache_dir = str(tmp_path / "cache")
    result = preprocessing_cache.load_or_build(_config(tiny_ml1m, cache_dir=cache_dir))
    assert result.cache_path == os.path.join(cache_dir, "ncf_cache.npz")
    assert os.listdir(os.path.join(tiny_ml1m, "ml-1m")) == ["ratings.dat"]


def test_ncf_split_dataset_through_the_cache(tmp_path):
    folder = tmp_path / "ncf"
    folder.mkdir()
    (folder / "ml-1m.train.rating").write_text("0\t1\t5\n0\t2\t5\n1\t0\t5\n")
    (folder / "ml-1m.test.rating").write_text("0\t0\t5\t1\n1\t2\t5\t1\n")
    (folder / "ml-1m.test.negative").write_text("(0,0)\t1\t2\n(1,2)\t0\t1\n")
    config = DataConfig(dataset="ncf-ml-1m", data_dir=str(tmp_path))
    built = preprocessing_cache.load_or_build(config)
    loaded = preprocessing_cache.load_or_build(config)
    assert loaded.from_cache
    _assert_same_data(built.data, loaded.data)
    np.testing.assert_array_equal(loaded.data.eval_negatives, [[1, 2], [0, 1]])
