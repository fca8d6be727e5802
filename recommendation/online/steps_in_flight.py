"""A hash embedding's rows while a cluster's steps are in flight: no step's update lands
on a row that another id holds by the time it is applied.

On a parameter-server cluster the coordinator resolves step t (ids to rows: admission,
eviction) while the workers still run up to a few earlier steps, whose row numbers
were fixed when they were resolved. A change of which id a row holds (an eviction, a
row freed and reused), of where an id's row is (the last rows moved into freed ones),
or of the row variables themselves (grown by a copy) would let such a step write one
id's gradient into another id's row, or lose it. So on a cluster every such change
happens only between drained steps, when no step is in flight:

- before a step that may evict (its ids without a row outnumber the table's free
  rows), that may grow the row variables, or when expiry is due (``ttl``, every
  `EXPIRY_EVERY_STEPS` steps at most), the coordinator waits for the steps in flight
  (`upkeep_due`, then `upkeep`); a step resolved otherwise only admits ids into free
  rows and refreshes rows;
- expiry (``ttl``) runs in `upkeep`, not in the step: a row is freed at most
  `EXPIRY_EVERY_STEPS` steps after it expired, and a full ``ttl`` table evicts as
  ``lru`` meanwhile.

The other way, pinning the rows of the steps in flight against eviction, was measured
and rejected (docs/cluster.md): each step's negatives pin rows all over the item table,
so a full table refused most new ids and its eviction order was scanned at every step.
In one process a step is applied before the next is resolved: none of this runs.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

# Most steps between two expiries of a ``ttl`` table on a cluster (each costs a drain
# of the steps in flight).
EXPIRY_EVERY_STEPS = 32


class DrainedUpkeep:
    """Mixed into `HashEmbedding`: `drain_for_changes`, `upkeep_due` and `upkeep`.

    The host provides ``step``, ``size``, ``allocated``, ``capacity``, ``policy``,
    ``num_evicted``, ``_pool``, `lookup_slots`, `_reserve`, `_close_holes` and
    `stamp_clock`.
    """

    drains = False  # True: on a cluster's coordinator (`drain_for_changes`)

    def drain_for_changes(self) -> None:
        """Leaves what changes rows to `upkeep` and to steps resolved with none in
        flight: for a coordinator whose steps run on workers. Call before tracing."""
        self.drains = True

    def upkeep_due(self, ids: np.ndarray) -> bool:
        """Whether the next step, looking up `ids` here, must wait for the steps in
        flight (eagerly, on the coordinator): its new ids could evict or outgrow the
        rows allocated, or expiry is due."""
        if self.policy.kind == "ttl" and (int(self.step.numpy()) + 1) % self._expiry_every == 0:
            return True
        size, allocated = int(self.size.numpy()), int(self.allocated.numpy())
        if size + len(ids) <= allocated:
            return False  # even if every id were new (allocated <= capacity)
        unique = tf.constant(np.unique(ids))
        new = int(np.count_nonzero(self.lookup_slots(unique).numpy() < 0))
        grows = size + new > allocated < self.capacity
        return grows or (self.policy.evicts and size + new > self.capacity)

    @property
    def _expiry_every(self) -> int:
        return min(self.policy.ttl_steps or EXPIRY_EVERY_STEPS, EXPIRY_EVERY_STEPS)

    @tf.autograph.experimental.do_not_convert
    def upkeep(self, new_ids: int) -> None:
        """Between drained steps: allocates rows for `new_ids` more ids, and frees the
        expired rows (``ttl``), moving the last rows into their places."""
        self._reserve(tf.minimum(self.size + new_ids, self.capacity))
        if self.policy.kind == "ttl":
            ttl = self.policy.ttl_seconds or self.policy.ttl_steps
            keys, freed = self._pool.take_expired(self.stamp_clock - ttl, self.step)
            self.num_evicted.assign_add(tf.size(keys, out_type=tf.int64))
            self._close_holes(freed)
