"""HashEmbedding: admission, eviction and row reuse, optimiser slots, checkpoints."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from recommendation import neumf_model
from recommendation.online.hash_embedding import HashEmbedding


class _Trainer:
    """One layer plus lazy Adam; each `step` pushes every looked-up value up by the
    gradient of ``sum(rows)``."""

    def __init__(self, **kwargs) -> None:
        keras.utils.set_random_seed(0)
        self.layer = HashEmbedding(4, **kwargs)
        self.layer.build()
        self.optimizer = neumf_model.LazyAdam(learning_rate=0.1)
        self.optimizer.build(self.layer.trainable_variables)
        self.num_slots = self.layer.attach_optimizer(self.optimizer)
        self._step = tf.function(self._train)

    def _train(self, ids):
        with tf.GradientTape() as tape:
            rows = self.layer(ids, training=True)
            loss = tf.reduce_sum(rows)
        variables = self.layer.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return rows

    def step(self, ids) -> np.ndarray:
        return self._step(tf.constant(ids, self.layer.key_dtype)).numpy()

    def keys(self) -> set:
        return set(self.layer.contents()[0].numpy().tolist())

    def row(self, key) -> np.ndarray:
        return self.layer(tf.constant([key], self.layer.key_dtype)).numpy()[0]


def test_finds_the_adam_moments_of_its_table():
    assert _Trainer().num_slots == 2


def test_an_id_reads_the_untrained_default_row_until_seen_permit_times():
    trainer = _Trainer(permit_filter_value=3)
    np.testing.assert_array_equal(trainer.step([7]), 0.0)  # sighting 1
    np.testing.assert_array_equal(trainer.step([7, 8]), 0.0)  # sighting 2 (8: 1)
    assert trainer.keys() == set()
    default_row = trainer.layer.embeddings.numpy()[-1]
    np.testing.assert_array_equal(default_row, 0.0)  # looked up, never trained
    rows = trainer.step([7, 8, 8])  # 7: 3rd sighting; 8: 2nd and 3rd in one batch
    assert trainer.keys() == {7, 8}
    assert np.abs(rows).sum() > 0
    assert int(trainer.layer.num_admitted.numpy()) == 2


def test_admitted_rows_train_and_unknown_ids_read_the_default_row():
    trainer = _Trainer()
    first = trainer.step([1, 2])
    trainer.step([1])
    assert np.all(trainer.row(1) < first[0])  # the gradient of sum(rows) is 1: rows fall
    np.testing.assert_allclose(trainer.row(2), trainer.step([2])[0])
    np.testing.assert_array_equal(trainer.row(99), 0.0)  # evaluation lookups admit nothing
    assert 99 not in trainer.keys()


def test_rows_are_gathered_from_the_table_without_reading_all_of_it():
    """A lookup gathers rows from the variable (ResourceGather) rather than reading the
    whole table first: a variable that scatters write (admission, lazy Adam) is copied
    whole by every such read."""
    trainer = _Trainer()
    trainer.step([1, 2])
    handle = trainer.layer.embeddings.value.handle
    graph = (
        tf.function(lambda ids: trainer.layer(ids, training=True))
        .get_concrete_function(tf.TensorSpec([None], tf.int64))
        .graph
    )
    captured = {id(outer): inner for outer, inner in graph.captures}[id(handle)]
    readers = {op.type for op in captured.consumers()}
    assert "ResourceGather" in readers and "ReadVariableOp" not in readers


def test_unseen_ids_are_evicted_and_their_rows_reused_with_fresh_state():
    trainer = _Trainer(evict_filter_value=2, capacity=2)
    trainer.step([1, 2])  # step 1
    for _ in range(3):  # steps 2-4: only 2 is seen
        trainer.step([2])
    evicted_slot = 0
    assert trainer.layer.slot_keys.numpy()[evicted_slot] == 1
    assert trainer.keys() == {2}  # step 4: 4 - 1 > 2
    assert int(trainer.layer.num_evicted.numpy()) == 1
    momentum = trainer.optimizer._momentums[0]
    assert np.abs(momentum.numpy()[evicted_slot]).sum() > 0
    trainer.step([3, 3])  # takes the freed row
    assert trainer.keys() == {2, 3}
    assert trainer.layer.slot_keys.numpy()[evicted_slot] == 3
    # The reused row's moments restarted: one update from a gradient of 2 (two
    # occurrences): m = (1 - beta1) * 2 exactly.
    np.testing.assert_allclose(momentum.numpy()[evicted_slot], 0.2, rtol=1e-6)
    velocity = trainer.optimizer._velocities[0].numpy()[evicted_slot]
    np.testing.assert_allclose(velocity, 0.001 * 4, rtol=1e-5)


def test_a_full_table_serves_the_default_row_and_counts_the_rejection():
    trainer = _Trainer(capacity=2)
    rows = trainer.step([1, 2, 3])
    np.testing.assert_array_equal(rows[2], 0.0)
    assert trainer.keys() == {1, 2}
    assert int(trainer.layer.num_rejected.numpy()) == 1


def test_pending_sightings_are_forgotten_after_the_eviction_period():
    trainer = _Trainer(permit_filter_value=3, evict_filter_value=2)
    trainer.step([5])  # step 1: one sighting
    for _ in range(3):
        trainer.step([6])  # steps 2-4; at step 4 the sighting of 5 is 3 steps old
    trainer.step([5])
    trainer.step([5])  # would be the 3rd sighting had the first been kept
    assert 5 not in trainer.keys()
    trainer.step([5])
    assert 5 in trainer.keys()


def test_max_norm_clips_looked_up_rows():
    layer = HashEmbedding(4, initializer=keras.initializers.Constant(3.0), max_norm=1.0)
    rows = layer(tf.constant([4, 5], tf.int64), training=True).numpy()
    np.testing.assert_allclose(np.linalg.norm(rows, axis=-1), 1.0, rtol=1e-6)


def test_string_ids():
    trainer = _Trainer(key_dtype="string", evict_filter_value=1, capacity=2)
    trainer.step(["alice", "bob"])
    trainer.step(["alice"])
    trainer.step(["alice", "carol"])  # bob unseen for 2 steps: his row goes to carol
    assert trainer.keys() == {b"alice", b"carol"}


def test_sample_slots_draws_occupied_rows():
    trainer = _Trainer(capacity=8)
    keys, slots = trainer.layer.sample_slots(4)
    np.testing.assert_array_equal(slots.numpy(), -1)  # empty table
    trainer.step([10, 20, 30])
    keys, slots = trainer.layer.sample_slots(200)
    assert set(keys.numpy().tolist()) == {10, 20, 30}
    rows = trainer.layer(slots, by_slot=True).numpy()
    np.testing.assert_allclose(rows, trainer.layer(keys).numpy())


def test_checkpoint_round_trip(tmp_path):
    trainer = _Trainer(permit_filter_value=2, evict_filter_value=3, capacity=4)
    for ids in ([1, 2, 3], [1, 2, 4], [2, 5, 5], [6]):
        trainer.step(ids)
    path = tf.train.Checkpoint(layer=trainer.layer, optimizer=trainer.optimizer).write(
        str(tmp_path / "ckpt")
    )
    restored = _Trainer(permit_filter_value=2, evict_filter_value=3, capacity=4)
    tf.train.Checkpoint(layer=restored.layer, optimizer=restored.optimizer).read(
        path
    ).assert_consumed()
    assert restored.keys() == trainer.keys() == {1, 2, 5}
    assert int(restored.layer.step.numpy()) == 4
    probe = tf.constant([1, 2, 3, 5, 6], tf.int64)
    np.testing.assert_array_equal(restored.layer(probe).numpy(), trainer.layer(probe).numpy())
    # Pending counts came back too: 6 (seen once) is admitted by one more sighting.
    np.testing.assert_array_equal(restored.step([6]), trainer.step([6]))
    assert 6 in restored.keys()


def test_serialization_round_trip():
    layer = HashEmbedding(3, max_norm=2.0, permit_filter_value=2, evict_filter_value=5)
    clone = keras.layers.deserialize(keras.layers.serialize(layer))
    assert clone.get_config() == layer.get_config()


@pytest.mark.parametrize(
    "kwargs",
    [{"embedding_size": 0}, {"capacity": 0}, {"evict_filter_value": 0}, {"key_dtype": "int32"}],
)
def test_bad_arguments_are_rejected(kwargs):
    with pytest.raises(ValueError):
        HashEmbedding(**{"embedding_size": 4, **kwargs})


class _TableModel:
    """A plain Python model of HashEmbedding's id-to-row bookkeeping, written from its
    documented rules: each training step refreshes the rows of the ids it holds, frees
    rows unseen for more than `evict` steps (and every `evict` steps forgets pending
    sightings as old), counts sightings of ids without a row, and admits those that
    reach `permit`, in order of first appearance, into the lowest free rows while any
    remain (the rest are rejected and start counting again)."""

    def __init__(self, capacity: int, permit: int, evict: int | None) -> None:
        self.capacity, self.permit, self.evict = capacity, permit, evict
        self.row_of: dict = {}
        self.last_seen = [-1] * capacity
        self.pending: dict = {}  # id -> [sightings, last step seen]
        self.step = 0

    def train(self, ids: list) -> list[int]:
        self.step += 1
        unique = list(dict.fromkeys(ids))
        missing = [key for key in unique if key not in self.row_of]
        for key in unique:
            if key in self.row_of:
                self.last_seen[self.row_of[key]] = self.step
        if self.evict is not None:
            for key, row in list(self.row_of.items()):
                if self.step - self.last_seen[row] > self.evict:
                    del self.row_of[key]
                    self.last_seen[row] = -1
            if self.permit > 1 and self.step % self.evict == 0:
                for key, (_, seen) in list(self.pending.items()):
                    if self.step - seen > self.evict:
                        del self.pending[key]
        ready = []
        for key in missing:
            sightings = self.pending.pop(key, [0, 0])[0] + ids.count(key)
            if sightings >= self.permit:
                ready.append(key)
            else:
                self.pending[key] = [sightings, self.step]
        free = [row for row in range(self.capacity) if self.last_seen[row] < 0]
        for key, row in zip(ready, free, strict=False):
            self.row_of[key] = row
            self.last_seen[row] = self.step
        return [self.row_of.get(key, -1) for key in ids]


@pytest.mark.parametrize(
    "key_dtype, capacity, permit, evict, seed",
    [
        ("int64", 6, 1, 1, 0),
        ("int64", 6, 1, 3, 1),
        ("int64", 4, 2, 2, 2),
        ("int64", 8, 3, 4, 3),
        ("string", 5, 1, 2, 4),
    ],
)
def test_no_two_ids_ever_share_a_row_and_evicted_ids_lose_theirs(
    key_dtype, capacity, permit, evict, seed
):
    """Random admissions and evictions, checked step by step against `_TableModel`:
    every id (seen or not) resolves to the modelled row or to none."""
    layer = HashEmbedding(
        2,
        key_dtype=key_dtype,
        capacity=capacity,
        permit_filter_value=permit,
        evict_filter_value=evict,
    )
    layer.build()
    dtype = tf.as_dtype(key_dtype)
    train = tf.function(
        lambda ids: layer.slots(ids, training=True), input_signature=[tf.TensorSpec([None], dtype)]
    )
    universe = list(range(3 * capacity))
    as_key = (lambda i: str(i).encode()) if key_dtype == "string" else (lambda i: i)
    probe = tf.constant([as_key(i) for i in universe], dtype)
    model = _TableModel(capacity, permit, evict)
    rng = np.random.default_rng(seed)
    for _ in range(150):
        batch = rng.choice(universe, size=rng.integers(1, 2 * capacity)).tolist()
        keys = [as_key(i) for i in batch]
        assert train(tf.constant(keys, dtype)).numpy().tolist() == model.train(keys)
        rows = layer.slots(probe).numpy()
        assert rows.tolist() == [model.row_of.get(as_key(i), -1) for i in universe]
        held = rows[rows >= 0]
        assert len(set(held.tolist())) == len(held)  # no two ids alias a row
        np.testing.assert_array_equal(layer.slot_keys.numpy()[held], probe.numpy()[rows >= 0])
    assert int(layer.num_evicted.numpy()) > 0 and int(layer.num_admitted.numpy()) > capacity
    assert int(layer.num_rejected.numpy()) > 0  # full tables were met too
