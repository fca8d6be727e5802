"""Each baseline's hyper-parameters chosen on the validation split within one stated
budget, then its test split evaluated once.

Every tunable baseline gets the same budget: `budget` configurations drawn at random
from its space (a seeded draw, so one seed, one search), the way Dacrema et al. (TOIS
2021) gave each baseline 35 configurations of Bayesian search. A configuration is fitted
on the validation split's training interactions and scored by validation HR@k against
the sampled negatives (the protocol of the published numbers); the best (the first on
ties) is fitted again on the test split's training interactions, which hold the
validation items, and the test split is evaluated once per seed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np

from recommendation.baselines import models
from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.evaluation.full_ranking import users_per_block
from recommendation.evaluation.protocol import SplitProtocol, UserResults

Config = dict[str, float]


@dataclasses.dataclass(frozen=True)
class Baseline:
    """A baseline: how to build it from a configuration, and its search space.

    Attributes:
        name: Its name in tables and on the command line.
        build: (configuration, seed) -> an unfitted model.
        draw: A random configuration from its space; None: it has no hyper-parameters.
        seeded: Whether the seed changes the fit (then it is tested over several).
    """

    name: str
    build: Callable[[Config, int], object]
    draw: Callable[[np.random.Generator], Config] | None = None
    seeded: bool = False


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def _log_uniform_int(rng: np.random.Generator, low: int, high: int) -> int:
    return int(round(_log_uniform(rng, low, high)))


BASELINES = {
    baseline.name: baseline
    for baseline in (
        Baseline("itempop", lambda config, seed: models.ItemPop()),
        Baseline(
            "itemknn",
            lambda config, seed: models.ItemKNN(int(config["neighbours"]), config["shrink"]),
            lambda rng: {
                "neighbours": _log_uniform_int(rng, 5, 1000),
                "shrink": float(round(rng.uniform(0, 1000), 1)),
            },
        ),
        Baseline(
            "ease",
            lambda config, seed: models.Ease(config["l2"]),
            lambda rng: {"l2": float(f"{_log_uniform(rng, 1.0, 1e7):.3g}")},
        ),
        Baseline(
            "ials",
            lambda config, seed: models.Ials(
                int(config["factors"]),
                config["l2"],
                config["alpha"],
                int(config["iterations"]),
                seed,
            ),
            lambda rng: {
                "factors": _log_uniform_int(rng, 8, 200),
                "l2": float(f"{_log_uniform(rng, 1e-3, 1e2):.3g}"),
                "alpha": float(f"{_log_uniform(rng, 0.1, 50.0):.3g}"),
                "iterations": int(rng.integers(5, 31)),
            },
            seeded=True,
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Trial:
    """One configuration's validation result."""

    config: Config
    metrics: dict[str, float]
    fit_seconds: float


def configurations(baseline: Baseline, budget: int, seed: int) -> list[Config]:
    """The configurations a search tries: `budget` draws (repeats dropped), or the one
    empty configuration of a baseline without hyper-parameters."""
    if baseline.draw is None:
        return [{}]
    rng = np.random.default_rng(seed)
    drawn: list[Config] = []
    for _ in range(budget):
        config = baseline.draw(rng)
        if config not in drawn:
            drawn.append(config)
    return drawn


def evaluate(
    baseline: Baseline, config: Config, seed: int, data: PreprocessedData, protocol: SplitProtocol
) -> tuple[UserResults, float]:
    """Fits `baseline` with `config` on `data`'s training interactions and evaluates it
    by `protocol`; returns the results and the fit's seconds."""
    start = time.perf_counter()
    model = baseline.build(config, seed).fit(models.training_matrix(data))
    fit_seconds = time.perf_counter() - start
    block = users_per_block(data.num_items, 1, data.num_users)
    return protocol.evaluate(model.scores, block), fit_seconds


def tune(
    baseline: Baseline,
    data: PreprocessedData,
    protocol: SplitProtocol,
    budget: int,
    seed: int,
    on_trial: Callable[[Trial], None] | None = None,
) -> list[Trial]:
    """Every configuration of the search, fitted on `data` (the validation split's)
    with `seed` and evaluated on validation."""
    trials = []
    for config in configurations(baseline, budget, seed):
        results, fit_seconds = evaluate(baseline, config, seed, data, protocol)
        trials.append(Trial(config, results.metrics(), fit_seconds))
        if on_trial is not None:
            on_trial(trials[-1])
    return trials


def chosen(trials: list[Trial]) -> Trial:
    """The trial with the best validation HR@k (sampled); the first on ties."""
    return max(trials, key=lambda trial: trial.metrics["hr"])
