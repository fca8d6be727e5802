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
priorities only grow when a row is seen. So the lowest rows, sorted once, stay the
lowest in that order while they are used up (each checked on use: still held,
priority unchanged), except under LFU, where a row seen later may rank below some of
them; those rows are sorted into runs of their own and merged in. `HashEmbedding`
keeps that order (`CandidatePool`): an eviction costs O(log n) amortised (a scan of
the n rows buys n/8 evictions or rows seen), not a scan of the table per step, and
since the order is a cache of what the priorities already say, it is not
checkpointed.
"""

from __future__ import annotations

import dataclasses
import math
import re

import tensorflow as tf

from recommendation.online import step_stages
from recommendation.online.tables import masks

POLICIES = ("none", "lru", "lfu", "ttl")
DEFAULT_HALF_LIFE_STEPS = 1000
# More rows than any take: doubled (a window's width) it still fits in an int64.
_UNLIMITED = 2**61


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


def _in_order(priorities: tf.Tensor, ties: tf.Tensor) -> tf.Tensor:
    """The permutation that sorts by ``(priority, tie)``, stably."""
    order = tf.argsort(ties, stable=True)
    return tf.gather(order, tf.argsort(tf.gather(priorities, order), stable=True))


def _not_above(priorities, ties, priority, tie) -> tf.Tensor:
    """Where ``(priorities, ties) <= (priority, tie)``."""
    return (priorities < priority) | ((priorities == priority) & (ties <= tie))


def _empty(variable: tf.Variable) -> None:
    """Assigns `variable` no elements through a value of unknown length: in a
    tf.function, a value of known shape assigned in one branch of a ``tf.cond`` gives
    reads of the variable that shape in the other branch too (``tf.size`` of them is
    folded to a constant)."""
    variable.assign(masks.keep(tf.zeros_like(variable, tf.bool), variable))


class CandidatePool:
    """The rows a full table gives up next, as sorted runs of ``(priority, tie)``
    (the tie is the id, or a string id's fingerprint), each used up from its head.

    A refill scans the table once: the `kept` lowest rows the step has not used become
    the first run, and the last of them is the pool's bound. Rows seen later get higher
    priorities; under LRU and TTL always above the bound, under LFU not always (a row
    seen twice a half-life ago still outranks a new one). So LFU tables note the rows
    each step sees, and the next step sorts those at or below the bound into a run of
    their own, merged with the run before it while that is not more than twice as
    long (a row is merged O(log n) times). A take merges the runs' heads; every entry
    is checked on use (still held, priority unchanged). The pool refills when it is
    used up or its noted rows outgrow it: a scan of n rows buys n/8 evictions or
    notes. The pool is a cache of what the priorities say: it is not checkpointed.

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
        self.notes = table.policy.kind == "lfu"

        def variable(dtype, shape=()):
            initial = tf.zeros([0] * len(shape), dtype)
            return tf.Variable(initial, shape=shape, trainable=False)

        # The runs' entries, written at the refill and by scatters after it: read by
        # gathers only (a dense read would copy the buffer).
        self.ids = variable(key_dtype, [None])
        self.priorities = variable(tf.float64, [None])
        self.length = variable(tf.int64)  # entries written
        self.room = variable(tf.int64)  # entries the buffer holds
        # Each run is buffer[head:end].
        self.heads = variable(tf.int64, [None])
        self.ends = variable(tf.int64, [None])
        self.bound = tf.Variable(-float("inf"), dtype=tf.float64, trainable=False)
        # No row outside the pool has an expiry stamp below this.
        self.stamp_bound = variable(tf.int64)
        # Rows seen this step (LFU): `(ids, priorities)`.
        self.seen_ids = variable(key_dtype, [None])
        self.seen_priorities = variable(tf.float64, [None])
        # Rows read by refills, for measuring what eviction costs.
        self.rows_scanned = variable(tf.int64)
        # Both kinds of take run one loop, traced once: a TTL table takes both ways at
        # each step, and its step's graph holds that loop once, not twice.
        scalar = tf.TensorSpec([], tf.int64)
        self._take = tf.function(
            self._take_in_order,
            input_signature=[scalar, scalar, scalar, tf.TensorSpec([], tf.bool)],
            autograph=False,
        )

    def clear(self) -> None:
        """Forgets every run (the next take refills): after the priorities were
        written other than by training, as a restore does."""
        _empty(self.heads)
        _empty(self.ends)
        self.length.assign(0)

    def note_seen(self, ids: tf.Tensor, priorities: tf.Tensor) -> None:
        """Records rows seen (refreshed or admitted) this step with their new
        priorities, for the next step's `add_seen` (LFU only)."""
        if self.notes:
            self.seen_ids.assign(tf.concat([self.seen_ids, ids], 0))
            self.seen_priorities.assign(tf.concat([self.seen_priorities, priorities], 0))

    def add_seen(self) -> None:
        """Sorts the rows noted last step at or below the bound into a run (at a
        step's start, before any row is seen)."""
        if not self.notes:
            return
        ids, priorities = self.seen_ids.read_value(), self.seen_priorities.read_value()
        _empty(self.seen_ids)
        _empty(self.seen_priorities)
        low = (priorities <= self.bound) & (tf.reduce_sum(self.ends - self.heads) > 0)
        ids, priorities = masks.keep(low, ids, priorities)
        order = _in_order(priorities, self.table.tiebreak(ids))
        count = tf.size(ids, out_type=tf.int64)

        def append():
            at = tf.range(self.length, self.length + count)
            self.ids.scatter_update(tf.IndexedSlices(tf.gather(ids, order), at))
            self.priorities.scatter_update(tf.IndexedSlices(tf.gather(priorities, order), at))
            self.heads.assign(tf.concat([self.heads, tf.reshape(self.length, [1])], 0))
            self.length.assign_add(count)
            self.ends.assign(tf.concat([self.ends, tf.reshape(self.length, [1])], 0))
            self._merge_runs()
            return tf.constant(True)

        def overflow():
            self.clear()
            return tf.constant(False)

        tf.cond(
            count == 0,
            lambda: tf.constant(False),
            lambda: tf.cond(self.length + count <= self.room, append, overflow),
        )

    def _merge_runs(self) -> None:
        """Drops used-up runs, then merges the last two while the older is not more
        than twice as long as the newer."""
        live = self.heads < self.ends
        heads, ends = masks.keep(live, self.heads, self.ends)
        self.heads.assign(heads)
        self.ends.assign(ends)

        def uneven(_):
            left = tf.concat([[tf.int64.max, 0], self.ends - self.heads], 0)[-2:]
            return (tf.size(self.heads) >= 2) & (left[0] <= 2 * left[1])

        def merge(merges):
            first, second = self.heads[-2], self.heads[-1]
            at = tf.concat([tf.range(first, self.ends[-2]), tf.range(second, self.ends[-1])], 0)
            ids, priorities = tf.gather(self.ids, at), tf.gather(self.priorities, at)
            valid = self._valid(ids, priorities)
            ids, priorities = masks.keep(valid, ids, priorities)
            order = _in_order(priorities, self.table.tiebreak(ids))
            count = tf.size(ids, out_type=tf.int64)
            to = tf.range(first, first + count)
            self.ids.scatter_update(tf.IndexedSlices(tf.gather(ids, order), to))
            self.priorities.scatter_update(tf.IndexedSlices(tf.gather(priorities, order), to))
            self.length.assign(first + count)
            self.heads.assign(self.heads[:-1])
            self.ends.assign(tf.concat([self.ends[:-2], tf.reshape(self.length, [1])], 0))
            return [merges + 1]  # the loop's variables, as given (run eagerly too)

        tf.while_loop(uneven, merge, [tf.constant(0)])

    def _valid(self, ids: tf.Tensor, priorities: tf.Tensor) -> tf.Tensor:
        """Entries whose id still holds a row of that priority."""
        slots = self.table.lookup_slots(ids)
        current = tf.gather(self.table.priority, tf.maximum(slots, 0))
        return (slots >= 0) & tf.equal(current, priorities)

    def take_lowest(self, count: tf.Tensor, step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Takes up to `count` rows of lowest priority, none seen this step (fewer when
        the table holds fewer such rows): `(ids, slots)`, ids already out of the
        table's index."""
        any_stamp = tf.constant(tf.int64.max)  # a deadline every row's stamp is below
        return self._take(count, step, any_stamp, tf.constant(False))

    def take_expired(self, deadline: tf.Tensor, step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Takes every row whose expiry stamp is below `deadline` (TTL policies, whose
        priority order is also the order of the stamps), as `take_lowest`."""
        return self._take(tf.constant(_UNLIMITED, tf.int64), step, deadline, tf.constant(True))

    def _take_in_order(self, count, step_now, deadline, expiring):
        """Takes rows in priority order while their expiry stamps are below `deadline`,
        at most `count` (`take_lowest`: any stamp; `take_expired`: any number);
        `expiring` sizes the windows and refills for the second."""
        with tf.name_scope(step_stages.EVICTION):  # a graph of its own: no outer scope
            return self._take_rows(count, step_now, deadline, expiring)

    def _take_rows(self, count, step_now, deadline, expiring):
        def step(ids, slots, refilled, done):
            left = tf.reduce_sum(self.ends - self.heads)
            wanted = count - tf.size(ids, out_type=tf.int64)
            useful = (wanted > 0) & (deadline > self.stamp_bound)
            return tf.cond(
                (left == 0) & ~refilled & useful,
                lambda: (
                    ids,
                    slots,
                    self._refill(step_now, tf.where(expiring, tf.zeros_like(wanted), wanted)),
                    tf.constant(False),
                ),
                lambda: self._from_heads(ids, slots, refilled, left, wanted, deadline, expiring),
            )

        ids, slots, _, _ = tf.while_loop(
            lambda ids, slots, refilled, done: ~done,
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

    def _from_heads(self, taken_ids, taken_slots, refilled, left, wanted, deadline, expiring):
        """Takes from a window at the head of each run, merged: exact up to the least
        last entry of the windows of runs that go on past theirs."""
        table = self.table
        width = tf.where(expiring, tf.constant(1024, tf.int64), 2 * wanted + 64)
        heads, ends = self.heads.read_value(), self.ends.read_value()
        window_ends = tf.minimum(heads + width, ends)
        windows = tf.ragged.range(heads, window_ends)
        # Each entry's run: `value_rowids`, without the tens of ops of its `tf.repeat`.
        entries = tf.range(tf.size(windows.flat_values, out_type=tf.int64))
        run = tf.searchsorted(windows.row_splits[1:], entries, side="right", out_type=tf.int64)
        ids = tf.gather(self.ids, windows.flat_values)
        priorities = tf.gather(self.priorities, windows.flat_values)
        ties = table.tiebreak(ids)
        go_on = masks.keep(window_ends < ends, window_ends - 1)
        bound = tf.reduce_min(tf.gather(self.priorities, go_on))  # (+inf if none)
        bound_tie = tf.reduce_min(
            tf.where(
                tf.gather(self.priorities, go_on) == bound,
                table.tiebreak(tf.gather(self.ids, go_on)),
                tf.int64.max,
            )
        )
        order = _in_order(priorities, ties)
        ids, priorities, run = (tf.gather(x, order) for x in (ids, priorities, run))
        ties = tf.gather(ties, order)
        # A prefix of the merged windows.
        exact = tf.reduce_sum(tf.cast(_not_above(priorities, ties, bound, bound_tie), tf.int64))
        slots = table.lookup_slots(ids)
        valid = self._valid(ids, priorities)
        expired = valid & (tf.gather(table.stamps, tf.maximum(slots, 0)) < deadline)
        # The exact prefix is used up to the entry that completes `wanted` or up to the
        # first valid entry not expired, whichever comes first.
        last = _first(tf.cumsum(tf.cast(expired, tf.int64)) >= wanted, exact)
        live = _first(valid & ~expired, exact)
        satisfied = tf.minimum(last, live) < exact
        used = tf.minimum(tf.minimum(last + 1, live), exact)
        consumed = tf.range(tf.size(ids, out_type=tf.int64)) < used
        chosen = expired & consumed
        self.heads.assign_add(
            tf.math.unsorted_segment_sum(tf.cast(consumed, tf.int64), run, tf.size(heads))
        )
        ids, slots = masks.keep(chosen, ids, slots)
        # Out of the index, and above any bound: a later refill in this step skips them.
        table.release(ids, slots)
        done = satisfied | (left == 0) | ((used == left) & refilled)
        return tf.concat([taken_ids, ids], 0), tf.concat([taken_slots, slots], 0), refilled, done

    def _refill(self, step: tf.Tensor, wanted: tf.Tensor) -> tf.Tensor:
        """Makes the pool one run from a scan of the table: the `kept` rows of lowest
        priority that this step has not used; returns True."""
        table = self.table
        wanted = tf.cast(wanted, tf.int64)
        live = tf.range(1, table.size + 1)
        self.rows_scanned.assign_add(table.size)
        priorities = tf.gather(table.priority, live)
        idle = (tf.gather(table.last_seen, live) != step) & (priorities < float("inf"))
        eligible = masks.positions(idle)
        kept = tf.maximum(tf.maximum(table.size // 8, wanted), self.MIN_SORTED)
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
        eligible, priorities = masks.keep(within, eligible, priorities)
        slots = tf.gather(live, eligible)
        ids = tf.gather(table.slot_keys, slots)
        order = _in_order(priorities, table.tiebreak(ids))[: tf.cast(kept, tf.int32)]
        ids, priorities = tf.gather(ids, order), tf.gather(priorities, order)
        count = tf.size(ids, out_type=tf.int64)
        # LFU tables keep room for the rows noted after the refill.
        room = count + (kept if self.notes else 0)
        self.ids.assign(tf.concat([ids, tf.zeros([room - count], ids.dtype)], 0))
        self.priorities.assign(tf.concat([priorities, tf.zeros([room - count], tf.float64)], 0))
        self.room.assign(room)
        self.length.assign(count)
        # One run, or none when nothing is eligible (lengths unknown: see `_empty`).
        self.heads.assign(tf.range(0, count, tf.maximum(count, 1)))
        self.ends.assign(self.heads + count)
        self.bound.assign(tf.concat([[-float("inf")], priorities], 0)[-1])
        stamps = tf.gather(table.stamps, tf.gather(slots, order))
        last = tf.concat([stamps[-1:], [table.stamp_clock]], 0)[0]
        self.stamp_bound.assign(tf.where(capped, last, table.stamp_clock))
        return tf.constant(True)
