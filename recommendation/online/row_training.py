"""Training a hash embedding's rows: the optimiser's rule applied to the rows a step
uses only (lazy Adam, or SGD), on one variable or on shards (`row_shards`).

The rows grow and shrink with the ids a table holds, so they are not Keras variables
and sit outside the optimiser's list: the table takes the optimiser's rule and rate
(`attach_optimizer`) and applies them to the gradient of its rows (`train_rows`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from recommendation.model import optimizers
from recommendation.online import masks, row_shards, step_stages


class RowTraining:
    """Mixed into `HashEmbedding`: `attach_optimizer`, `train_rows`, `note_trained`,
    `gradient_variables`, `rows_per_shard` and the rows' `moments`.

    The host provides ``embeddings`` (one variable or `row_shards.RowShards`),
    ``momentum``/``velocity`` (None until an Adam optimiser is attached),
    ``_update``, ``allocated``, ``size``, ``embedding_size``, `_value_rows` and
    `_note_changed`.
    """

    def attach_optimizer(self, optimizer: keras.optimizers.Optimizer) -> int:
        """Makes the rows train with `optimizer`'s rule and rate, lazily (only the rows
        a step uses): Adam (moments kept per row, zeroed for a new id) or SGD without
        momentum. Returns the number of moment tables."""
        inner = optimizer
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            inner = optimizer.inner_optimizer
        if isinstance(inner, keras.optimizers.Adam) and not getattr(inner, "amsgrad", False):
            if self.momentum is None:
                zeros = tf.zeros([self.allocated.numpy() + 1, self.embedding_size])
                self.momentum = self._value_rows(zeros, "momentum")
                self.velocity = self._value_rows(zeros, "velocity")
        elif not (isinstance(inner, keras.optimizers.SGD) and not inner.momentum):
            raise ValueError(
                f"HashEmbedding rows train with Adam or SGD without momentum, lazily; "
                f"got {type(inner).__name__}"
            )
        object.__setattr__(self, "_update", (optimizer, inner))
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
        optimizer, inner = self._update
        if isinstance(gradients, tf.IndexedSlices):
            gradients = [gradients]
        if step is None:
            step = inner.iterations + 1
        step = tf.cast(step, tf.float32)
        rate = tf.cast(inner.learning_rate, tf.float32)
        shards = row_shards.shard_variables(self.embeddings)
        moments = [row_shards.shard_variables(moment) for moment in self.moments]
        for index, gradient in enumerate(gradients):
            values, indices = gradient.values, gradient.indices
            rows = indices * len(shards) + index  # the table's row numbers
            known = rows > 0  # the default row (0) is never trained
            values, indices, rows = masks.keep(known, values, indices, rows)
            if note_changes:
                self._note_changed(rows)
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
        optimizer, inner = self._update

        def apply():
            if moments:
                optimizers.lazy_adam_rows(
                    gradient,
                    variable,
                    *moments,
                    rate,
                    inner.beta_1,
                    inner.beta_2,
                    inner.epsilon,
                    step,
                )
            else:
                variable.scatter_sub(tf.IndexedSlices(rate * gradient.values, gradient.indices))
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
        """The rows' optimiser moments (Adam's two; none for SGD)."""
        return [] if self.momentum is None else [self.momentum, self.velocity]
