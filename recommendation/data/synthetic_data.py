"""A deterministic generator of MovieLens-like implicit feedback (``--dataset synthetic``).

Each user draws their items without replacement with probability proportional to
``popularity_i ** popularity_weight * exp(preference_strength * <u, v_i>)``: a
power-law popularity shared by everyone, plus planted low-rank preferences that a
collaborative-filtering model can learn but item popularity cannot. Items are drawn
with the exponential-race form of weighted sampling without replacement (the `k`
largest ``w_i / E_i``, ``E_i ~ Exp(1)``), one block of users at a time, so the
ml-20m-shaped file (20 M rows) is made in bounded memory.

Run ``python -m recommendation.data.synthetic_data --shape ml-20m --data_dir DIR`` to write
``DIR/ml-20m/ratings.csv`` in the ml-20m file format for scale benchmarks.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import tensorflow as tf
from absl import app, flags, logging

from official.utils.misc import atomic
from official.utils.misc.progress import ProgressBar
from recommendation.data import constants
from recommendation.data.movielens import DataError
from recommendation.data.ratings_readers import RawRatings

# Seconds of the first and last MovieLens-1M ratings: synthetic times fall in between.
_FIRST_TIMESTAMP = 956_703_932
_LAST_TIMESTAMP = 1_046_454_590
_BLOCK_ELEMENTS = 1 << 22  # users x items scored at once: bounds memory at ~50 MB


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    """Size and shape of a synthetic dataset; defaults are about the size of ML-1M.

    Attributes:
        num_users: Users, each with at least `min_ratings_per_user` ratings.
        num_items: Items; every item is rated at least once.
        num_ratings: Total interactions (exact).
        min_ratings_per_user: Smallest per-user activity.
        latent_dim: Rank of the planted preferences.
        preference_strength: Weight of the planted preferences against popularity.
        popularity_exponent: Zipf exponent of the item popularity.
        max_item_id: Raw item ids are spread over 1..max_item_id (0: 4x num_items),
            like MovieLens ids, so the id mapping is exercised.
    """

    num_users: int = 6040
    num_items: int = 3706
    num_ratings: int = 1_000_209
    min_ratings_per_user: int = constants.MIN_NUM_RATINGS
    latent_dim: int = 8
    preference_strength: float = 3.0
    popularity_exponent: float = 1.0
    max_item_id: int = 0

    def validate(self) -> None:
        """Raises `DataError` if the sizes cannot describe a dataset."""
        if min(self.num_users, self.num_items, self.num_ratings, self.latent_dim) <= 0:
            raise DataError("synthetic sizes must be positive")
        if self.num_ratings < self.num_users * self.min_ratings_per_user:
            raise DataError(
                f"synthetic data needs at least {self.min_ratings_per_user} ratings per user: "
                f"raise --synthetic_num_ratings to {self.num_users * self.min_ratings_per_user}"
                f" or lower --synthetic_num_users"
            )
        if self.min_ratings_per_user > self.num_items:
            raise DataError("synthetic data needs more items than ratings per user")
        if self.num_ratings > self.num_users * self.num_items // 2:
            raise DataError("synthetic data would rate more than half of all (user, item) pairs")
        if self.num_ratings < self.num_items:
            raise DataError("synthetic data needs at least one rating per item")


SHAPES: dict[str, SyntheticSpec] = {
    "ml-1m": SyntheticSpec(),
    # The published ml-20m figures: 20,000,263 ratings by 138,493 users of 26,744 movies.
    "ml-20m": SyntheticSpec(num_users=138_493, num_items=26_744, num_ratings=20_000_263),
}


@dataclasses.dataclass(frozen=True)
class SyntheticTruth:
    """The planted model behind a synthetic dataset, for checking what can be learned.

    Attributes:
        item_log_weight: `(num_items,)` popularity term of every item's log weight.
        user_factors: `(num_users, latent_dim)` planted user preferences.
        item_factors: `(num_items, latent_dim)` planted item preferences.
        item_ids: `(num_items,)` raw id of each item row.
    """

    item_log_weight: np.ndarray
    user_factors: np.ndarray
    item_factors: np.ndarray
    item_ids: np.ndarray

    def scores(self, user_rows: np.ndarray, item_rows: np.ndarray) -> np.ndarray:
        """Log sampling weight of each (user row, item row) pair: the oracle's score."""
        affinity = np.sum(self.user_factors[user_rows] * self.item_factors[item_rows], axis=-1)
        return self.item_log_weight[item_rows] + affinity


def generate(spec: SyntheticSpec, seed: int, show_progress: bool = False) -> RawRatings:
    """Returns the synthetic ratings for `spec` and `seed` (same inputs, same bytes)."""
    return generate_with_truth(spec, seed, show_progress)[0]


def generate_with_truth(
    spec: SyntheticSpec, seed: int, show_progress: bool = False
) -> tuple[RawRatings, SyntheticTruth]:
    """Like `generate`, also returning the planted model (user rows = raw id - 1)."""
    spec.validate()
    rng = np.random.default_rng(seed)
    truth = _plant_model(spec, rng)
    counts = _user_activity(spec, rng)
    user_rows, item_rows = _draw_items(spec, truth, counts, rng, show_progress)
    _cover_every_item(item_rows, spec.num_items, rng)
    timestamps = _timestamps(user_rows, spec.num_users, rng)
    # Source files list each user's ratings together; within a user, by raw item id.
    order = np.lexsort((truth.item_ids[item_rows], user_rows))
    ratings = RawRatings(
        users=user_rows[order].astype(np.int64) + 1,
        items=truth.item_ids[item_rows[order]],
        timestamps=timestamps[order],
    )
    return ratings, truth


def _plant_model(spec: SyntheticSpec, rng: np.random.Generator) -> SyntheticTruth:
    ranks = rng.permutation(spec.num_items) + 1
    item_log_weight = -spec.popularity_exponent * np.log(ranks)
    scale = np.sqrt(spec.preference_strength / np.sqrt(spec.latent_dim))
    user_factors = rng.standard_normal((spec.num_users, spec.latent_dim)) * scale
    item_factors = rng.standard_normal((spec.num_items, spec.latent_dim)) * scale
    max_item_id = spec.max_item_id or 4 * spec.num_items
    item_ids = np.sort(rng.choice(max_item_id, spec.num_items, replace=False)) + 1
    return SyntheticTruth(
        item_log_weight=item_log_weight.astype(np.float32),
        user_factors=user_factors.astype(np.float32),
        item_factors=item_factors.astype(np.float32),
        item_ids=item_ids.astype(np.int64),
    )


def _user_activity(spec: SyntheticSpec, rng: np.random.Generator) -> np.ndarray:
    """Per-user rating counts: a log-normal tail above the minimum, summing exactly."""
    floor = spec.min_ratings_per_user
    cap = max(floor, spec.num_items // 2)
    extra = spec.num_ratings - floor * spec.num_users
    shares = rng.lognormal(0.0, 1.2, spec.num_users)
    counts = np.full(spec.num_users, floor, dtype=np.int64)
    while extra > 0:
        room = cap - counts
        weights = np.where(room > 0, shares, 0.0)
        add = np.minimum(np.floor(extra * weights / weights.sum()).astype(np.int64), room)
        if add.sum() == 0:  # distribute the last few one at a time, largest shares first
            candidates = np.flatnonzero(room > 0)
            take = candidates[np.argsort(-shares[candidates], kind="stable")][:extra]
            add = np.zeros_like(counts)
            add[take] = 1
        counts += add
        extra -= int(add.sum())
    return counts


def _draw_items(
    spec: SyntheticSpec,
    truth: SyntheticTruth,
    counts: np.ndarray,
    rng: np.random.Generator,
    show_progress: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Weighted sampling without replacement for every user, in blocks of users."""
    by_activity = np.argsort(counts, kind="stable")  # similar counts share a block
    block_users = max(1, _BLOCK_ELEMENTS // spec.num_items)
    user_out = np.empty(int(counts.sum()), dtype=np.int32)
    item_out = np.empty(int(counts.sum()), dtype=np.int32)
    position = 0
    progress = (
        ProgressBar(spec.num_users, "generating synthetic ratings", unit=" users")
        if show_progress
        else None
    )
    for start in range(0, spec.num_users, block_users):
        users = by_activity[start : start + block_users]
        logits = truth.user_factors[users] @ truth.item_factors.T
        logits += truth.item_log_weight
        logits -= logits.max(axis=1, keepdims=True)
        keys = np.exp(logits, dtype=np.float32)
        races = rng.standard_exponential(keys.shape, dtype=np.float32)
        keys /= np.maximum(races, np.float32(1e-30), out=races)  # float32 draws can be 0
        need = counts[users]
        top = np.argpartition(-keys, int(need.max()) - 1, axis=1)[:, : int(need.max())]
        top_keys = np.take_along_axis(keys, top, axis=1)
        ranked = np.take_along_axis(top, np.argsort(-top_keys, axis=1, kind="stable"), axis=1)
        keep = np.arange(ranked.shape[1]) < need[:, None]
        size = int(need.sum())
        user_out[position : position + size] = np.repeat(users, need)
        item_out[position : position + size] = ranked[keep]
        position += size
        if progress:
            progress.update(len(users))
    if progress:
        progress.close()
    return user_out, item_out


def _cover_every_item(item_rows: np.ndarray, num_items: int, rng: np.random.Generator) -> None:
    """Gives each never-drawn item one rating taken from a much-rated item.

    No user holds a never-drawn item, so the swap never creates a duplicate pair.
    """
    item_counts = np.bincount(item_rows, minlength=num_items)
    missing = np.flatnonzero(item_counts == 0)
    if len(missing) == 0:
        return
    donors = np.flatnonzero(item_counts[item_rows] > len(missing) + 1)
    if len(donors) < len(missing):
        raise DataError("synthetic spec is too sparse to rate every item; add ratings")
    chosen = rng.choice(donors, len(missing), replace=False)
    item_rows[chosen] = rng.permutation(missing)


def _timestamps(user_rows: np.ndarray, num_users: int, rng: np.random.Generator) -> np.ndarray:
    """Per-row times: each user rates at increasing times, in random item order.

    Items were drawn best first; a random order makes the last one in time (the
    held-out item) a typical draw rather than the least preferred one. Gaps are
    often zero seconds, as in MovieLens, so ties exercise the sort rules.
    """
    total = len(user_rows)
    starts = rng.integers(_FIRST_TIMESTAMP, _LAST_TIMESTAMP - 10_000_000, num_users)
    gaps = np.floor(rng.exponential(60.0, total) * rng.integers(0, 2, total)).astype(np.int64)
    by_user = np.lexsort((rng.random(total), user_rows))
    sorted_users = user_rows[by_user]
    elapsed = np.cumsum(gaps)
    first_rows = np.flatnonzero(np.r_[True, sorted_users[1:] != sorted_users[:-1]])
    run_lengths = np.diff(np.r_[first_rows, total])
    elapsed -= np.repeat(elapsed[first_rows] - gaps[first_rows], run_lengths)
    timestamps = np.empty(total, dtype=np.int64)
    timestamps[by_user] = starts[sorted_users] + elapsed
    return timestamps


def write_ratings_csv(ratings: RawRatings, path: str) -> None:
    """Writes ``userId,movieId,rating,timestamp`` (the ml-20m format), atomically.

    Ratings are 1..5 stars drawn uniformly: only presence matters for implicit NCF.
    """
    stars = np.random.default_rng(0).integers(1, 6, len(ratings)).astype(np.float64)
    table = pa.table(
        {
            "userId": ratings.users,
            "movieId": ratings.items,
            "rating": stars,
            "timestamp": ratings.timestamps,
        }
    )
    text = pa.BufferOutputStream()  # pyarrow cannot write to a gfile handle
    options = pa_csv.WriteOptions(quoting_style="none", quoting_header="none")
    pa_csv.write_csv(table, text, options)
    tf.io.gfile.makedirs(os.path.dirname(path))
    atomic.write_file(path, text.getvalue().to_pybytes())


def main(argv: list[str]) -> None:
    del argv
    spec = SHAPES[flags.FLAGS.shape]
    start = time.monotonic()
    ratings = generate(spec, flags.FLAGS.seed, show_progress=True)
    path = os.path.join(flags.FLAGS.data_dir, flags.FLAGS.shape, "ratings.csv")
    write_ratings_csv(ratings, path)
    logging.info("wrote %d ratings to %s in %.1f s", len(ratings), path, time.monotonic() - start)


if __name__ == "__main__":
    flags.DEFINE_enum("shape", "ml-20m", list(SHAPES), "Which MovieLens release to imitate.")
    flags.DEFINE_string("data_dir", constants.DEFAULT_DATA_DIR, "Writes DATA_DIR/<shape>/.")
    flags.DEFINE_integer("seed", 0, "Random seed; the same seed writes the same file.")
    app.run(main)
