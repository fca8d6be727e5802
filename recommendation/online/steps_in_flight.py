"""A hash embedding's rows while a cluster's steps are in flight: no step's update lands
on a row that another id holds by the time it is applied.

On a parameter-server cluster the coordinator resolves step t (ids to rows: admission,
eviction) while the workers still run up to `steps` earlier steps, whose row numbers
were fixed when they were resolved. Any change of which id a row holds, or of where an
id's row is, would let such a step write one id's gradient into another id's row, or
lose it. So, on a cluster:

- every row a step trains (its users, items and negatives) is pinned: its step is
  noted (`note_trained`), and until `steps` more steps have been resolved (by then the
  coordinator has waited for it) no eviction takes it; the table evicts the next
  lowest row instead (the pinned one keeps its place in the eviction order, for the
  steps after), or refuses the new id for that step when every candidate is pinned.
  The window is counted in steps, not read off the workers, so which rows are pinned
  does not depend on their timing;
- what moves or reallocates rows (growing the row variables, freeing expired rows
  under ``ttl`` and moving the last rows into their places) happens only between
  drained steps (`upkeep`, when `upkeep_due` says the next step needs it, and every
  `EXPIRY_EVERY_STEPS` steps under ``ttl``): a step resolved on the cluster frees no
  row and grows no variable, and a full ``ttl`` table evicts as ``lru`` meanwhile.

In one process a step is applied before the next is resolved: nothing is pinned, and
none of this runs.
"""

from __future__ import annotations

import tensorflow as tf

from recommendation.online import masks, row_shards

# Most steps between two expiries of a ``ttl`` table on a cluster (each costs a drain
# of the steps in flight): a row is freed at most this many steps after it expires.
EXPIRY_EVERY_STEPS = 32


class InFlightRows:
    """Mixed into `HashEmbedding`: `pin_in_flight`, `note_trained`, `pinned`,
    `upkeep_due` and `upkeep`.

    The host provides ``step``, ``size``, ``allocated``, ``capacity``, ``policy``,
    ``num_evicted``, ``_pool``, `_growing`-style row state, `_reserve`,
    `_close_holes`, `_note_changed` and `stamp_clock`.
    """

    pin_steps = 0  # steps in flight at most (0: one process)

    def pin_in_flight(self, steps: int) -> None:
        """Pins the rows of the last `steps` steps (`note_trained`) against eviction,
        and leaves expiry and growth to `upkeep`: for a coordinator that resolves a
        step while up to `steps` earlier ones are in flight. Call before tracing."""
        if steps <= 0:
            raise ValueError(f"steps in flight must be positive, got {steps}")
        self.pin_steps = int(steps)
        # Each row's last step that trains it (0: none since this process started: a
        # restored table has no step in flight). Not checkpointed, not tracked; a row's
        # pin stays where the row is (rows move only once no step is in flight).
        trained_at = tf.Variable(
            tf.zeros([int(self.allocated.numpy()) + 1], tf.int64),
            shape=tf.TensorShape([None]),
            trainable=False,
            name="trained_at",
        )
        object.__setattr__(self, "_trained_at", trained_at)
        # The step after which every step was applied (`upkeep` runs then).
        drained_at = tf.Variable(0, dtype=tf.int64, trainable=False, name="drained_at")
        object.__setattr__(self, "_drained_at", drained_at)

    def in_flight_state(self) -> list[tf.Variable]:
        """Per-row variables of the pins (grown and trimmed with the rows; not moved:
        rows move only between drained steps)."""
        return [self._trained_at] if self.pin_steps else []

    def note_trained(self, slots: tf.Tensor) -> None:
        """Notes rows `slots` (the default row and -1 left out) trained by the step just
        resolved, on a worker: changed (for the next delta checkpoint), and pinned."""
        slots = masks.keep(slots > 0, slots)
        self._note_changed(slots)
        if self.pin_steps:
            steps = tf.fill(tf.shape(slots), self.step.read_value())
            self._trained_at.scatter_update(tf.IndexedSlices(steps, slots))

    def pinned(self, slots: tf.Tensor) -> tf.Tensor:
        """Which of rows `slots` (>= 0) a step in flight may still train, as the step
        being resolved sees it (after `pin_in_flight`)."""
        trained = tf.gather(self._trained_at, slots)
        return trained > tf.maximum(self.step - self.pin_steps - 1, self._drained_at)

    def upkeep_due(self, events: int) -> bool:
        """Whether the next step, of `events` events, needs `upkeep` first (eagerly, on
        the coordinator): it could admit ids past the rows allocated, the pins do not
        cover the rows (a restore replaced them), or expiry is due."""
        size, allocated = int(self.size.numpy()), int(self.allocated.numpy())
        if min(size + events, self.capacity) > allocated:
            return True
        if int(tf.shape(self._trained_at)[0]) != allocated + 1:  # rows restored
            return True
        return self.policy.kind == "ttl" and (int(self.step.numpy()) + 1) % self._expiry_every == 0

    @property
    def _expiry_every(self) -> int:
        return min(self.policy.ttl_steps or EXPIRY_EVERY_STEPS, EXPIRY_EVERY_STEPS)

    @tf.autograph.experimental.do_not_convert
    def upkeep(self, events: int) -> None:
        """Between drained steps: allocates rows for a step of `events` events, and
        frees the expired rows (``ttl``), moving the last rows into their places. No
        row is pinned after it (none is in flight)."""
        self._drained_at.assign(self.step)
        self._reserve(tf.minimum(self.size + events, self.capacity))
        row_shards.resize(self._trained_at, self.allocated + 1)  # (after a restore)
        if self.policy.kind == "ttl":
            ttl = self.policy.ttl_seconds or self.policy.ttl_steps
            self._pool.add_seen()  # the rows passed over while pinned, back in order
            keys, freed = self._pool.take_expired(self.stamp_clock - ttl, self.step)
            self.num_evicted.assign_add(tf.size(keys, out_type=tf.int64))
            self._close_holes(freed)
