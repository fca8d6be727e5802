"""A hash embedding: rows for ids of any value, admitted and evicted as a stream runs.

The counterpart of MindSpore Rec's ``HashEmbeddingLookup`` on TensorFlow's own mutable
hash tables. A live stream brings users and items no fixed-size table was sized for,
so ids map to rows of a bounded table through a ``tf.lookup`` hash table:

- an id gets a row of its own only after `permit_filter_value` sightings in training
  calls (one-off ids, bots and typos never take a row); until then it reads a shared
  default row that is never trained;
- a row whose id has not been seen for `evict_filter_value` training steps is freed
  and reused by the next admitted id, with fresh initial values and, for any optimiser
  attached with `attach_optimizer`, zeroed slot rows (a new id must not inherit the
  Adam moments of the one before it);
- everything (tables, rows, counters) is tracked by ``tf.train.Checkpoint`` and
  ``tf.saved_model``.

A "step" is one training call (``training=True``): call each layer once per step.
"""

from __future__ import annotations

import keras
import tensorflow as tf

# Reserved keys of the int64 DenseHashTable; ids must not take these two values.
_EMPTY_KEY = -(2**63)
_DELETED_KEY = -(2**63) + 1


def _make_table(key_dtype: tf.DType, default_value) -> tf.lookup.experimental.MutableHashTable:
    """An int64-keyed DenseHashTable (open addressing, faster) or, for strings, a
    MutableHashTable."""
    if key_dtype == tf.int64:
        return tf.lookup.experimental.DenseHashTable(
            tf.int64,
            tf.int64,
            default_value=default_value,
            empty_key=_EMPTY_KEY,
            deleted_key=_DELETED_KEY,
            initial_num_buckets=1024,  # grows as needed; keeps checkpoints small
        )
    return tf.lookup.experimental.MutableHashTable(key_dtype, tf.int64, default_value)


@tf.custom_gradient
def _default_rows_untrained(rows: tf.Tensor, known: tf.Tensor):
    """`rows` as they are, with no gradient where not `known` (the default row's
    places): the gradient of ``tf.where(known, rows, tf.stop_gradient(rows))``
    without selecting between two copies of the rows on the way forward."""

    def gradient(upstream):
        return tf.where(known[:, None], upstream, 0.0), None

    return tf.identity(rows), gradient


@keras.saving.register_keras_serializable(package="ncf")
class HashEmbedding(keras.layers.Layer):
    """Embedding rows for arbitrary int64 or string ids, with admission and eviction.

    Args:
        embedding_size: Width of each row.
        key_dtype: ``"int64"`` or ``"string"``.
        initializer: Keras initializer for new (and reused) rows.
        max_norm: If set, looked-up rows are scaled down to at most this L2 norm.
        permit_filter_value: Sightings an id needs before it gets a row of its own.
        evict_filter_value: Free an id's row after this many training steps without
            a sighting; None never evicts.
        capacity: Rows available to admitted ids.

    Call args:
        ids: `(...)` ids, or row numbers when `by_slot` (`sample_slots` output; no
            bookkeeping, -1 reads the default row).
        training: Whether this is a training step (admits, refreshes, evicts).
        by_slot: `ids` are row numbers.
    Returns:
        `(..., embedding_size)` rows; ids without a row get the default row.
    """

    def __init__(
        self,
        embedding_size: int,
        key_dtype: str = "int64",
        initializer: str | keras.initializers.Initializer = "uniform",
        max_norm: float | None = None,
        permit_filter_value: int = 1,
        evict_filter_value: int | None = None,
        capacity: int = 2**16,
        **kwargs,
    ) -> None:
        # Off, so that row resets write the float32 variables themselves; rows are cast
        # to the compute dtype after the gather instead.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        if embedding_size <= 0 or capacity <= 0 or permit_filter_value <= 0:
            raise ValueError(
                "embedding_size, capacity and permit_filter_value must be positive, got "
                f"{embedding_size}, {capacity}, {permit_filter_value}"
            )
        if evict_filter_value is not None and evict_filter_value <= 0:
            raise ValueError(f"evict_filter_value must be positive or None: {evict_filter_value}")
        if key_dtype not in ("int64", "string"):
            raise ValueError(f"key_dtype must be 'int64' or 'string', got {key_dtype!r}")
        self.embedding_size = int(embedding_size)
        self.key_dtype = key_dtype
        self.max_norm = max_norm
        self.permit_filter_value = int(permit_filter_value)
        self.evict_filter_value = evict_filter_value
        self.capacity = int(capacity)
        self.initializer = keras.initializers.get(initializer)
        self._initializer_config = keras.initializers.serialize(self.initializer)
        if isinstance(getattr(self.initializer, "seed", None), int):
            # A seed generator makes each reset draw new values (an int seed would
            # give every reused row the same ones); as an attribute it is checkpointed.
            self.seed_generator = keras.random.SeedGenerator(self.initializer.seed)
            self.initializer.seed = self.seed_generator
            # TensorFlow checkpoints do not follow Keras seed generators; a tf.Module
            # (which Keras does not track a second time) puts its state into them.
            self.seed_checkpoint = tf.Module(name="seed")
            self.seed_checkpoint.state = self.seed_generator.state
        dtype = tf.as_dtype(key_dtype)
        self._table = _make_table(dtype, -1)
        # Not-yet-admitted ids: [sightings, last step seen].
        self._pending = _make_table(dtype, tf.constant([0, 0], tf.int64))
        object.__setattr__(self, "_slot_variables", ())
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self.slot_keys = tf.Variable(
            tf.zeros([self.capacity], dtype), trainable=False, name="slot_keys"
        )
        # -1 marks a free row.
        self.last_seen = tf.Variable(
            tf.fill([self.capacity], tf.constant(-1, tf.int64)), trainable=False, name="last_seen"
        )
        self.num_admitted = tf.Variable(0, dtype=tf.int64, trainable=False, name="num_admitted")
        self.num_evicted = tf.Variable(0, dtype=tf.int64, trainable=False, name="num_evicted")
        self.num_rejected = tf.Variable(0, dtype=tf.int64, trainable=False, name="num_rejected")

    def build(self, input_shape=None) -> None:
        # The last row is the shared default row; zeros keep unknown ids neutral.
        def initial(shape, dtype):
            rows = self.initializer((self.capacity, self.embedding_size), dtype)
            return tf.concat([rows, tf.zeros([1, self.embedding_size], dtype)], 0)

        self.embeddings = self.add_weight(
            shape=(self.capacity + 1, self.embedding_size), initializer=initial, name="embeddings"
        )
        super().build(input_shape)

    def attach_optimizer(self, optimizer: keras.optimizers.Optimizer) -> int:
        """Finds the optimiser's slot variables of the table (moments, accumulators) so
        that reused rows start them afresh; returns how many were found.

        Keras optimisers name a slot ``<variable path with _>_<slot name>`` and give it
        the variable's shape; the optimiser must be built.
        """
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = optimizer.inner_optimizer
        prefix = self.embeddings.path.replace("/", "_") + "_"
        slots = tuple(
            variable
            for variable in optimizer.variables
            if variable.name.startswith(prefix) and variable.shape == self.embeddings.shape
        )
        # Past Keras' and TensorFlow's attribute tracking: the optimiser owns (and
        # checkpoints) these variables, this layer only resets rows of them.
        object.__setattr__(self, "_slot_variables", slots)
        return len(slots)

    def call(self, ids, training=None, by_slot=False):
        if by_slot:
            slots = tf.reshape(tf.cast(ids, tf.int64), [-1])
        else:
            slots = self.slots(ids, training)
        rows = self._gather(slots)
        shape = tf.concat([tf.shape(ids), [self.embedding_size]], 0)
        return tf.reshape(rows, shape)

    def slots(self, ids, training: bool = False) -> tf.Tensor:
        """Row numbers `(n,)` of `ids` (flattened), -1 for ids without a row.

        With `training`, this is the step's bookkeeping (admission, refresh,
        eviction): call it outside any mixed-precision Keras call, as `call` and
        RecModel do, since it writes rows of the float32 variables.
        """
        flat = tf.reshape(tf.convert_to_tensor(ids, dtype=self.key_dtype), [-1])
        return self._resolve(flat) if training else self._lookup(flat)

    def _gather(self, slots: tf.Tensor) -> tf.Tensor:
        """The default row gets no gradient; rows are clipped to `max_norm`.

        The rows are gathered from the tf.Variable itself (a ResourceGather): a dense
        read of a variable that scatter updates write (admission here, lazy Adam)
        copies the whole table first.
        """
        known = slots >= 0
        rows = tf.gather(self.embeddings.value, tf.where(known, slots, self.capacity))
        rows = _default_rows_untrained(rows, known)
        if self.max_norm is not None:
            rows = tf.clip_by_norm(rows, self.max_norm, axes=[-1])
        return tf.cast(rows, self.compute_dtype)

    def sample_slots(self, num: tf.Tensor | int) -> tuple[tf.Tensor, tf.Tensor]:
        """`num` rows drawn uniformly from the occupied ones: `(keys, slots)`; slots are
        -1 while the table is empty."""
        occupied = tf.where(self.last_seen >= 0)[:, 0]
        count = tf.size(occupied, out_type=tf.int64)
        # While the table is empty the one candidate is -1, the default row.
        candidates = tf.concat([occupied, tf.constant([-1], tf.int64)], 0)
        draws = tf.random.uniform([num], 0, tf.maximum(count, 1), dtype=tf.int64)
        slots = tf.gather(candidates, draws)
        return tf.gather(self.slot_keys, tf.maximum(slots, 0)), slots

    def size(self) -> tf.Tensor:
        """Ids that hold a row."""
        return tf.reduce_sum(tf.cast(self.last_seen >= 0, tf.int64))

    def counts(self) -> dict[str, int]:
        """What the table holds and has done since it was created (eagerly): ``ids``
        holding a row, its ``capacity``, ids ``admitted``, rows ``evicted``, and
        ``refused`` admissions (an id that reached admission while every row was
        taken; refused again at each later step that sees it)."""
        return {
            "ids": int(self.size()),
            "capacity": self.capacity,
            "admitted": int(self.num_admitted.numpy()),
            "evicted": int(self.num_evicted.numpy()),
            "refused": int(self.num_rejected.numpy()),
        }

    def contents(self) -> tuple[tf.Tensor, tf.Tensor]:
        """`(keys, slots)` of every admitted id, sorted by slot (a stable view for
        comparing tables)."""
        slots = tf.where(self.last_seen >= 0)[:, 0]
        return tf.gather(self.slot_keys, slots), slots

    # -- the training-time bookkeeping ----------------------------------------

    def _lookup(self, keys: tf.Tensor) -> tf.Tensor:
        """Slots of `keys` (`(n,)`), -1 where absent (with the static shape the table
        lookup loses)."""
        return tf.reshape(self._table.lookup(keys), [-1])

    def _resolve(self, flat: tf.Tensor) -> tf.Tensor:
        step = self.step.assign_add(1)
        unique, positions, counts = tf.unique_with_counts(flat, out_idx=tf.int64)
        slots = self._lookup(unique)
        hits = tf.boolean_mask(slots, slots >= 0)
        self.last_seen.scatter_update(tf.IndexedSlices(tf.fill(tf.shape(hits), step), hits))
        if self.evict_filter_value is not None:
            self._evict(step)
        admit = self._count_sightings(unique, counts, slots < 0, step)
        self._admit(tf.boolean_mask(unique, admit), step)
        return tf.gather(self._lookup(unique), positions)

    def _count_sightings(self, unique, counts, missing, step) -> tf.Tensor:
        """Which missing ids reach `permit_filter_value` sightings now."""
        if self.permit_filter_value == 1:
            return missing
        keys = tf.boolean_mask(unique, missing)
        sightings = tf.reshape(self._pending.lookup(keys), [-1, 2])[:, 0]
        total = sightings + tf.boolean_mask(counts, missing)
        ready = total >= self.permit_filter_value
        waiting = ~ready
        seen = tf.stack([total, tf.fill(tf.shape(total), step)], axis=1)
        self._pending.insert(tf.boolean_mask(keys, waiting), tf.boolean_mask(seen, waiting))
        self._pending.remove(tf.boolean_mask(keys, ready))
        return tf.tensor_scatter_nd_update(tf.zeros_like(missing), tf.where(missing), ready)

    def _admit(self, keys: tf.Tensor, step: tf.Tensor) -> None:
        free = tf.where(self.last_seen < 0)[:, 0]
        num = tf.minimum(tf.size(keys, out_type=tf.int64), tf.size(free, out_type=tf.int64))
        self.num_rejected.assign_add(tf.size(keys, out_type=tf.int64) - num)
        keys, slots = keys[:num], free[:num]
        self._table.insert(keys, slots)
        self.slot_keys.scatter_update(tf.IndexedSlices(keys, slots))
        self.last_seen.scatter_update(tf.IndexedSlices(tf.fill([num], step), slots))
        fresh = self.initializer((num, self.embedding_size), self.embeddings.dtype)
        # Keras variables wrap a tf.Variable; autocast is off in this layer, so
        # `.value` is that variable, not a cast copy.
        self.embeddings.value.scatter_update(tf.IndexedSlices(fresh, slots))
        for variable in self._slot_variables:
            variable.value.scatter_update(tf.IndexedSlices(tf.zeros_like(fresh), slots))
        self.num_admitted.assign_add(num)

    def _evict(self, step: tf.Tensor) -> None:
        stale = (self.last_seen >= 0) & (step - self.last_seen > self.evict_filter_value)
        slots = tf.where(stale)[:, 0]
        self._table.remove(tf.gather(self.slot_keys, slots))
        free = tf.fill(tf.shape(slots), tf.constant(-1, tf.int64))
        self.last_seen.scatter_update(tf.IndexedSlices(free, slots))
        self.num_evicted.assign_add(tf.size(slots, out_type=tf.int64))
        if self.permit_filter_value > 1:
            # Ids that never reached admission are forgotten on the same schedule.
            tf.cond(
                step % self.evict_filter_value == 0,
                lambda: self._forget_pending(step),
                lambda: tf.constant(0, tf.int64),
            )

    def _forget_pending(self, step: tf.Tensor) -> tf.Tensor:
        keys, values = self._pending.export()
        keys, values = tf.reshape(keys, [-1]), tf.reshape(values, [-1, 2])
        if self.key_dtype == "int64":
            live = (keys != _EMPTY_KEY) & (keys != _DELETED_KEY)
        else:
            live = tf.ones_like(keys, tf.bool)
        stale = live & (step - values[:, 1] > self.evict_filter_value)
        self._pending.remove(tf.boolean_mask(keys, stale))
        return tf.reduce_sum(tf.cast(stale, tf.int64))

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            embedding_size=self.embedding_size,
            key_dtype=self.key_dtype,
            initializer=self._initializer_config,
            max_norm=self.max_norm,
            permit_filter_value=self.permit_filter_value,
            evict_filter_value=self.evict_filter_value,
            capacity=self.capacity,
        )
        return config
