"""Admission to a hash embedding: which ids get a row, and which row.

An id without a row counts its sightings in training calls (the pending sightings;
under ``ttl:N``, forgotten on the same schedule when it never reaches admission) and
needs `permit_filter_value` of them, then a draw of `admit_probability`, keyed by the
seed and the step, so a run is reproducible. Admitted ids take rows freed this step
first, then new rows (allocated doubling, up to the capacity), then the rows of the
policy's victims; the rest are refused, and counted. Freed rows no new id took are
filled with the last live rows, so that the live rows stay ``1..size``.
"""

from __future__ import annotations

import tensorflow as tf

from recommendation.online import step_stages
from recommendation.online.tables import id_index, masks, row_shards

_FIRST_ALLOCATION = 64  # rows allocated by the first admission


class Admission:
    """Mixed into `HashEmbedding`: `_count_sightings`, `_admission_draws`, `_admit`
    (with `_reserve` and `_close_holes`) and `_forget_pending`.

    The host provides the index (``_table``), the pending sightings (``_pending``,
    values ``[sightings, last step seen]``), its settings, rows, counters and
    eviction order (``_pool``), `row_variables`, `_mark_seen`, `_note_changed` and
    `_note_pending`.
    """

    def _admission_draws(self, num: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        """Which of `num` candidates pass `admit_probability` this step."""
        if self.admit_probability >= 1.0:
            return tf.ones([num], tf.bool)
        seed = tf.stack([tf.constant(self.seed, tf.int64), step])
        return tf.random.stateless_uniform([num], seed, dtype=tf.float64) < self.admit_probability

    def _count_sightings(self, unique, counts, missing, drawn, step) -> tf.Tensor:
        """Which missing ids reach `permit_filter_value` sightings now and are
        `drawn` for admission (the others keep counting)."""
        if self.permit_filter_value == 1:
            return missing & drawn
        keys, counts, drawn = masks.keep(missing, unique, counts, drawn)
        sightings = tf.reshape(self._pending.lookup(keys), [-1, 2])[:, 0]
        total = sightings + counts
        ready = (total >= self.permit_filter_value) & drawn
        seen = tf.stack([total, tf.fill(tf.shape(total), step)], axis=1)
        self._pending.remove(masks.keep(ready, keys))
        updated = id_index.put(self._pending, *masks.keep(~ready, keys, seen))
        self._note_pending(keys)
        removed = tf.reduce_sum(tf.cast(ready & (sightings > 0), tf.int64)) + updated
        self.removals.assign_add(tf.stack([0, removed]))
        return tf.tensor_scatter_nd_update(tf.zeros_like(missing), tf.where(missing), ready)

    def _admit(self, keys, sightings, freed, step) -> None:
        """Rows for `keys` (in order): freed rows first, then new rows while the
        capacity allows, then rows of the policy's victims; the rest are refused.
        Freed rows left over are filled from the end."""
        wanted = tf.size(keys, out_type=tf.int64)
        spare = tf.size(freed, out_type=tf.int64) + self.capacity - self.size
        victims = tf.zeros([0], tf.int64)
        if self.policy.evicts:
            with tf.name_scope(step_stages.EVICTION):
                victims = self._pool.take_lowest(tf.maximum(wanted - spare, 0), step)[1]
        self.num_evicted.assign_add(tf.size(victims, out_type=tf.int64))
        reused = tf.concat([freed, victims], 0)
        num = tf.minimum(wanted, spare + tf.size(victims, out_type=tf.int64))
        self.num_rejected.assign_add(wanted - num)
        num_reused = tf.minimum(num, tf.size(reused, out_type=tf.int64))
        appended = tf.range(self.size + 1, self.size + 1 + num - num_reused)
        self._reserve(self.size + num - num_reused)
        self.size.assign_add(num - num_reused)
        slots = tf.concat([reused[:num_reused], appended], 0)
        keys, sightings = keys[:num], sightings[:num]
        self._table.insert(keys, slots)  # (ids without a row: a plain insert)
        self.slot_keys.scatter_update(tf.IndexedSlices(keys, slots))
        self._mark_seen(slots, None, sightings, step)
        fresh = self.initializer((num, self.embedding_size), self.embeddings.dtype)
        self.embeddings.scatter_update(tf.IndexedSlices(fresh, slots))
        for moment in self.moments:
            zeros = tf.zeros([num, moment.shape[1]], self.embeddings.dtype)
            moment.scatter_update(tf.IndexedSlices(zeros, slots))
        # Freed rows no new id took.
        self._close_holes(reused[num_reused:])
        self.num_admitted.assign_add(num)

    def _reserve(self, rows: tf.Tensor) -> None:
        """Allocates rows up to `rows` (doubling, up to the capacity)."""
        allocated = self.allocated.read_value()

        def grow():
            target = tf.maximum(tf.maximum(2 * allocated, rows), _FIRST_ALLOCATION)
            extra = tf.minimum(target, self.capacity) - allocated
            for variable in self.row_variables().values():
                row_shards.resize(variable, allocated + extra + 1)
            self.allocated.assign_add(extra)
            return tf.constant(True)

        tf.cond(rows > allocated, grow, lambda: tf.constant(False))

    def _close_holes(self, holes: tf.Tensor) -> None:
        """Frees rows `holes` (already out of the index) by moving the last live rows
        into them, so that the live rows stay ``1..size``."""
        num = tf.size(holes, out_type=tf.int64)
        size = self.size - num
        tail = tf.range(size + 1, self.size + 1)
        in_tail = holes > size
        emptied = tf.scatter_nd(
            masks.keep(in_tail, holes)[:, None] - size - 1,
            tf.ones([tf.reduce_sum(tf.cast(in_tail, tf.int32))], tf.bool),
            tf.reshape(num, [1]),
        )
        movers = masks.keep(~emptied, tail)
        targets = tf.sort(masks.keep(~in_tail, holes))
        moved = id_index.put(self._table, tf.gather(self.slot_keys, movers), targets)
        self.removals.assign_add(tf.stack([moved, 0]))
        for variable in self.row_variables().values():
            moving = row_shards.gather(variable, movers)
            variable.scatter_update(tf.IndexedSlices(moving, targets))
        self._note_changed(targets)
        self.size.assign(size)

    def _forget_pending(self, step: tf.Tensor, horizon: int) -> tf.Tensor:
        keys, values = id_index.live_entries(self._pending, 2)
        stale = step - values[:, 1] > horizon
        stale_keys = masks.keep(stale, keys)
        self._pending.remove(stale_keys)
        self._note_pending(stale_keys)
        self.removals.assign_add(tf.stack([0, tf.reduce_sum(tf.cast(stale, tf.int64))]))
        return tf.reduce_sum(tf.cast(stale, tf.int64))
