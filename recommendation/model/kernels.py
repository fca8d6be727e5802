"""The training step's row kernels: gathers whose gradient is a scatter of rows, the
first MLP layer computed from each table's rows once, each distinct row's summed
gradient for a lazy row update, and XLA compilation of them where a step is large
enough to gain from it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import tensorflow as tf


def dense_gradient(gradient: tf.IndexedSlices) -> tf.Tensor:
    """The dense tensor of a row gather's gradient, bit for bit TensorFlow's own
    conversion (UnsortedSegmentSum, several times slower than a scatter on CPU). The
    scatter is compiled by XLA where the table's row count is known when the step is
    traced and the step is large (`compiled_for_large_steps`), where XLA's loop beats
    TensorFlow's per-row kernel (docs/benchmarks.md, "The step's kernels"). Not for
    LazyAdam's unique rows, whose count changes each step (a compilation each)."""
    rows = tf.get_static_value(gradient.dense_shape)
    if rows is None:
        rows = tf.cast(gradient.dense_shape[0], tf.int32)
        return _scatter_rows(gradient.indices, gradient.values, rows)
    return _compiled_scatter_rows(gradient.indices, gradient.values, int(rows[0]))


def _scatter_rows(ids: tf.Tensor, values: tf.Tensor, rows: int | tf.Tensor) -> tf.Tensor:
    """``(rows, width)`` zeros with each row of `values` added at its row in `ids`."""
    zeros = tf.zeros([rows, tf.shape(values)[1]], values.dtype)
    return tf.tensor_scatter_nd_add(zeros, ids[:, None], values)


# Below this many elements in its largest input a loop runs as TensorFlow ops: XLA's
# compilation, one per shape, costs more than a small step saves (docs/benchmarks.md,
# "The step's kernels").
COMPILE_MIN_ELEMENTS = 2**18


def compiled_for_large_steps(function: Callable) -> Callable:
    """`function` XLA-compiled where a step is traced and its largest input has at least
    `COMPILE_MIN_ELEMENTS` (an unknown shape counts as large); run op by op otherwise,
    and where the step runs eagerly (``--run_eagerly``: no graphs, no XLA). Both give
    the same bits."""
    compiled = tf.function(function, jit_compile=True)

    @functools.wraps(function)
    def call(*args):
        sizes = [arg.shape.num_elements() for arg in args if isinstance(arg, tf.Tensor)]
        large = None in sizes or max(sizes) >= COMPILE_MIN_ELEMENTS
        return (compiled if large and not tf.executing_eagerly() else function)(*args)

    call.compiled = compiled
    return call


# Traced once per table (`rows`, a Python int) and batch shape.
_compiled_scatter_rows = compiled_for_large_steps(_scatter_rows)


def summed_rows(gradient: tf.IndexedSlices) -> tuple[tf.Tensor, tf.Tensor]:
    """The distinct rows of a sparse `gradient` (those of negative index left out: no
    row) and each one's summed gradient, in order of first appearance: what a lazy
    row update reads and writes once per row.

    The sum is a scatter into as many rows as the gradient has entries, XLA-compiled
    for large steps (2x TensorFlow's kernel at 20,480 entries of 41 floats): once per
    step shape where the step knows its entries, else once per padded size
    (`_scatter_padded`); then the distinct rows are kept.
    """
    rows, positions = tf.unique(gradient.indices)
    bound = gradient.values.shape[0]
    if bound is None:
        summed = _scatter_padded(positions, gradient.values, tf.size(rows))
    else:
        summed = _compiled_scatter_rows(positions, gradient.values, bound)[: tf.size(rows)]
    kept = tf.squeeze(tf.where(rows >= 0), axis=1)
    return tf.gather(rows, kept), tf.gather(summed, kept)


def padded_size(count: tf.Tensor) -> tf.Tensor:
    """`count` rounded up to a multiple of a quarter of its highest power of two: four
    sizes an octave, at most a quarter more than `count`."""
    octave = tf.math.floor(tf.math.log(tf.cast(tf.maximum(count, 1), tf.float64)) / math.log(2))
    unit = tf.bitwise.left_shift(
        tf.constant(1, count.dtype), tf.maximum(0, tf.cast(octave, count.dtype) - 2)
    )
    return (count + unit - 1) // unit * unit


def _scatter_padded(ids: tf.Tensor, values: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
    """`_scatter_rows` of inputs whose length a traced step learns only when it runs:
    large ones padded with zero rows (added to row 0: no change) to a `padded_size`,
    which XLA compiles once each (not once per length); small ones, and eager calls,
    op by op."""
    width = values.shape[1]
    if tf.executing_eagerly() or width is None:
        return _scatter_rows(ids, values, rows)
    count = tf.size(ids)

    def compiled():
        size = padded_size(count)
        padded_ids = tf.pad(ids, [[0, size - count]])
        padded_values = tf.pad(values, [[0, size - count], [0, 0]])
        return _compiled_scatter_rows.compiled(padded_ids, padded_values, size)[:rows]

    large = count * width >= COMPILE_MIN_ELEMENTS
    return tf.cond(large, compiled, lambda: _scatter_rows(ids, values, rows))


@tf.custom_gradient
def take_rows(table: tf.Tensor, ids: tf.Tensor):
    """``tf.gather(table, ids)`` whose gradient is built dense by `dense_gradient`'s
    scatter: for a table computed in the step (a projected first-layer term), which
    TensorFlow would otherwise densify with UnsortedSegmentSum."""

    def gradient(upstream):
        slices = tf.IndexedSlices(upstream, ids, tf.shape(table, out_type=tf.int64))
        return dense_gradient(slices), None

    return tf.gather(table, ids), gradient


@tf.custom_gradient
def first_layer_of_rows(user_terms, item_terms, users, items):
    """``relu(user_terms[users] + item_terms[items])``: the first MLP layer's output
    from the tables' first-layer terms, each way one loop over the batch (gathers, sum
    and ReLU; ReLU's gradient and the two scatters of `dense_gradient`), XLA-compiled for
    large steps (`compiled_for_large_steps`) instead of five TensorFlow ops, each a pass
    over a batch x width tensor."""
    output = _compiled_first_layer(user_terms, item_terms, users, items)

    def gradient(upstream):
        rows = (user_terms.shape[0], item_terms.shape[0])
        return (*_compiled_first_layer_gradient(upstream, output, users, items, rows), None, None)

    return output, gradient


@compiled_for_large_steps
def _compiled_first_layer(user_terms, item_terms, users, items):
    return tf.nn.relu(tf.gather(user_terms, users) + tf.gather(item_terms, items))


@compiled_for_large_steps
def _compiled_first_layer_gradient(upstream, output, users, items, rows):
    upstream = tf.where(output > 0, upstream, tf.zeros_like(upstream))  # ReluGrad's
    return _scatter_rows(users, upstream, rows[0]), _scatter_rows(items, upstream, rows[1])
