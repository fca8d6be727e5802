"""Online NeuMF on hand-built tables: raw ids scored by the model as it is, and each
sink scored by the prequential protocol before it trains, new ids on the default rows.

Every model here scores a (user, item) pair by the dot product of the two rows' GMF
halves (the logit reads the GMF product only, with weight 1 and no bias), and the
rows are set by hand, so each score follows from a few products.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from recommendation.data import constants
from recommendation.online import evaluation, online_ncf, prequential
from recommendation.online.tables.hash_embedding import HashEmbedding

MF_DIM, MLP_HALF = 2, 2
PARAMS = dict(
    mf_dim=MF_DIM,
    layers=(2 * MLP_HALF, 2),
    mlp_regularization=(0.0, 0.0),
    user_capacity=8,
    item_capacity=16,
)


def _hand_built(model) -> None:
    """The logit reads the GMF product only; a row given to an id by training is all
    ones (scored with it, a new id would score otherwise than with the default row)."""
    kernel = np.zeros((MF_DIM + 2, 1), np.float32)
    kernel[:MF_DIM] = 1.0  # the logit is the sum of the GMF product
    model.logit.kernel.assign(kernel)
    model.logit.bias.assign(np.zeros(1, np.float32))
    model.user_embedding.initializer = keras.initializers.Constant(1.0)
    model.item_embedding.initializer = keras.initializers.Constant(1.0)


def _model(**overrides) -> online_ncf.OnlineNeuMF:
    keras.utils.set_random_seed(0)
    model = online_ncf.build_online_model(online_ncf.OnlineParams(**{**PARAMS, **overrides}))
    _hand_built(model)
    return model


def _admit(embedding, rows: dict[int, tuple[float, float]]) -> None:
    """Gives each id a row (one training lookup) whose GMF half is set by hand."""
    slots = embedding.slots(tf.constant(list(rows), tf.int64), training=True).numpy()
    assert np.all(slots >= 0)
    table = embedding.embeddings.numpy()
    table[slots] = 0.0
    table[slots, :MF_DIM] = list(rows.values())
    embedding.embeddings.assign(table)


def _has_row(embedding, key: int) -> bool:
    return int(embedding.slots(tf.constant([key], tf.int64))[0]) >= 0


def test_candidates_are_scored_by_the_model_as_it_is_without_admitting_any():
    model = _model()
    _admit(model.user_embedding, {1: (1.0, 1.0), 2: (0.0, 1.0)})
    _admit(model.item_embedding, {100: (1.0, -1.0), 200: (-1.0, -1.0)})
    users = tf.constant([1, 2, 3], tf.int64)  # user 3 and item 999 have no row
    items = tf.constant([100, 200, 999], tf.int64)
    scores = model.score_candidates(users, items, tf.constant([[0, 1, 2]] * 3)).numpy()
    np.testing.assert_array_equal(scores, [[0.0, -2.0, 0.0], [-1.0, -1.0, 0.0], [0, 0, 0]])
    assert not _has_row(model.user_embedding, 3) and not _has_row(model.item_embedding, 999)


@pytest.mark.parametrize("bias_terms", [False, True])
def test_candidates_score_as_the_whole_network_does_with_the_first_layer_split(bias_terms):
    """The reference's sizes, random rows and weights: each (user, candidate) pair
    scores as `score_rows` of its two looked-up rows (the network's every layer on the
    pair, and the biases), for known and unknown ids and candidates repeated within and
    across events; and no op multiplies a pair's whole first-layer input (its user and
    item halves are projected apart, each distinct row once)."""
    keras.utils.set_random_seed(3)
    model = online_ncf.build_online_model(online_ncf.OnlineParams(bias_terms=bias_terms))
    generator = np.random.default_rng(3)
    for table, count in ((model.user_embedding, 60), (model.item_embedding, 90)):
        table.slots(tf.range(1, count, dtype=tf.int64), training=True)
        rows = generator.normal(0.0, 0.5, table.embeddings.numpy().shape).astype(np.float32)
        rows[0] = 0.0  # the default row
        table.embeddings.assign(rows)
    users = tf.constant(generator.integers(1, 70, 40), tf.int64)  # 60 to 69: no row
    candidates = generator.integers(1, 100, [40, 30])
    items, positions = np.unique(candidates, return_inverse=True)
    scores = model.score_candidates(users, items, positions.reshape(40, 30).astype(np.int32))
    pairs_user = model.user_embedding(tf.repeat(users, 30), training=False)
    pairs_item = model.item_embedding(candidates.ravel(), training=False)
    expected = tf.reshape(model.score_rows(pairs_user, pairs_item), [40, 30]).numpy()
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert np.std(expected) > 0.01  # random rows and weights: the pairs differ
    specs = [tf.TensorSpec([None], tf.int64)] * 2 + [tf.TensorSpec([None, None], tf.int32)]
    graph = tf.function(model.score_candidates).get_concrete_function(*specs).graph
    first_kernel = model.mlp[0].kernel.shape  # (2 x half, layer 1)
    products = [op for op in graph.get_operations() if op.type in ("MatMul", "BatchMatMulV2")]
    assert products and all(op.inputs[1].shape.as_list() != list(first_kernel) for op in products)


def test_a_sink_is_scored_by_the_protocol_before_it_trains():
    """Every event scored (``every=1``) against 1 negative, HR@1; the rows of users 1
    and 2 and items 100 and 200 are set by hand, user 3 is new: it is scored with the
    default row, then admitted by the training of its sink."""
    params = online_ncf.OnlineParams(**PARAMS, num_neg=1)
    keras.utils.set_random_seed(0)
    rec_model = online_ncf.build_rec_model(params)
    model = rec_model.network
    _hand_built(model)
    _admit(model.user_embedding, {1: (1.0, 1.0), 2: (0.0, 1.0)})
    _admit(model.item_embedding, {100: (1.0, -1.0), 200: (-1.0, -1.0)})
    events = [(1, 100, 0), (1, 200, 1), (2, 100, 2), (3, 200, 3)]
    users, items, times = (np.array(column, np.int64) for column in zip(*events, strict=True))
    batch = {constants.USER_COLUMN: users, constants.ITEM_COLUMN: items}
    batch[constants.TIME_COLUMN] = times
    protocol = prequential.Prequential(every=1, negatives=1, top_k=1)
    rec_model.online_train([batch], [evaluation.PrequentialEvaluation(protocol)], sink_size=1)
    # The negatives the protocol drew (a plan of the same events is the same plan):
    # event 1 has only item 100 before it, events 2 and 3 draw from [100, 200].
    plan = prequential.Prequential(every=1, negatives=1, top_k=1).plan(users, items, times)
    drawn = plan.candidates[:, 1].tolist()
    assert plan.positions.tolist() == [1, 2, 3] and drawn[0] == 100
    # Event 1: user 1 scores item 200 at -2 and item 100 at 0: a miss, AUC 0.
    # Event 2: user 2 scores items 100 and 200 alike (-1): a tie loses, AUC 1/2.
    # Event 3: the new user's default row scores every item 0: a tie, AUC 1/2.
    # A draw of the event's own item is no rival: then a hit, and no AUC.
    hits = [False, drawn[1] == 100, drawn[2] == 200]
    aucs = [0.0] + [0.5 for rival, own in zip(drawn[1:], (100, 200), strict=True) if rival != own]
    results = protocol.results()
    assert results["all"] == {
        "scored": 3,
        "hr": sum(hits) / 3,
        "ndcg": sum(hits) / 3,
        "auc": sum(aucs) / len(aucs),
    }
    assert _has_row(model.user_embedding, 3)  # admitted by the sink, after its scoring


def test_a_config_round_trip_builds_the_same_hash_tables():
    model = _model(permit_filter_value=2, evict_filter_value=3, max_norm=2.0)
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(model))
    assert type(clone) is online_ncf.OnlineNeuMF and clone.get_config() == model.get_config()
    for table, capacity in ((clone.user_embedding, 8), (clone.item_embedding, 16)):
        assert isinstance(table, HashEmbedding) and table.capacity == capacity
        assert (table.permit_filter_value, table.evict_filter_value, table.max_norm) == (2, 3, 2.0)
    assert model.get_config()["user_capacity"] == 8 and "num_users" not in model.get_config()


def test_new_rows_start_near_zero():
    """A new id's row starts within +-0.004 (`NEW_ROW_SCALE`), drawn: its noise must not
    swamp a cold user's ranking, which the item rows and the layers carry."""
    keras.utils.set_random_seed(0)
    model = online_ncf.build_online_model(online_ncf.OnlineParams(**PARAMS))
    for table, ids in ((model.user_embedding, range(1, 9)), (model.item_embedding, range(16))):
        slots = table.slots(tf.constant(list(ids), tf.int64), training=True).numpy()
        rows = table.embeddings.numpy()[slots]
        assert np.all(np.abs(rows) <= 0.004) and len(np.unique(rows)) == rows.size
        assert np.abs(rows).max() > 0.002


def test_bias_terms_add_each_ids_bias_to_the_logit_and_train():
    """A row's last column is its id's bias: user (1, 2 | bias 0.5) and item (3, -1 |
    bias -2) score 1 * 3 + 2 * -1 + 0.5 - 2 = -0.5 (the logit reads the GMF product
    only); a step on the event raises the item's bias (its gradient sigmoid - 1 < 0)."""
    params = online_ncf.OnlineParams(**PARAMS, bias_terms=True, num_neg=1)
    keras.utils.set_random_seed(0)
    rec_model = online_ncf.build_rec_model(params)
    model = rec_model.network
    _hand_built(model)
    assert model.user_embedding.embeddings.shape[1] == MF_DIM + MLP_HALF + 1
    for table, key, row in (
        (model.user_embedding, 1, [1.0, 2.0, 0.0, 0.0, 0.5]),
        (model.item_embedding, 10, [3.0, -1.0, 0.0, 0.0, -2.0]),
    ):
        slot = int(table.slots(tf.constant([key], tf.int64), training=True)[0])
        table.embeddings.scatter_nd_update([[slot]], [row])
    users, items = tf.constant([1], tf.int64), tf.constant([10], tf.int64)
    user, item = model.user_embedding(users), model.item_embedding(items)
    np.testing.assert_allclose(model.score_rows(user, item).numpy(), [-0.5], rtol=1e-6)
    batch = {constants.USER_COLUMN: np.array([1], np.int64)}
    batch |= {constants.ITEM_COLUMN: np.array([10], np.int64)}
    batch[constants.TIME_COLUMN] = np.array([0], np.int64)
    rec_model.online_train([batch], [], sink_size=1)
    assert model.item_embedding(items).numpy()[0, -1] > -2.0
