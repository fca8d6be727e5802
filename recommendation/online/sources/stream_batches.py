"""What RecModel trains on: a stream's batches (`StreamBatch`), grouped into the sinks of
one graph call each, and read ahead on a background thread (boost O1+).

A sink stacks consecutive batches of one structure and shape, so that one traced graph
runs any number of steps; a None from the stream (no data yet) ends the sink early, so
that a quiet stream still reaches the callbacks.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging


@dataclasses.dataclass
class StreamBatch:
    """One batch from an unbounded source.

    Attributes:
        data: What the network (or `loss_fn`) takes: ``(data, label)`` or its inputs.
        position: JSON-able source offsets just after this batch (None: untracked).
        num_events: Source events in the batch (for rates and stop conditions).
        ids: Source ids of the events (for audits), or None.
    """

    data: Any
    position: Any = None
    num_events: int = 0
    ids: list | None = None


@dataclasses.dataclass
class BatchGroup:
    """Up to sink_size batches of one structure and shape, stacked on a new axis.

    By callback: `notes`, what it prepared from them as they were read
    (`on_sink_read`); `probe_inputs`, the arrays its ``probe`` runs on in the sink's
    graph call, and `probe_outputs`, what that gave (numpy), by the sink's end.
    """

    stacked: Any
    num_steps: int
    position: Any
    num_events: int
    ids: list
    notes: dict = dataclasses.field(default_factory=dict)
    probe_inputs: dict = dataclasses.field(default_factory=dict)
    probe_outputs: dict = dataclasses.field(default_factory=dict)


def _num_examples(data) -> int:
    first = tf.nest.flatten(data)[0]
    return int(first.shape[0]) if len(first.shape) else 1


def _signature(data) -> tuple:
    return tuple((tuple(np.shape(t)), np.asarray(t).dtype.str) for t in tf.nest.flatten(data))


def group_batches(
    elements: Iterator,
    size: int,
    has_position: list,
    on_read: Callable[[BatchGroup], None] = lambda group: None,
) -> Iterator[BatchGroup | None]:
    """Groups consecutive same-shaped batches; None (quiet stream) ends a group.
    `on_read` sees each group, in stream order, before it is handed on."""
    pending: list[StreamBatch] = []

    def flush() -> BatchGroup:
        datas = [b.data for b in pending]
        stacked = tf.nest.map_structure(lambda *ts: np.stack([np.asarray(t) for t in ts]), *datas)
        group = BatchGroup(
            stacked,
            len(pending),
            pending[-1].position,
            sum(b.num_events for b in pending),
            [i for b in pending for i in (b.ids or ())],
        )
        pending.clear()
        on_read(group)
        return group

    for element in elements:
        if element is None:
            if pending:
                yield flush()
            yield None
            continue
        if isinstance(element, StreamBatch):
            has_position[0] = True
        else:
            element = StreamBatch(element, None, _num_examples(element))
        if pending and _signature(pending[0].data) != _signature(element.data):
            yield flush()
        pending.append(element)
        if len(pending) == size:
            yield flush()
    if pending:
        yield flush()


class Prefetcher:
    """Runs `group_batches` on a background thread, `depth` groups ahead (boost O1+).

    `close` waits for that thread to end: one left inside TensorFlow or a socket read
    (polling a gs:// folder, say) when the interpreter exits is killed there by
    Python's finalisation, which aborts the process ("FATAL: exception not rethrown")
    after training has already succeeded.
    """

    _END = object()
    # Longest wait in `close` for the read in flight (a source read is bounded by its
    # own timeout, seconds); the producer thread of `data_pipeline` gets the same.
    _JOIN_TIMEOUT_SEC = 60.0

    def __init__(self, groups: Iterator, depth: int = 2) -> None:
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(groups,), daemon=True, name="rec-model-prefetch"
        )
        self._thread.start()

    def _run(self, groups: Iterator) -> None:
        try:
            for group in groups:
                if not self._put(group):
                    return
        except BaseException as error:  # handed to the training thread
            self._error = error
        self._put(self._END)

    def _put(self, item: Any) -> bool:
        """Queues `item` unless `close` is called first (False then)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator:
        while True:
            item = self._queue.get()
            if item is self._END:
                if self._error is not None:
                    raise self._error
                return
            yield item

    def close(self) -> None:
        """Stops reading ahead and waits for the read in flight to return."""
        self._stop.set()
        self._thread.join(self._JOIN_TIMEOUT_SEC)
        if self._thread.is_alive():
            logging.warning(
                "the stream read in flight did not return within %.0f s of the stop; "
                "the process may abort when it exits",
                self._JOIN_TIMEOUT_SEC,
            )
