"""Ratings readers: every published format, the NCF split, generic files, and bad input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from conftest import TINY_ROWS, write_movielens

from recommendation.data import movielens, ratings_readers
from recommendation.data.movielens import DataError


@pytest.mark.parametrize(
    "kind,file_format",
    [
        ("dat", movielens.DAT_FORMAT),
        ("u.data", movielens.U_DATA_FORMAT),
        ("csv", movielens.CSV_FORMAT),
    ],
)
def test_reads_every_published_format(tmp_path, kind, file_format):
    path = write_movielens(str(tmp_path / "ratings"), TINY_ROWS, kind)
    raw = ratings_readers.read_ratings_file(path, file_format)
    users, items, times = zip(*TINY_ROWS, strict=True)
    np.testing.assert_array_equal(raw.users, users)
    np.testing.assert_array_equal(raw.items, items)  # 70000 > 65535 survives
    np.testing.assert_array_equal(raw.timestamps, times)
    assert raw.users.dtype.kind == "i" and raw.sources == (path,)


def test_reads_ids_past_32_bits(tmp_path):
    rows = [(1, 3_000_000_000, 5), (5_000_000_000, 2, 6)]
    path = write_movielens(str(tmp_path / "ratings"), rows, "csv")
    raw = ratings_readers.read_ratings_file(path, movielens.CSV_FORMAT)
    np.testing.assert_array_equal(raw.users, [1, 5_000_000_000])
    np.testing.assert_array_equal(raw.items, [3_000_000_000, 2])


def test_reads_crlf_csv_as_published_for_ml_latest_small(tmp_path):
    path = tmp_path / "ratings.csv"
    path.write_bytes(b"userId,movieId,rating,timestamp\r\n1,31,2.5,1260759144\r\n1,1029,3.0,5\r\n")
    raw = ratings_readers.read_ratings_file(str(path), movielens.CSV_FORMAT)
    np.testing.assert_array_equal(raw.items, [31, 1029])
    np.testing.assert_array_equal(raw.timestamps, [1260759144, 5])


def test_read_movielens_uses_the_registry_layout(tiny_ml1m):
    raw = ratings_readers.read_movielens(tiny_ml1m, "ml-1m")
    assert len(raw) == len(TINY_ROWS)


def test_missing_file_names_path_and_fix(tmp_path):
    with pytest.raises(DataError, match=r"ml-1m/ratings\.dat not found.*--download_if_missing"):
        ratings_readers.read_movielens(str(tmp_path), "ml-1m")


def test_empty_file(tmp_path):
    path = tmp_path / "ratings.dat"
    path.write_text("")
    with pytest.raises(DataError, match="is empty"):
        ratings_readers.read_ratings_file(str(path), movielens.DAT_FORMAT)


def test_header_only_csv_has_no_ratings(tmp_path):
    path = tmp_path / "ratings.csv"
    path.write_text("userId,movieId,rating,timestamp\n")
    with pytest.raises(DataError, match="holds no ratings"):
        ratings_readers.read_ratings_file(str(path), movielens.CSV_FORMAT)


@pytest.mark.parametrize(
    "bad_line,message",
    [
        ("3::4::5", r"ratings\.dat:3: expected 4 fields, found 3"),
        ("3::x4::5::6", r"ratings\.dat:3: item id 'x4' is not an integer"),
        ("3::4::5::1.5e9", r"ratings\.dat:3: timestamp '1.5e9' is not an integer"),
    ],
)
def test_malformed_line_is_named_with_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "ratings.dat"
    path.write_text(f"1::2::3::4\n1::3::3::5\n{bad_line}\n4::4::4::4\n")
    with pytest.raises(DataError, match=message):
        ratings_readers.read_ratings_file(str(path), movielens.DAT_FORMAT)


def _write_ncf_split(folder, negatives_per_user=3):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ml-1m.train.rating").write_text("0\t0\t5\t10\n0\t1\t4\t11\n1\t2\t3\t12\n")
    (folder / "ml-1m.test.rating").write_text("0\t2\t5\t20\n1\t0\t4\t21\n")
    negatives = {0: [1, 1, 2][:negatives_per_user], 1: [1, 2, 2][:negatives_per_user]}
    (folder / "ml-1m.test.negative").write_text(
        "".join(
            f"({user},{item})\t" + "\t".join(map(str, negatives[user])) + "\n"
            for user, item in ((0, 2), (1, 0))
        )
    )


def test_reads_ncf_paper_split_as_given(tmp_path):
    _write_ncf_split(tmp_path / "ncf")
    split = ratings_readers.read_ncf_split(str(tmp_path), "ncf-ml-1m")
    np.testing.assert_array_equal(split.train_items, [0, 1, 2])
    np.testing.assert_array_equal(split.test_items, [2, 0])
    np.testing.assert_array_equal(split.test_negatives, [[1, 1, 2], [1, 2, 2]])


def test_ncf_negatives_must_match_test_file(tmp_path):
    _write_ncf_split(tmp_path / "ncf")
    path = tmp_path / "ncf" / "ml-1m.test.negative"
    path.write_text(path.read_text().replace("(1,0)", "(1,1)"))
    with pytest.raises(DataError, match="does not list the same"):
        ratings_readers.read_ncf_split(str(tmp_path), "ncf-ml-1m")


def test_ncf_negatives_malformed_line(tmp_path):
    _write_ncf_split(tmp_path / "ncf")
    path = tmp_path / "ncf" / "ml-1m.test.negative"
    path.write_text(path.read_text() + "(2,1)\t5\n")
    with pytest.raises(DataError, match=r"ml-1m\.test\.negative:3: expected '\(user,item\)'"):
        ratings_readers.read_ncf_split(str(tmp_path), "ncf-ml-1m")


def test_generic_csv_with_named_columns(tmp_path):
    path = tmp_path / "clicks.tsv"
    path.write_text("who\twhat\twhen\textra\n7\t900000\t3\tx\n7\t5\t1\ty\n")
    source = ratings_readers.GenericSource(str(path), "who", "what", "when", separator="\t")
    raw = ratings_readers.read_generic(source)
    np.testing.assert_array_equal(raw.items, [900000, 5])
    np.testing.assert_array_equal(raw.timestamps, [3, 1])


def test_generic_parquet_without_timestamps(tmp_path):
    path = tmp_path / "events.parquet"
    pd.DataFrame({"u": [1, 2, 1], "i": [3, 4, 5]}).to_parquet(path)
    raw = ratings_readers.read_generic(ratings_readers.GenericSource(str(path), "u", "i", ""))
    np.testing.assert_array_equal(raw.users, [1, 2, 1])
    assert raw.timestamps is None


def test_generic_missing_column_names_the_fix(tmp_path):
    path = tmp_path / "events.csv"
    path.write_text("user,item\n1,2\n")
    message = r"no column 'user_id' \(columns: user, item\).*--user_column"
    with pytest.raises(DataError, match=message):
        ratings_readers.read_generic(ratings_readers.GenericSource(str(path), timestamp_column=""))


def test_generic_string_ids_are_rejected(tmp_path):
    path = tmp_path / "events.csv"
    path.write_text("user_id,item_id\n1,2\nbob,3\n")
    with pytest.raises(DataError, match="column 'user_id' holds 'bob', which is not an integer"):
        ratings_readers.read_generic(ratings_readers.GenericSource(str(path), timestamp_column=""))


def test_generic_parquet_ids_stored_as_decimal_strings_are_integers(tmp_path):
    path = tmp_path / "events.parquet"
    frame = pd.DataFrame(
        {
            "user_id": pd.Categorical(["12", "7", "12"]),
            "item_id": ["900000", " 5", "+3"],
            "timestamp": ["-1", "2", "0030"],
        }
    )
    frame.to_parquet(path)
    raw = ratings_readers.read_generic(ratings_readers.GenericSource(str(path)))
    np.testing.assert_array_equal(raw.users, [12, 7, 12])
    np.testing.assert_array_equal(raw.items, [900000, 5, 3])
    np.testing.assert_array_equal(raw.timestamps, [-1, 2, 30])


@pytest.mark.parametrize(
    "bad,message",
    [
        ("1_000", "column 'item_id' holds '1_000', which is not an integer id"),
        ("0x10", "column 'item_id' holds '0x10', which is not an integer id"),
        ("\u0663", "column 'item_id' holds '\u0663', which is not an integer id"),  # Arabic 3
        ("99999999999999999999", "column 'item_id': .*; ids must fit in 64 bits"),
    ],
)
def test_generic_parquet_string_ids_that_are_not_integers(tmp_path, bad, message):
    path = tmp_path / "events.parquet"
    pd.DataFrame({"user_id": ["1", "2"], "item_id": ["4", bad]}).to_parquet(path)
    with pytest.raises(DataError, match=message):
        ratings_readers.read_generic(ratings_readers.GenericSource(str(path), timestamp_column=""))


def test_generic_parquet_of_another_type_names_it(tmp_path):
    path = tmp_path / "events.parquet"
    pd.DataFrame({"user_id": [1, 2], "item_id": [True, False]}).to_parquet(path)
    with pytest.raises(DataError, match="column 'item_id' holds bool values, not integers"):
        ratings_readers.read_generic(ratings_readers.GenericSource(str(path), timestamp_column=""))
