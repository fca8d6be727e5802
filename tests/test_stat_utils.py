"""Sampling primitives: exact exclusion by bisection, duplicate masks."""

from __future__ import annotations

import numpy as np
import pytest
from absl.testing import parameterized

from recommendation.producer import stat_utils


def _index(rows: list[list[int]], num_items: int) -> stat_utils.ExclusionIndex:
    offsets = np.concatenate([[0], np.cumsum([len(row) for row in rows])])
    items = np.array([item for row in rows for item in row], dtype=np.int32)
    return stat_utils.ExclusionIndex.from_csr(offsets, items, num_items)


def test_kth_allowed_matches_brute_force():
    rng = np.random.default_rng(0)
    num_items = 50
    rows = [
        sorted(rng.choice(num_items, size, replace=False).tolist())[::-1]
        for size in (0, 1, 10, 49, 25)
    ]
    index = _index(rows, num_items)
    for user, row in enumerate(rows):
        allowed = [item for item in range(num_items) if item not in row]
        ranks = np.arange(len(allowed))
        got = index.kth_allowed(np.full(len(ranks), user), ranks)
        assert got.tolist() == allowed


def test_sampling_is_uniform_over_allowed_items():
    index = _index([[0, 3, 4, 9], [1]], num_items=10)
    draws = index.sample(np.random.default_rng(1), np.zeros(60_000, dtype=np.int64))
    counts = np.bincount(draws, minlength=10)
    assert counts[[0, 3, 4, 9]].sum() == 0
    expected = len(draws) / 6
    chi_square = np.sum((counts[[1, 2, 5, 6, 7, 8]] - expected) ** 2 / expected)
    assert chi_square < 20.5  # p = 0.001 for 5 degrees of freedom


def test_user_with_every_item_cannot_be_sampled():
    with pytest.raises(ValueError, match="user 1 has interacted with every item"):
        _index([[0], [0, 1, 2]], num_items=3)


class MaskDuplicatesTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("no_repeats", [[4, 2, 7]], [[False, False, False]]),
        ("first_occurrence_kept", [[5, 1, 5, 5]], [[False, False, True, True]]),
        ("rows_are_independent", [[1, 1], [2, 1]], [[False, True], [False, False]]),
    )
    def test_mask(self, items, expected):
        mask = stat_utils.mask_duplicates(np.array(items))
        self.assertEqual(mask.tolist(), expected)


def test_rng_streams_are_independent_of_order():
    first = stat_utils.rng_for(3, 1, 7).random(4)
    stat_utils.rng_for(3, 1, 6).random(100)
    again = stat_utils.rng_for(3, 1, 7).random(4)
    np.testing.assert_array_equal(first, again)
