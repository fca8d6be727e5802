"""Full-catalogue ranking metrics: each user's held-out item ranked against every item
the user has not interacted with, beside the sampled protocol's 99 or 999 negatives.

Sampled metrics can order models differently from the metric over the whole catalogue
(Krichene and Rendle, KDD 2020), so an evaluation can also compute HR@k, NDCG@k and
Recall@k over every item. The candidates are the items the sampled protocol draws its
negatives from: every item except the user's other known interactions (training items
and the other held-out item), so the two rankings differ only in how many candidates
they see. The held-out item loses ties, as in the sampled metric: a model that scores
every item alike ranks it last.

Scores come from any model (`score_users`: a block of users to their scores of every
item), so NeuMF and the baselines are ranked by this one code. Users are scored in
blocks, so memory follows the block, not the catalogue times the users.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from recommendation.data import constants
from recommendation.data.data_preprocessing import PreprocessedData

# What a full ranking reports, by name (as ``full_<name>`` beside the sampled metrics).
METRICS = ("hr", "ndcg", "recall")

ScoreUsers = Callable[[np.ndarray], "tf.Tensor | np.ndarray"]


@dataclasses.dataclass(frozen=True)
class RankedUsers:
    """Each evaluated user's rank of the held-out item and the metrics at `k`.

    Attributes:
        ranks: `(num_users,)` int64: how many candidates score at least as high as the
            held-out item (0: it is first).
        k: The cut-off.
        seconds: Wall time of the ranking, scoring included.
    """

    ranks: np.ndarray
    k: int
    seconds: float

    @property
    def hits(self) -> np.ndarray:
        """`(num_users,)` 1.0 where the held-out item is in the top k."""
        return (self.ranks < self.k).astype(np.float64)

    @property
    def ndcgs(self) -> np.ndarray:
        """`(num_users,)` NDCG@k of the one relevant item: 1 / log2(rank + 2) in the top k."""
        return np.where(self.ranks < self.k, 1.0 / np.log2(self.ranks + 2.0), 0.0)

    def metrics(self) -> dict[str, float]:
        """``hr``, ``ndcg``, ``recall`` (means over users) and ``seconds``.

        Recall@k is the share of a user's held-out items in the top k; with one held-out
        item per user (this protocol) it equals HR@k, and is reported so that tables
        from protocols holding out several items line up.
        """
        hr = float(self.hits.mean()) if len(self.ranks) else 0.0
        return {
            "hr": hr,
            "ndcg": float(self.ndcgs.mean()) if len(self.ranks) else 0.0,
            "recall": hr,
            "seconds": self.seconds,
        }

    def full_metrics(self) -> dict[str, float]:
        """The metrics under the names evaluations report them by: ``full_hr``,
        ``full_ndcg``, ``full_recall``."""
        metrics = self.metrics()
        return {f"full_{name}": metrics[name] for name in METRICS}


@dataclasses.dataclass(frozen=True)
class FullRanking:
    """What ranking a split over the whole catalogue needs: each user's held-out item
    and the items that are not candidates for it (CSR by user).

    Attributes:
        held_out: `(num_users,)` int32 held-out item of each user.
        excluded_offsets: `(num_users + 1,)` int64; user `u`'s excluded items are
            ``excluded_items[excluded_offsets[u]:excluded_offsets[u + 1]]``.
        excluded_items: int32 items the user interacted with, the held-out one aside.
        num_items: Catalogue size.
    """

    held_out: np.ndarray
    excluded_offsets: np.ndarray
    excluded_items: np.ndarray
    num_items: int

    @classmethod
    def of(cls, data: PreprocessedData, split: str = constants.TEST_SPLIT) -> FullRanking:
        """The ranking of `split`'s held-out items: every other interaction of the user
        (training, and the other split's held-out item) is excluded."""
        validation = split == constants.VALIDATION_SPLIT
        held_out = data.validation_items if validation else data.eval_items
        if held_out is None:
            raise ValueError(f"the data holds no {split} items")
        others = [data.eval_items] if validation else []
        if not validation and data.validation_items is not None:
            others.append(data.validation_items)
        every_user = np.arange(data.num_users, dtype=np.int32)
        users = np.concatenate([data.train_users(), *(every_user for _ in others)])
        items = np.concatenate([data.train_items, *others]).astype(np.int32)
        keep = items != held_out[users]
        # Sorted by user, then item, each pair once (an item may be held out and trained).
        pairs = np.sort(users[keep].astype(np.int64) * data.num_items + items[keep])
        pairs = pairs[np.concatenate([[True], pairs[1:] != pairs[:-1]])]  # np.unique hashes: slower
        users, items = np.divmod(pairs, data.num_items)
        counts = np.bincount(users, minlength=data.num_users)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return cls(held_out.astype(np.int32), offsets, items.astype(np.int32), data.num_items)

    @property
    def num_users(self) -> int:
        return len(self.held_out)

    def first(self, num_users: int) -> FullRanking:
        """The ranking of the first `num_users` users only."""
        return FullRanking(
            self.held_out[:num_users],
            self.excluded_offsets[: num_users + 1],
            self.excluded_items,
            self.num_items,
        )

    def rank(
        self,
        score_users: ScoreUsers,
        users_per_block: int,
        k: int,
        on_block: Callable[[int], None] | None = None,
    ) -> RankedUsers:
        """Ranks every user's held-out item among its candidates.

        Args:
            score_users: `(block,)` int32 users -> `(block, num_items)` scores.
            users_per_block: Users scored at once (memory: block x items x the model's
                widest per-pair layer).
            k: The cut-off of the metrics.
            on_block: Called with the users ranked so far after each block.
        """
        start = time.perf_counter()
        ranks = np.empty(self.num_users, dtype=np.int64)
        for first in range(0, self.num_users, users_per_block):
            users = np.arange(first, min(first + users_per_block, self.num_users), dtype=np.int32)
            begin, end = self.excluded_offsets[first], self.excluded_offsets[users[-1] + 1]
            rows = np.repeat(
                np.arange(len(users), dtype=np.int32),
                np.diff(self.excluded_offsets[first : users[-1] + 2]),
            )
            scores = tf.convert_to_tensor(score_users(users), dtype=tf.float32)
            ranks[first : first + len(users)] = held_out_ranks(
                scores,
                tf.constant(self.held_out[users]),
                tf.constant(np.stack([rows, self.excluded_items[begin:end]], axis=1)),
            ).numpy()
            if on_block is not None:
                on_block(first + len(users))
        return RankedUsers(ranks, k, time.perf_counter() - start)


@tf.function(
    input_signature=(
        tf.TensorSpec([None, None], tf.float32),
        tf.TensorSpec([None], tf.int32),
        tf.TensorSpec([None, 2], tf.int32),
    )
)
def held_out_ranks(scores: tf.Tensor, held_out: tf.Tensor, excluded: tf.Tensor) -> tf.Tensor:
    """Per user, how many candidates score at least as high as the held-out item.

    Excluded items never count; every other item with an equal score does (ties lose);
    a held-out item scored NaN ranks last. Example: scores ``[3, 5, 5, 1, 5]`` with the
    held-out item 4 and item 1 excluded give rank 1.

    Args:
        scores: `(users, num_items)`.
        held_out: `(users,)` the held-out item of each row.
        excluded: `(n, 2)` (row, item) pairs that are not candidates.
    """
    positive = tf.gather(scores, held_out, axis=1, batch_dims=1)
    masked = tf.tensor_scatter_nd_update(
        scores, excluded, tf.fill([tf.shape(excluded)[0]], float("-inf"))
    )
    # Minus one: the held-out item scores at least as high as itself.
    others = tf.reduce_sum(tf.cast(masked >= positive[:, None], tf.int64), axis=1) - 1
    last = tf.cast(tf.shape(scores)[1], tf.int64)
    return tf.where(tf.math.is_nan(positive), last, others)


# Bytes of the largest per-pair tensor a block of users may make.
_BLOCK_BYTES = 256 * 2**20


def users_per_block(num_items: int, widest: int, num_users: int) -> int:
    """Users scored at once: as many as keep a `(users, num_items, widest)` float32
    tensor within 256 MiB, at least one, at most every user."""
    return int(min(num_users, max(1, _BLOCK_BYTES // (4 * num_items * max(widest, 1)))))


class ModelScores:
    """A `network.NeuMF`'s scores of every item, for `FullRanking.rank`.

    The item side (the item table and its half of the first MLP layer) is computed
    once per evaluation (`for_evaluation`); each block of users then costs its own
    rows and the layers above the first. One traced function serves every evaluation.
    """

    def __init__(self, model) -> None:
        self.model = model
        # No tensor-dependent Python control flow to convert: no autograph.
        self._score = tf.function(self._scores, reduce_retracing=True, autograph=False)

    def _scores(self, users: tf.Tensor, side: tuple) -> tf.Tensor:
        return tf.cast(self.model.score_against(users, side), tf.float32)

    def for_evaluation(self) -> ScoreUsers:
        """Scores of the model as it is now (the item side is read here)."""
        side = tuple(None if part is None else tf.identity(part) for part in self.model.item_side())

        def score_users(users: np.ndarray) -> tf.Tensor:
            return self._score(tf.constant(users, tf.int32), side)

        return score_users

    def users_per_block(self, num_users: int) -> int:
        """Users per block: a pair's widest tensor is an MLP layer's output above the
        first (the GMF share is one matrix product), else its logit."""
        model = self.model
        widest = max(model.layer_sizes[1:]) if model.mlp else 1
        return users_per_block(model.num_items, widest, num_users)
