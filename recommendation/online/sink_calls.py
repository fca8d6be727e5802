"""The graph functions a `RecModel` runs its sinks with: made once for what they run
and the structure, dtypes and ranks of their inputs (`SinkCalls`), with the callbacks'
probes of a sink run inside them (`run_probes`) or alone (`probe_call`, on a cluster's
chief); and the garbage collector kept off what lives as long as training
(`freeze_long_lived`)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from official.core.runner import traced


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


def run_probes(probing: list, inputs: tuple) -> tuple:
    """Each of the `probing` callbacks' ``probe`` on its own inputs, in order."""
    return tuple(callback.probe(given) for callback, given in zip(probing, inputs, strict=True))


def probe_call(_, probing: list, inputs: tuple) -> Callable:
    """A graph function of the `probing` callbacks' probes alone (on a cluster's chief,
    before it schedules a sink's steps); `SinkCalls` passes no batches."""
    return traced(lambda inputs: run_probes(probing, inputs), input_signature=[any_length(inputs)])


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
