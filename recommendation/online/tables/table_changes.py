"""What a hash embedding changed since its last checkpoint, for incremental checkpoints
(`delta_checkpoints`): taken as a few tensors, and applied to a restored table; and
which rows it wrote since a given step, for the publications a server applies
(`publishing`).

A table notes every row it writes (admission, refresh, training, a row moved into a
hole, a row released) in its per-row ``changed`` flags, and every not-yet-admitted id
whose sightings it counts or forgets. Since the live rows are always ``1..size``, the
changed rows (by row number, with their ids and all their state) and the new size say
everything about the rows: an id removed since has either left its row to another id,
whose row is changed, or its row now lies past the size. The id-to-row index is not
stored: `reindex` rebuilds it from the rows' ids.

Each row written is also stamped with the table's step (``written_at``, not
checkpointed: after a restore a trainer publishes a whole version first), so that the
rows written since any step are found without clearing flags: `written_since`.
"""

from __future__ import annotations

import tensorflow as tf

from recommendation.online.tables import id_index, masks, row_shards

_ROWS, _PENDING = "rows.", "pending."
# Row variables that say what changed, not what a restore needs: in no delta.
_BOOKKEEPING = ("changed", "written_at")


class ChangeTracking:
    """Mixed into `HashEmbedding`: `take_changes`, `apply_changes`, `reindex`.

    The host provides ``changed`` and ``written_at`` (a per-row bool and int64
    variable among its row variables; ``written_at`` is not checkpointed), ``step``,
    ``size``, ``slot_keys``, ``embeddings``, ``row_variables()``, ``_table``,
    ``_pending`` and ``_pending_changed`` (a hash table of the ids whose pending
    sightings changed; it is not checkpointed: a restored table has changed nothing
    yet).
    """

    def _note_changed(self, slots: tf.Tensor) -> None:
        self.changed.scatter_update(tf.IndexedSlices(tf.ones(tf.shape(slots), tf.bool), slots))
        stamps = tf.fill(tf.shape(slots), self.step.read_value())
        self._write_stamps().scatter_update(tf.IndexedSlices(stamps, slots))

    def _write_stamps(self) -> tf.Variable:
        """``written_at``, first made as long as the other row variables where a restore
        (by any path: it is not checkpointed) left it behind; its stamps are zeros then,
        and a publisher starts from a whole version after a restore."""
        rows = row_shards.variable_shape(self.changed)[0]

        def match() -> tf.Tensor:
            self.written_at.assign(tf.zeros([rows], tf.int64))
            return tf.constant(True)

        behind = row_shards.variable_shape(self.written_at)[0] != rows
        tf.cond(behind, match, lambda: tf.constant(False))
        return self.written_at

    def _note_pending(self, keys: tf.Tensor) -> None:
        # A plain insert: nothing is removed from this set but by `clear_changes`,
        # which leaves no tombstones (`id_index`).
        self._pending_changed.insert(keys, tf.zeros(tf.shape(keys), tf.int64))

    def change_specs(self) -> dict[str, tf.TensorSpec]:
        """What `take_changes` returns: each tensor's dtype and shape."""
        specs = {"slots": tf.TensorSpec([None], tf.int64)}
        for name, variable in self.row_variables().items():
            if name not in _BOOKKEEPING:
                specs[_ROWS + name] = tf.TensorSpec([None, *variable.shape[1:]], variable.dtype)
        if self.permit_filter_value > 1:
            key = tf.as_dtype(self.key_dtype)
            specs[_PENDING + "keys"] = tf.TensorSpec([None], key)
            specs[_PENDING + "values"] = tf.TensorSpec([None, 2], tf.int64)
            specs[_PENDING + "removed"] = tf.TensorSpec([None], key)
        return specs

    def clear_changes(self) -> None:
        """Forgets what changed (a checkpoint now holds it)."""
        self.changed.assign(tf.zeros_like(self.changed))
        if self.permit_filter_value > 1:
            id_index.clear(self._pending_changed)

    def take_changes(self) -> dict[str, tf.Tensor]:
        """The rows changed since the last call (``slots`` and each row variable's
        values there, under ``rows.<name>``) and, when ids wait for admission, the
        pending sightings changed (``pending.keys``, ``pending.values``) and removed
        (``pending.removed``); then forgets them, as written."""
        live = self.changed[1 : self.size + 1]
        slots = masks.positions(live) + 1
        changes = {"slots": slots}
        for name, variable in self.row_variables().items():
            if name not in _BOOKKEEPING:
                changes[_ROWS + name] = row_shards.gather(variable, slots)
        if self.permit_filter_value > 1:
            keys, _ = id_index.live_entries(self._pending_changed, 1)
            values = tf.reshape(self._pending.lookup(keys), [-1, 2])
            held = values[:, 0] > 0  # an id waiting for admission was seen at least once
            changes[_PENDING + "keys"], changes[_PENDING + "values"] = masks.keep(
                held, keys, values
            )
            changes[_PENDING + "removed"] = masks.keep(~held, keys)
        self.clear_changes()
        return changes

    def apply_changes(self, changes: dict[str, tf.Tensor]) -> None:
        """Applies `take_changes` of a table in the state this one holds, whose scalars
        (``size`` and ``allocated`` among them) already hold the values they had then;
        `reindex` once the last is applied."""
        end = self.allocated + 1
        slots = changes["slots"]
        for name, variable in self.row_variables().items():
            row_shards.resize(variable, end)
            if name not in _BOOKKEEPING:
                variable.scatter_update(tf.IndexedSlices(changes[_ROWS + name], slots))
        if self.permit_filter_value > 1:
            self._pending.remove(changes[_PENDING + "removed"])
            id_index.put(self._pending, changes[_PENDING + "keys"], changes[_PENDING + "values"])

    def written_since(self, step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """`(slots, keys, rows)` of the live rows written after the table's `step` (by
        row number, with their ids and values), gathered from shards."""
        live = self._write_stamps()[1 : self.size + 1] > step
        slots = masks.positions(live) + 1
        return slots, tf.gather(self.slot_keys, slots), row_shards.gather(self.embeddings, slots)

    def reindex(self) -> None:
        """Rebuilds the id-to-row index from the rows' ids (and, for int64 ids, the
        pending sightings' index, clearing its tombstones), and forgets the eviction
        order cached from the rows before."""
        self._pool.clear()
        live = tf.range(1, self.size + 1)
        keys = tf.gather(self.slot_keys, live)
        if self.key_dtype == "int64":
            self._rebuilt(0, id_index.rebuild(self._table, keys, live[:, None], 1))
            self._rebuild_pending()
        else:
            id_index.replace(self._table, keys, live)
