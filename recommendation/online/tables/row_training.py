"""Training a hash embedding's rows: a rule applied to the rows a step uses only (lazy
Adam, row-wise Adagrad or SGD), on one variable or on shards (`row_shards`).

The rows grow and shrink with the ids a table holds, so they are not Keras variables
and sit outside the optimiser's list: the table takes its rule and rate (its own
`row_optimizer` and `row_learning_rate`, else the optimiser's) when the optimiser is
attached (`attach_optimizer`) and applies them to the gradient of its rows
(`train_rows`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from recommendation.model import optimizers
from recommendation.online import step_stages
from recommendation.online.tables import masks, row_shards

ROW_OPTIMIZERS = ("adam", "adagrad", "sgd")
ROW_ADAGRAD_EPSILON = 1e-8  # FBGEMM's


class RowTraining:
    """Mixed into `HashEmbedding`: `attach_optimizer`, `train_rows`, `note_trained`,
    `gradient_variables`, `rows_per_shard` and the rows' `moments`.

    The host provides ``embeddings`` (one variable or `row_shards.RowShards`),
    ``momentum``/``velocity``/``accumulator`` (None until a rule needs them),
    ``row_optimizer``, ``row_learning_rate``, ``_update``, ``allocated``, ``size``,
    ``embedding_size``, `_value_rows` and `_note_changed`.
    """

    def attach_optimizer(self, optimizer: keras.optimizers.Optimizer) -> int:
        """Makes the rows train lazily (only the rows a step uses) by the table's
        `row_optimizer`, else by `optimizer`'s rule (Adam, or SGD without momentum): lazy
        Adam (two moments a row), row-wise Adagrad (one accumulator a row) or SGD; each
        moment of a new id starts at zero. Returns the number of moment tables."""
        inner = optimizer
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            inner = optimizer.inner_optimizer
        rule = self.row_optimizer
        if rule is None and isinstance(inner, keras.optimizers.Adam):
            rule = None if getattr(inner, "amsgrad", False) else "adam"
        elif rule is None and isinstance(inner, keras.optimizers.SGD):
            rule = None if inner.momentum else "sgd"
        if rule is None:
            raise ValueError(
                f"HashEmbedding rows train with Adam or SGD without momentum, lazily, or "
                f"by their own row_optimizer; got {type(inner).__name__}"
            )
        rows = self.allocated.numpy() + 1
        if rule == "adam" and self.momentum is None:
            zeros = tf.zeros([rows, self.embedding_size])
            self.momentum = self._value_rows(zeros, "momentum")
            self.velocity = self._value_rows(zeros, "velocity")
        if rule == "adagrad" and self.accumulator is None:
            self.accumulator = self._value_rows(tf.zeros([rows, 1]), "accumulator")
        object.__setattr__(self, "_update", (optimizer, inner, rule))
        return len(self.moments)

    @tf.autograph.experimental.do_not_convert
    def train_rows(
        self,
        gradients: tf.IndexedSlices | list[tf.IndexedSlices],
        step: tf.Tensor | None = None,
        note_changes: bool = True,
    ) -> None:
        """Applies the gradient of the rows (of each of `gradient_variables`, in order)
        with the attached optimiser; call before the optimiser's own ``apply`` of the
        step, or give Adam's `step` (from 1; a coordinator's count, when workers share
        the optimiser). `note_changes` False: whoever resolved the rows notes them
        changed (a worker cannot write the coordinator's flags)."""
        if self._update is None:
            raise ValueError("call attach_optimizer before training the rows")
        optimizer, inner, _ = self._update
        if isinstance(gradients, tf.IndexedSlices):
            gradients = [gradients]
        if step is None:
            step = inner.iterations + 1
        step = tf.cast(step, tf.float32)
        rate = tf.cast(self.row_learning_rate or inner.learning_rate, tf.float32)
        shards = row_shards.shard_variables(self.embeddings)
        moments = [row_shards.shard_variables(moment) for moment in self.moments]
        for index, gradient in enumerate(gradients):
            values, indices = gradient.values, gradient.indices
            rows = indices * len(shards) + index  # the table's row numbers
            known = rows > 0  # the default row (0) is never trained
            if note_changes:
                self._note_changed(masks.keep(known, rows))
            # Marked rather than selected: the rules leave negative indices out after
            # summing, so the gradient keeps the step's shape and is not copied.
            indices = tf.where(known, indices, tf.constant(-1, indices.dtype))
            if optimizer is not inner:  # loss scaling: unscale, skip non-finite steps
                values = values / tf.cast(optimizer.dynamic_scale, values.dtype)
            self._apply_rows(
                tf.IndexedSlices(values, indices),
                shards[index],
                [shard[index] for shard in moments],
                rate,
                step,
            )

    def _apply_rows(self, gradient, variable, moments, rate, step) -> None:
        optimizer, inner, rule = self._update

        def apply():
            if rule == "adam":  # Keras' defaults where the optimiser is not Adam
                optimizers.lazy_adam_rows(
                    gradient,
                    variable,
                    *moments,
                    rate,
                    getattr(inner, "beta_1", 0.9),
                    getattr(inner, "beta_2", 0.999),
                    getattr(inner, "epsilon", 1e-7),
                    step,
                )
            elif rule == "adagrad":
                optimizers.rowwise_adagrad_rows(
                    gradient, variable, *moments, rate, ROW_ADAGRAD_EPSILON
                )
            else:
                optimizers.sgd_rows(gradient, variable, rate)
            return tf.constant(True)

        with tf.name_scope(step_stages.ROW_UPDATE):
            if optimizer is inner:
                apply()
            else:
                finite = tf.reduce_all(tf.math.is_finite(gradient.values))
                tf.cond(finite, apply, lambda: tf.constant(False))

    def note_trained(self, slots: tf.Tensor) -> None:
        """Notes rows `slots` (the default row and -1 left out) changed by a step that
        trains them elsewhere (`train_rows` with `note_changes` False)."""
        self._note_changed(masks.keep(slots > 0, slots))

    def gradient_variables(self) -> list[tf.Variable]:
        """The variables holding the rows, whose gradients `train_rows` takes."""
        return row_shards.shard_variables(self.embeddings)

    def rows_per_shard(self) -> list[int]:
        """Live rows (default row excluded) on each shard (eagerly); one entry when the
        rows are not sharded."""
        num = len(self.gradient_variables())
        size = int(self.size.numpy())
        return [len(range(index or num, size + 1, num)) for index in range(num)]

    @property
    def moments(self) -> list[tf.Variable]:
        """The rows' optimiser moments (Adam's two, Adagrad's accumulator; none for SGD)."""
        if self.momentum is not None:
            return [self.momentum, self.velocity]
        return [] if self.accumulator is None else [self.accumulator]
