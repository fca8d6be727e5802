"""Whether one model's HR@k beats another's on the same users by more than chance:
a paired bootstrap interval of the difference and McNemar's exact test.

Both models are scored on the same held-out items, so their per-user hits are paired;
the comparison resamples users (scipy's `bootstrap`) and tests the users on which
exactly one model hits (an exact binomial test, scipy's `binomtest`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy import stats


@dataclasses.dataclass(frozen=True)
class PairedComparison:
    """Model A against model B on the same users.

    Attributes:
        difference: HR of A minus HR of B.
        low, high: The bootstrap confidence interval of `difference`.
        only_a, only_b: Users hit by A alone, by B alone.
        p_value: McNemar's exact two-sided p-value (1.0 when no user tells them apart).
    """

    difference: float
    low: float
    high: float
    only_a: int
    only_b: int
    p_value: float


def compare(
    hits_a: np.ndarray,
    hits_b: np.ndarray,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> PairedComparison:
    """Compares two models' per-user hits (1.0 hit, 0.0 miss) of the same users.

    Args:
        hits_a, hits_b: `(num_users,)` in the same user order.
        confidence: Of the bootstrap interval (percentile method).
        resamples: Bootstrap resamples.
        seed: The resampling's seed: one seed, one interval.
    """
    hits_a, hits_b = np.asarray(hits_a, np.float64), np.asarray(hits_b, np.float64)
    if hits_a.shape != hits_b.shape:
        raise ValueError(f"paired hits need the same users: {hits_a.shape} vs {hits_b.shape}")
    differences = hits_a - hits_b
    only_a, only_b = int(np.sum(differences > 0)), int(np.sum(differences < 0))
    if only_a + only_b == 0:
        low = high = 0.0
        p_value = 1.0
    else:
        interval = stats.bootstrap(
            (differences,),
            np.mean,
            confidence_level=confidence,
            n_resamples=resamples,
            method="percentile",
            rng=np.random.default_rng(seed),
        ).confidence_interval
        low, high = float(interval.low), float(interval.high)
        p_value = float(stats.binomtest(only_a, only_a + only_b, 0.5).pvalue)
    return PairedComparison(float(differences.mean()), low, high, only_a, only_b, p_value)
