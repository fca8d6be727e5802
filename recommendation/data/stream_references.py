"""Two reference scores of a generated event stream, by the prequential protocol on the
very events and candidates a trainer of the stream is scored on: where a learner sits
between what popularity alone gives and what knowing everything planted gives.

- *popularity*: each candidate's true popularity at the event's second (its place in
  the drifting ranking, `event_stream_data`), the best a model without users can do;
- *oracle*: the log of that popularity plus the user's true affinity for the item
  (``<u, v>`` of the planted factors), the log of the chance that one event of the user
  picks the item when it chooses among many popularity draws (`EventStreamSpec.
  candidates` of them: exact as they grow, a close ranking at the default).

Both by `recommendation.online.prequential` with its defaults (the trainer's own
`--prequential_every` and negatives): the same hash picks the same events, the same
draws give the same candidates, and the same cohorts split cold from warm users.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from recommendation.data.event_stream_data import (
    EventStreamModel,
    EventStreamSpec,
    iter_events,
    plant,
)
from recommendation.data.ratings_readers import RawRatings
from recommendation.online.prequential import Prequential

FILE_NAME = "reference_scores.json"  # beside the event files (not an event file)


def log_popularity(spec: EventStreamSpec, ranks: np.ndarray) -> np.ndarray:
    """Log of the chance that one popularity draw lands on 0-based rank `ranks`: the
    power-law density of `event_stream_data` integrated over ``[r + 1, r + 2)`` (the
    common normaliser left out)."""
    low = ranks.astype(np.float64) + 1.0
    if spec.popularity_exponent == 1.0:
        return np.log(np.log1p(1.0 / low))
    power = 1.0 - spec.popularity_exponent
    return np.log(np.abs(np.expm1(power * np.log1p(1.0 / low)))) + power * np.log(low)


class ReferenceScorer:
    """The true popularity rank and affinity of any (user, item, second) of a stream."""

    def __init__(self, spec: EventStreamSpec, model: EventStreamModel) -> None:
        self.spec, self.model = spec, model
        # Raw ids to model rows by hashing (a binary search is 4x slower here).
        self._user_rows = pd.Index(model.user_ids)
        self._item_rows = pd.Index(model.planted.item_ids)
        self._start_rank = np.empty(spec.num_items, np.int64)
        self._start_rank[model.rank_items] = np.arange(spec.num_items)

    def item_rows(self, items: np.ndarray) -> np.ndarray:
        return self._item_rows.get_indexer(items.ravel()).reshape(items.shape)

    def ranks(self, item_rows: np.ndarray, times: np.ndarray) -> np.ndarray:
        """0-based popularity rank of items (model rows, (n, k)) at seconds `times` (n,)."""
        spec = self.spec
        fraction = (times - spec.start_timestamp) / spec.duration_seconds
        fallen = np.floor(fraction * (spec.popularity_drift * spec.num_items)).astype(np.int64)
        return (self._start_rank[item_rows] + fallen[:, None]) % spec.num_items

    def scores(
        self, users: np.ndarray, items: np.ndarray, times: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Of each user (raw id, (n,)) for its items (raw ids, (n, k)) at `times`: the
        popularity reference (minus the rank) and the oracle's (log popularity plus
        the planted affinity)."""
        item_rows = self.item_rows(items)
        ranks = self.ranks(item_rows, times)
        oracle = log_popularity(self.spec, ranks)
        if self.spec.candidates > 1:  # else events ignore taste
            planted = self.model.planted
            user_factors = planted.user_factors[self._user_rows.get_indexer(users)]
            affinity = np.matmul(planted.item_factors[item_rows], user_factors[:, :, None])
            oracle += affinity[..., 0]
        return -ranks.astype(np.float64), oracle


class StreamReferences:
    """Both references over a stream fed to `add` a block at a time, in order."""

    def __init__(self, spec: EventStreamSpec, model: EventStreamModel, **protocol) -> None:
        self.scorer = ReferenceScorer(spec, model)
        self.popularity, self.oracle = Prequential(**protocol), Prequential(**protocol)

    def add(self, block: RawRatings) -> None:
        plan = self.popularity.plan(block.users, block.items, block.timestamps)
        self.oracle.events = self.popularity.events  # it records the same plans
        if plan.size:
            times = block.timestamps[plan.positions]
            popularity, oracle = self.scorer.scores(plan.users, plan.candidates, times)
            self.popularity.record(plan, popularity)
            self.oracle.record(plan, oracle)

    def results(self) -> dict:
        """``{"popularity": ..., "oracle": ...}``: `Prequential.results` of each,
        windows left out."""
        return {
            name: {key: value for key, value in state.results().items() if key != "windows"}
            for name, state in (("popularity", self.popularity), ("oracle", self.oracle))
        }


def reference_scores(spec: EventStreamSpec, seed: int, **protocol) -> dict:
    """`StreamReferences.results` over the whole stream of `spec` and `seed`;
    `protocol` overrides the protocol's settings (`every`, `negatives`, ...) as a
    trainer's flags would."""
    model = plant(spec, seed)
    references = StreamReferences(spec, model, **protocol)
    for block in iter_events(spec, seed, model):
        references.add(block)
    return references.results()
