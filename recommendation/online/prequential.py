"""One prequential protocol for every online system: test, then train, on a fixed,
hash-chosen subset of the stream.

Progressive validation scores an event with the model as it is before it learns from
that event. To compare systems (ours, TorchRec, river) on one stream, what is scored
must not depend on a system's speed or batch size, nor favour the users a fast
trainer happens to reach first:

- which events: those whose seeded hash of (user, item, timestamp) falls in 1 of
  `every` (every event with ``every=1``), whatever the batches;
- against what: each scored event's item is ranked against `negatives` items drawn
  (with replacement, by the same hash) from the distinct items seen in the stream
  before that event, in the order they first appeared; a drawn item equal to the
  event's own is left out of its ranking;
- what: HR@`top_k` and NDCG@`top_k` (a tie with the event's item counts against it)
  and AUC (the share of the valid negatives scored below it, ties half; over the
  events with a valid negative), tallied in integers so that any chunking of the
  stream gives the same numbers to the bit;
- reported over the whole stream, by windows of `window_events` events (a curve), and
  by cohort: events among a user's first `cold_events` (cold users, where admission
  and eviction show) and later ones (warm).

A system calls `plan` with each chunk of the stream in order (before training on it),
scores the plan's users and candidate items with its model as it is, and hands the
scores to `record`. Plain numpy, no TensorFlow: the peer harnesses in their own
environments use this module as it is. The protocol's memory (the distinct items
seen, and each user's event count up to `cold_events`, about 18 bytes a user) is the
same in every system's process.
"""

from __future__ import annotations

import dataclasses

import numpy as np

COLD_EVENTS = 5
SEED = 0  # the protocol's own: every system scores the same events

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    z = values + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def event_keys(users, items, times, seed: int = SEED) -> np.ndarray:
    """Each event's 64-bit key: a hash of the seed, user, item and timestamp."""
    with np.errstate(over="ignore"):
        key = _mix(np.full(np.shape(users), seed, np.int64).astype(np.uint64))
        for column in (users, items, times):
            key = _mix(key ^ np.asarray(column, np.int64).astype(np.uint64))
    return key


class IdCounts:
    """How many events each id has had, up to `cap`, in a numpy open-addressing table
    (linear probing, doubled at half full): a few bytes an id, where a dict of Python
    ints takes about a hundred."""

    def __init__(self, cap: int, buckets: int = 1024) -> None:
        self.cap = cap
        self.keys = np.zeros(buckets, np.int64)
        self.used = np.zeros(buckets, bool)
        self.counts = np.zeros(buckets, np.uint8)
        self.size = 0

    def _find_or_add(self, keys: np.ndarray) -> np.ndarray:
        """The bucket of each of `keys` (distinct), added where absent: a new key
        takes the first free bucket of its probe sequence; two that reach the same
        free bucket at once, the first in order takes it and the other probes on."""
        mask = len(self.keys) - 1
        with np.errstate(over="ignore"):
            slots = (_mix(keys.astype(np.uint64)) & np.uint64(mask)).astype(np.int64)
        pending = np.arange(len(keys))
        while len(pending):
            at = slots[pending]
            done = self.used[at] & (self.keys[at] == keys[pending])
            free = np.flatnonzero(~self.used[at])
            taken, first = np.unique(at[free], return_index=True)
            self.used[taken], self.keys[taken] = True, keys[pending[free[first]]]
            self.counts[taken] = 0
            self.size += len(taken)
            done[free[first]] = True
            pending = pending[~done]
            slots[pending] = (slots[pending] + 1) & mask
        return slots

    def count_and_add(self, ids: np.ndarray) -> np.ndarray:
        """How many events each of `ids` (in stream order) had before it, capped; then
        counts these too."""
        unique, inverse, repeats = np.unique(ids, return_inverse=True, return_counts=True)
        if 2 * (self.size + len(unique)) > len(self.keys):
            self._grow(2 * (self.size + len(unique)))
        slots = self._find_or_add(unique)
        before = self.counts[slots].astype(np.int64)
        # An id's k-th event in this chunk comes after the k - 1 before it here.
        order = np.argsort(inverse, kind="stable")
        rank = np.empty(len(ids), np.int64)
        rank[order] = np.arange(len(ids)) - np.repeat(np.cumsum(repeats) - repeats, repeats)
        self.counts[slots] = np.minimum(before + repeats, self.cap)
        return np.minimum(before[inverse] + rank, self.cap)

    def _grow(self, wanted: int) -> None:
        buckets = len(self.keys)
        while buckets < wanted:
            buckets *= 2
        keys, counts = self.keys[self.used], self.counts[self.used]
        self.keys = np.zeros(buckets, np.int64)
        self.used = np.zeros(buckets, bool)
        self.counts = np.zeros(buckets, np.uint8)
        self.size = 0
        self.counts[self._find_or_add(keys)] = counts


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to score of one chunk: the scored events' `positions` in the chunk, their
    `users` and `items`, `candidates` (n, 1 + negatives): the event's item, then the
    drawn negatives, with `valid` (n, negatives) False where a negative is the item
    itself, and whether each event is `cold` (among its user's first events); `ordinals`
    are the events' places in the stream (from 0)."""

    positions: np.ndarray
    users: np.ndarray
    items: np.ndarray
    candidates: np.ndarray
    valid: np.ndarray
    cold: np.ndarray
    ordinals: np.ndarray

    @property
    def size(self) -> int:
        return len(self.positions)


class Prequential:
    """The protocol's state over one stream (module docstring).

    Args:
        every: Score 1 event in this many (1: all; 0: none).
        negatives: Items each scored event is ranked against.
        top_k: The cut-off of HR and NDCG.
        cold_events: A user's first events that count as cold.
        window_events: Events per window of the curve.
        seed: The hash's seed (keep the default to compare systems).
    """

    def __init__(
        self,
        every: int = 8,
        negatives: int = 99,
        top_k: int = 10,
        cold_events: int = COLD_EVENTS,
        window_events: int = 100_000,
        seed: int = SEED,
    ) -> None:
        if every < 0 or negatives <= 0 or top_k <= 0 or window_events <= 0:
            raise ValueError(
                "every must be >= 0 and negatives, top_k and window_events positive, got "
                f"{every}, {negatives}, {top_k}, {window_events}"
            )
        self.every, self.negatives, self.top_k = every, negatives, top_k
        self.cold_events, self.window_events, self.seed = cold_events, window_events, seed
        self.events = 0  # seen so far
        self._seen_items = np.zeros(1024, np.int64)  # in first-seen order
        self._num_seen = 0
        self._item_set = IdCounts(1)  # membership only
        self._user_counts = IdCounts(cold_events)
        # Integer tallies (so that any chunking sums them alike), by cohort (cold, warm)
        # and by window: the scored events' ranks among their valid negatives (below
        # `top_k`; `top_k`: not a hit), and by their number of valid negatives, twice
        # the AUC's numerator (negatives below, ties half).
        self._ranks = np.zeros((2, top_k + 1), np.int64)
        self._auc = np.zeros((2, negatives + 1), np.int64)
        self._by_valid = np.zeros((2, negatives + 1), np.int64)
        self._windows: dict[int, tuple[np.ndarray, ...]] = {}

    def plan(self, users, items, times) -> Plan:
        """The events of the next chunk of the stream to score (call in stream order,
        before training on it); then notes its items and users as seen."""
        users, items = np.asarray(users, np.int64), np.asarray(items, np.int64)
        count = len(users)
        ordinals = self.events + np.arange(count)
        # Distinct items seen before each event: those before the chunk, then each
        # item's first appearance in it (if new) before the event.
        known = self._item_set.count_and_add(items) > 0
        unique, first = np.unique(items, return_index=True)
        new_first = np.zeros(count, bool)
        new_first[first[~known[first]]] = True
        seen_before = self._num_seen + np.cumsum(new_first) - new_first
        cold = self._user_counts.count_and_add(users) < self.cold_events
        chosen = np.zeros(count, bool)
        if self.every:
            keys = event_keys(users, items, times, self.seed)
            chosen = (keys % np.uint64(self.every) == 0) & (seen_before > 0)
        positions = np.flatnonzero(chosen)
        self._note_items(items[new_first])
        if len(positions):
            draws = np.arange(1, self.negatives + 1, dtype=np.uint64)
            with np.errstate(over="ignore"):
                hashed = _mix(keys[positions, None] + draws[None, :])
            index = (hashed % seen_before[positions, None].astype(np.uint64)).astype(np.int64)
            negative_items = self._seen_items[index]
        else:
            negative_items = np.zeros((0, self.negatives), np.int64)
        self.events += count
        scored = items[positions]
        return Plan(
            positions=positions,
            users=users[positions],
            items=scored,
            candidates=np.concatenate([scored[:, None], negative_items], axis=1),
            valid=negative_items != scored[:, None],
            cold=cold[positions],
            ordinals=ordinals[positions],
        )

    def _note_items(self, new: np.ndarray) -> None:
        end = self._num_seen + len(new)
        if end > len(self._seen_items):
            grown = np.zeros(max(2 * len(self._seen_items), end), np.int64)
            grown[: self._num_seen] = self._seen_items[: self._num_seen]
            self._seen_items = grown
        self._seen_items[self._num_seen : end] = new
        self._num_seen = end

    def record(self, plan: Plan, scores: np.ndarray) -> None:
        """Adds the scores (n, 1 + negatives) of `plan`'s candidates, by the model as
        it was before training on them."""
        scores = np.asarray(scores, np.float64)
        positive, negative = scores[:, :1], scores[:, 1:]
        rank = np.minimum(((negative >= positive) & plan.valid).sum(axis=1), self.top_k)
        below = ((negative < positive) & plan.valid).sum(axis=1)
        ties = ((negative == positive) & plan.valid).sum(axis=1)
        valid = plan.valid.sum(axis=1)
        cohort = np.where(plan.cold, 0, 1)
        window = plan.ordinals // self.window_events
        for tallies, index in [((self._ranks, self._auc, self._by_valid), None)] + [
            (self._window(w), window == w) for w in np.unique(window)
        ]:
            rows = slice(None) if index is None else index
            ranks, auc, by_valid = tallies
            np.add.at(ranks, (cohort[rows], rank[rows]), 1)
            np.add.at(auc, (cohort[rows], valid[rows]), 2 * below[rows] + ties[rows])
            np.add.at(by_valid, (cohort[rows], valid[rows]), 1)

    def _window(self, window: int) -> tuple[np.ndarray, ...]:
        if window not in self._windows:
            self._windows[int(window)] = (
                np.zeros_like(self._ranks),
                np.zeros_like(self._auc),
                np.zeros_like(self._by_valid),
            )
        return self._windows[int(window)]

    def _metrics(self, ranks: np.ndarray, auc: np.ndarray, by_valid: np.ndarray) -> dict:
        """HR, NDCG and AUC from the tallies of the cohorts summed (a row each)."""
        ranks, auc, by_valid = ranks.sum(axis=0), auc.sum(axis=0), by_valid.sum(axis=0)
        scored = int(ranks.sum())
        if not scored:
            return {"scored": 0, "hr": None, "ndcg": None, "auc": None}
        gains = 1.0 / np.log2(np.arange(self.top_k) + 2.0)
        ranked = int(by_valid[1:].sum())  # events with a valid negative have an AUC
        per_valid = auc[1:] / (2.0 * np.arange(1, len(auc)))
        return {
            "scored": scored,
            "hr": float(ranks[: self.top_k].sum() / scored),
            "ndcg": float(ranks[: self.top_k] @ gains / scored),
            "auc": float(per_valid.sum() / ranked) if ranked else None,
        }

    def results(self) -> dict:
        """The protocol's numbers so far: ``all``, ``cold``, ``warm`` (each ``scored``,
        ``hr``, ``ndcg``, ``auc``; None where nothing was scored), ``windows`` (one per
        window of the stream: its first event and those numbers), and the settings."""
        tallies = (self._ranks, self._auc, self._by_valid)
        return {
            "every": self.every,
            "negatives": self.negatives,
            "top_k": self.top_k,
            "cold_events": self.cold_events,
            "events": self.events,
            "all": self._metrics(*tallies),
            "cold": self._metrics(*(t[:1] for t in tallies)),
            "warm": self._metrics(*(t[1:] for t in tallies)),
            "windows": [
                {"start": window * self.window_events, **self._metrics(*sums)}
                for window, sums in sorted(self._windows.items())
            ],
        }
