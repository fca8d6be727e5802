"""NeuMF's optimisers: Adam, its lazy form that updates only the rows a step looks up
(`LazyAdam`, `lazy_adam_rows`), row-wise Adagrad on such rows (`rowwise_adagrad_rows`),
SGD, and the learning-rate decay.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from official.core import precision
from recommendation.model import hyperparams, kernels


@keras.saving.register_keras_serializable(package="ncf")
class LazyAdam(keras.optimizers.Adam):
    """Adam that updates only the embedding rows present in a sparse gradient.

    Rows a batch does not touch keep their weights and moments (dense Adam decays
    every row's moments each step and so moves rows no example touched). Dense
    gradients get ordinary Adam.
    """

    def update_step(self, gradient, variable, learning_rate):
        if not isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable, learning_rate)
        index = self._get_variable_index(variable)

        def tf_variable(v):  # a Keras variable's tf.Variable
            return v.value if isinstance(v, keras.Variable) else v

        lazy_adam_rows(
            gradient,
            tf_variable(variable),
            tf_variable(self._momentums[index]),
            tf_variable(self._velocities[index]),
            tf.cast(learning_rate, variable.dtype),
            self.beta_1,
            self.beta_2,
            self.epsilon,
            tf.cast(self.iterations + 1, variable.dtype),
        )


def lazy_adam_rows(
    gradient: tf.IndexedSlices,
    variable: tf.Variable,
    momentum: tf.Variable,
    velocity: tf.Variable,
    learning_rate: tf.Tensor,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    step: tf.Tensor,
) -> None:
    """One Adam step (number `step`, from 1) of the rows present in `gradient` (entries
    of negative index left out) and of their moments; other rows keep their weights and
    moments. LazyAdam's update, and hash-embedding rows' (`HashEmbedding.train_rows`)."""
    rows, grad = kernels.summed_rows(gradient)
    alpha = learning_rate * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
    # Gathered from the tf.Variables (a ResourceGather): a dense read of a variable
    # that scatters write copies all of it first. Each row read once and written once:
    # a scatter that subtracts runs a kernel per row, several times a scatter's copy.
    new_m = beta_1 * tf.gather(momentum, rows) + (1 - beta_1) * grad
    new_v = beta_2 * tf.gather(velocity, rows) + (1 - beta_2) * tf.square(grad)
    new_rows = tf.gather(variable, rows) - alpha * new_m / (tf.sqrt(new_v) + epsilon)
    momentum.scatter_update(tf.IndexedSlices(new_m, rows))
    velocity.scatter_update(tf.IndexedSlices(new_v, rows))
    variable.scatter_update(tf.IndexedSlices(new_rows, rows))


def rowwise_adagrad_rows(
    gradient: tf.IndexedSlices,
    variable: tf.Variable,
    accumulator: tf.Variable,
    learning_rate: tf.Tensor,
    epsilon: float,
) -> None:
    """Row-wise Adagrad on the rows present in `gradient` (negative indices left out;
    FBGEMM's and TorchRec's
    ``EXACT_ROWWISE_ADAGRAD``): each row's `accumulator` (one value a row, from 0)
    gains the mean of the row's squared gradient, and the row moves by the rate over
    its square root; other rows keep theirs. A row that has seen few gradients moves
    most: a new user's row learns from their first events."""
    rows, grad = kernels.summed_rows(gradient)
    summed = tf.gather(accumulator, rows) + tf.reduce_mean(tf.square(grad), 1, keepdims=True)
    new_rows = tf.gather(variable, rows) - learning_rate * grad / (tf.sqrt(summed) + epsilon)
    accumulator.scatter_update(tf.IndexedSlices(summed, rows))
    variable.scatter_update(tf.IndexedSlices(new_rows, rows))


def sgd_rows(gradient: tf.IndexedSlices, variable: tf.Variable, learning_rate: tf.Tensor) -> None:
    """Plain SGD on the rows present in `gradient` (negative indices left out), each
    distinct row read once and written once."""
    rows, grad = kernels.summed_rows(gradient)
    variable.scatter_update(
        tf.IndexedSlices(tf.gather(variable, rows) - learning_rate * grad, rows)
    )


def decayed_learning_rate(params: hyperparams.ModelParams, step: tf.Tensor) -> tf.Tensor:
    """The rate of optimiser step `step`: constant, then shrinking once per epoch.

    Small models on MovieLens peak after a few epochs and then over-fit; decaying the
    rate from there holds the hit rate near the level it had reached instead (on the
    NCF paper split it does not raise the peak: docs/benchmarks.md). Epoch `e` trains at
    ``learning_rate * learning_rate_decay ** max(0, e - decay_start_epoch + 1)``; the
    epoch is the step divided by `steps_per_epoch`, so a resumed run continues the
    decay where its checkpoint left it.
    """
    if params.steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be positive, got {params.steps_per_epoch}")
    epoch = tf.cast(step // params.steps_per_epoch, tf.float32)
    decays = tf.maximum(0.0, epoch - params.decay_start_epoch + 1.0)
    return params.learning_rate * tf.pow(float(params.learning_rate_decay), decays)


def set_learning_rate(
    optimizer: keras.optimizers.Optimizer, params: hyperparams.ModelParams
) -> None:
    """Sets the rate of the coming step: `params`' rate, decayed when it asks for decay.

    The rate stays the optimiser's variable rather than becoming a Keras schedule, so
    checkpoints hold the same variables with or without decay; setting it every step
    makes the flags, not the restored variable, decide the rate of a resumed run.
    """
    rate = params.learning_rate
    if params.learning_rate_decay != 1.0:
        rate = decayed_learning_rate(params, optimizer.iterations)
    optimizer.learning_rate.assign(rate)


def build_optimizer(params: hyperparams.ModelParams) -> keras.optimizers.Optimizer:
    """Adam with the reference's hyper-parameters (AdamW with `weight_decay`), or plain
    SGD (decoupled weight decay too: each step shrinks a weight by `weight_decay` x the
    rate of itself), which with sparse updates already moves only the rows a batch
    touches; fp16 adds dynamic loss scaling unless `params` fixes the scale
    (`_train_spec` applies that)."""
    if params.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(
            learning_rate=params.learning_rate, weight_decay=params.weight_decay or None
        )
    else:
        adam = LazyAdam if params.sparse_updates else keras.optimizers.Adam
        optimizer = adam(
            learning_rate=params.learning_rate,
            beta_1=params.beta1,
            beta_2=params.beta2,
            epsilon=params.epsilon,
            weight_decay=params.weight_decay or None,
        )
    return precision.with_loss_scaling(
        optimizer, precision.POLICIES[params.dtype], params.loss_scale
    )
