"""river's ``reco.BiasedMF`` trained test-then-train on an event folder, by the
prequential protocol ncf-online is measured by, so that the two compare on one stream.

    PYTHON=$(scripts/peers/setup_river.sh)
    $PYTHON scripts/peers/river_online.py --events_dir DIR --seed 1 --summary_file river.json

Run it with the python of river's own environment (`setup_river.sh`); the rest of the
harness (`peer_harness`: the folder read as ncf-online reads it, the protocol, the
result) is river-free. river's ``evaluate.progressive_val_score`` cannot be used: no
metric of river accepts a reco model, and its protocol (each event scored on its own
label) is not a ranking among sampled items; the harness runs the project's protocol
instead, with ``predict_one`` as the score.

The model is configured as a river user would find it: ``reco.BiasedMF(seed=...)``,
river's documented defaults (10 factors, plain SGD at 0.01 for biases and factors,
squared loss, no L2, factors drawn from N(0, 0.1), biases from 0); ``--n_factors`` and
``--learning_rate`` (both SGDs') change the two that a user would tune. Its documentation
gives no other settings for implicit feedback (its examples regress ratings), and the
defaults work for it: with every event learned as y=1 and --num_neg items sampled from
those seen so far as y=0 (ncf-online's default 4), squared loss regresses the click
indicator, pointwise, as ncf-online's log loss does. Each example is one
``learn_one`` call, in the order of the stream; river keeps every user and item it
sees, for ever (no eviction), so its tables' ``ids`` are all the stream's.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import numpy as np
import river
from river import optim, reco

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_harness  # noqa: E402  (a sibling script)


class RiverBiasedMF:
    """river's ``reco.BiasedMF`` as a `peer_harness.Learner`: one Python call per
    score and per example, as river is used.

    Args:
        seed: Fixes the factors' initial draws (None: unseeded).
        n_factors, learning_rate: None: river's defaults (10; SGD at 0.01).
    """

    def __init__(
        self, seed: int | None, n_factors: int | None = None, learning_rate: float | None = None
    ) -> None:
        settings = {} if n_factors is None else {"n_factors": n_factors}
        if learning_rate is not None:
            settings.update(
                latent_optimizer=optim.SGD(learning_rate), bias_optimizer=optim.SGD(learning_rate)
            )
        self.model = reco.BiasedMF(seed=seed, **settings)

    def score(self, users: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        predict = self.model.predict_one
        return np.array(
            [
                [predict(user, item) for item in row]
                for user, row in zip(users.tolist(), candidates.tolist(), strict=True)
            ],
            np.float64,
        ).reshape(candidates.shape)

    def learn(self, users: np.ndarray, items: np.ndarray, labels: np.ndarray) -> None:
        learn = self.model.learn_one
        for user, item, label in zip(users.tolist(), items.tolist(), labels.tolist(), strict=True):
            learn(user, item, label)

    def tables(self) -> dict[str, dict]:
        """Every id river has seen (a score creates a new user's row too)."""
        return {
            name: {
                "ids": len(held),
                "capacity": None,
                "admitted": len(held),
                "evicted": 0,
                "refused": 0,
            }
            for name, held in (("user", self.model.u_latents), ("item", self.model.i_latents))
        }

    def describe(self) -> dict:
        return {
            "library": f"river {river.__version__}",
            "model": " ".join(repr(self.model).split()),
        }


def add_flags(flag: Callable[..., argparse.Action]) -> None:
    flag("--n_factors", type=peer_harness.positive, help="Factors (default: river's, 10).")
    flag(
        "--learning_rate",
        type=peer_harness.positive_rate,
        help="SGD's rate, of the factors and the biases (default: river's, 0.01).",
    )


def main() -> None:
    peer_harness.main(
        sys.argv[1:],
        "river",
        __doc__.split("\n\n")[0],
        lambda flags: RiverBiasedMF(flags.seed, flags.n_factors, flags.learning_rate),
        add_flags,
    )


if __name__ == "__main__":
    main()
