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

from recommendation.data.event_stream_data import (
    EventStreamModel,
    EventStreamSpec,
    iter_events,
    plant,
)
from recommendation.data.ratings_readers import RawRatings
from recommendation.online.prequential import Prequential

FILE_NAME = "reference_scores.json"  # beside the event files (not an event file)


def _rows(ids: np.ndarray, sorted_ids: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The row of each of `ids` among `sorted_ids` (the ids sorted, `order` their rows)."""
    return order[np.searchsorted(sorted_ids, ids)]


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
        self._user_order = np.argsort(model.user_ids, kind="stable")
        self._user_sorted = model.user_ids[self._user_order]
        self._item_order = np.argsort(model.planted.item_ids, kind="stable")
        self._item_sorted = model.planted.item_ids[self._item_order]
        self._start_rank = np.empty(spec.num_items, np.int64)
        self._start_rank[model.rank_items] = np.arange(spec.num_items)

    def ranks(self, items: np.ndarray, times: np.ndarray) -> np.ndarray:
        """0-based popularity rank of raw item ids `items` (n, k) at seconds `times` (n,)."""
        spec = self.spec
        rows = _rows(items, self._item_sorted, self._item_order)
        fraction = (times - spec.start_timestamp) / spec.duration_seconds
        fallen = np.floor(fraction * (spec.popularity_drift * spec.num_items)).astype(np.int64)
        return (self._start_rank[rows] + fallen[:, None]) % spec.num_items

    def popularity(self, items: np.ndarray, times: np.ndarray) -> np.ndarray:
        """Higher for more popular: minus the rank."""
        return -self.ranks(items, times).astype(np.float64)

    def oracle(self, users: np.ndarray, items: np.ndarray, times: np.ndarray) -> np.ndarray:
        """Log popularity plus the planted affinity of each user (n,) for its items (n, k)."""
        planted = self.model.planted
        user_rows = _rows(users, self._user_sorted, self._user_order)
        item_rows = _rows(items, self._item_sorted, self._item_order)
        affinity = np.einsum(
            "nd,nkd->nk", planted.user_factors[user_rows], planted.item_factors[item_rows]
        )
        if self.spec.candidates == 1:  # events ignore taste
            affinity = np.zeros_like(affinity)
        return log_popularity(self.spec, self.ranks(items, times)) + affinity


class StreamReferences:
    """Both references over a stream fed to `add` a block at a time, in order."""

    def __init__(self, spec: EventStreamSpec, model: EventStreamModel, **protocol) -> None:
        self.scorer = ReferenceScorer(spec, model)
        self.popularity, self.oracle = Prequential(**protocol), Prequential(**protocol)

    def add(self, block: RawRatings) -> None:
        plan = self.popularity.plan(block.users, block.items, block.timestamps)
        self.oracle.plan(block.users, block.items, block.timestamps)  # the same plan
        if plan.size:
            times = block.timestamps[plan.positions]
            self.popularity.record(plan, self.scorer.popularity(plan.candidates, times))
            self.oracle.record(plan, self.scorer.oracle(plan.users, plan.candidates, times))

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
