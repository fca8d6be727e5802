"""How the producer writes: padded batches, encoded as records, dealt out over shards.

Every batch is padded to a static shape with a valid-point mask (XLA/TPU friendly),
encoded as a `run_folder` record, and written to one of the shard files; each shard
is written by one task of the pool.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Protocol

import numpy as np
import tensorflow as tf

from recommendation.data import constants
from recommendation.producer import run_folder
from recommendation.producer.negative_sampling import EvalBlocks, TrainingEpoch
from recommendation.producer.run_folder import RecordField


def _padded_rows(
    columns: dict[str, np.ndarray], start: int, size: int, pad_values: dict[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Rows ``start .. start + size`` of each column, padded to `size` rows (with
    `pad_values`, else 0), plus a valid mask that is False on the padding."""
    stop = min(start + size, len(next(iter(columns.values()))))
    batch = {}
    for key, column in columns.items():
        rows = column[start:stop]
        padding = [(0, size - len(rows))] + [(0, 0)] * (rows.ndim - 1)
        batch[key] = np.pad(rows, padding, constant_values=(pad_values or {}).get(key, 0))
    batch[constants.VALID_POINT_MASK] = np.arange(size) < stop - start
    return batch


def train_batch(epoch: TrainingEpoch, index: int, batch_size: int) -> dict[str, np.ndarray]:
    """Batch `index` of `epoch`, zero-padded to `batch_size` with a valid-point mask."""
    columns = {
        constants.USER_COLUMN: epoch.users,
        constants.ITEM_COLUMN: epoch.items,
        constants.LABELS: epoch.labels,
    }
    return _padded_rows(columns, index * batch_size, batch_size)


def eval_batch(blocks: EvalBlocks, index: int, users_per_batch: int) -> dict[str, np.ndarray]:
    """Users ``index * users_per_batch ...`` as one record; padding users are invalid
    and their items all masked as duplicates."""
    columns = {
        constants.USER_COLUMN: blocks.users,
        constants.ITEM_COLUMN: blocks.items,
        constants.DUPLICATE_MASK: blocks.duplicate_mask,
    }
    return _padded_rows(
        columns,
        index * users_per_batch,
        users_per_batch,
        pad_values={constants.DUPLICATE_MASK: True},
    )


class ShardWriter(Protocol):
    """What a shard file is written through (`tf.io.TFRecordWriter`'s interface)."""

    def write(self, record: bytes) -> None: ...

    def close(self) -> None: ...


def write_shards(
    writers: list[ShardWriter],
    make_batch: Callable[[int], dict[str, np.ndarray]],
    record: dict[str, RecordField],
    num_batches: int,
    pool: concurrent.futures.Executor,
    first_batch: int = 0,
) -> None:
    """Writes ``make_batch(0 .. num_batches - 1)``, encoded as `record`, as global
    batches from `first_batch`.

    Global batch ``b`` goes to ``writers[b % len(writers)]``, so reading one record
    from each shard in turn restores batch order. Each shard is written by one task.
    """
    num_shards = len(writers)

    def write_shard(shard: int) -> None:
        first = first_batch + (shard - first_batch) % num_shards
        for batch in range(first, first_batch + num_batches, num_shards):
            encoded = run_folder.encode_record(make_batch(batch - first_batch), record)
            writers[shard].write(encoded)

    list(pool.map(write_shard, range(num_shards)))


def open_writers(
    folder: str,
    num_shards: int,
    open_writer: Callable[[str], ShardWriter] = tf.io.TFRecordWriter,
) -> list[ShardWriter]:
    """Creates `folder` and opens its `num_shards` shard files with `open_writer`."""
    tf.io.gfile.makedirs(folder)
    return [open_writer(path) for path in run_folder.shard_paths(folder, num_shards)]


def close_writers(writers: list[ShardWriter]) -> None:
    for writer in writers:
        writer.close()
