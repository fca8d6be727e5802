"""Shared helpers: small MovieLens-format files written into pytest's tmp_path."""

from __future__ import annotations

import os
from collections.abc import Iterable

import pytest

# Rows of (user, item, timestamp) used by several tests: three users, 4/2/3 ratings.
TINY_ROWS = [
    (10, 500, 100),
    (10, 70000, 90),
    (10, 501, 100),
    (10, 502, 80),
    (20, 500, 5),
    (20, 503, 6),
    (30, 501, 50),
    (30, 503, 40),
    (30, 70000, 60),
]

# A tiny ncf-main command line (seconds to train): synthetic data, a small model.
TINY_NCF_MAIN_FLAGS = [
    "--dataset=synthetic",
    "--synthetic_num_users=200",
    "--synthetic_num_items=150",
    "--synthetic_num_ratings=8000",
    "--batch_size=1024",
    "--num_eval_negatives=49",
    "--num_factors=4",
    "--layers=8,4",
    "--mlp_regularization=0,0",
    "--seed=2",
]


def write_movielens(path: str, rows: Iterable[tuple[int, int, int]], kind: str) -> str:
    """Writes `rows` as a ``dat`` (::), ``u.data`` (tab) or ``csv`` (header) ratings file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lines = []
    if kind == "csv":
        lines.append("userId,movieId,rating,timestamp")
    separator = {"dat": "::", "u.data": "\t", "csv": ","}[kind]
    for user, item, timestamp in rows:
        lines.append(separator.join(str(v) for v in (user, item, 4, timestamp)))
    with open(path, "w", newline="") as out:
        out.write("\n".join(lines) + "\n")
    return path


@pytest.fixture
def tiny_ml1m(tmp_path) -> str:
    """A data_dir holding ``ml-1m/ratings.dat`` with `TINY_ROWS`; returns data_dir."""
    write_movielens(str(tmp_path / "ml-1m" / "ratings.dat"), TINY_ROWS, "dat")
    return str(tmp_path)
