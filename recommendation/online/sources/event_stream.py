"""Batching a source into training steps: `EventStream` is the unbounded dataset
`RecModel.online_train` reads.

A source (`sources`) hands out whatever events it has; a training step wants a batch
of a fixed size, but not at the price of freshness: when the stream goes quiet, the
events already read are trained on as a partial batch instead of waiting for more.
Each batch carries the source position after it, which the checkpoint stores and
commits.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from recommendation.data import constants
from recommendation.online.sources.stream_batches import StreamBatch


class EventStream:
    """Batches of `batch_size` events from a source, as `StreamBatch` of
    ``{"user_id", "item_id", "timestamp"}``; a partial batch once the source has been quiet for
    `linger_seconds` (fresh events are not held back); None while idle.

    Args:
        source: A `sources` source.
        batch_size: Events per batch.
        linger_seconds: Longest wait for a batch to fill.
    """

    def __init__(self, source, batch_size: int, linger_seconds: float = 0.2) -> None:
        self.source, self.batch_size = source, batch_size
        self.linger_seconds = linger_seconds

    def restore(self, position) -> None:
        self.source.restore(position)

    def commit(self, position) -> None:
        self.source.commit(position)

    def __iter__(self) -> Iterator[StreamBatch | None]:
        users, items, times, ids = [], [], [], []
        count, started, position = 0, None, None
        while True:
            wait = self.linger_seconds if count else 0.1
            chunk = self.source.read(self.batch_size - count, wait)
            if chunk is not None:
                position = chunk.position
                if len(chunk):
                    users.append(chunk.users)
                    items.append(chunk.items)
                    times.append(chunk.timestamps)
                    ids.extend(chunk.ids)
                    count += len(chunk)
                    started = started or time.monotonic()
            full = count >= self.batch_size
            lingered = count and time.monotonic() - started >= self.linger_seconds
            if full or (count and (chunk is None or lingered)):
                yield StreamBatch(
                    {
                        constants.USER_COLUMN: np.concatenate(users),
                        constants.ITEM_COLUMN: np.concatenate(items),
                        constants.TIME_COLUMN: np.concatenate(times),
                    },
                    position,
                    count,
                    ids,
                )
                users, items, times, ids, count, started = [], [], [], [], 0, None
            elif chunk is None:
                if self.source.exhausted:
                    return
                yield None
