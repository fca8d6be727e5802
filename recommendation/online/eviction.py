"""Which row a full hash table gives up: eviction policies and their priorities.

Each row of a `HashEmbedding` carries a priority; the row of lowest priority (ties:
the lower id) is the one evicted when a new id needs a row and none is free, and never
a row the current step uses. The policies:

- ``none``: a full table refuses new ids (they read the shared default row);
- ``lru``: the least recently seen row goes first; priority = the step last seen;
- ``lfu`` or ``lfu:H``: the row of fewest sightings goes first, each sighting's weight
  halving every H steps (default 1000) so that old popularity fades; priority =
  ``log(decayed sightings) + step * ln 2 / H``, which two rows keep in the same order
  while neither is seen, so it is stored once and never recomputed;
- ``ttl:N`` / ``ttl:Ns``: a row unseen for N steps (or N seconds of event time, by the
  stream's clock: the newest event time seen) is freed at once; a full table evicts as
  ``lru``.

A row seen at step t gets a priority of at least ``floor(t)`` (t, or t ln 2 / H), and
priorities only grow when a row is seen. So the rows of priority below ``floor(t0)``,
sorted once at step t0, stay the lowest rows in that order until they are used up
(each checked on use: still held, priority unchanged). `HashEmbedding` keeps that
sorted list (`CandidatePool`): an eviction costs O(log n) amortised (a sort of the
n rows buys n/8 evictions), not a scan of the table, and since the list is a cache of
what the priorities already say, it is not checkpointed. Under LRU and TTL every row
the step has not used is below the floor. Under LFU, when fewer rows are (the table
holds only ids seen more than once a half-life), the step selects the rows it needs
from all its unused ones (a partial selection, then a sort of those) and keeps that
list for itself only: such a table still pays a scan of its rows per evicting step.
"""

from __future__ import annotations

import dataclasses
import math
import re

import tensorflow as tf

POLICIES = ("none", "lru", "lfu", "ttl")
DEFAULT_HALF_LIFE_STEPS = 1000


@dataclasses.dataclass(frozen=True)
class EvictionPolicy:
    """A parsed policy (see the module docstring).

    Attributes:
        kind: One of `POLICIES`.
        half_life_steps: LFU: steps over which a sighting's weight halves.
        ttl_steps: TTL in training steps.
        ttl_seconds: TTL in seconds of event time.
    """

    kind: str = "none"
    half_life_steps: int = DEFAULT_HALF_LIFE_STEPS
    ttl_steps: int | None = None
    ttl_seconds: int | None = None

    @property
    def evicts(self) -> bool:
        """Whether a full table evicts rather than refuses."""
        return self.kind != "none"

    @property
    def decay_rate(self) -> float:
        """LFU's priority gain per step (ln 2 / half-life); LRU and TTL: 1."""
        return math.log(2.0) / self.half_life_steps if self.kind == "lfu" else 1.0

    def __str__(self) -> str:
        if self.kind == "lfu":
            return f"lfu:{self.half_life_steps}"
        if self.kind == "ttl":
            return f"ttl:{self.ttl_seconds}s" if self.ttl_seconds else f"ttl:{self.ttl_steps}"
        return self.kind


_SPEC = re.compile(r"^(none|lru|lfu|ttl)(?::(\d+)(s?))?$")


def parse_policy(spec: str) -> EvictionPolicy:
    """`EvictionPolicy` from ``none``, ``lru``, ``lfu[:H]``, ``ttl:N`` or ``ttl:Ns``;
    ValueError naming the accepted forms otherwise."""
    match = _SPEC.match(str(spec).strip().lower())
    forms = "none, lru, lfu, lfu:HALF_LIFE_STEPS, ttl:STEPS or ttl:SECONDSs"
    if not match:
        raise ValueError(f"unknown eviction policy {spec!r}: use {forms}")
    kind, number, seconds = match.groups()
    value = int(number) if number else None
    if value is not None and value <= 0:
        raise ValueError(f"eviction policy {spec!r}: the number must be positive")
    if kind == "ttl":
        if value is None:
            raise ValueError(
                f"eviction policy {spec!r} needs its time to live: ttl:STEPS or ttl:SECONDSs"
            )
        return (
            EvictionPolicy("ttl", ttl_seconds=value)
            if seconds
            else EvictionPolicy("ttl", ttl_steps=value)
        )
    if seconds or (value is not None and kind != "lfu"):
        raise ValueError(f"eviction policy {spec!r} takes no number here: use {forms}")
    if kind == "lfu":
        return EvictionPolicy("lfu", half_life_steps=value or DEFAULT_HALF_LIFE_STEPS)
    return EvictionPolicy(kind)


def seen_priority(
    policy: EvictionPolicy, old: tf.Tensor | None, sightings: tf.Tensor, step: tf.Tensor
) -> tf.Tensor:
    """Priorities (float64) of rows seen `sightings` times at `step`; `old` is their
    priority before (None for new rows)."""
    now = tf.cast(step, tf.float64) * policy.decay_rate
    if policy.kind != "lfu":
        return tf.fill(tf.shape(sightings), now)
    count = tf.cast(sightings, tf.float64)
    if old is not None:
        # exp(old - now): the earlier sightings, decayed to this step.
        count += tf.exp(old - now)
    return tf.math.log(count) + now


def priority_floor(policy: EvictionPolicy, step: tf.Tensor) -> tf.Tensor:
    """The least priority a row seen at `step` or later can have."""
    return tf.cast(step, tf.float64) * policy.decay_rate


def _first(condition: tf.Tensor, otherwise: tf.Tensor) -> tf.Tensor:
    """Index of the first True in `condition`, else `otherwise`."""
    positions = tf.range(tf.size(condition, out_type=tf.int64))
    # (The minimum of nothing is the largest int64.)
    return tf.minimum(tf.reduce_min(tf.where(condition, positions, otherwise)), otherwise)


class CandidatePool:
    """The lowest rows of a table in eviction order, sorted once and used up in order
    (module docstring): ``(priority, tie)`` ascending, where the tie is the id (int64
    keys) or its fingerprint (strings).

    Args:
        table: The `HashEmbedding` whose rows it orders (its index, per-row priority,
            ids and expiry stamps).
        key_dtype: The table's id dtype.
    """

    # Rows sorted at once: an eighth of the table, so that a sort of n rows buys n/8
    # evictions (O(log n) a row), and never fewer than this.
    MIN_SORTED = 256

    def __init__(self, table, key_dtype: tf.DType) -> None:
        self.table = table
        self.ids = tf.Variable(tf.zeros([0], key_dtype), shape=[None], trainable=False)
        self.priorities = tf.Variable(tf.zeros([0], tf.float64), shape=[None], trainable=False)
        self.head = tf.Variable(0, dtype=tf.int64, trainable=False)
        # No row outside the pool has an expiry stamp below this.
        self.stamp_bound = tf.Variable(0, dtype=tf.int64, trainable=False)
        # The step of a pool that also holds rows above the floor (too few were below
        # it): good for that step only. -1: none.
        self.transient_step = tf.Variable(-1, dtype=tf.int64, trainable=False)

    def take_lowest(self, count: tf.Tensor, step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Takes up to `count` rows of lowest priority, none seen this step (fewer when
        the table holds fewer such rows): `(ids, slots)`, ids already out of the
        table's index."""
        return self._take(count, step, deadline=None)

    def take_expired(self, deadline: tf.Tensor, step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Takes every row whose expiry stamp is below `deadline` (TTL policies, whose
        priority order is also the order of the stamps), as `take_lowest`."""
        return self._take(tf.constant(2**62, tf.int64), step, deadline=deadline)

    def _take(self, count, step_now, deadline):
        stale = (self.transient_step >= 0) & (self.transient_step != step_now)
        self.head.assign(tf.where(stale, tf.size(self.ids, out_type=tf.int64), self.head))
        self.transient_step.assign(tf.where(stale, tf.constant(-1, tf.int64), self.transient_step))

        def step(ids, slots, rebuilt, done):
            left = tf.size(self.ids, out_type=tf.int64) - self.head
            wanted = count - tf.size(ids, out_type=tf.int64)
            useful = wanted > 0 if deadline is None else deadline > self.stamp_bound
            return tf.cond(
                (left == 0) & ~rebuilt & useful,
                lambda: (
                    ids,
                    slots,
                    self._sort(step_now, wanted if deadline is None else 0),
                    tf.constant(False),
                ),
                lambda: self._from_window(ids, slots, rebuilt, left, wanted, deadline),
            )

        ids, slots, _, _ = tf.while_loop(
            lambda ids, slots, rebuilt, done: ~done,
            step,
            (
                tf.zeros([0], self.ids.dtype),
                tf.zeros([0], tf.int64),
                tf.constant(False),
                count <= 0,
            ),
            shape_invariants=(
                tf.TensorShape([None]),
                tf.TensorShape([None]),
                tf.TensorShape([]),
                tf.TensorShape([]),
            ),
        )
        return ids, slots

    def _from_window(self, taken_ids, taken_slots, rebuilt, left, wanted, deadline):
        width = tf.minimum(left, 2 * wanted + 64 if deadline is None else 1024)
        window = self.head + tf.range(width)
        ids = tf.gather(self.ids, window)
        slots = self.table.lookup_slots(ids)
        row = tf.maximum(slots, 0)
        valid = (slots >= 0) & tf.equal(
            tf.gather(self.table.priority, row), tf.gather(self.priorities, window)
        )
        if deadline is None:
            # Through the entry that completes `wanted`.
            reached = tf.cumsum(tf.cast(valid, tf.int64)) >= wanted
            used = tf.minimum(_first(reached, width), width - 1) + 1
            chosen = valid
        else:
            expired = valid & (tf.gather(self.table.stamps, row) < deadline)
            used = _first(valid & ~expired, width)
            chosen = expired
        chosen &= tf.range(width) < used
        self.head.assign_add(used)
        ids, slots = tf.boolean_mask(ids, chosen), tf.boolean_mask(slots, chosen)
        # Out of the index, and above any floor: a later sort in this step skips them.
        self.table.release(ids, slots)
        if deadline is None:
            satisfied = tf.size(ids, out_type=tf.int64) >= wanted
        else:
            satisfied = used < width
        done = satisfied | (left == 0) | ((used == left) & rebuilt)
        return tf.concat([taken_ids, ids], 0), tf.concat([taken_slots, slots], 0), rebuilt, done

    def _sort(self, step: tf.Tensor, wanted: tf.Tensor) -> tf.Tensor:
        """Refills the pool from a scan of the table: the rows below the floor or, if
        fewer than `wanted`, every row this step has not used (for this step only);
        returns True."""
        table = self.table
        wanted = tf.cast(wanted, tf.int64)
        live = tf.range(1, table.size + 1)
        priorities = tf.gather(table.priority, live)
        cold = priorities < priority_floor(table.policy, step)
        idle = (tf.gather(table.last_seen, live) != step) & (priorities < float("inf"))
        short = tf.reduce_sum(tf.cast(cold, tf.int64)) < wanted
        eligible = tf.where(tf.where(short, idle, cold))[:, 0]
        self.transient_step.assign(tf.where(short, step, -1))
        # A pool for this step only needs what the step takes.
        kept = tf.where(
            short, wanted, tf.maximum(tf.maximum(table.size // 8, wanted), self.MIN_SORTED)
        )
        capped = tf.size(eligible, out_type=tf.int64) > kept
        priorities = tf.gather(priorities, eligible)
        # Only the rows up to the kept-th lowest priority (ties included) are sorted:
        # a partial selection, not a sort of every eligible row.
        lowest = -tf.math.top_k(
            -priorities,
            tf.cast(tf.minimum(kept, tf.size(eligible, out_type=tf.int64)), tf.int32),
            sorted=False,
        ).values
        within = priorities <= tf.reduce_max(tf.concat([lowest, [-float("inf")]], 0))
        eligible = tf.boolean_mask(eligible, within)
        priorities = tf.boolean_mask(priorities, within)
        slots = tf.gather(live, eligible)
        ids = tf.gather(table.slot_keys, slots)
        order = tf.argsort(table.tiebreak(ids), stable=True)
        order = tf.gather(order, tf.argsort(tf.gather(priorities, order), stable=True))
        order = order[: tf.cast(tf.minimum(kept, table.size), tf.int32)]
        self.ids.assign(tf.gather(ids, order))
        self.priorities.assign(tf.gather(priorities, order))
        self.head.assign(0)
        stamps = tf.gather(table.stamps, tf.gather(slots, order))
        last = tf.concat([stamps[-1:], [table.stamp_clock]], 0)[0]
        self.stamp_bound.assign(tf.where(capped, last, table.stamp_clock))
        return tf.constant(True)
