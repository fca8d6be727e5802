"""Training and evaluation data: the sampling properties, checked over several epochs."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from recommendation.data import data_preprocessing, synthetic_data
from recommendation.producer import negative_sampling, stat_utils

SPEC = synthetic_data.SyntheticSpec(num_users=120, num_items=90, num_ratings=4000)


@pytest.fixture(scope="module")
def data():
    return data_preprocessing.preprocess(synthetic_data.generate(SPEC, seed=11))


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        yield executor


def _positive_sets(data):
    users = data.train_users()
    return [set(data.train_items[users == user].tolist()) for user in range(data.num_users)]


@pytest.mark.parametrize("num_neg, chunk_points", [(1, 1 << 20), (4, 1 << 20), (4, 777)])
def test_epochs_hold_each_positive_once_and_num_neg_true_negatives(
    data, pool, num_neg, chunk_points
):
    exclusion = stat_utils.ExclusionIndex.from_csr(
        data.train_offsets, data.train_items, data.num_items
    )
    positives = _positive_sets(data)
    expected_pairs = sorted(
        zip(data.train_users().tolist(), data.train_items.tolist(), strict=True)
    )
    for epoch_index in range(3):
        epoch = negative_sampling.training_epoch(
            data, exclusion, num_neg, 5, epoch_index, pool, chunk_points=chunk_points
        )
        assert len(epoch.users) == data.num_train_positives * (1 + num_neg)
        pairs = sorted(
            zip(epoch.users[epoch.labels].tolist(), epoch.items[epoch.labels].tolist(), strict=True)
        )
        assert pairs == expected_pairs  # every positive exactly once
        negative_users = epoch.users[~epoch.labels]
        for user, item in zip(
            negative_users.tolist(), epoch.items[~epoch.labels].tolist(), strict=True
        ):
            assert item not in positives[user]
        per_user = np.bincount(negative_users, minlength=data.num_users)
        np.testing.assert_array_equal(per_user, num_neg * np.diff(data.train_offsets))
        assert not np.all(epoch.labels[:-1] >= epoch.labels[1:])  # shuffled


def test_negatives_are_uniform_over_each_users_allowed_items(data, pool):
    exclusion = stat_utils.ExclusionIndex.from_csr(
        data.train_offsets, data.train_items, data.num_items
    )
    positives = _positive_sets(data)
    user = int(np.argmax(np.diff(data.train_offsets)))  # the busiest user
    allowed = np.array([item for item in range(data.num_items) if item not in positives[user]])
    counts = np.zeros(data.num_items)
    for epoch_index in range(40):
        epoch = negative_sampling.training_epoch(
            data, exclusion, 4, seed=6, epoch=epoch_index, pool=pool
        )
        chosen = (~epoch.labels) & (epoch.users == user)
        counts += np.bincount(epoch.items[chosen], minlength=data.num_items)
    expected = counts.sum() / len(allowed)
    chi_square = np.sum((counts[allowed] - expected) ** 2 / expected)
    degrees = len(allowed) - 1
    assert counts.sum() == counts[allowed].sum()
    assert chi_square < degrees + 5 * np.sqrt(2 * degrees), (chi_square, degrees)


def test_an_epoch_is_the_same_bytes_whatever_the_worker_count(data):
    """Many chunks (777 points, one straddling the positives' end) on 1 and 3 workers."""
    exclusion = stat_utils.ExclusionIndex.from_csr(
        data.train_offsets, data.train_items, data.num_items
    )
    epochs = []
    for workers in (1, 3):
        with concurrent.futures.ThreadPoolExecutor(workers) as executor:
            epochs.append(
                negative_sampling.training_epoch(
                    data, exclusion, 4, seed=3, epoch=1, pool=executor, chunk_points=777
                )
            )
    for field in ("users", "items", "labels"):
        assert getattr(epochs[0], field).tobytes() == getattr(epochs[1], field).tobytes()


def test_the_shuffle_is_uniform_within_each_range(pool):
    """Two points next to each other before the shuffle end up next to each other, in
    the same order, with probability 1/n under a uniform permutation of n points. A
    scatter into ranges without the per-range permutation keeps such pairs together
    whenever they share a range (1/64 of the time): 8 times as often here."""
    num_users, per_user, num_items, num_epochs = 16, 8, 40, 200
    data = data_preprocessing.PreprocessedData(
        user_ids=np.arange(num_users),
        item_ids=np.arange(num_items),
        train_offsets=np.arange(0, num_users * per_user + 1, per_user),
        train_items=np.concatenate(
            [(np.arange(per_user) + 2 * user) % num_items for user in range(num_users)]
        ).astype(np.int32),
        eval_items=((np.arange(num_users) * 2 + per_user) % num_items).astype(np.int32),
    )
    exclusion = stat_utils.ExclusionIndex.from_csr(
        data.train_offsets, data.train_items, data.num_items
    )
    keys = data.train_users().astype(np.int64) * num_items + data.train_items
    successions = 0
    for epoch_index in range(num_epochs):
        epoch = negative_sampling.training_epoch(
            data, exclusion, 4, seed=9, epoch=epoch_index, pool=pool, chunk_points=8
        )
        at = np.flatnonzero(epoch.labels)
        shuffled_keys = epoch.users[at].astype(np.int64) * num_items + epoch.items[at]
        position = np.empty(len(keys), np.int64)
        position[np.argsort(keys)] = at[np.argsort(shuffled_keys)]
        successions += int(np.sum(position[1:] == position[:-1] + 1))
    num_points = len(keys) * 5
    expected = num_epochs * (len(keys) - 1) / num_points  # 39.7
    assert successions < expected + 6 * np.sqrt(expected), (successions, expected)
    assert successions > expected - 6 * np.sqrt(expected), (successions, expected)


def test_eval_blocks_hold_negatives_then_the_holdout(data, pool):
    blocks = negative_sampling.eval_blocks(data, num_eval_negatives=999, seed=2, pool=pool)
    assert blocks.items.shape == (data.num_users, 1000)
    np.testing.assert_array_equal(blocks.items[:, -1], data.eval_items)
    assert not blocks.duplicate_mask[:, -1].any()  # the held-out item always counts
    positives = _positive_sets(data)
    for user in range(data.num_users):
        negatives = blocks.items[user, :-1]
        rated = positives[user] | {int(data.eval_items[user])}
        assert not rated & set(negatives.tolist())
        # Each distinct negative is unmasked exactly once, at its first occurrence.
        kept = negatives[~blocks.duplicate_mask[user, :-1]]
        assert sorted(kept.tolist()) == sorted(set(negatives.tolist()))
        first = {item: np.flatnonzero(negatives == item)[0] for item in set(negatives.tolist())}
        assert all(not blocks.duplicate_mask[user, index] for index in first.values())


def test_fixed_negatives_are_used_as_given_and_masked_against_the_holdout(pool):
    data = data_preprocessing.PreprocessedData(
        user_ids=np.arange(2),
        item_ids=np.arange(5),
        train_offsets=np.array([0, 1, 2]),
        train_items=np.array([0, 1], np.int32),
        eval_items=np.array([2, 3], np.int32),
        eval_negatives=np.array([[4, 2, 4], [1, 0, 4]], np.int32),
    )
    blocks = negative_sampling.eval_blocks(data, num_eval_negatives=999, seed=0, pool=pool)
    assert blocks.items.tolist() == [[4, 2, 4, 2], [1, 0, 4, 3]]
    # User 0: its own held-out item among the negatives is the copy that is masked.
    assert blocks.duplicate_mask.tolist() == [[False, True, True, False], [False] * 4]
