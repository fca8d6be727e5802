"""NeuMF: metrics on hand-computed cases, the network, loss masking, lazy Adam."""

from __future__ import annotations

import dataclasses
import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from official.core.runner import Mode, ModelState
from recommendation.data import constants
from recommendation.model import kernels, network, neumf_model, optimizers
from recommendation.model.hyperparams import ModelParams

LN2 = math.log(2)


class TextbookMetricsTest(parameterized.TestCase):
    """4 users, 3 items each, the held-out item (last column) at ranks 2, 1, 3, 3."""

    LOGITS = np.array([[3.0, 1.0, 2.0], [1.0, 2.0, 3.0], [2.0, 3.0, 1.0], [2.0, 3.0, 1.0]])

    @parameterized.named_parameters(
        ("k1", 1, 1 / 4, 1 / 4),
        ("k2", 2, 2 / 4, (1 + LN2 / math.log(3)) / 4),
        ("k3", 3, 1.0, (1 + LN2 / math.log(3) + 2 * LN2 / math.log(4)) / 4),
    )
    def test_hr_and_ndcg(self, k, hr, ndcg):
        hits, gains = neumf_model.compute_hr_ndcg(tf.constant(self.LOGITS), None, k)
        self.assertAlmostEqual(float(tf.reduce_mean(hits)), hr, places=6)
        self.assertAlmostEqual(float(tf.reduce_mean(gains)), ndcg, places=6)


class TieAndDuplicateTest(parameterized.TestCase):
    @parameterized.named_parameters(  # held-out item last
        ("positive_on_top", [[1.0, 2.0, 3.0]], None, 1, 1.0),
        ("positive_at_bottom", [[3.0, 2.0, 0.0]], None, 2, 0.0),
        ("ties_go_against_the_positive", [[2.0, 2.0, 2.0]], None, 2, 0.0),
        ("one_tie_ranks_second", [[2.0, 1.0, 2.0]], None, 2, 1.0),
        ("a_duplicate_counts_once", [[5.0, 5.0, 1.0, 4.0]], [[0, 1, 0, 0]], 2, 1.0),
        ("without_the_mask_it_counts_twice", [[5.0, 5.0, 1.0, 4.0]], None, 2, 0.0),
    )
    def test_hit(self, logits, mask, k, expected):
        mask = None if mask is None else tf.constant(np.array(mask, dtype=bool))
        hits, _ = neumf_model.compute_hr_ndcg(tf.constant(logits), mask, k)
        self.assertEqual(float(hits[0]), expected)


def _brute_force(logits: np.ndarray, mask: np.ndarray, k: int) -> tuple[float, float]:
    """Sort each block's distinct items by score, best first; equal scores keep their
    order, so the held-out item (last) ranks after the negatives it ties with."""
    hits, gains = [], []
    for row, row_mask in zip(logits, mask, strict=True):
        kept = [
            (score, index)
            for index, (score, masked) in enumerate(zip(row, row_mask, strict=True))
            if not masked
        ]
        order = sorted(kept, key=lambda pair: -pair[0])  # stable
        position = [index for _, index in order].index(len(row) - 1)
        hits.append(float(position < k))
        gains.append(LN2 / math.log(position + 2) if position < k else 0.0)
    return float(np.mean(hits)), float(np.mean(gains))


@pytest.mark.parametrize("k", [1, 5, 10])
def test_metrics_match_brute_force_with_ties_and_duplicates(k):
    rng = np.random.default_rng(k)
    logits = rng.integers(0, 6, (300, 21)).astype(np.float32)  # many ties
    mask = rng.random((300, 21)) < 0.2
    mask[:, -1] = False
    hits, gains = neumf_model.compute_hr_ndcg(tf.constant(logits), tf.constant(mask), k)
    hr, ndcg = _brute_force(logits, mask, k)
    assert float(tf.reduce_mean(hits)) == pytest.approx(hr, abs=1e-6)
    assert float(tf.reduce_mean(gains)) == pytest.approx(ndcg, abs=1e-6)


def _params(**overrides) -> ModelParams:
    values = dict(
        num_users=7, num_items=11, mf_dim=4, layers=(8, 6, 4), mlp_regularization=(0.0, 0.01, 0.0)
    )
    values.update(overrides)
    return ModelParams(**values)


def _features(users, items, valid=None):
    features = {
        constants.USER_COLUMN: tf.constant(users, tf.int32),
        constants.ITEM_COLUMN: tf.constant(items, tf.int32),
    }
    if valid is not None:
        features[constants.VALID_POINT_MASK] = tf.constant(valid)
    return features


def test_network_shape_follows_the_reference():
    model = network.build_model(_params())
    assert model.user_embedding.embeddings.shape == (7, 4 + 8 // 2)
    assert model.item_embedding.embeddings.shape == (11, 8)
    assert [layer.units for layer in model.mlp] == [6, 4]
    assert model.logit.kernel.shape == (4 + 4, 1)
    assert len(model.losses) == 1  # only mlp_1 has an L2 weight


def test_embedding_initialisers():
    params = _params(num_users=3000, num_items=1000)
    glorot = network.build_model(params).user_embedding.embeddings.numpy()
    limit = math.sqrt(6 / (3000 + 8))  # uniform on +-limit, fans of the whole table
    assert limit * 0.99 < np.abs(glorot).max() <= limit
    paper = dataclasses.replace(params, embedding_init="normal")
    normal = network.build_model(paper).user_embedding.embeddings.numpy()
    assert abs(normal.std() - 0.01) < 3e-4 and abs(normal.mean()) < 3e-4
    wide = dataclasses.replace(paper, embedding_stddev=0.1)
    normal = network.build_model(wide).user_embedding.embeddings.numpy()
    assert abs(normal.std() - 0.1) < 3e-3 and abs(normal.mean()) < 3e-3
    with pytest.raises(ValueError, match="embedding_init must be one of"):
        _params(embedding_init="zeros")
    with pytest.raises(ValueError, match="embedding_stddev must be a positive number"):
        _params(embedding_init="normal", embedding_stddev=0.0)
    with pytest.raises(ValueError, match="embedding_stddev is the spread of embedding_init normal"):
        _params(embedding_stddev=0.1)


def test_gmf_block_rejects_mismatched_widths():
    with pytest.raises(ValueError, match="user and item widths differ"):
        network.GmfBlock()(tf.zeros([2, 3]), tf.zeros([2, 4]))


def test_model_serialization_round_trip(tmp_path):
    model = network.build_model(_params(embedding_init="normal", embedding_stddev=0.1))
    features = _features([0, 3, 6], [1, 10, 5])
    path = str(tmp_path / "neumf.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_allclose(restored(features), model(features), rtol=1e-6)
    assert restored.layer_sizes == (8, 6, 4) and restored.mf_dim == 4
    assert (restored.embedding_init, restored.embedding_stddev) == ("normal", 0.1)


def test_given_tables_are_used_and_saved_with_the_model(tmp_path):
    width = network.NeuMF.table_width(4, (8, 6, 4))
    users = keras.layers.Embedding(3, width, embeddings_initializer="ones", name="embedding_user")
    items = keras.layers.Embedding(5, width, name="embedding_item")
    model = network.NeuMF(
        mf_dim=4,
        layers=(8, 6, 4),
        mlp_regularization=(0.0, 0.0, 0.0),
        user_embedding=users,
        item_embedding=items,
    )
    # A batch larger than the tables: tables made by NeuMF would be projected first.
    features = _features([0, 2, 1, 0, 2, 1], [4, 0, 3, 1, 2, 4])
    logits = model(features)
    assert model.user_embedding is users and model.item_embedding is items
    expected = model.score(
        users(features[constants.USER_COLUMN]), items(features[constants.ITEM_COLUMN])
    )
    np.testing.assert_allclose(logits, expected, rtol=1e-6)
    path = str(tmp_path / "given.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_allclose(restored(features), logits, rtol=1e-6)
    assert restored.user_embedding.get_config() == users.get_config()
    assert (restored.num_users, restored.item_embedding.input_dim) == (None, 5)


def test_each_table_is_sized_or_given_exactly_once():
    sizes = dict(mf_dim=4, layers=(8, 4), mlp_regularization=(0.0, 0.0))
    with pytest.raises(ValueError, match="give num_users or user_embedding"):
        network.NeuMF(num_items=5, **sizes)  # neither
    with pytest.raises(ValueError, match="give num_items or item_embedding"):
        network.NeuMF(3, 5, item_embedding=keras.layers.Embedding(5, 8), **sizes)  # both


def test_padding_never_reaches_the_loss():
    params = _params(mlp_regularization=(0.0, 0.0, 0.0))
    state = neumf_model.build_state(params)
    model = state.model
    features = _features([1, 2, 3, 4], [1, 2, 3, 4])
    logits = model(features)[:, 0].numpy()
    labels = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
    expected = np.mean(np.logaddexp(0, logits[:2]) - labels[:2] * logits[:2])
    valid = [True, True, False, False]
    for padded_labels in ([1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0]):
        weights = [w.numpy().copy() for w in model.trainable_variables]
        spec = neumf_model.model_fn(
            _features([1, 2, 3, 4], [1, 2, 3, 4], valid),
            tf.constant(padded_labels),
            Mode.TRAIN,
            params,
            state,
        )
        assert float(spec.loss) == pytest.approx(expected, rel=1e-5)
        for variable, value in zip(model.trainable_variables, weights, strict=True):
            variable.assign(value)  # undo the step so both runs start equal


@pytest.mark.parametrize("kind", ["neumf", "mf"])
def test_row_regularization_weighs_the_rows_of_each_valid_point(kind):
    """loss = mean cross-entropy + lambda x mean(|user row|^2 + |item row|^2) over the
    valid points: user 1's row counts twice (two points), the padding point's rows not
    at all."""
    strength = 0.25
    params = _params(mlp_regularization=(0.0, 0.0, 0.0), row_regularization=strength)
    params = dataclasses.replace(params, model_kind=kind)
    state = neumf_model.build_state(params)
    model = state.model
    users, items = [1, 1, 3, 6], [2, 0, 3, 10]
    logits = model(_features(users, items))[:, 0].numpy().astype(np.float64)
    labels = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
    user_rows, item_rows = (
        table.embeddings.numpy().astype(np.float64)
        for table in (model.user_embedding, model.item_embedding)
    )
    norms = [
        (user_rows[u] ** 2).sum() + (item_rows[i] ** 2).sum()
        for u, i in zip(users, items, strict=True)
    ]
    cross_entropy = np.logaddexp(0, logits) - labels * logits
    expected = cross_entropy[:3].mean() + strength * np.mean(norms[:3])
    spec = neumf_model.model_fn(
        _features(users, items, [True, True, True, False]),
        tf.constant(labels),
        Mode.TRAIN,
        params,
        state,
    )
    assert float(spec.loss) == pytest.approx(expected, rel=1e-5)
    # The summary's loss stays the cross-entropy alone.
    summary = spec.summarize({key: float(value) for key, value in spec.metrics.items()})
    assert summary["loss"] == pytest.approx(cross_entropy[:3].mean(), rel=1e-5)


def _model_scoring_item_ids(params: ModelParams) -> network.NeuMF:
    """NeuMF whose logit for (any user, item i) is exactly i: no hidden MLP layer, and
    the output weighs only the item's MLP half, which holds the item id."""
    model = network.build_model(params)
    width = params.mf_dim + params.layers[0] // 2
    items = np.zeros((params.num_items, width), np.float32)
    items[:, -1] = np.arange(params.num_items)
    model.item_embedding.embeddings.assign(items)
    kernel = np.zeros((params.mf_dim + params.layers[0], 1), np.float32)
    kernel[-1] = 1.0
    model.logit.kernel.assign(kernel)
    model.logit.bias.assign([0.0])
    return model


def test_eval_spec_counts_duplicates_once_and_skips_padding_users():
    """Exact HR@2/NDCG@2 sums from model_fn on one flattened batch of four blocks,
    held-out item last, scored by item id:

    - user 0, [5, 5, 5, 1 | 4], two repeats of 5 masked: rank 1 (3 without the mask);
    - user 1, [1, 2, 2, 0 | 3]: rank 0;
    - user 2, [6, 7, 6, 1 | 2], the second 6 masked: rank 2, a miss;
    - user 3, padding (item 0, all masked, invalid): would be a hit if counted.
    """
    params = _params(
        num_users=4,
        num_items=8,
        mf_dim=1,
        layers=(2,),
        mlp_regularization=(0.0,),
        top_k=2,
        eval_block_size=5,
    )
    model = _model_scoring_item_ids(params)
    items = [5, 5, 5, 1, 4, 1, 2, 2, 0, 3, 6, 7, 6, 1, 2, 0, 0, 0, 0, 0]
    duplicates = [0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1, 1, 1]
    features = _features(np.repeat([0, 1, 2, 3], 5), items, np.repeat([1, 1, 1, 0], 5) == 1)
    features[constants.DUPLICATE_MASK] = tf.constant(np.array(duplicates) == 1)
    np.testing.assert_array_equal(model(features)[:, 0], items)  # the scores are as stated
    spec = neumf_model.model_fn(features, None, Mode.EVAL, params, ModelState(model))
    metrics = {key: float(value) for key, value in spec.metrics.items()}
    assert metrics == pytest.approx(
        {"hits": 2.0, "ndcg": LN2 / math.log(1 + 2) + 1.0, "num_users": 3.0}, abs=1e-6
    )


def test_the_train_summary_is_the_mean_loss_of_the_valid_points():
    params = _params(mlp_regularization=(0.0, 0.0, 0.0))
    state = neumf_model.build_state(params)
    features = _features([1, 2, 3, 4], [1, 2, 3, 4], [True, True, True, False])
    spec = neumf_model.model_fn(
        features, tf.constant([1.0, 0.0, 1.0, 1.0]), Mode.TRAIN, params, state
    )
    summary = spec.summarize({key: float(value) for key, value in spec.metrics.items()})
    assert summary == {"loss": pytest.approx(float(spec.loss), rel=1e-6), "num_points": 3.0}
    assert spec.summarize({"loss_sum": 0.0, "num_points": 0.0}) == {"loss": 0.0, "num_points": 0.0}


@pytest.mark.parametrize(
    "totals,summary",
    [
        ({"hits": 3.0, "ndcg": 1.5, "num_users": 4.0}, {"hr": 0.75, "ndcg": 0.375}),
        ({"hits": 0.0, "ndcg": 0.0, "num_users": 0.0}, {"hr": 0.0, "ndcg": 0.0}),  # no users
    ],
)
def test_the_eval_summary_is_hr_and_ndcg_per_real_user(totals, summary):
    params = _params(num_items=8, eval_block_size=4)
    features = _features([0] * 4, [0, 1, 2, 3], [True] * 4)
    features[constants.DUPLICATE_MASK] = tf.zeros([4], tf.bool)
    state = ModelState(network.build_model(params))
    spec = neumf_model.model_fn(features, None, Mode.EVAL, params, state)
    assert spec.summarize(totals) == {**summary, "num_users": totals["num_users"]}


def test_predict_gives_probabilities():
    params = _params()
    state = ModelState(network.build_model(params))
    spec = neumf_model.model_fn(_features([0, 1], [2, 3]), None, Mode.PREDICT, params, state)
    np.testing.assert_allclose(
        spec.predictions["scores"], tf.sigmoid(spec.predictions["logits"]), rtol=1e-6
    )


def _two_steps(sparse: bool):
    params = _params(sparse_updates=sparse, mlp_regularization=(0.0, 0.0, 0.0))
    keras.utils.set_random_seed(0)
    state = neumf_model.build_state(params)
    table = state.model.user_embedding.embeddings
    initial = table.numpy().copy()
    for users in ([1, 2], [3, 3]):  # user 1 and 2 only in the first step
        neumf_model.model_fn(
            _features(users, [0, 1], [True, True]),
            tf.constant([1.0, 0.0]),
            Mode.TRAIN,
            params,
            state,
        )
    return initial, table.numpy(), state


def test_lazy_adam_leaves_rows_outside_the_batch_alone():
    initial, after, _ = _two_steps(sparse=True)
    dense_initial, dense_after, _ = _two_steps(sparse=False)
    np.testing.assert_array_equal(initial, dense_initial)
    changed = np.flatnonzero(np.any(after != initial, axis=1)).tolist()
    assert changed == [1, 2, 3]
    # Dense Adam keeps moving rows 1 and 2 in step two with their momentum; lazy does not.
    lazy_rows_after_step_one = after[[1, 2]]
    assert not np.allclose(dense_after[[1, 2]], lazy_rows_after_step_one)


def test_lazy_adam_step_matches_the_formula():
    params = _params(sparse_updates=True, mlp_regularization=(0.0, 0.0, 0.0))
    optimizer = optimizers.build_optimizer(params)
    table = keras.Variable(np.ones((4, 2), np.float32))
    optimizer.build([table])
    gradient = tf.IndexedSlices(
        tf.constant([[0.5, -1.0], [0.5, 1.0]]), tf.constant([2, 2]), tf.constant([4, 2])
    )
    optimizer.apply([gradient], [table])
    g = np.array([1.0, 0.0])  # the two slices of row 2 summed
    m, v = 0.1 * g, 0.001 * g**2
    alpha = 0.001 * math.sqrt(1 - 0.999) / (1 - 0.9)
    expected = np.ones((4, 2))
    expected[2] -= alpha * m / (np.sqrt(v) + 1e-8)
    np.testing.assert_allclose(table.numpy(), expected, rtol=1e-5)


def test_rowwise_adagrad_rows_follow_the_formula_on_hand_computed_rows():
    variable = tf.Variable([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    accumulator = tf.Variable([[0.0], [0.5], [0.0]])
    gradient = tf.IndexedSlices(
        tf.constant([[0.5, 0.5], [0.5, -0.5], [1.0, 2.0]]), tf.constant([1, 1, 2])
    )
    optimizers.rowwise_adagrad_rows(gradient, variable, accumulator, 0.1, 1e-8)
    # Row 1: gradient (1, 0), accumulator 0.5 + 0.5; row 2: (1, 2), 0 + 2.5; row 0 kept.
    np.testing.assert_allclose(accumulator.numpy()[:, 0], [0.0, 1.0, 2.5], rtol=1e-6)
    expected = [[1.0, 2.0], [3.0 - 0.1, 4.0], [5.0 - 0.1 / 2.5**0.5, 6.0 - 0.2 / 2.5**0.5]]
    np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-6)


def test_lazy_adam_rows_read_and_write_each_row_once_with_the_formulas_values():
    """A table's rows and moments: each distinct row read once and written once by
    copy (no scatter that adds or subtracts, a kernel per row), to the hand-computed
    Adam step; rows outside the gradient untouched."""
    table = tf.Variable(np.ones((4, 2), np.float32))
    momentum = tf.Variable(np.full((4, 2), 0.5, np.float32))
    velocity = tf.Variable(np.full((4, 2), 0.25, np.float32))
    gradient = tf.IndexedSlices(
        tf.constant([[0.5, -1.0], [1.0, 2.0], [0.5, 1.0]]), tf.constant([2, 0, 2])
    )

    @tf.function(autograph=False)
    def step():
        optimizers.lazy_adam_rows(
            gradient,
            table,
            momentum,
            velocity,
            tf.constant(0.1),
            0.9,
            0.999,
            1e-8,
            tf.constant(3.0),
        )

    ops = [op.type for op in step.get_concrete_function().graph.get_operations()]
    assert ops.count("ResourceGather") == 3 and ops.count("ResourceScatterUpdate") == 3
    assert not [op for op in ops if op.startswith("ResourceScatter") and "Update" not in op]
    step()
    alpha = 0.1 * math.sqrt(1 - 0.999**3) / (1 - 0.9**3)
    expected = np.ones((4, 2))
    for row, g in ((2, np.array([1.0, 0.0])), (0, np.array([1.0, 2.0]))):
        m, v = 0.9 * 0.5 + 0.1 * g, 0.999 * 0.25 + 0.001 * g**2
        expected[row] -= alpha * m / (np.sqrt(v) + 1e-8)
        np.testing.assert_allclose(momentum.numpy()[row], m, rtol=1e-6)
        np.testing.assert_allclose(velocity.numpy()[row], v, rtol=1e-6)
    np.testing.assert_allclose(table.numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("traced", ["eager", "entries known", "entries unknown"])
def test_summed_rows_sum_each_distinct_row_once_and_leave_negative_indices_out(traced, monkeypatch):
    """A lazy rule's input: distinct rows in order of first appearance with their
    summed gradients, marked rows (-1) left out, the same in every way it runs; traced,
    the sum is one XLA-compiled scatter into as many rows as there are entries, or into
    their padded size where the step learns their count only when it runs (a
    compilation per padded size, not per count)."""
    monkeypatch.setattr(kernels, "COMPILE_MIN_ELEMENTS", 0)  # compile this small one
    values = tf.constant([[1.0, 2.0], [9.0, 9.0], [0.5, 0.5], [3.0, -1.0], [7.0, 7.0]])
    indices = tf.constant([3, -1, 1, 3, -1], tf.int64)

    def rows_and_sums(values, indices):
        return kernels.summed_rows(tf.IndexedSlices(values, indices))

    specs = [tf.TensorSpec([None, 2]), tf.TensorSpec([None], tf.int64)]
    run = {
        "eager": rows_and_sums,
        "entries known": tf.function(rows_and_sums),
        "entries unknown": tf.function(rows_and_sums, input_signature=specs),
    }[traced]
    rows, sums = run(values, indices)
    np.testing.assert_array_equal(rows, [3, 1])
    np.testing.assert_array_equal(sums, [[4.0, 1.0], [0.5, 0.5]])
    if traced != "eager":
        graph_def = run.get_concrete_function(values, indices).graph.as_graph_def()
        nodes = [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]
        assert [n for n in nodes if n.attr["_XlaMustCompile"].b]


def test_padded_sizes_are_four_an_octave_and_at_most_a_quarter_more():
    counts = [0, 1, 4, 5, 9, 4096, 4097, 5000, 20480, 20481]
    sizes = [int(kernels.padded_size(tf.constant(n))) for n in counts]
    assert sizes == [0, 1, 4, 5, 10, 4096, 5120, 5120, 20480, 24576]


def test_sgd_rows_read_and_write_each_row_once():
    table = tf.Variable([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    gradient = tf.IndexedSlices(tf.constant([[1.0, 2.0], [1.0, 0.0], [5.0, 5.0]]), [2, 2, -1])

    @tf.function(autograph=False)
    def step():
        optimizers.sgd_rows(gradient, table, tf.constant(0.5))

    ops = [op.type for op in step.get_concrete_function().graph.get_operations()]
    assert ops.count("ResourceGather") == 1 and ops.count("ResourceScatterUpdate") == 1
    assert not [op for op in ops if op.startswith("ResourceScatter") and "Update" not in op]
    step()
    np.testing.assert_allclose(table.numpy(), [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]])


def test_epoch_decay_holds_then_shrinks_once_per_epoch():
    params = _params(
        learning_rate=0.8, learning_rate_decay=0.5, decay_start_epoch=2, steps_per_epoch=3
    )
    rates = [
        float(optimizers.decayed_learning_rate(params, tf.constant(step, tf.int64)))
        for step in range(12)
    ]
    np.testing.assert_allclose(rates, [0.8] * 6 + [0.4] * 3 + [0.2] * 3, rtol=1e-6)
    with pytest.raises(ValueError, match="steps_per_epoch must be positive, got 0"):
        optimizers.decayed_learning_rate(
            dataclasses.replace(params, steps_per_epoch=0), tf.constant(0, tf.int64)
        )


@pytest.mark.parametrize("sparse", [False, True])
def test_optimizer_steps_at_the_decayed_rate(sparse):
    params = _params(
        sparse_updates=sparse, learning_rate_decay=0.1, decay_start_epoch=1, steps_per_epoch=2
    )
    optimizer = optimizers.build_optimizer(params)
    table = keras.Variable(np.zeros((1, 1), np.float32))
    optimizer.build([table])
    optimizer.iterations.assign(1)  # the last step of epoch 0
    optimizers.set_learning_rate(optimizer, params)
    assert float(optimizer.learning_rate) == pytest.approx(0.001)
    optimizer.iterations.assign(2)  # the first step of epoch 1
    optimizers.set_learning_rate(optimizer, params)
    optimizer.apply([tf.constant([[1.0]])], [table])
    # Adam's update for step 3 (iterations 2) with fresh moments, at rate 0.001 * 0.1.
    beta1, beta2 = 0.9, 0.999
    m, v = 1 - beta1, 1 - beta2
    alpha = 0.0001 * math.sqrt(1 - beta2**3) / (1 - beta1**3)
    np.testing.assert_allclose(table.numpy(), [[-alpha * m / (math.sqrt(v) + 1e-8)]], rtol=1e-5)
    assert float(optimizer.learning_rate) == pytest.approx(0.0001)


def test_weight_decay_shrinks_weights_by_rate_times_learning_rate():
    optimizer = optimizers.build_optimizer(_params(weight_decay=0.5))
    table = keras.Variable(np.full((2, 2), 3.0, np.float32))
    optimizer.build([table])
    optimizer.apply([tf.zeros([2, 2])], [table])  # a zero gradient: Adam itself moves nothing
    np.testing.assert_allclose(table.numpy(), 3.0 * (1 - 0.5 * 0.001), rtol=1e-6)
    with pytest.raises(ValueError, match="weight_decay shrinks every embedding row"):
        _params(weight_decay=0.5, sparse_updates=True)


def test_table_side_first_layer_is_the_same_function():
    """The fast path (first MLP layer applied to the tables) equals the direct one."""
    params = _params(num_users=5, num_items=6)  # 11 table rows < 2 x batch of 40
    model = network.build_model(params)
    rng = np.random.default_rng(0)
    features = _features(rng.integers(0, 5, 40), rng.integers(0, 6, 40))
    labels = tf.constant(rng.integers(0, 2, 40), tf.float32)

    def loss_and_gradients(fast: bool):
        model._project_tables_first = lambda batch_size: fast
        with tf.GradientTape() as tape:
            logits = model(features)[:, 0]
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))
        gradients = tape.gradient(loss, model.trainable_variables)
        return logits, [tf.convert_to_tensor(g) for g in gradients]

    fast_logits, fast_gradients = loss_and_gradients(True)
    direct_logits, direct_gradients = loss_and_gradients(False)
    np.testing.assert_allclose(fast_logits, direct_logits, rtol=1e-5, atol=1e-6)
    for fast, direct in zip(fast_gradients, direct_gradients, strict=True):
        np.testing.assert_allclose(fast, direct, rtol=1e-4, atol=1e-6)
    del model._project_tables_first
    assert model._project_tables_first(40) and not model._project_tables_first(5)


def _table_side_gradient_graph():
    """(model, the traced graph of its gradients) on a batch of 40 over 12 table rows,
    so that the first layer is applied to the tables."""
    params = _params(num_users=5, num_items=7)  # 12 table rows < 2 x batch of 40
    model = network.build_model(params)
    rng = np.random.default_rng(0)
    features = _features(rng.integers(0, 5, 40), rng.integers(0, 7, 40))

    @tf.function
    def gradients():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(features))
        return tape.gradient(loss, model.trainable_variables)

    return model, gradients.get_concrete_function().graph


def test_the_table_side_step_sums_and_cuts_tables_not_batches():
    """With the first layer on the tables, its bias gradient is a sum over the user
    table's rows (the bias joins the user term), not over the batch, and each table is
    split once into its GMF and MLP columns (gradient: one concatenation), not sliced
    twice (two zero-filled table-sized gradients and their sum)."""
    model, graph = _table_side_gradient_graph()
    first_width = model.mlp[0].units
    summed = [tuple(op.inputs[0].shape) for op in graph.get_operations() if op.type == "Sum"]
    assert (5, first_width) in summed and (40, first_width) not in summed, summed
    tables = {
        tuple(model.user_embedding.embeddings.shape),
        tuple(model.item_embedding.embeddings.shape),
    }
    slice_gradients = [
        tuple(op.outputs[0].shape) for op in graph.get_operations() if op.type == "StridedSliceGrad"
    ]
    assert not tables & set(slice_gradients), slice_gradients


def test_the_table_side_first_layer_is_one_compiled_loop_each_way(monkeypatch):
    """Its gathers, sum and ReLU (and ReLU's gradient and the scatters) run in XLA-compiled
    calls, not as TensorFlow ops each writing a batch x first-width tensor."""
    monkeypatch.setattr(kernels, "COMPILE_MIN_ELEMENTS", 0)  # compile this small one
    model, graph = _table_side_gradient_graph()
    operations = graph.get_operations()
    batch_wide = (40, model.mlp[0].units)
    written = [op for op in operations if any(out.shape == batch_wide for out in op.outputs)]
    compiled = [op for op in written if op.type.endswith("PartitionedCall")]
    assert all(op.get_attr("_XlaMustCompile") for op in compiled) and compiled
    # Besides: the next layer's input gradient, and a custom gradient's pass-through.
    others = {op.type for op in written} - {compiled[0].type}
    assert others == {"MatMul", "Identity", "IdentityN"}, others


def test_a_checkpoint_of_the_model_alone_holds_every_weight(tmp_path):
    """`tf.train.Checkpoint(model=...)` without the optimizer restores the MLP too
    (Keras' list of layers is invisible to TensorFlow's object graph)."""
    params = _params()
    trained, fresh = network.build_model(params), network.build_model(params)
    for variable in trained.weights:
        variable.assign(variable + 0.5)
    path = tf.train.Checkpoint(model=trained).save(str(tmp_path / "model"))
    tf.train.Checkpoint(model=fresh).restore(path).assert_consumed()
    for saved, restored in zip(trained.weights, fresh.weights, strict=True):
        np.testing.assert_array_equal(restored, saved, err_msg=saved.path)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "in_a_graph_by_xla"])
def test_dense_row_gradients_are_tensorflows_own_bit_for_bit(traced, monkeypatch):
    """The scatter that densifies gather gradients (dense Adam's tables, the projected
    first-layer terms) gives TensorFlow's UnsortedSegmentSum bits, repeated ids included,
    run op by op (eagerly) or compiled (in a traced step)."""
    monkeypatch.setattr(kernels, "COMPILE_MIN_ELEMENTS", 0)  # compile this small one
    rng = np.random.default_rng(0)
    table = tf.constant(rng.normal(size=(7, 5)), tf.float32)
    ids = tf.constant(rng.integers(0, 7, 300), tf.int32)  # each row about 43 times
    upstream = tf.constant(rng.normal(size=(300, 5)), tf.float32)

    def rows_and_gradients(table, ids, upstream):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(table)
            ours, theirs = kernels.take_rows(table, ids), tf.gather(table, ids)
        sparse = tape.gradient(theirs, table, output_gradients=upstream)
        assert isinstance(sparse, tf.IndexedSlices)
        dense = tape.gradient(ours, table, output_gradients=upstream)
        assert not isinstance(dense, tf.IndexedSlices)
        expected = tf.convert_to_tensor(sparse)
        return ours, theirs, expected, kernels.dense_gradient(sparse), dense

    run = tf.function(rows_and_gradients) if traced else rows_and_gradients
    ours, theirs, expected, densified, dense = run(table, ids, upstream)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(densified, expected)
    np.testing.assert_array_equal(dense, expected)


def test_small_steps_compile_nothing():
    """Below `COMPILE_MIN_ELEMENTS` the loops run as TensorFlow ops: a compilation per
    shape (40-80 ms) would cost more than such a step saves (and slowed the suite)."""

    @tf.function
    def gradient(table, ids):
        with tf.GradientTape() as tape:
            tape.watch(table)
            rows = kernels.take_rows(table, ids)
        return tape.gradient(rows, table, output_gradients=tf.ones_like(rows))

    graph = gradient.get_concrete_function(
        tf.TensorSpec((7, 5)), tf.TensorSpec((300,), tf.int32)
    ).graph
    calls = [op for op in graph.get_operations() if op.type.endswith("PartitionedCall")]
    assert not [op for op in calls if op.get_attr("_XlaMustCompile")]


def test_steps_run_eagerly_compile_nothing(monkeypatch):
    """``--run_eagerly`` runs the step op by op: the compiled scatter is not traced."""
    monkeypatch.setattr(kernels, "COMPILE_MIN_ELEMENTS", 0)  # however large
    scatter = kernels._compiled_scatter_rows
    compiled = getattr(scatter, "compiled", scatter)  # the XLA-compiled tf.function
    traces = compiled.experimental_get_tracing_count()
    table = tf.zeros((11, 3))
    with tf.GradientTape() as tape:
        tape.watch(table)
        rows = kernels.take_rows(table, tf.constant([1, 1, 4]))
    tape.gradient(rows, table, output_gradients=tf.ones((3, 3)))
    assert compiled.experimental_get_tracing_count() == traces


def test_dense_row_gradients_of_known_tables_are_compiled_by_xla(monkeypatch):
    """A table whose row count the step knows gets its gather gradient from one
    XLA-compiled scatter (4x TensorFlow's kernel at the MLPerf size), not from a
    TensorFlow scatter run op by op; a count known only when it runs (LazyAdam's unique
    rows) keeps TensorFlow's kernel rather than a compilation per count."""
    monkeypatch.setattr(kernels, "COMPILE_MIN_ELEMENTS", 0)  # compile this small one

    @tf.function
    def gradients(table, ids, upstream):
        with tf.GradientTape() as tape:
            tape.watch(table)
            rows = kernels.take_rows(table, ids)
        unique, positions = tf.unique(ids)  # as LazyAdam densifies
        shape = tf.stack([tf.size(unique, tf.int64), 5])
        unknown_rows = tf.IndexedSlices(upstream, positions, shape)
        return tape.gradient(rows, table, upstream), kernels.dense_gradient(unknown_rows)

    specs = (tf.TensorSpec((7, 5)), tf.TensorSpec((300,), tf.int32), tf.TensorSpec((300, 5)))
    graph = gradients.get_concrete_function(*specs).graph
    calls = [op for op in graph.get_operations() if op.type.endswith("PartitionedCall")]
    compiled = [op for op in calls if op.get_attr("_XlaMustCompile")]
    assert len(compiled) == 1, [op.type for op in graph.get_operations()]
    scatters = [op.type for op in graph.get_operations() if "Scatter" in op.type]
    assert scatters == ["TensorScatterAdd"]  # the unknown count's, outside XLA


@pytest.mark.parametrize(
    "layers", [(8, 6, 4), (8,)], ids=["with_mlp_layers", "embedding_concatenation_only"]
)
def test_scoring_all_items_equals_scoring_each_pair(layers):
    params = _params(layers=layers, mlp_regularization=(0.0,) * len(layers))
    model = network.build_model(params)
    users = np.array([6, 0, 3, 3])
    logits = model.score_all_items(tf.constant(users, tf.int32)).numpy()
    pairs = _features(np.repeat(users, 11), np.tile(np.arange(11), len(users)))
    expected = model(pairs)[:, 0].numpy().reshape(len(users), 11)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "num_items, layers",
    [(11, (8, 6, 4)), (400, (8, 6, 4)), (11, (8,))],
    ids=["item_table_projected", "item_rows_projected", "embedding_concatenation_only"],
)
def test_scoring_blocks_equals_scoring_each_pair(num_items, layers):
    """Evaluation's block scoring is `call` on the flattened pairs, whether the item
    table (11 rows < 12 points) or the looked-up rows (400 > 12) are projected."""
    params = _params(num_items=num_items, layers=layers, mlp_regularization=(0.0,) * len(layers))
    model = network.build_model(params)
    rng = np.random.default_rng(3)
    users, items = np.array([6, 0, 3]), rng.integers(0, num_items, (3, 4))
    logits = model.score_blocks(tf.constant(users, tf.int32), tf.constant(items, tf.int32))
    expected = model(_features(np.repeat(users, 4), items.reshape(-1)))[:, 0]
    np.testing.assert_allclose(logits, tf.reshape(expected, [3, 4]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_steps_keep_float32_variables(dtype):
    params = _params(dtype=dtype, mlp_regularization=(0.0, 0.0, 0.0))
    try:
        state = neumf_model.build_state(params)
        assert state.model.user_embedding.embeddings.dtype == "float32"
        assert state.model.compute_dtype == {"bf16": "bfloat16", "fp16": "float16"}[dtype]
        before = state.model.logit.kernel.numpy().copy()
        spec = neumf_model.model_fn(
            _features([1, 2], [3, 4], [True, True]),
            tf.constant([1.0, 0.0]),
            Mode.TRAIN,
            params,
            state,
        )
        assert np.isfinite(float(spec.loss))
        assert not np.array_equal(before, state.model.logit.kernel.numpy())
        if dtype == "fp16":
            assert isinstance(state.optimizer, keras.optimizers.LossScaleOptimizer)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("sparse", [False, True])
def test_a_fixed_fp16_loss_scale_is_applied_every_step_without_skipping(sparse):
    # 2**40 overflows float16 gradients: a fixed scale applies the overflow (the
    # weights turn non-finite); dynamic scaling would skip such a step.
    results = {}
    for loss_scale in (None, 2.0**40, 128.0):
        params = _params(
            dtype="fp16",
            loss_scale=loss_scale,
            sparse_updates=sparse,
            mlp_regularization=(0.0, 0.0, 0.0),
        )
        try:
            state = neumf_model.build_state(params)
            before = [w.numpy().copy() for w in state.model.weights]
            neumf_model.model_fn(
                _features([1, 2], [3, 4], [True, True]),
                tf.constant([1.0, 0.0]),
                Mode.TRAIN,
                params,
                state,
            )
            after = [w.numpy() for w in state.model.weights]
        finally:
            keras.mixed_precision.set_global_policy("float32")
        results[loss_scale] = before, after, state.optimizer
    before, after, optimizer = results[None]
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert all(np.isfinite(a).all() for a in after)
    before, after, optimizer = results[2.0**40]
    assert not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert not all(np.isfinite(a).all() for a in after)
    before, after, _ = results[128.0]
    assert all(np.isfinite(a).all() for a in after)
    user_rows = after[0]  # the user table: rows 1 and 2 trained, the others untouched
    assert not np.array_equal(before[0][[1, 2]], user_rows[[1, 2]])
    if sparse:
        np.testing.assert_array_equal(before[0][[0, 3, 4, 5, 6]], user_rows[[0, 3, 4, 5, 6]])
