"""Preprocessing: index ids, drop repeats, filter users, sort by time, hold out.

The reference (TensorFlow Model Garden) does this with a pandas
``groupby().filter(lambda ...)``, dict lookups applied row by row and a per-user
``apply`` to split off the last rating, which takes minutes on ml-20m. Here every step
is a whole-array numpy/pandas operation:

1. map raw ids to dense 0-based indexes in order of first appearance, as the reference
   does (`pd.factorize`), and keep both maps for serving;
2. keep only the latest of repeated (user, item) pairs (a sort of one integer key per
   pair), so that no held-out item is also a training positive of its user;
3. drop users with fewer than `min_num_ratings` ratings (`np.bincount` of user codes);
4. stable sort by (user, timestamp); with ``ml_perf`` ties are first shuffled by an
   unstable quicksort on time, exactly the reference's MLPerf ordering;
5. hold out each user's last interaction for evaluation (the test holdout) and, with
   ``eval_split="validation"``, the second-to-last for validation; the rest is
   training, kept in CSR form (`train_offsets`, `train_items`) because negative
   sampling wants each user's items as one slice.

`build` reads the configured source and preprocesses it; `preprocessing_cache` keeps
the result on disk.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import numpy as np
import pandas as pd
from absl import logging

from recommendation.data import constants, movielens, ratings_readers, synthetic_data
from recommendation.data.movielens import DataError
from recommendation.data.ratings_readers import RawRatings


@dataclasses.dataclass(frozen=True)
class PreprocessedData:
    """Indexed interactions, split into training positives and one holdout per user.

    Attributes:
        user_ids: `(num_users,)` raw id of each user index.
        item_ids: `(num_items,)` raw id of each item index.
        train_offsets: `(num_users + 1,)` int64; user `u`'s training items are
            ``train_items[train_offsets[u]:train_offsets[u + 1]]``.
        train_items: `(num_train,)` int32 item indexes, each user's in time order.
        eval_items: `(num_users,)` int32 held-out (test) item of each user.
        eval_negatives: `(num_users, k)` int32 fixed evaluation negatives of the test
            items (the NCF paper's split), or None when negatives are sampled.
        validation_items: `(num_users,)` int32 validation item of each user (its
            latest interaction before the test item), or None for the test split.
    """

    user_ids: np.ndarray
    item_ids: np.ndarray
    train_offsets: np.ndarray
    train_items: np.ndarray
    eval_items: np.ndarray
    eval_negatives: np.ndarray | None = None
    validation_items: np.ndarray | None = None

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def num_items(self) -> int:
        return len(self.item_ids)

    @property
    def num_train_positives(self) -> int:
        return len(self.train_items)

    def train_users(self) -> np.ndarray:
        """`(num_train,)` int32 user index of every training positive."""
        counts = np.diff(self.train_offsets)
        return np.repeat(np.arange(self.num_users, dtype=np.int32), counts)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Everything that decides which data is read and how it is preprocessed.

    Attributes:
        dataset: Registry name (see `movielens.DATASETS`).
        data_dir: Folder holding ``<dataset>/`` (downloads go there too).
        cache_dir: Where the preprocessing cache lives ("" = ``data_dir/<dataset>``).
        download_if_missing: Fetch a missing MovieLens release from GroupLens.
        url_base: Where releases are downloaded from.
        min_num_ratings: Users with fewer interactions are dropped.
        ml_perf: Order same-time interactions as the MLPerf reference did.
        seed: Seed of the synthetic generator.
        synthetic: Size of ``--dataset synthetic``.
        generic: The file read by ``--dataset generic``.
        cache_max_age_sec: Older caches are rebuilt.
        eval_split: `constants.TEST_SPLIT`, or `constants.VALIDATION_SPLIT` to hold
            out a validation item per user as well.
    """

    dataset: str = movielens.ML_1M
    data_dir: str = constants.DEFAULT_DATA_DIR
    cache_dir: str = ""
    download_if_missing: bool = False
    url_base: str = constants.MOVIELENS_URL
    min_num_ratings: int = constants.MIN_NUM_RATINGS
    ml_perf: bool = False
    seed: int = 0
    synthetic: synthetic_data.SyntheticSpec = synthetic_data.SyntheticSpec()
    generic: ratings_readers.GenericSource | None = None
    cache_max_age_sec: float = constants.CACHE_INVALIDATION_SEC
    eval_split: str = constants.TEST_SPLIT

    def resolved_cache_dir(self) -> str:
        info = movielens.dataset_info(self.dataset)
        return self.cache_dir or os.path.join(self.data_dir, info.name)

    def cache_parameters(self) -> dict:
        """The parameters a cache is valid for (sources are checked separately)."""
        params = {
            "dataset": self.dataset,
            "min_num_ratings": self.min_num_ratings,
            "ml_perf": self.ml_perf,
        }
        if self.dataset == movielens.SYNTHETIC:
            params.update(seed=self.seed, synthetic=dataclasses.asdict(self.synthetic))
        if self.dataset == movielens.GENERIC:
            params["generic"] = dataclasses.asdict(self.generic)
        if self.eval_split != constants.TEST_SPLIT:
            # Named only when not the default, so caches of the test split stay valid.
            params["eval_split"] = self.eval_split
        return params


# ---------------------------------------------------------------------------
# The transformation


def preprocess(
    raw: RawRatings,
    min_num_ratings: int = constants.MIN_NUM_RATINGS,
    ml_perf: bool = False,
    eval_split: str = constants.TEST_SPLIT,
) -> PreprocessedData:
    """Filters, indexes, sorts and splits `raw` (see the module docstring).

    Repeated (user, item) pairs keep only their latest occurrence (largest timestamp,
    then last in the file), before users are counted: a pair left in training beside
    its own held-out copy would be an evaluation positive the model was trained on.

    Args:
        raw: Interactions in source order.
        min_num_ratings: Users with fewer distinct items are dropped.
        ml_perf: Order same-time interactions of a user as the MLPerf reference did
            (an unstable quicksort on time first), instead of by file order.
        eval_split: `constants.VALIDATION_SPLIT` also holds out each user's
            second-to-last interaction, for validation.

    Raises:
        DataError: no user has `min_num_ratings` interactions, or `min_num_ratings`
            leaves a user nothing to train on once the holdouts are taken.
    """
    holdouts = 2 if eval_split == constants.VALIDATION_SPLIT else 1
    if min_num_ratings < 2:
        raise DataError("min_num_ratings must be at least 2: one to train on, one to hold out")
    if min_num_ratings < 1 + holdouts:
        raise DataError(
            f"--eval_split validation needs --min_num_ratings of at least 3 (one interaction "
            f"to train on, one to validate on, one to test on), not {min_num_ratings}"
        )
    timestamps = raw.timestamps
    # Sorts and factorizations release the GIL, so the (user, time) sort of every row
    # runs in a worker beside the item factorization and the search for repeated pairs:
    # two cores share the work (docs/benchmarks.md, "Preprocessing", measures it).
    # MovieLens never has rows to drop; when some are dropped, the stable order of the
    # kept rows is the sorted order with the others left out, but the reference's
    # unstable time quicksort is redone on them.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as worker:
        by_time = None
        if ml_perf and timestamps is not None:
            by_time = worker.submit(np.argsort, timestamps, kind="quicksort")
        user_index, user_ids = pd.factorize(raw.users)  # first-appearance order, as the reference
        order = worker.submit(_time_order, user_index, timestamps, ml_perf, by_time)
        item_index, item_ids = pd.factorize(raw.items)
        repeated = repeated_pair_rows(
            user_index, item_index, len(user_ids), len(item_ids), timestamps
        )
        _log_dropped(len(repeated), "repeated (user, item) pairs, keeping the latest of each")
        keep = np.ones(len(user_index), dtype=bool)
        keep[repeated] = False
        user_counts = np.bincount(user_index[keep], minlength=len(user_ids))
        kept_users = user_counts >= min_num_ratings
        if not kept_users.any():
            raise DataError(
                f"every user has fewer than {min_num_ratings} ratings, so none is left; use "
                f"a larger dataset or lower --min_num_ratings"
            )
        if not kept_users.all():
            _log_dropped(
                len(kept_users) - np.count_nonzero(kept_users),
                f"users with fewer than {min_num_ratings} distinct items",
            )
            keep &= kept_users[user_index]
        order = order.result()
    if not keep.all():
        # Renumbering the kept codes in order keeps first-appearance order.
        user_index = (np.cumsum(kept_users) - 1)[user_index[keep]]
        user_ids = user_ids[kept_users]
        user_counts = user_counts[kept_users]
        item_index, first_items = pd.factorize(item_index[keep])
        item_ids = item_ids[first_items]
        if by_time is None:
            order = (np.cumsum(keep) - 1)[order[keep[order]]]
        else:
            order = _time_order(user_index, timestamps[keep], ml_perf)
    sorted_items = item_index.astype(constants.INDEX_DTYPE)[order]
    ends = np.cumsum(user_counts)
    is_holdout = np.zeros(len(order), dtype=bool)
    for last in range(1, holdouts + 1):  # the test item, then the validation item
        is_holdout[ends - last] = True
    return PreprocessedData(
        user_ids=np.asarray(user_ids, dtype=constants.RAW_ID_DTYPE),
        item_ids=np.asarray(item_ids, dtype=constants.RAW_ID_DTYPE),
        train_offsets=np.concatenate([[0], ends - holdouts * np.arange(1, len(ends) + 1)]).astype(
            np.int64
        ),
        train_items=sorted_items[~is_holdout],
        eval_items=sorted_items[ends - 1],
        validation_items=sorted_items[ends - 2] if holdouts == 2 else None,
    )


def repeated_pair_rows(
    users: np.ndarray,
    items: np.ndarray,
    num_users: int,
    num_items: int,
    timestamps: np.ndarray | None = None,
) -> np.ndarray:
    """Rows to drop so that each (user, item) pair keeps only its latest occurrence.

    Latest means the largest timestamp, then the last in the file. `users` and `items`
    are dense indexes, so each pair is one integer key (32 bits up to ml-20m's 3.7 G
    pairs): sorting the keys tells whether any repeats at a tenth of the cost of a hash
    table on 20 M rows, and only the rows of repeated pairs are looked at further.

    Returns:
        Ascending row numbers; empty when no pair repeats (every MovieLens release).
    """
    key_type = np.uint32 if num_users * num_items <= 2**32 else np.int64
    keys = users.astype(key_type) * key_type(num_items) + items.astype(key_type)
    sorted_keys = np.sort(keys)
    repeated_keys = np.unique(sorted_keys[1:][sorted_keys[1:] == sorted_keys[:-1]])
    if len(repeated_keys) == 0:
        return np.zeros(0, dtype=np.int64)
    position = np.minimum(np.searchsorted(repeated_keys, keys), len(repeated_keys) - 1)
    rows = np.flatnonzero(repeated_keys[position] == keys)
    by_time = () if timestamps is None else (timestamps[rows],)
    rows = rows[np.lexsort((rows, *by_time, keys[rows]))]  # by pair, then time, then file
    is_latest = np.append(keys[rows[1:]] != keys[rows[:-1]], True)
    return np.sort(rows[~is_latest])


def _time_order(
    user_index: np.ndarray,
    timestamps: np.ndarray | None,
    ml_perf: bool,
    by_time: concurrent.futures.Future | None = None,
) -> np.ndarray:
    """Row order sorted by (user, time); equal times keep file order unless `ml_perf`.

    `by_time`, if given, holds the result of the `ml_perf` time quicksort of these rows.
    """
    if timestamps is None:
        return np.argsort(user_index, kind="stable")
    if ml_perf:
        # The reference sorts by time with pandas' default (unstable) quicksort before
        # its stable (user, time) sort; the MLPerf HR targets were set with that order.
        # Rows are then already in time order, so a stable sort by user finishes it.
        first = np.argsort(timestamps, kind="quicksort") if by_time is None else by_time.result()
        return first[_stable_argsort_small_ints(user_index[first])]
    span = int(timestamps.max()) - int(timestamps.min())
    if span < 2**31 and len(user_index) < 2**31:
        # One int64 key sorts faster than a two-key lexsort and gives the same order.
        key = user_index.astype(np.int64) << 31 | (timestamps - timestamps.min())
        return np.argsort(key, kind="stable")
    return np.lexsort((timestamps, user_index))


def _stable_argsort_small_ints(values: np.ndarray) -> np.ndarray:
    """`np.argsort(values, kind="stable")` for non-negative ints below ``len(values)``.

    Each value is packed with its position into one int64 and the keys are sorted by
    value (no argsort, no merge sort): faster than the stable argsort at the ml-20m size
    (docs/benchmarks.md, "Preprocessing", measures it).
    """
    bits = len(values).bit_length()
    if 2 * bits > 63:
        return np.argsort(values, kind="stable")
    keys = values.astype(np.int64, copy=False) << bits  # fresh memory costs here: few copies
    keys |= np.arange(len(values), dtype=np.int32 if bits < 32 else np.int64)
    keys.sort()
    keys &= (1 << bits) - 1
    return keys


def from_ncf_split(
    split: ratings_readers.NcfSplitFiles, eval_split: str = constants.TEST_SPLIT
) -> PreprocessedData:
    """Uses the NCF paper's split as given: its ids are already dense indexes.

    The test and negative files are kept as they are (their rows are the evaluation
    set); a training pair equal to its user's test pair, which would train on the
    evaluation positive, is dropped, and repeated training pairs keep their last line.
    With `constants.VALIDATION_SPLIT`, each user's latest training line (by time, then
    the last in the file; the last line when the file has no time) becomes the
    validation item: the paper's split has no validation set of its own.

    Raises:
        DataError: the split is not one holdout per user for users 0..n-1, or, for
            validation, a user has fewer than two training items.
    """
    num_users = len(split.test_users)
    if not np.array_equal(split.test_users, np.arange(num_users)):
        raise DataError(
            f"{split.sources[1]} must list users 0..{num_users - 1} once each, in order"
        )
    if split.train_users.min() < 0 or split.train_users.max() >= num_users:
        raise DataError(f"{split.sources[0]} has users missing from {split.sources[1]}")
    # As the NCF code does, the item count comes from the training file.
    num_items = int(split.train_items.max()) + 1
    for name, values in (("test", split.test_items), ("negative", split.test_negatives)):
        if values.min() < 0 or values.max() >= num_items:
            raise DataError(
                f"the {name} file has item ids outside the training file's 0.."
                f"{num_items - 1}; use files from the same release"
            )
    keep = split.train_items != split.test_items[split.train_users]
    _log_dropped(
        len(keep) - np.count_nonzero(keep),
        f"training pairs of {split.sources[0]} that are their user's test pair",
    )
    keep_rows = np.flatnonzero(keep)
    repeated = repeated_pair_rows(
        split.train_users[keep_rows], split.train_items[keep_rows], num_users, num_items
    )
    _log_dropped(len(repeated), f"repeated training pairs of {split.sources[0]}")
    keep[keep_rows[repeated]] = False
    train_users, train_items = split.train_users[keep], split.train_items[keep]
    counts = np.bincount(train_users, minlength=num_users)
    validation_items = None
    if eval_split == constants.VALIDATION_SPLIT:
        if counts.min() < 2:
            user = int(np.argmin(counts))
            raise DataError(
                f"user {user} has {counts[user]} training item(s) in {split.sources[0]}: "
                "--eval_split validation takes each user's latest one for validation and "
                "needs another to train on; use --eval_split test with these files"
            )
        times = () if split.train_timestamps is None else (split.train_timestamps[keep],)
        # Stable: in each user's rows by time, equal times keep file order; take the last.
        latest = np.lexsort((*times, train_users))[np.cumsum(counts) - 1]
        validation_items = train_items[latest].astype(constants.INDEX_DTYPE)
        is_train = np.ones(len(train_users), dtype=bool)
        is_train[latest] = False
        train_users, train_items = train_users[is_train], train_items[is_train]
        counts -= 1
    order = np.argsort(train_users, kind="stable")
    return PreprocessedData(
        user_ids=np.arange(num_users, dtype=constants.RAW_ID_DTYPE),
        item_ids=np.arange(num_items, dtype=constants.RAW_ID_DTYPE),
        train_offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        train_items=train_items[order].astype(constants.INDEX_DTYPE),
        eval_items=split.test_items.astype(constants.INDEX_DTYPE),
        eval_negatives=split.test_negatives.astype(constants.INDEX_DTYPE),
        validation_items=validation_items,
    )


def _log_dropped(count: int, what: str) -> None:
    if count:
        logging.warning("Dropped %d %s", count, what)


def build(config: DataConfig) -> tuple[PreprocessedData, tuple[str, ...]]:
    """Reads the configured source and preprocesses it; returns data and source files."""
    info = movielens.dataset_info(config.dataset)
    if info.kind == "ncf_split":
        split = ratings_readers.read_ncf_split(config.data_dir, config.dataset)
        return from_ncf_split(split, config.eval_split), split.sources
    if info.kind == "synthetic":
        raw = synthetic_data.generate(config.synthetic, config.seed)
    elif info.kind == "generic":
        if config.generic is None:
            raise DataError("--dataset generic needs --ratings_file")
        raw = ratings_readers.read_generic(config.generic)
    else:
        raw = ratings_readers.read_movielens(
            config.data_dir, config.dataset, config.download_if_missing, config.url_base
        )
    data = preprocess(raw, config.min_num_ratings, config.ml_perf, config.eval_split)
    return data, raw.sources
