"""What the producer generates: training epochs with negatives, and evaluation blocks.

A training epoch is every positive once plus its negatives, shuffled; an evaluation
block is a user's negatives, the held-out item and their duplicate mask.

Both are pure functions of data, parameters and seed. Every piece of random work draws
from its own stream (`stat_utils.rng_for`, keyed by seed, epoch and chunk), so the
output is byte-identical for a given seed whatever the number of workers.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np

from recommendation.data import constants
from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.producer import stat_utils

# Stream tags of `stat_utils.rng_for`, one per kind of random work.
_NEGATIVES, _SHUFFLE, _EVAL, _BUCKET, _VALIDATION = 1, 2, 3, 4, 5
_CHUNK = 1 << 20  # sampling work unit (points); fixed so output ignores worker count
_SHUFFLE_BUCKETS = 64  # output ranges of the scatter shuffle; fixed for the same reason
_EVAL_CHUNK_USERS = 4096


@dataclasses.dataclass(frozen=True)
class TrainingEpoch:
    """One shuffled epoch: every positive once plus `num_neg` negatives each.

    Attributes:
        users, items: `(points,)` int32.
        labels: `(points,)` bool, True for positives.
    """

    users: np.ndarray
    items: np.ndarray
    labels: np.ndarray


def training_epoch(
    data: PreprocessedData,
    exclusion: stat_utils.ExclusionIndex,
    num_neg: int,
    seed: int,
    epoch: int,
    pool: concurrent.futures.Executor,
    chunk_points: int = _CHUNK,
) -> TrainingEpoch:
    """Samples negatives for every training positive and shuffles the epoch.

    Negatives are drawn uniformly from the items the user has no training
    interaction with (the held-out items, test and validation, may be drawn, as the
    reference draws its test item: excluding them would tell the model which they are).

    The shuffle is a scatter shuffle, so every stage runs in parallel: each chunk of
    points sends each point to one of `_SHUFFLE_BUCKETS` output ranges drawn
    uniformly, then each range is permuted on its own. Every outcome of that is
    equally likely (a uniform permutation), and each draw is keyed by its chunk or
    range, so the bytes do not depend on the number of workers. `chunk_points` is
    the work unit (a fixed constant in production; tests make it small).
    """
    positive_users = data.train_users()
    negative_users = np.repeat(positive_users, num_neg)  # user-major: cache-friendly lookups
    num_positives = len(positive_users)
    num_points = num_positives + len(negative_users)
    starts = range(0, num_points, chunk_points)

    def scatter(index: int, start: int) -> _ScatteredChunk:
        stop = min(start + chunk_points, num_points)
        users, items, labels = [], [], []
        if start < num_positives:  # the chunk's positives
            end = min(stop, num_positives)
            users.append(positive_users[start:end])
            items.append(data.train_items[start:end])
            labels.append(np.ones(end - start, dtype=bool))
        if stop > num_positives:  # its negatives
            begin = max(start, num_positives) - num_positives
            chunk_users = negative_users[begin : stop - num_positives]
            rng = stat_utils.rng_for(seed, _NEGATIVES, epoch, index)
            users.append(chunk_users)
            items.append(exclusion.sample(rng, chunk_users))
            labels.append(np.zeros(len(chunk_users), dtype=bool))
        bucket = stat_utils.rng_for(seed, _BUCKET, epoch, index).integers(
            0, _SHUFFLE_BUCKETS, stop - start, dtype=np.uint8
        )
        order = np.argsort(bucket, kind="stable")
        counts = np.bincount(bucket, minlength=_SHUFFLE_BUCKETS)
        return _ScatteredChunk(
            columns=[np.concatenate(column)[order] for column in (users, items, labels)],
            bounds=np.concatenate([[0], np.cumsum(counts)]),
        )

    chunks = list(pool.map(scatter, range(len(starts)), starts))
    sizes = np.sum([np.diff(chunk.bounds) for chunk in chunks], axis=0, dtype=np.int64)
    bucket_bounds = np.concatenate([[0], np.cumsum(sizes)])
    columns = [np.empty(num_points, np.int32), np.empty(num_points, np.int32)]
    columns.append(np.empty(num_points, bool))

    def permute(bucket: int) -> None:
        order = stat_utils.rng_for(seed, _SHUFFLE, epoch, bucket).permutation(sizes[bucket])
        target = slice(bucket_bounds[bucket], bucket_bounds[bucket + 1])
        for column, out in enumerate(columns):
            gathered = np.concatenate(
                [c.columns[column][c.bounds[bucket] : c.bounds[bucket + 1]] for c in chunks]
            )
            out[target] = gathered[order]

    list(pool.map(permute, range(_SHUFFLE_BUCKETS if chunks else 0)))
    return TrainingEpoch(users=columns[0], items=columns[1], labels=columns[2])


@dataclasses.dataclass(frozen=True)
class _ScatteredChunk:
    """One chunk's points (users, items, labels) ordered by output range;
    range ``b`` holds rows ``bounds[b] .. bounds[b + 1]``."""

    columns: list[np.ndarray]
    bounds: np.ndarray


@dataclasses.dataclass(frozen=True)
class EvalBlocks:
    """Per evaluation user, a block of negatives followed by the held-out item.

    Attributes:
        users: `(num_users,)` int32.
        items: `(num_users, block)` int32; the last column is the held-out item, so
            it loses ties against negatives with the same score (the reference's rule).
        duplicate_mask: `(num_users, block)` bool; True marks a repeat of an item
            earlier in the block (the held-out item is never masked).
    """

    users: np.ndarray
    items: np.ndarray
    duplicate_mask: np.ndarray

    @property
    def block_size(self) -> int:
        return self.items.shape[1]


def eval_blocks(
    data: PreprocessedData,
    num_eval_negatives: int,
    seed: int,
    pool: concurrent.futures.Executor,
    split: str = constants.TEST_SPLIT,
) -> EvalBlocks:
    """Builds every user's evaluation block of `split`, a chunk of users per task.

    Sampled negatives come uniformly, with replacement, from the items the user never
    interacted with (training or held out, test and validation). Datasets with fixed
    negatives (the NCF paper's split) use them as given for the test set; their
    validation set samples `num_eval_negatives`, as every other dataset does, from a
    stream of its own.
    """
    validation = split == constants.VALIDATION_SPLIT
    held_out = data.validation_items if validation else data.eval_items
    fixed = None if validation else data.eval_negatives
    users = np.arange(data.num_users, dtype=np.int32)
    exclusion = _all_interactions(data) if fixed is None else None
    block = 1 + (num_eval_negatives if fixed is None else fixed.shape[1])
    items = np.empty((data.num_users, block), dtype=np.int32)
    mask = np.empty((data.num_users, block), dtype=bool)

    def build(start: int) -> None:
        chunk = users[start : start + _EVAL_CHUNK_USERS]
        if fixed is not None:
            negatives = fixed[chunk].astype(np.int32)
        else:
            stream = _VALIDATION if validation else _EVAL
            rng = stat_utils.rng_for(seed, stream, start // _EVAL_CHUNK_USERS)
            negatives = exclusion.sample(rng, np.repeat(chunk, num_eval_negatives))
            negatives = negatives.reshape(len(chunk), num_eval_negatives)
        # The positive goes first while masking, so a negative equal to it is the one
        # masked, then moves to the last column.
        rows = np.concatenate([held_out[chunk, None].astype(np.int32), negatives], axis=1)
        items[chunk] = np.roll(rows, -1, axis=1)
        mask[chunk] = np.roll(stat_utils.mask_duplicates(rows), -1, axis=1)

    list(pool.map(build, range(0, data.num_users, _EVAL_CHUNK_USERS)))
    return EvalBlocks(users=users, items=items, duplicate_mask=mask)


def _all_interactions(data: PreprocessedData) -> stat_utils.ExclusionIndex:
    """Exclusion index of each user's training items plus the held-out items."""
    held_out = [data.eval_items]
    if data.validation_items is not None:
        held_out.append(data.validation_items)
    every_user = np.arange(data.num_users, dtype=np.int32)
    users = np.concatenate([data.train_users(), *(every_user for _ in held_out)])
    items = np.concatenate([data.train_items, *held_out])
    order = np.argsort(users, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(users, minlength=data.num_users))])
    return stat_utils.ExclusionIndex.from_csr(offsets, items[order], data.num_items)
