"""NeuMF's Estimator-style contract: `model_fn` (TRAIN and EVAL specs for the runner),
its loss, HR/NDCG, the reduction of its metric sums, and `build_state`.

The network is `network.NeuMF`, its hyper-parameters `hyperparams.ModelParams`, its
optimisers `optimizers`. This package holds numerics only: no flags, no files, no
logging.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from official.core.runner import Mode, ModelSpec, ModelState
from recommendation.data import constants
from recommendation.model import hyperparams, kernels, network, optimizers


def build_state(params: hyperparams.ModelParams) -> ModelState:
    """The model and optimiser a `Runner` trains (its ``build_state``)."""
    return ModelState(network.build_model(params), optimizers.build_optimizer(params))


def weighted_sigmoid_cross_entropy(
    logits: tf.Tensor, labels: tf.Tensor, valid: tf.Tensor
) -> tf.Tensor:
    """Sum of per-point sigmoid cross-entropy over valid points.

    The reference's softmax over ``[0, logit]`` is the same function:
    ``softmax([0, z])[1] = sigmoid(z)``.
    """
    losses = tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
    return tf.reduce_sum(losses * tf.cast(valid, losses.dtype))


def compute_hr_ndcg(
    logits: tf.Tensor, duplicate_mask: tf.Tensor | None, k: int
) -> tuple[tf.Tensor, tf.Tensor]:
    """Per-user hit (HR@k) and NDCG@k for blocks whose last item is the held-out one.

    The held-out item's rank is the number of other, non-duplicate items scoring at
    least as high: it sits last in its block and loses ties, as in the reference
    (whose stable descending sort puts equal scores at lower positions first).
    Duplicates count once. Example: scores ``[3, 5, 5, 1, 5]`` (held-out last, no
    duplicates) give rank 3, so HR@3 = 0, HR@4 = 1, NDCG@4 = log(2) / log(5).

    Args:
        logits: `(users, block)` scores.
        duplicate_mask: `(users, block)` bool, True for repeats; None for none.
        k: Cut-off.
    Returns:
        `(users,)` float32 hits and NDCGs.
    """
    logits = tf.cast(logits, tf.float32)
    positive = logits[:, -1:]
    beats = logits[:, :-1] >= positive
    if duplicate_mask is not None:
        beats = beats & ~duplicate_mask[:, :-1]
    rank = tf.reduce_sum(tf.cast(beats, tf.int32), axis=1)
    hit = tf.cast(rank < k, tf.float32)
    ndcg = hit * tf.math.log(2.0) / tf.math.log(tf.cast(rank, tf.float32) + 2.0)
    return hit, ndcg


def model_fn(
    features: dict,
    labels: tf.Tensor | None,
    mode: Mode,
    params: hyperparams.ModelParams,
    state: ModelState,
) -> ModelSpec:
    """Builds the TRAIN, EVAL or PREDICT computation for one replica's batch.

    Args:
        features: ``user_id``, ``item_id`` and ``valid_point_mask`` (TRAIN, EVAL),
            ``duplicate_mask`` (EVAL: blocks of evaluation items, held-out last).
        labels: `(batch,)` float 0/1 (TRAIN only).
        mode: What to build.
        params: Hyper-parameters.
        state: The model and optimiser whose variables are used.
    """
    if mode == Mode.PREDICT:
        logits = tf.cast(state.model(features, training=False)[:, 0], tf.float32)
        return ModelSpec(mode, predictions={"logits": logits, "scores": tf.sigmoid(logits)})
    if mode == Mode.EVAL:
        return _eval_spec(features, params, state)
    return _train_spec(features, labels, params, state)


def _train_spec(features, labels, params: hyperparams.ModelParams, state: ModelState) -> ModelSpec:
    valid = features[constants.VALID_POINT_MASK]
    context = tf.distribute.get_replica_context()
    num_valid = tf.reduce_sum(tf.cast(valid, tf.float32))
    global_valid = context.all_reduce(tf.distribute.ReduceOp.SUM, num_valid)
    model, optimizer = state.model, state.optimizer
    with tf.GradientTape() as tape:
        logits = tf.cast(model(features, training=True)[:, 0], tf.float32)
        loss_sum = weighted_sigmoid_cross_entropy(logits, labels, valid)
        loss = loss_sum / tf.maximum(global_valid, 1.0)
        if params.row_regularization:
            norms = model.squared_row_norms(features) * tf.cast(valid, tf.float32)
            loss += params.row_regularization * tf.reduce_sum(norms) / tf.maximum(global_valid, 1.0)
        if model.losses:
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        if params.loss_scale is None:
            scaled = optimizer.scale_loss(loss)  # identity unless dynamic fp16 scaling
        else:
            scaled = loss * params.loss_scale
    variables = model.trainable_variables
    gradients = tape.gradient(scaled, variables)
    if params.loss_scale is not None:
        # Keras' own fixed scale (`loss_scale_factor`) cannot unscale the sparse
        # (IndexedSlices) gradients of the embedding tables; keras.ops keeps them sparse.
        gradients = [keras.ops.divide(g, params.loss_scale) for g in gradients]
    if not params.sparse_updates:
        # MLPerf's reference applies dense Adam to whole embedding tables.
        gradients = [
            kernels.dense_gradient(g) if isinstance(g, tf.IndexedSlices) else g for g in gradients
        ]
    optimizers.set_learning_rate(optimizer, params)
    train_op = optimizer.apply(gradients, variables)
    return ModelSpec(
        Mode.TRAIN,
        loss=loss,
        train_op=train_op,
        metrics={"loss_sum": loss_sum, "num_points": num_valid},
        summarize=summarize_train,
    )


def _eval_spec(features, params: hyperparams.ModelParams, state: ModelState) -> ModelSpec:
    block = params.eval_block_size
    users = tf.reshape(features[constants.USER_COLUMN], [-1, block])[:, 0]
    items = tf.reshape(features[constants.ITEM_COLUMN], [-1, block])
    logits = tf.cast(state.model.score_blocks(users, items), tf.float32)
    duplicates = tf.reshape(features[constants.DUPLICATE_MASK], [-1, block])
    valid_users = tf.reshape(features[constants.VALID_POINT_MASK], [-1, block])[:, 0]
    hit, ndcg = compute_hr_ndcg(logits, duplicates, params.top_k)
    weight = tf.cast(valid_users, tf.float32)
    return ModelSpec(
        Mode.EVAL,
        metrics={
            "hits": tf.reduce_sum(hit * weight),
            "ndcg": tf.reduce_sum(ndcg * weight),
            "num_users": tf.reduce_sum(weight),
        },
        summarize=summarize_eval,
    )


def summarize_train(totals: dict[str, float]) -> dict[str, float]:
    """The TRAIN metrics from the sums over every replica and step: ``loss`` (mean
    cross-entropy per valid point, without L2) and ``num_points``."""
    return {
        "loss": totals["loss_sum"] / max(totals["num_points"], 1.0),
        "num_points": totals["num_points"],
    }


def summarize_eval(totals: dict[str, float]) -> dict[str, float]:
    """The EVAL metrics from the sums over every replica and step: ``hr`` and ``ndcg``
    (means over real users, padding excluded) and ``num_users``."""
    users = max(totals["num_users"], 1.0)
    return {
        "hr": totals["hits"] / users,
        "ndcg": totals["ndcg"] / users,
        "num_users": totals["num_users"],
    }
