"""What RecModel calls back: `Callback`, a Keras callback that also sees the RecModel,
each sink as it is read, before and after it trains (and may probe the model inside
the sink's graph call), and a stream's quiet periods, `CallbackList`, which calls
every callback given, and the `Schedule` of periodic ones.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import keras

if TYPE_CHECKING:
    from recommendation.online.rec_model import RecModel
    from recommendation.online.sources.stream_batches import BatchGroup


class Callback(keras.callbacks.Callback):
    """A Keras callback that also sees the RecModel (``self.rec_model``), each sink's
    batches as they are read (`on_sink_read`), before they train (`on_sink_begin`) and
    after (`on_sink_end`), and quiet periods of a stream (`on_idle`).

    A callback may also define ``probe(inputs, step)``: a graph function of the arrays
    it puts in ``group.probe_inputs[self]`` as a sink is read and of a step's index
    (int32) in the sink, run inside the sink's graph call right before that step, so
    that it reads the model as it is before the step trains (test, then train) while
    the step's ops take the cores it leaves. It returns one tensor a step; their
    concatenation over the sink's steps is in ``group.probe_outputs[self]`` (numpy) by
    `on_sink_end`.
    """

    rec_model: RecModel | None = None

    def set_rec_model(self, rec_model: RecModel) -> None:
        self.rec_model = rec_model

    def on_sink_read(self, group: BatchGroup) -> None:
        """Called with each sink's batches as the stream is read, in stream order, on
        the thread that reads it (boost O1+: ahead of training, while the sink before
        trains): where what follows from the stream alone is prepared, into
        ``group.notes`` and ``group.probe_inputs``, off the training thread. Touch no
        model state here."""

    def on_sink_begin(self, group: BatchGroup) -> None:
        """Called with each sink's batches (`stream_batches.BatchGroup`) before the
        model trains on them."""

    def on_sink_end(self, group: BatchGroup) -> None:
        """Called with each sink's batches once the model has trained on them (and its
        probes have run: ``group.probe_outputs``)."""

    def on_idle(self, logs: dict | None = None) -> None:
        """Called while the stream has no new data (about once per source poll)."""


class CallbackList:
    """Dispatches to Keras callbacks and to ours (which get the RecModel too)."""

    def __init__(self, callbacks, rec_model: RecModel) -> None:
        self.callbacks = list(callbacks or [])
        for callback in self.callbacks:
            callback.set_model(rec_model.network)
            if isinstance(callback, Callback):
                callback.set_rec_model(rec_model)

    @property
    def probing(self) -> list:
        """The callbacks with a ``probe``, in order."""
        return [callback for callback in self.callbacks if hasattr(callback, "probe")]

    def __getattr__(self, name: str):
        def dispatch(*args):
            for callback in self.callbacks:
                getattr(callback, name, lambda *_: None)(*args)

        return dispatch


class Schedule:
    """Due every `steps` steps or `seconds` seconds (whichever first), and only when
    training has advanced since the last time."""

    def __init__(self, steps: int | None, seconds: float | None) -> None:
        if not steps and not seconds:
            raise ValueError("give every_steps or every_seconds (or both)")
        self.steps, self.seconds = steps, seconds
        self.last_step, self.last_time = 0, time.monotonic()

    def due(self, step: int) -> bool:
        if step <= self.last_step:
            return False
        by_steps = self.steps and step - self.last_step >= self.steps
        by_time = self.seconds and time.monotonic() - self.last_time >= self.seconds
        return bool(by_steps or by_time)

    def mark(self, step: int) -> None:
        self.last_step, self.last_time = step, time.monotonic()
