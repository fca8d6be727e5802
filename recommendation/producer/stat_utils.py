"""Sampling primitives for negative generation: exact exclusion, duplicate masks, seeds.

`ExclusionIndex` answers "the k-th item user u has NOT interacted with" for many
(u, k) at once by bisection, so sampling uniformly among a user's allowed items is
one `searchsorted` over all users together instead of a per-user Python loop or a
rejection loop.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ExclusionIndex:
    """Per-user sorted sets of excluded items, searchable for all users at once.

    Attributes:
        num_items: Items are ``0 .. num_items - 1``.
        offsets: `(num_users + 1,)` int64 CSR offsets into `gaps_key`.
        gaps_key: `(n,)` int64. For the j-th smallest excluded item ``p`` of user ``u``,
            ``u * num_items + (p - j)``: user-major, non-decreasing, and ``p - j`` counts
            the allowed items below ``p``.
        num_allowed: `(num_users,)` int64 allowed items per user.
    """

    num_items: int
    offsets: np.ndarray
    gaps_key: np.ndarray
    num_allowed: np.ndarray

    @classmethod
    def from_csr(cls, offsets: np.ndarray, items: np.ndarray, num_items: int) -> ExclusionIndex:
        """Builds the index from CSR rows of excluded items (any order, no repeats).

        Raises:
            ValueError: a user has excluded every item, so nothing can be sampled.
        """
        num_users = len(offsets) - 1
        counts = np.diff(offsets)
        num_allowed = num_items - counts
        if len(num_allowed) and num_allowed.min() <= 0:
            user = int(np.argmin(num_allowed))
            raise ValueError(f"user {user} has interacted with every item; nothing to sample")
        users = np.repeat(np.arange(num_users, dtype=np.int64), counts)
        # Sorting user * num_items + item sorts items within each user in one pass.
        keys = np.sort(users * num_items + items)
        rank_in_user = np.arange(len(keys), dtype=np.int64) - np.repeat(offsets[:-1], counts)
        return cls(
            num_items=num_items,
            offsets=np.asarray(offsets, dtype=np.int64),
            gaps_key=keys - rank_in_user,
            num_allowed=num_allowed.astype(np.int64),
        )

    def kth_allowed(self, users: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """The `ranks`-th (0-based) allowed item of each user in `users`.

        The answer is ``rank + (number of excluded items p with p - j <= rank)``: each
        excluded item at or below the answer shifts it up by one.
        """
        users = users.astype(np.int64, copy=False)
        keys = users * self.num_items + ranks
        below = np.searchsorted(self.gaps_key, keys, side="right") - self.offsets[users]
        return (ranks + below).astype(np.int32)

    def sample(self, rng: np.random.Generator, users: np.ndarray) -> np.ndarray:
        """One item per entry of `users`, uniform over that user's allowed items."""
        ranks = np.floor(rng.random(len(users)) * self.num_allowed[users]).astype(np.int64)
        return self.kth_allowed(users, ranks)


def mask_duplicates(items: np.ndarray) -> np.ndarray:
    """`(rows, k)` bool: True where an item already appeared earlier in its row.

    The reference's ``stat_utils.mask_duplicates``: the first occurrence stays
    unmasked, so metrics count each distinct item once.
    """
    order = np.argsort(items, axis=1, kind="stable")
    sorted_items = np.take_along_axis(items, order, axis=1)
    repeated = np.zeros(items.shape, dtype=bool)
    repeated[:, 1:] = sorted_items[:, 1:] == sorted_items[:, :-1]
    mask = np.empty_like(repeated)
    np.put_along_axis(mask, order, repeated, axis=1)
    return mask


def rng_for(seed: int, *stream: int) -> np.random.Generator:
    """An independent generator for one piece of work (e.g. cycle, epoch, chunk).

    Each piece seeds its own stream, so the bytes produced do not depend on how the
    pieces are spread over workers.
    """
    return np.random.default_rng([seed, *stream])
