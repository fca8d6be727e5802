"""A hash embedding: rows for ids of any value, admitted and evicted as a stream runs.

The counterpart of MindSpore Rec's ``HashEmbeddingLookup`` on TensorFlow's own mutable
hash tables. A live stream brings users and items no fixed-size table was sized for,
so ids map to rows through a ``tf.lookup`` hash table, and the table costs what it
holds:

- rows (and their optimiser moments) are allocated as ids are admitted, doubling up to
  `capacity`, which is a bound, not an allocation; the live rows are always rows
  ``1..size`` (row 0 is the shared default row), so checkpoints and exports, taken
  after `trim`, hold the live rows only;
- every step's work is proportional to its batch: admission, refresh, eviction
  (`eviction.CandidatePool`), freeing rows (the last rows move into the holes) and
  drawing rows (uniform over ``1..size``);
- an id gets a row of its own only after `permit_filter_value` sightings in training
  calls, and then with probability `admit_probability` at each sighting (one-off ids,
  bots and typos never take a row); until then it reads the default row, never
  trained (`admission`);
- a full table makes room by its `eviction` policy (`eviction.parse_policy`: lru, lfu,
  ttl, none), never taking a row the current step uses; a new id starts with fresh
  initial values and zeroed moments (on a cluster, only while no step is in flight:
  `steps_in_flight`);
- the rows train by their own rule, or by the optimiser given to `attach_optimizer`
  (lazy Adam, row-wise Adagrad or SGD), only the rows each step uses, and everything
  (index, rows, moments, priorities, counters) is tracked by ``tf.train.Checkpoint``:
  a restored table evicts exactly the rows an uninterrupted one does; `table_changes`
  says what changed since the last checkpoint, for incremental ones.

A "step" is one training call (``training=True``): call each layer once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from recommendation.online import step_stages
from recommendation.online.steps_in_flight import DrainedUpkeep
from recommendation.online.tables import id_index, masks, row_shards
from recommendation.online.tables.admission import Admission
from recommendation.online.tables.eviction import (
    CandidatePool,
    EvictionPolicy,
    parse_policy,
    seen_priority,
)
from recommendation.online.tables.row_shards import RowShards
from recommendation.online.tables.row_training import ROW_OPTIMIZERS, RowTraining
from recommendation.online.tables.table_changes import ChangeTracking


def _growing(initial: tf.Tensor, name: str, trainable: bool = False) -> tf.Variable:
    """A variable whose first dimension may change (rows are added and trimmed)."""
    shape = tf.TensorShape([None]).concatenate(initial.shape[1:])
    return tf.Variable(initial, shape=shape, trainable=trainable, name=name)


# These methods build their control flow with tf.cond and tf.while_loop themselves:
# AutoGraph's conversion of them would only cost time (seconds at each trace).
_graph_code = tf.autograph.experimental.do_not_convert


@tf.custom_gradient
def _default_rows_untrained(rows: tf.Tensor, known: tf.Tensor):
    """`rows` as they are, with no gradient where not `known` (the default row's
    places): the gradient of ``tf.where(known, rows, tf.stop_gradient(rows))``
    without selecting between two copies of the rows on the way forward."""

    def gradient(upstream):
        return tf.where(known[:, None], upstream, 0.0), None

    return tf.identity(rows), gradient


@keras.saving.register_keras_serializable(package="ncf")
class HashEmbedding(Admission, ChangeTracking, RowTraining, DrainedUpkeep, keras.layers.Layer):
    """Embedding rows for arbitrary int64 or string ids, with admission and eviction.

    Args:
        embedding_size: Width of each row.
        key_dtype: ``"int64"`` or ``"string"``.
        initializer: Keras initializer for new rows.
        max_norm: If set, looked-up rows are scaled down to at most this L2 norm.
        permit_filter_value: Sightings an id needs before it may get a row.
        evict_filter_value: Free an id's row after this many training steps without
            a sighting (the same as ``eviction="ttl:N"``); None: by `eviction`.
        capacity: Most rows held at once.
        eviction: Policy of a full table (`eviction.parse_policy`): ``none`` refuses
            new ids, ``lru``, ``lfu[:H]``, ``ttl:N`` and ``ttl:Ns`` make room.
        admit_probability: Chance that a sighting of an id without a row (past the
            permit filter) admits it; drawn from `seed` and the step, so a run is
            reproducible.
        seed: Seed of those draws.
        row_optimizer: How the rows train (`row_training.ROW_OPTIMIZERS`: lazy
            ``adam``, row-wise ``adagrad``, ``sgd``); None: by the attached
            optimiser's rule.
        row_learning_rate: The rows' rate; None: the attached optimiser's.
        shard_devices: Devices to split the rows and their moments over (`row_shards`:
            row r on ``shard_devices[r % N]``), such as parameter-server tasks; the
            index and the eviction state stay where the table is built. None: one
            variable each, where the table is built. Not part of the config: where a
            model runs is not what it is.

    Call args:
        ids: `(...)` ids, or row numbers when `by_slot` (`sample_slots` output; no
            bookkeeping, -1 reads the default row).
        training: Whether this is a training step (admits, refreshes, evicts).
        by_slot: `ids` are row numbers.
        times: Event times of `ids` (int64 seconds), for ``ttl:Ns``.
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
        eviction: str = "none",
        admit_probability: float = 1.0,
        seed: int = 0,
        row_optimizer: str | None = None,
        row_learning_rate: float | None = None,
        shard_devices: Sequence[str] | None = None,
        **kwargs,
    ) -> None:
        # Off, so that row writes go to the float32 variables themselves; rows are cast
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
        if row_optimizer not in (None, *ROW_OPTIMIZERS):
            raise ValueError(
                f"row_optimizer must be one of {', '.join(ROW_OPTIMIZERS)}, got {row_optimizer!r}"
            )
        if row_learning_rate is not None and not 0 < row_learning_rate < float("inf"):
            raise ValueError(f"row_learning_rate must be positive, got {row_learning_rate}")
        if not 0.0 < admit_probability <= 1.0:
            raise ValueError(f"admit_probability must be in (0, 1], got {admit_probability}")
        policy = parse_policy(eviction)
        if evict_filter_value is not None:
            if policy.kind != "none":
                raise ValueError(
                    f"evict_filter_value={evict_filter_value} is eviction='ttl:"
                    f"{evict_filter_value}': give one of the two, not eviction={eviction!r} too"
                )
            policy = EvictionPolicy("ttl", ttl_steps=int(evict_filter_value))
        self.policy = policy
        self.embedding_size = int(embedding_size)
        self.key_dtype = key_dtype
        self.max_norm = max_norm
        self.permit_filter_value = int(permit_filter_value)
        self.evict_filter_value = evict_filter_value
        self.capacity = int(capacity)
        self.admit_probability = float(admit_probability)
        self.seed = int(seed)
        self.row_optimizer, self.row_learning_rate = row_optimizer, row_learning_rate
        self.shard_devices = list(shard_devices) if shard_devices else None
        self._initializer_config = keras.initializers.serialize(keras.initializers.get(initializer))
        # A copy of the caller's: its seed becomes this table's seed generator below.
        self.initializer = keras.initializers.deserialize(self._initializer_config)
        if isinstance(getattr(self.initializer, "seed", None), int):
            # A seed generator makes each admission draw new values (an int seed would
            # give every new row the same ones); as an attribute it is checkpointed.
            self.seed_generator = keras.random.SeedGenerator(self.initializer.seed)
            self.initializer.seed = self.seed_generator
            # TensorFlow checkpoints do not follow Keras seed generators; a tf.Module
            # (which Keras does not track a second time) puts its state into them.
            self.seed_checkpoint = tf.Module(name="seed")
            self.seed_checkpoint.state = self.seed_generator.state
        dtype = tf.as_dtype(key_dtype)
        self._table = id_index.make_table(dtype, -1)
        # Not-yet-admitted ids: [sightings, last step seen].
        self._pending = id_index.make_table(dtype, tf.constant([0, 0], tf.int64))
        # Ids whose pending sightings changed since the last checkpoint: not
        # checkpointed (a restored table has changed nothing yet).
        object.__setattr__(self, "_pending_changed", id_index.make_table(dtype, 0))
        int64 = tf.int64
        self.step = tf.Variable(0, dtype=int64, trainable=False, name="step")
        self.size = tf.Variable(0, dtype=int64, trainable=False, name="size")
        # Rows allocated after the default row (a variable's shape would be read from
        # the variable: a full copy when scatters write it).
        self.allocated = tf.Variable(0, dtype=int64, trainable=False, name="allocated")
        # Row 0 is the default row: zeros, never trained.
        self.embeddings = self._value_rows(tf.zeros([1, self.embedding_size]), "embeddings", True)
        self.slot_keys = _growing(tf.zeros([1], dtype), "slot_keys")
        self.priority = _growing(tf.zeros([1], tf.float64), "priority")
        self.last_seen = _growing(tf.zeros([1], int64), "last_seen")
        # Rows written since the last checkpoint, and the step each was last written at
        # (`table_changes`; not checkpointed).
        self.changed = _growing(tf.zeros([1], tf.bool), "changed")
        object.__setattr__(self, "written_at", _growing(tf.zeros([1], int64), "written_at"))
        if policy.ttl_seconds:
            self.last_time = _growing(tf.zeros([1], int64), "last_time")
            self.clock = tf.Variable(-(2**62), dtype=int64, trainable=False, name="clock")
        self.num_admitted = tf.Variable(0, dtype=int64, trainable=False, name="num_admitted")
        self.num_evicted = tf.Variable(0, dtype=int64, trainable=False, name="num_evicted")
        self.num_rejected = tf.Variable(0, dtype=int64, trainable=False, name="num_rejected")
        # Removals from each index (rows, pending sightings) since its last rebuild
        # (`id_index`), and its buckets then.
        self.removals = tf.Variable([0, 0], dtype=int64, trainable=False, name="removals")
        self.buckets = tf.Variable(
            [id_index.INITIAL_BUCKETS] * 2, dtype=int64, trainable=False, name="buckets"
        )
        # The optimiser's moments of the rows (`attach_optimizer`), grown with them.
        self.momentum: tf.Variable | None = None
        self.velocity: tf.Variable | None = None
        self.accumulator: tf.Variable | None = None
        object.__setattr__(self, "_update", None)
        # A cache of the eviction order, rebuilt when needed: not checkpointed.
        object.__setattr__(self, "_pool", CandidatePool(self, dtype))

    def _value_rows(
        self, initial: tf.Tensor, name: str, trainable: bool = False
    ) -> tf.Variable | RowShards:
        """The rows' values or moments: sharded over `shard_devices`, or one variable."""
        if self.shard_devices:
            return RowShards(initial, name, self.shard_devices, trainable)
        return _growing(initial, name, trainable)

    # -- what the pool and the trainer read ------------------------------------

    @property
    def stamps(self) -> tf.Variable:
        """Each row's expiry stamp: the step (or, for ``ttl:Ns``, the clock) it was
        last seen at."""
        return self.last_time if self.policy.ttl_seconds else self.last_seen

    @property
    def stamp_clock(self) -> tf.Tensor:
        """The stamp a row seen now gets."""
        return tf.identity(self.clock if self.policy.ttl_seconds else self.step)

    def lookup_slots(self, keys: tf.Tensor) -> tf.Tensor:
        """Rows of `keys` (`(n,)`), -1 where absent."""
        return tf.reshape(self._table.lookup(keys), [-1])

    def tiebreak(self, keys: tf.Tensor) -> tf.Tensor:
        """What orders rows of equal priority: the id, or a string's fingerprint."""
        if self.key_dtype == "int64":
            return keys
        return tf.strings.to_hash_bucket_fast(keys, 2**62)

    def release(self, keys: tf.Tensor, slots: tf.Tensor) -> None:
        """Takes `keys` out of the index; their rows (`slots`) get a priority above
        any eviction floor until they are reused or moved."""
        self._table.remove(keys)
        self.removals.assign_add(tf.stack([tf.size(keys, out_type=tf.int64), 0]))
        self.priority.scatter_update(
            tf.IndexedSlices(tf.fill(tf.shape(slots), tf.constant(float("inf"), tf.float64)), slots)
        )
        self._note_changed(slots)

    def row_variables(self) -> dict[str, tf.Variable]:
        """Every variable with a value per row, by name: the rows, their moments, ids
        and eviction state, the changed flags and the write stamps."""
        variables = {"embeddings": self.embeddings}
        if self.momentum is not None:
            variables.update(momentum=self.momentum, velocity=self.velocity)
        if self.accumulator is not None:
            variables.update(accumulator=self.accumulator)
        variables.update(slot_keys=self.slot_keys, priority=self.priority)
        variables.update(last_seen=self.last_seen, changed=self.changed)
        variables["written_at"] = self.written_at
        if self.policy.ttl_seconds:
            variables["last_time"] = self.last_time
        return variables

    @_graph_code
    def trim(self) -> None:
        """Drops the rows allocated beyond the live ones (before a checkpoint or an
        export, so that they hold the live rows only)."""
        for variable in self.row_variables().values():
            row_shards.resize(variable, self.size + 1)
        self.allocated.assign(self.size)

    def live_rows(self) -> tuple[tf.Tensor, tf.Tensor]:
        """`(keys, rows)` of rows ``0..size`` (row 0: the default row, key 0), gathered
        from shards: what a served version copies of the table (a slice of one
        variable: a third of a gather's time, 0.16 s at 10^7 rows)."""
        end = self.size + 1
        if isinstance(self.embeddings, RowShards):
            return self.slot_keys[:end], self.embeddings.gather(tf.range(end))
        return self.slot_keys[:end], self.embeddings[:end]

    # -- lookups -----------------------------------------------------------------

    @_graph_code
    def call(self, ids, training=None, by_slot=False, times=None):
        if by_slot:
            slots = tf.reshape(tf.cast(ids, tf.int64), [-1])
        else:
            slots = self.slots(ids, training, times)
        rows = self._gather(slots)
        shape = tf.concat([tf.shape(ids), [self.embedding_size]], 0)
        return tf.reshape(rows, shape)

    @_graph_code
    def slots(self, ids, training: bool = False, times=None) -> tf.Tensor:
        """Row numbers `(n,)` of `ids` (flattened), -1 for ids without a row.

        With `training`, this is the step's bookkeeping (admission, refresh,
        eviction): call it outside any mixed-precision Keras call, as `call` and
        RecModel do, since it writes rows of the float32 variables.
        """
        flat = tf.reshape(tf.convert_to_tensor(ids, dtype=self.key_dtype), [-1])
        if not training:
            return self.lookup_slots(flat)
        if self.policy.ttl_seconds:
            if times is None:
                raise ValueError(f"eviction {self.policy} needs the events' times")
            self.clock.assign(tf.maximum(self.clock, tf.reduce_max(tf.cast(times, tf.int64))))
        return self._resolve(flat)

    def _gather(self, slots: tf.Tensor) -> tf.Tensor:
        """The default row gets no gradient; rows are clipped to `max_norm`.

        The rows are gathered from the tf.Variable itself (a ResourceGather): a dense
        read of a variable that scatter updates write (admission, lazy Adam) copies
        the whole table first.
        """
        with tf.name_scope(step_stages.ROW_GATHER):
            known = slots > 0
            rows = row_shards.gather(self.embeddings, tf.where(known, slots, 0))
            rows = _default_rows_untrained(rows, known)
            if self.max_norm is not None:
                rows = tf.clip_by_norm(rows, self.max_norm, axes=[-1])
            return tf.cast(rows, self.compute_dtype)

    @_graph_code
    def sample_slots(self, num: tf.Tensor | int) -> tuple[tf.Tensor, tf.Tensor]:
        """`num` rows drawn uniformly from the occupied ones: `(keys, slots)`; slots are
        -1 while the table is empty."""
        draws = tf.random.uniform([num], 1, tf.maximum(self.size, 1) + 1, dtype=tf.int64)
        slots = tf.where(self.size > 0, draws, -1)
        return tf.gather(self.slot_keys, tf.maximum(slots, 0)), slots

    def counts(self) -> dict[str, int]:
        """What the table holds and has done since it was created (eagerly): ``ids``
        holding a row, its ``capacity``, ids ``admitted``, rows ``evicted``, and
        ``refused`` admissions (an id that reached admission while no row could be
        given; refused again at each later step that sees it)."""
        return {
            "ids": int(self.size.numpy()),
            "capacity": self.capacity,
            "admitted": int(self.num_admitted.numpy()),
            "evicted": int(self.num_evicted.numpy()),
            "refused": int(self.num_rejected.numpy()),
        }

    @_graph_code
    def contents(self) -> tuple[tf.Tensor, tf.Tensor]:
        """`(keys, slots)` of every admitted id, by slot."""
        slots = tf.range(1, self.size + 1)
        return tf.gather(self.slot_keys, slots), slots

    # -- the training-time bookkeeping ----------------------------------------

    def _resolve(self, flat: tf.Tensor) -> tf.Tensor:
        step = self.step.assign_add(1)
        with tf.name_scope(step_stages.EVICTION):
            self._pool.add_seen()
        with tf.name_scope(step_stages.ID_LOOKUP):
            unique, positions, counts = tf.unique_with_counts(flat, out_idx=tf.int64)
            slots = self.lookup_slots(unique)
            held = slots >= 0
            self._refresh(*masks.keep(held, slots, counts), step)
        freed = tf.zeros([0], tf.int64)
        if self.policy.kind == "ttl":
            ttl = self.policy.ttl_seconds or self.policy.ttl_steps
            if not self.drains:  # on a cluster: `upkeep`, between drained steps
                with tf.name_scope(step_stages.EVICTION):
                    keys, freed = self._pool.take_expired(self.stamp_clock - ttl, step)
                self.num_evicted.assign_add(tf.size(keys, out_type=tf.int64))
            if self.permit_filter_value > 1 and not self.policy.ttl_seconds:
                # Ids that never reached admission are forgotten on the same schedule.
                tf.cond(
                    step % ttl == 0,
                    lambda: self._forget_pending(step, ttl),
                    lambda: tf.constant(0, tf.int64),
                )
        with tf.name_scope(step_stages.ADMISSION):
            draws = self._admission_draws(tf.size(unique), step)
            admit = self._count_sightings(unique, counts, ~held, draws, step)
            self._admit(*masks.keep(admit, unique, counts), freed, step)
        with tf.name_scope(step_stages.ID_LOOKUP):
            if self.key_dtype == "int64":
                self._rebuild_indexes_if_worn()
            return tf.gather(self.lookup_slots(unique), positions)

    def _rebuild_indexes_if_worn(self) -> None:
        worn = id_index.worn(self.removals, self.buckets)
        tf.cond(worn[0], self._rebuild_index, lambda: tf.constant(False))
        if self.permit_filter_value > 1:
            tf.cond(worn[1], self._rebuild_pending, lambda: tf.constant(False))

    def _rebuild_index(self) -> tf.Tensor:
        live = tf.range(1, self.size + 1)
        keys = tf.gather(self.slot_keys, live)
        self._rebuilt(0, id_index.rebuild(self._table, keys, live[:, None], 1))
        return tf.constant(True)

    def _rebuild_pending(self) -> tf.Tensor:
        keys, values = id_index.live_entries(self._pending, 2)
        self._rebuilt(1, id_index.rebuild(self._pending, keys, values, 2))
        return tf.constant(True)

    def _rebuilt(self, index: int, buckets: tf.Tensor) -> None:
        self.buckets.scatter_update(tf.IndexedSlices(buckets[None], [index]))
        self.removals.scatter_update(tf.IndexedSlices(tf.zeros([1], tf.int64), [index]))

    def _refresh(self, slots, sightings, step) -> None:
        self._mark_seen(slots, tf.gather(self.priority, slots), sightings, step)

    def _mark_seen(self, slots, old, sightings, step) -> None:
        """Rows `slots` seen `sightings` times at `step` (`old`: their priorities
        before, None for new rows): priority, last step and clock."""
        fresh = seen_priority(self.policy, old, sightings, step)
        self.priority.scatter_update(tf.IndexedSlices(fresh, slots))
        self._pool.note_seen(tf.gather(self.slot_keys, slots), fresh)
        self._note_changed(slots)
        self.last_seen.scatter_update(tf.IndexedSlices(tf.fill(tf.shape(slots), step), slots))
        if self.policy.ttl_seconds:
            clock = tf.fill(tf.shape(slots), self.clock.read_value())
            self.last_time.scatter_update(tf.IndexedSlices(clock, slots))

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
            eviction=str(self.policy) if self.evict_filter_value is None else "none",
            admit_probability=self.admit_probability,
            seed=self.seed,
            row_optimizer=self.row_optimizer,
            row_learning_rate=self.row_learning_rate,
        )
        return config
