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
environments use this module as it is. The protocol's memory is the same in every
system's process, and bounded whatever the number of ids a stream ever brings (a
trainer runs for weeks): each user's event count up to `cold_events` is exact for the
first `MAX_USERS` users (about 20 bytes a user), then kept in a count-min sketch of
fixed size, where a new user reads as warm with the probability
``results()["cohort_error"]`` estimates; the negatives are drawn from the first
`MAX_ITEMS` distinct items; the curve keeps at most `MAX_WINDOWS` windows, doubling
their size (merging neighbours) when it would hold more.
"""

from __future__ import annotations

import dataclasses

import numpy as np

COLD_EVENTS = 5
SEED = 0  # the protocol's own: every system scores the same events
# The bounds on its memory (module docstring): about 100 MB of users, 50 MB of items.
MAX_USERS = 1 << 22
MAX_ITEMS = 1 << 21
MAX_WINDOWS = 1024

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
    ints takes about a hundred.

    With `max_ids`, the table holds at most that many ids, exactly; the ids that come
    after it is full are counted in a count-min sketch of `sketch_counters` one-byte
    counters (3 hashes, conservative update), whose memory is fixed: an id there may
    read as having more events than it had (never fewer), with a probability that
    `overcount_rate` estimates. So memory stays bounded whatever the number of ids a
    stream ever brings."""

    SKETCH_HASHES = 3

    def __init__(
        self,
        cap: int,
        buckets: int = 1024,
        max_ids: int | None = None,
        sketch_counters: int = 1 << 24,
    ) -> None:
        self.cap, self.max_ids = cap, max_ids
        self.keys = np.zeros(buckets, np.int64)
        self.used = np.zeros(buckets, bool)
        self.counts = np.zeros(buckets, np.uint8)
        self.size = 0
        self.sketch_counters = sketch_counters
        self.sketch: np.ndarray | None = None  # allocated when the table is full

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

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """The bucket of each of `keys`, or -1 where it is not in the table."""
        mask = len(self.keys) - 1
        with np.errstate(over="ignore"):
            slots = (_mix(keys.astype(np.uint64)) & np.uint64(mask)).astype(np.int64)
        found = np.full(len(keys), -1, np.int64)
        pending = np.arange(len(keys))
        while len(pending):
            at = slots[pending]
            hit = self.used[at] & (self.keys[at] == keys[pending])
            found[pending[hit]] = at[hit]
            pending = pending[~hit & self.used[at]]
            slots[pending] = (slots[pending] + 1) & mask
        return found

    def count_and_add(self, ids: np.ndarray) -> np.ndarray:
        """How many events each of `ids` (in stream order) had before it, capped; then
        counts these too."""
        unique, inverse, repeats = np.unique(ids, return_inverse=True, return_counts=True)
        exact = np.ones(len(unique), bool)
        if self.max_ids is not None and self.size + len(unique) > self.max_ids:
            # Ids already held, and new ones (in id order) while there is room (with
            # room for all of them, they are all held: no lookup needed).
            new = self._find(unique) < 0
            exact = ~new | (np.cumsum(new) <= self.max_ids - self.size)
        held = unique[exact]
        if 2 * (self.size + len(held)) > len(self.keys):
            self._grow(2 * (self.size + len(held)))
        slots = self._find_or_add(held)
        before = np.empty(len(unique), np.int64)
        before[exact] = self.counts[slots]
        if not exact.all():
            sketched = self._sketch_slots(unique[~exact])
            before[~exact] = self.sketch[sketched].min(axis=0)
            after = np.minimum(before[~exact] + repeats[~exact], self.cap).astype(np.uint8)
            for row in sketched:  # conservative update: no counter above the new count
                np.maximum.at(self.sketch, row, after)
        # An id's k-th event in this chunk comes after the k - 1 before it here.
        order = np.argsort(inverse, kind="stable")
        rank = np.empty(len(ids), np.int64)
        rank[order] = np.arange(len(ids)) - np.repeat(np.cumsum(repeats) - repeats, repeats)
        self.counts[slots] = np.minimum(before[exact] + repeats[exact], self.cap)
        return np.minimum(before[inverse] + rank, self.cap)

    def _sketch_slots(self, keys: np.ndarray) -> np.ndarray:
        """The sketch counters of each of `keys`: (hashes, len(keys))."""
        if self.sketch is None:
            self.sketch = np.zeros(self.sketch_counters, np.uint8)
        seeds = np.arange(1, self.SKETCH_HASHES + 1, dtype=np.uint64) * _GOLDEN
        with np.errstate(over="ignore"):
            hashed = _mix(keys.astype(np.uint64)[None, :] ^ seeds[:, None])
        return (hashed % np.uint64(self.sketch_counters)).astype(np.int64)

    def overcount_rate(self) -> float:
        """The estimated share of new ids counted in the sketch that read as already
        at `cap` (the chance that each of its counters is): 0 while the table holds
        every id."""
        if self.sketch is None:
            return 0.0
        return float(np.mean(self.sketch >= self.cap)) ** self.SKETCH_HASHES

    @property
    def nbytes(self) -> int:
        """The bytes its arrays hold."""
        arrays = (self.keys, self.used, self.counts, self.sketch)
        return sum(array.nbytes for array in arrays if array is not None)

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
        window_events: Events per window of the curve (doubled while it would have
            more than `max_windows` windows).
        seed: The hash's seed (keep the default to compare systems).
        max_users: Users whose event counts are exact (module docstring; keep the
            defaults of these bounds to compare systems).
        max_items: Distinct items the negatives are drawn from.
        max_windows: Most windows of the curve.
    """

    def __init__(
        self,
        every: int = 8,
        negatives: int = 99,
        top_k: int = 10,
        cold_events: int = COLD_EVENTS,
        window_events: int = 100_000,
        seed: int = SEED,
        max_users: int = MAX_USERS,
        max_items: int = MAX_ITEMS,
        max_windows: int = MAX_WINDOWS,
    ) -> None:
        if every < 0 or negatives <= 0 or top_k <= 0 or window_events <= 0:
            raise ValueError(
                "every must be >= 0 and negatives, top_k and window_events positive, got "
                f"{every}, {negatives}, {top_k}, {window_events}"
            )
        self.every, self.negatives, self.top_k = every, negatives, top_k
        self.cold_events, self.window_events, self.seed = cold_events, window_events, seed
        self.events = 0  # seen so far
        self._seen_items = np.zeros(min(1024, max_items), np.int64)  # in first-seen order
        self._num_seen = 0
        self.max_items, self.max_windows = max_items, max_windows
        self._item_set = IdCounts(1, max_ids=max_items, sketch_counters=1 << 20)  # membership
        self._user_counts = IdCounts(cold_events, max_ids=max_users)
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
        # (the first `max_items` of them: the pool of negatives keeps no more)
        seen_before = np.minimum(self._num_seen + np.cumsum(new_first) - new_first, self.max_items)
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
        new = new[: self.max_items - self._num_seen]
        end = self._num_seen + len(new)
        if end > len(self._seen_items):
            grown = np.zeros(min(max(2 * len(self._seen_items), end), self.max_items), np.int64)
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
        while len(self._windows) > self.max_windows:
            self._coarsen()

    def _coarsen(self) -> None:
        """Doubles the windows' size: each pair of neighbours becomes one (the same
        tallies as windows of that size from the start)."""
        self.window_events *= 2
        merged: dict[int, tuple[np.ndarray, ...]] = {}
        for window, tallies in sorted(self._windows.items()):
            if window // 2 in merged:
                merged[window // 2] = tuple(
                    a + b for a, b in zip(merged[window // 2], tallies, strict=True)
                )
            else:
                merged[window // 2] = tallies
        self._windows = merged

    def closed_windows(self, start: int, through: int) -> list[dict]:
        """The windows of the curve that begin at or after event `start` and end at or
        before event `through` (all their events recorded), oldest first: each its
        ``start``, ``end`` and numbers."""
        size = self.window_events
        return [
            {"start": window * size, "end": (window + 1) * size, **self._metrics(*tallies)}
            for window, tallies in sorted(self._windows.items())
            if window * size >= start and (window + 1) * size <= through
        ]

    @property
    def nbytes(self) -> int:
        """The bytes its arrays hold (bounded: module docstring)."""
        windows = sum(array.nbytes for tallies in self._windows.values() for array in tallies)
        counts = self._item_set.nbytes + self._user_counts.nbytes
        return self._seen_items.nbytes + counts + windows

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
            "cohort_error": self._user_counts.overcount_rate(),
            "events": self.events,
            "all": self._metrics(*tallies),
            "cold": self._metrics(*(t[:1] for t in tallies)),
            "warm": self._metrics(*(t[1:] for t in tallies)),
            "windows": [
                {"start": window * self.window_events, **self._metrics(*sums)}
                for window, sums in sorted(self._windows.items())
            ],
        }
