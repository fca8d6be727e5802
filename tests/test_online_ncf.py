"""Online NeuMF's test-then-train step on hand-built tables: prequential HR@1 and NDCG@1
with the model as it was before the batch, new ids on the default rows, negatives.

Every model here scores a (user, item) pair by the dot product of the two rows' GMF
halves (the logit reads the GMF product only, with weight 1 and no bias), and the
rows are set by hand, so each event's hit follows from a few products. The held-out
item loses ties (`neumf_model.compute_hr_ndcg`); with 20 negatives drawn from the
item table, a batch is scored the same way whatever the draws, but for draws of
probability 10**-20 or less.
"""

from __future__ import annotations

import re

import keras
import numpy as np
import tensorflow as tf

from recommendation.data import constants
from recommendation.online import online_ncf
from recommendation.online.hash_embedding import HashEmbedding

MF_DIM, MLP_HALF = 2, 2


def _model(**overrides) -> online_ncf.OnlineNeuMF:
    keras.utils.set_random_seed(0)
    settings = dict(
        mf_dim=MF_DIM,
        layers=(2 * MLP_HALF, 2),
        mlp_regularization=(0.0, 0.0),
        user_capacity=8,
        item_capacity=16,
        prequential_events=8,
        prequential_negatives=20,
        top_k=1,
    )
    params = online_ncf.OnlineParams(**{**settings, **overrides})
    model = online_ncf.build_online_model(params)
    kernel = np.zeros((MF_DIM + 2, 1), np.float32)
    kernel[:MF_DIM] = 1.0  # the logit is the sum of the GMF product
    model.logit.kernel.assign(kernel)
    model.logit.bias.assign(np.zeros(1, np.float32))
    # A row given to an id by this batch would be all ones: scored with it, a new id
    # would score otherwise than with the default (zero) row.
    model.user_embedding.initializer = keras.initializers.Constant(1.0)
    model.item_embedding.initializer = keras.initializers.Constant(1.0)
    return model


def _admit(embedding, rows: dict[int, tuple[float, float]]) -> None:
    """Gives each id a row (one training lookup) whose GMF half is set by hand."""
    slots = embedding.slots(tf.constant(list(rows), tf.int64), training=True).numpy()
    assert np.all(slots >= 0)
    table = embedding.embeddings.numpy()
    table[slots] = 0.0
    table[slots, :MF_DIM] = list(rows.values())
    embedding.embeddings.assign(table)


def _test_then_train(model, events: list[tuple[int, int]]) -> dict[str, float]:
    """One step's resolve (admitting the batch) and scores, as RecModel runs it."""
    users, items = zip(*events, strict=True)
    batch = {
        constants.USER_COLUMN: tf.constant(users, tf.int64),
        constants.ITEM_COLUMN: tf.constant(items, tf.int64),
    }
    outputs = model(model.resolve(batch, training=True), training=True)
    return {key: float(value) for key, value in outputs.items()}


def _has_row(embedding, key: int) -> bool:
    return int(embedding.slots(tf.constant([key], tf.int64))[0]) >= 0


def test_prequential_hr_and_ndcg_on_a_hand_built_batch():
    model = _model()
    _admit(model.user_embedding, {1: (1.0, 1.0), 2: (0.0, 1.0)})
    # Item 100 scores 0 for user 1 and -1 for user 2; items 200-208 score -2 and -1.
    _admit(model.item_embedding, {100: (1.0, -1.0), **{200 + i: (-1.0, -1.0) for i in range(9)}})
    logs = _test_then_train(
        model,
        [
            (1, 100),  # 0 beats every 200s item (-2): a hit at rank 0
            (1, 200),  # -2: item 100 (0) or another 200s item (a tie) ranks above it
            (3, 100),  # a new user: the default row ties everything, and ties lose
            (2, 999),  # a new item: the default row's 0 beats -1 everywhere
        ],
    )
    assert logs["hr"] == 0.5 and logs["ndcg"] == 0.5
    assert np.isfinite(logs["loss"])


def test_new_ids_read_the_default_rows_until_their_batch_is_scored():
    model = _model()
    _admit(model.user_embedding, {2: (0.0, 1.0)})
    _admit(model.item_embedding, {100: (1.0, -1.0), **{200 + i: (-1.0, -1.0) for i in range(9)}})
    # With the ones row this batch admits, user 3 would score 0 on item 100 against
    # -2 on the rest: a hit. On the default row it ties everything: a miss.
    logs = _test_then_train(model, [(3, 100), (2, 999)])
    assert logs["hr"] == 0.5
    # The same step admitted them: they were scored before, not for want of a row.
    assert _has_row(model.user_embedding, 3) and _has_row(model.item_embedding, 999)


def test_negatives_are_never_the_events_item_even_in_a_row_the_batch_reuses_for_it():
    model = _model(item_capacity=2, evict_filter_value=1)
    _admit(model.user_embedding, {1: (1.0, 1.0)})
    _admit(model.item_embedding, {100: (-2.0, -2.0), 200: (-1.0, -1.0)})  # item step 1
    model.item_embedding.slots(tf.constant([200], tf.int64), training=True)  # step 2
    # Step 3 evicts item 100 (unseen for 2 steps) and gives its row to the new item
    # 999 (with a ones row, scoring 2). The negatives were drawn before: those drawn
    # in item 100's row must score as item 100 (-4), never as item 999.
    logs = _test_then_train(
        model,
        [
            (1, 999),  # the default row's 0 beats item 100 (-4) and item 200 (-2)
            (1, 200),  # -2 beats item 100; draws of item 200 itself are not counted
        ],
    )
    assert logs["hr"] == 1.0 and logs["ndcg"] == 1.0
    assert not _has_row(model.item_embedding, 100) and _has_row(model.item_embedding, 999)


def test_a_config_round_trip_builds_the_same_hash_tables():
    model = _model(permit_filter_value=2, evict_filter_value=3, max_norm=2.0)
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(model))
    assert type(clone) is online_ncf.OnlineNeuMF and clone.get_config() == model.get_config()
    for table, capacity in ((clone.user_embedding, 8), (clone.item_embedding, 16)):
        assert isinstance(table, HashEmbedding) and table.capacity == capacity
        assert (table.permit_filter_value, table.evict_filter_value, table.max_norm) == (2, 3, 2.0)
    assert model.get_config()["user_capacity"] == 8 and "num_users" not in model.get_config()


def test_a_serving_export_holds_the_index_and_live_rows_only(tmp_path):
    """What a server loads: the tables' index and live rows (not their moments or
    eviction state, nor the rows allocated ahead), scoring as the trained model does."""
    params = online_ncf.OnlineParams(mf_dim=4, layers=(8, 4), user_capacity=2**40)
    rec_model = online_ncf.build_rec_model(params)
    batch = {
        constants.USER_COLUMN: np.arange(1, 101, dtype=np.int64)[None],
        constants.ITEM_COLUMN: (np.arange(100, dtype=np.int64) % 7)[None],
        constants.TIME_COLUMN: np.zeros([1, 100], np.int64),
    }
    rec_model.train(1, [batch], dataset_sink_mode=False)
    rec_model.trim_tables()
    module, signatures = online_ncf.serving(rec_model)
    tf.saved_model.save(module, str(tmp_path / "export"), signatures=signatures)
    names = [
        name
        for name, _ in tf.train.list_variables(str(tmp_path / "export" / "variables" / "variables"))
    ]
    assert not [n for n in names if re.search("momentum|velocity|priority|last_seen|slot_keys", n)]
    shapes = dict(tf.train.list_variables(str(tmp_path / "export" / "variables" / "variables")))
    assert sorted(shape[0] for name, shape in shapes.items() if "rows" in name) == [8, 101]
    served = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    users, items = tf.constant([1, 50, 10**6], tf.int64), tf.constant([3, 4, 5], tf.int64)
    network = rec_model.network
    expected = tf.sigmoid(
        network.score(network.user_embedding(users), network.item_embedding(items))[:, 0]
    )
    np.testing.assert_allclose(served(user_id=users, item_id=items)["scores"], expected, rtol=1e-6)
