"""The synthetic generator: exact shape, determinism, and learnable planted structure."""

from __future__ import annotations

import numpy as np
import pytest

from recommendation.data import movielens, ratings_readers, synthetic_data
from recommendation.data.movielens import DataError
from recommendation.data.synthetic_data import SyntheticSpec

SMALL = SyntheticSpec(num_users=400, num_items=300, num_ratings=30_000)


def test_exact_shape_and_movielens_like_invariants():
    ratings = synthetic_data.generate(SMALL, seed=1)
    assert len(ratings) == 30_000
    per_user = np.unique(ratings.users, return_counts=True)[1]
    assert len(per_user) == 400 and per_user.min() >= 20
    per_item = np.unique(ratings.items, return_counts=True)[1]
    assert len(per_item) == 300  # every item rated
    pairs = ratings.users * 10**9 + ratings.items
    assert len(np.unique(pairs)) == len(pairs)  # no repeated (user, item)
    assert ratings.items.max() > 300  # raw ids are spread out, not dense
    top_tenth = np.sort(per_item)[::-1][: len(per_item) // 10]
    assert top_tenth.sum() > 0.15 * len(ratings)  # a popularity head (uniform: 0.10)
    assert len(np.unique(ratings.timestamps)) < len(ratings)  # same-second ties exist


def test_same_seed_same_bytes_other_seed_other_data():
    first = synthetic_data.generate(SMALL, seed=7)
    again = synthetic_data.generate(SMALL, seed=7)
    other = synthetic_data.generate(SMALL, seed=8)
    for name in ("users", "items", "timestamps"):
        assert getattr(first, name).tobytes() == getattr(again, name).tobytes()
    assert first.items.tobytes() != other.items.tobytes()


def _hit_rate(scores_of, holdouts, rated, num_items, rng, num_negatives=99, k=10):
    hits = 0
    for user, item in holdouts:
        negatives = rng.choice(np.flatnonzero(~rated[user]), num_negatives, replace=False)
        scores = scores_of(user, np.concatenate([[item], negatives]))
        hits += np.sum(scores[1:] > scores[0]) < k
    return hits / len(holdouts)


def test_planted_preferences_beat_popularity_clearly():
    spec = SyntheticSpec(num_users=600, num_items=800, num_ratings=60_000)
    ratings, truth = synthetic_data.generate_with_truth(spec, seed=2)
    users = ratings.users - 1
    items = np.searchsorted(truth.item_ids, ratings.items)
    last = {}
    for row in np.lexsort((ratings.timestamps, users)):
        last[users[row]] = items[row]
    rated = np.zeros((spec.num_users, spec.num_items), dtype=bool)
    rated[users, items] = True
    popularity = np.bincount(items, minlength=spec.num_items).astype(float)
    holdouts = list(last.items())
    rng = np.random.default_rng(0)
    oracle = _hit_rate(
        lambda u, i: truth.scores(np.full(len(i), u), i), holdouts, rated, spec.num_items, rng
    )
    popular = _hit_rate(lambda u, i: popularity[i], holdouts, rated, spec.num_items, rng)
    assert oracle > popular + 0.15, (oracle, popular)


def test_csv_round_trip_in_ml20m_format(tmp_path):
    ratings = synthetic_data.generate(SMALL, seed=3)
    path = str(tmp_path / "ml-20m" / "ratings.csv")
    synthetic_data.write_ratings_csv(ratings, path)
    with open(path) as text:
        assert text.readline() == "userId,movieId,rating,timestamp\n"
    back = ratings_readers.read_ratings_file(path, movielens.CSV_FORMAT)
    np.testing.assert_array_equal(back.items, ratings.items)
    np.testing.assert_array_equal(back.timestamps, ratings.timestamps)


@pytest.mark.parametrize(
    "spec,message",
    [
        (SyntheticSpec(num_users=100, num_items=50, num_ratings=1000), "at least 20 ratings per"),
        (SyntheticSpec(num_users=0), "must be positive"),
        (SyntheticSpec(num_users=10, num_items=40, num_ratings=300), "more than half"),
    ],
)
def test_impossible_specs_are_rejected(spec, message):
    with pytest.raises(DataError, match=message):
        synthetic_data.generate(spec, seed=0)
