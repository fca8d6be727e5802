"""The online baseline ladder's popularity rungs, by the prequential protocol ncf-online
is measured by: a learner that beats none of them has learned nothing a counter does
not know.

    python scripts/peers/popularity_online.py --events_dir DIR --summary_file pop.json
    python scripts/peers/popularity_online.py --events_dir DIR --half_life_events 20000

A scored event's candidates rank by their events before it in the stream: every one
of them (popularity so far), or each weighted by ``2 ** (-age / half_life_events)``,
its age in events (recent popularity). Both follow the stream event by event, inside
a chunk too (an item's weight of the chunk's events before a scored one is a
cumulative sum over the chunk in item order), so the chunk size changes nothing but
the speed. Nothing is learned from the training examples' negatives, and nothing is
kept of users. numpy only: it runs in the project's environment or a peer's.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_harness  # noqa: E402  (a sibling script)


class ItemPopularity:
    """Each item's weight of the events before the scored one, as a
    `peer_harness.Learner` that scores a chunk's events knowing the chunk's earlier
    ones (`test_then_add`).

    Args:
        half_life_events: None: every event weighs 1 (popularity so far); else an
            event's weight halves every this many events after it (recent popularity).
    """

    def __init__(self, half_life_events: float | None = None) -> None:
        self.half_life_events = half_life_events
        self.rate = 0.0 if half_life_events is None else math.log(2) / half_life_events
        # Items seen, sorted, and each one's weight at the end of the events added (an
        # event's age is the number of events from it on: an event at ordinal o weighs
        # 2 ** (-(o - its ordinal) / half_life_events) at the event scored at o).
        self.ids = np.zeros(0, np.int64)
        self.weights = np.zeros(0, np.float64)

    def test_then_add(self, plan, chunk_items: np.ndarray) -> np.ndarray:
        """The candidates' weights `(n, c)` at the scored events of `plan`, each counting
        every event before it (the chunk's items, `chunk_items`, in order); then adds
        the chunk's events.

        A block of the chunk at a time, over which a weight decays by at most e (so
        that a running sum of the block's weights loses no digits to another item's):
        the whole chunk without decay."""
        scores = np.zeros(plan.candidates.shape)
        length = len(chunk_items)
        block = max(1, int(1 / self.rate)) if self.rate else max(length, 1)
        for begin in range(0, length, block):
            end = min(begin + block, length)
            rows = (plan.positions >= begin) & (plan.positions < end)
            events = np.unique(chunk_items[begin:end], return_inverse=True)
            if rows.any():
                scores[rows] = self._score_block(
                    events, plan.positions[rows] - begin, plan.candidates[rows]
                )
            self._add(*events)
        return scores

    def _score_block(
        self, block: tuple[np.ndarray, np.ndarray], positions: np.ndarray, candidates: np.ndarray
    ) -> np.ndarray:
        """Weights of `candidates` at `positions` of a block of events (`block`: its
        distinct items and each event's code among them, `np.unique`'s): the weights
        before the block, decayed, plus the block's events before each."""
        block_ids, codes = block
        length = len(codes)
        # The block's events by (item, position), and a running sum of each one's
        # exp(rate * position) in that order: an item's events before position p are
        # a range of it.
        order = np.argsort(codes.astype(np.int64) * length + np.arange(length), kind="stable")
        sorted_keys = codes[order].astype(np.int64) * length + order
        running = np.concatenate([[0.0], np.cumsum(np.exp(self.rate * order))])
        at = np.minimum(np.searchsorted(block_ids, candidates), len(block_ids) - 1)
        start = np.searchsorted(sorted_keys, at * length)
        end = np.searchsorted(sorted_keys, at * length + positions[:, None])
        within = np.where(block_ids[at] == candidates, running[end] - running[start], 0.0)
        return (self._weights_of(candidates) + within) * np.exp(-self.rate * positions[:, None])

    def _weights_of(self, items: np.ndarray) -> np.ndarray:
        """The weights of `items` (any shape) at the end of the events added."""
        if not len(self.ids):
            return np.zeros(items.shape)
        at = np.minimum(np.searchsorted(self.ids, items), len(self.ids) - 1)
        return np.where(self.ids[at] == items, self.weights[at], 0.0)

    def _add(self, block_ids: np.ndarray, codes: np.ndarray) -> None:
        """Adds a block of events (its distinct items, each event's code among them, in
        order) to the weights."""
        length = len(codes)
        ages = length - np.arange(length)  # from each event to the end of the block
        added = np.bincount(codes, np.exp(-self.rate * ages), len(block_ids))
        merged = np.union1d(self.ids, block_ids)
        total = np.zeros(len(merged))
        total[np.searchsorted(merged, self.ids)] = self.weights * math.exp(-self.rate * length)
        total[np.searchsorted(merged, block_ids)] += added
        self.ids, self.weights = merged, total

    def score(self, users: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        """Weights at the end of the events added (the harness scores by
        `test_then_add`)."""
        return self._weights_of(candidates)

    def learn(self, users: np.ndarray, items: np.ndarray, labels: np.ndarray) -> None:
        """Nothing: the events came in through `test_then_add`, and negatives teach a
        count nothing."""

    def tables(self) -> dict[str, dict]:
        items = len(self.ids)
        return {
            "user": {"ids": 0, "capacity": None, "admitted": 0, "evicted": 0, "refused": 0},
            "item": {"ids": items, "capacity": None, "admitted": items, "evicted": 0, "refused": 0},
        }

    def describe(self) -> dict:
        if self.half_life_events is None:
            return {"library": "numpy", "model": "popularity so far"}
        return {
            "library": "numpy",
            "model": f"recent popularity (half-life {self.half_life_events:g} events)",
        }


def add_flags(flag: Callable[..., argparse.Action]) -> None:
    flag(
        "--half_life_events",
        type=peer_harness.positive_rate,
        help="Weigh each event 2^(-age/this), its age in events (recent popularity; "
        "default: every event weighs 1, popularity so far).",
    )


def main(argv: list[str]) -> dict:
    """The command line (`peer_harness.main`); returns the result."""
    return peer_harness.main(
        argv,
        "popularity",
        __doc__.split("\n\n")[0],
        lambda flags: ItemPopularity(flags.half_life_events),
        add_flags,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
