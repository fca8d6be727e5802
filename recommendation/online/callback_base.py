"""What RecModel calls back: `Callback`, a Keras callback that also sees the RecModel,
each sink as it is read and before it trains, and a stream's quiet periods, and
`CallbackList`, which calls every callback given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import keras

if TYPE_CHECKING:
    from recommendation.online.rec_model import RecModel
    from recommendation.online.stream_batches import BatchGroup


class Callback(keras.callbacks.Callback):
    """A Keras callback that also sees the RecModel (``self.rec_model``), each sink's
    batches as they are read (`on_sink_read`) and before they train (`on_sink_begin`),
    and quiet periods of a stream (`on_idle`)."""

    rec_model: RecModel | None = None

    def set_rec_model(self, rec_model: RecModel) -> None:
        self.rec_model = rec_model

    def on_sink_read(self, group: BatchGroup) -> None:
        """Called with each sink's batches as the stream is read, in stream order, on
        the thread that reads it (boost O1+: ahead of training, while the sink before
        trains): where what follows from the stream alone is prepared, into
        ``group.notes``, off the training thread. Touch no model state here."""

    def on_sink_begin(self, group: BatchGroup) -> None:
        """Called with each sink's batches (`stream_batches.BatchGroup`) before the
        model trains on them: where test-then-train evaluation scores them."""

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

    def __getattr__(self, name: str):
        def dispatch(*args):
            for callback in self.callbacks:
                getattr(callback, name, lambda *_: None)(*args)

        return dispatch
