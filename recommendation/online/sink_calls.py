"""The graph functions a `RecModel` runs its sinks with: made once for what they run
and the structure, dtypes and ranks of their inputs (`SinkCalls`), each step after the
callbacks' probes of it (`steps_with_probes`), or the probes alone (`probe_call`, on a
cluster's chief); and the garbage collector kept off what lives as long as training
(`freeze_long_lived`)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from official.core.runner import sum_over_steps, traced


def freeze_long_lived() -> None:
    """Moves every object alive now out of the garbage collector's full passes, until
    `online_train` returns (which unfreezes them).

    TensorFlow, the model and each traced graph are hundreds of thousands of objects
    that live as long as training, and a stream read allocates thousands of lists
    (a Redis reply: several per event): every few reads the collector's full pass
    walked all of them again, most of the cost of reading Redis (docs/benchmarks.md).
    Called when training starts and after each trace; objects freed by reference
    counting are freed as ever.
    """
    gc.freeze()


def any_length(arrays) -> Any:
    """TensorSpecs of `arrays` (a nest) with every dimension left open."""
    return tf.nest.map_structure(
        lambda array: tf.TensorSpec([None] * np.ndim(array), tf.as_dtype(np.asarray(array).dtype)),
        arrays,
    )


def run_probes(probing: list, inputs: tuple, step: tf.Tensor) -> tuple:
    """Each of the `probing` callbacks' ``probe`` of a sink's step `step`, on its own
    inputs, in order."""
    return tuple(
        callback.probe(given, step) for callback, given in zip(probing, inputs, strict=True)
    )


def steps_with_probes(
    step: Callable | None, probing: list, inputs: tuple, num_steps: tf.Tensor
) -> tuple[dict, tuple]:
    """``step(0) + ... + step(num_steps - 1)``, key by key (`step` None: no steps), each
    step right after the `probing` callbacks' probes of it: in program order, so that a
    probe reads the model every earlier step of the sink trained and none of its own
    step's writes (test, then train, step by step), and the rest of its ops run beside
    the step's. Returns the totals and each probe's outputs over the steps, concatenated
    (a probe returns one tensor a step)."""
    if not probing:
        return (sum_over_steps(step, num_steps) if step else {}), ()

    def probed(index):
        outputs = run_probes(probing, inputs, index)
        return (step(index) if step else {}), outputs

    # One trace, called twice (the first call gives the loop its structure), as
    # `sum_over_steps` does.
    probed = traced(probed)
    totals, outputs = probed(tf.constant(0))
    arrays = tuple(
        tf.TensorArray(output.dtype, size=num_steps, infer_shape=False).write(0, output)
        for output in outputs
    )

    def next_step(index, totals, arrays):
        logs, outputs = probed(index)
        totals = {key: totals[key] + logs[key] for key in totals}
        arrays = tuple(array.write(index, out) for array, out in zip(arrays, outputs, strict=True))
        return index + 1, totals, arrays

    num_steps = tf.convert_to_tensor(num_steps, tf.int32)
    _, totals, arrays = tf.while_loop(
        lambda index, *_: index < num_steps, next_step, (tf.constant(1), totals, arrays)
    )
    return totals, tuple(array.concat() for array in arrays)


def probe_call(_, probing: list, inputs: tuple) -> Callable:
    """A graph function of the `probing` callbacks' probes of a sink's steps alone (on
    a cluster's chief, before it schedules the sink's steps: every step is scored by
    the model before the sink); `SinkCalls` passes no batches."""
    return traced(
        lambda num_steps, inputs: steps_with_probes(None, probing, inputs, num_steps)[1],
        input_signature=[tf.TensorSpec([], tf.int32), any_length(inputs)],
    )


class SinkCalls:
    """The graph functions made so far, by what made them and the structure, dtypes
    and shapes of their batches (past the step and batch axes) and probe inputs."""

    def __init__(self) -> None:
        self._calls: dict[tuple, Callable] = {}

    def __call__(self, make: Callable, stacked, probing: list, inputs: tuple, *more) -> Any:
        """Calls the graph function ``make(stacked, probing, inputs)`` makes (made and
        traced on first use, then the objects alive frozen) with `stacked` (None: no
        batches), `more` and `inputs`."""
        key = (
            make.__name__,
            tuple((t.dtype, t.shape[2:]) for t in tf.nest.flatten(stacked) if t is not None),
            tuple(id(callback) for callback in probing),
            tuple(tf.nest.flatten(any_length(inputs))),
            str(tf.nest.map_structure(lambda _: 0, inputs)),
        )
        new = key not in self._calls
        if new:
            self._calls[key] = make(stacked, probing, inputs)
        result = self._calls[key](*(() if stacked is None else (stacked,)), *more, inputs)
        if new:
            freeze_long_lived()
        return result
