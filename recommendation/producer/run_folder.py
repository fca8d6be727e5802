"""The producer/trainer file protocol: what a run folder holds and how it is encoded.

The trainer (`data_pipeline.ProducerHandle`) and the producer process
(`data_async_generation`) share nothing but a run folder,
``CACHE_DIR/runs/ncf_run_<time>_<id>/``; this module is all either side knows of the
other's files. In order:

1. the producer writes ``alive.json``; the trainer answers with ``params.json``
   (`GenerationParams`);
2. the producer writes the evaluation set once into ``eval/`` (and, for
   ``--eval_split validation``, the validation set into ``validation/`` first), then
   training cycles
   ``cycle_00000/``, ``cycle_00001/`` ... at most `cycles_to_buffer` ahead of the
   trainer, which deletes each cycle once it has read it;
3. each folder holds shards of batch-serialised TFRecords (one record = one whole
   batch, its arrays as `train_record` / `eval_record` say) and, written last,
   ``READY.json`` (`CycleInfo`, `EvalInfo`); the trainer never opens a folder before
   its ready file exists: a folder can show before its shards are complete, and on
   ``gs://`` a folder rename is not atomic, a one-object file is;
4. ``progress.json`` is rewritten as work advances, so the trainer can tell a slow
   producer from a stuck one; a producer that cannot write its files says why in one
   line of ``producer.log`` that starts with `FAILURE_PREFIX`.

Every JSON file is written atomically (`atomic.write_file`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from collections.abc import Mapping
from typing import TypeVar

import numpy as np
import tensorflow as tf

from official.utils.logs import mlperf_helper
from official.utils.misc import atomic
from recommendation.data import constants

RUNS_FOLDER = "runs"  # under the cache dir: the run folders of every trainer using it
ALIVE_FILE = "alive.json"  # producer: I am running
PARAMS_FILE = "params.json"  # trainer: generate this
PROGRESS_FILE = "progress.json"  # producer: still working (rewritten as work advances)
READY_FILE = "READY.json"  # producer: this folder is complete
PRODUCER_LOG = "producer.log"
# The folder of each evaluation set, by split.
EVAL_FOLDERS = {constants.TEST_SPLIT: "eval", constants.VALIDATION_SPLIT: "validation"}
# Starts the one line the producer writes to its log when its files cannot be written.
FAILURE_PREFIX = "error: "

# How often each side looks for the other's files.
POLL_SEC = 0.05
# Training cycles the producer may have written but the trainer not yet consumed.
CYCLES_TO_BUFFER = 2
# Shards per cycle: enough for parallel reads, few enough to keep files large.
NUM_SHARDS = 8
# Producer threads: about 0.75 x cores leaves room for the trainer.
DEFAULT_NUM_WORKERS = max(1, int(0.75 * (os.cpu_count() or 1)))


def new_run_dir(run_root: str) -> str:
    """A run folder name no other run uses, so runs sharing a cache dir never meet."""
    return os.path.join(run_root, f"ncf_run_{int(time.time())}_{uuid.uuid4().hex[:8]}")


def eval_folder(run_dir: str, split: str = constants.TEST_SPLIT) -> str:
    return os.path.join(run_dir, EVAL_FOLDERS[split])


def cycle_folder(run_dir: str, cycle: int) -> str:
    return os.path.join(run_dir, f"cycle_{cycle:05d}")


def shard_paths(folder: str, num_shards: int) -> list[str]:
    """The shard files of a folder; global batch ``b`` is in shard ``b % num_shards``."""
    return [os.path.join(folder, f"shard_{shard:03d}.tfrecord") for shard in range(num_shards)]


def ready_file(folder: str) -> str:
    return os.path.join(folder, READY_FILE)


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    """What the trainer asks the producer to generate (``params.json``).

    Attributes:
        cache_path: Preprocessing cache (`preprocessing_cache.read_cache`).
        batch_size: Training points per batch (global, across replicas).
        eval_users_per_batch: Evaluation users per batch (each a block of points).
        num_neg: Negatives per training positive.
        num_eval_negatives: Sampled negatives per evaluation user (ignored when the
            dataset has fixed negatives).
        epochs_per_cycle: Epochs in each training cycle, in order.
        first_epoch: Number of the first epoch (resumed runs continue the epoch
            numbering, and so the random streams, where they stopped).
        seed: Base seed of every random stream.
        num_shards: TFRecord files per folder.
        cycles_to_buffer: Cycles written ahead of the trainer.
        num_workers: Threads sampling and writing (about 0.75 x cores).
        mlperf_log_file: Where the producer writes its MLPerf compliance lines, for
            the trainer to merge into its log ("" = no compliance logging).
        mlperf_log_format: ``mllog`` or ``v0.5``.
    """

    cache_path: str
    batch_size: int
    eval_users_per_batch: int
    num_neg: int
    num_eval_negatives: int
    epochs_per_cycle: tuple[int, ...]
    seed: int
    first_epoch: int = 0
    num_shards: int = NUM_SHARDS
    cycles_to_buffer: int = CYCLES_TO_BUFFER
    num_workers: int = DEFAULT_NUM_WORKERS
    mlperf_log_file: str = ""
    mlperf_log_format: str = mlperf_helper.MLLOG

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GenerationParams:
        values = json.loads(text)
        values["epochs_per_cycle"] = tuple(values["epochs_per_cycle"])
        return cls(**values)


_Info = TypeVar("_Info", bound="_ReadyInfo")


class _ReadyInfo:
    """A ready file holds every field of its info but where the folder is: the reader
    knows that, it waited there."""

    _LOCATION = ("index", "folder")

    def to_json(self) -> str:
        values = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name not in self._LOCATION
        }
        return json.dumps(values, sort_keys=True)

    @classmethod
    def from_json(cls: type[_Info], text: str, **location: int | str) -> _Info:
        """The info of ready file `text`, found at `location` (``folder``, ``index``)."""
        return cls(**json.loads(text), **location)


@dataclasses.dataclass(frozen=True)
class CycleInfo(_ReadyInfo):
    """A complete training cycle on disk (its ready file, and where it is).

    Attributes:
        index: Cycle number.
        folder: Where its shards are.
        epochs: Epochs it holds.
        batches_per_epoch: Batches per epoch (the last one padded).
        batch_size: Points per batch.
        num_shards: Shard files.
    """

    index: int
    folder: str
    epochs: int
    batches_per_epoch: int
    batch_size: int
    num_shards: int

    @property
    def num_batches(self) -> int:
        return self.epochs * self.batches_per_epoch


@dataclasses.dataclass(frozen=True)
class EvalInfo(_ReadyInfo):
    """The evaluation set on disk (its ready file, and where it is).

    Attributes:
        folder: Where its shards are.
        num_batches: Records (batches of users).
        users_per_batch: Users per record (the last record padded).
        block_size: Items per user: negatives then the held-out item.
        num_users: Real (unpadded) evaluation users.
        num_shards: Shard files.
    """

    folder: str
    num_batches: int
    users_per_batch: int
    block_size: int
    num_users: int
    num_shards: int


def write_ready(info: CycleInfo | EvalInfo) -> None:
    """Marks `info.folder` complete: call once every shard in it is closed."""
    atomic.write_file(ready_file(info.folder), info.to_json())


# ---------------------------------------------------------------------------
# Records: one whole batch per record, each array as its raw little-endian bytes


@dataclasses.dataclass(frozen=True)
class RecordField:
    """One array of a batch record: its stored dtype and shape."""

    dtype: np.dtype
    shape: tuple[int, ...]


_INDEX = np.dtype("<i4")  # dense user and item indexes
_FLAG = np.dtype("u1")  # a bool, as 0 or 1


def train_record(batch_size: int) -> dict[str, RecordField]:
    """A training batch: `batch_size` points, the padding ones with valid mask 0."""
    points = (batch_size,)
    return {
        constants.USER_COLUMN: RecordField(_INDEX, points),
        constants.ITEM_COLUMN: RecordField(_INDEX, points),
        constants.LABELS: RecordField(_FLAG, points),
        constants.VALID_POINT_MASK: RecordField(_FLAG, points),
    }


def eval_record(users_per_batch: int, block_size: int) -> dict[str, RecordField]:
    """An evaluation batch: per user a row of `block_size` items (negatives, then the
    held-out item) with their duplicate mask; padding users have valid mask 0."""
    users, blocks = (users_per_batch,), (users_per_batch, block_size)
    return {
        constants.USER_COLUMN: RecordField(_INDEX, users),
        constants.ITEM_COLUMN: RecordField(_INDEX, blocks),
        constants.DUPLICATE_MASK: RecordField(_FLAG, blocks),
        constants.VALID_POINT_MASK: RecordField(_FLAG, users),
    }


def encode_record(arrays: Mapping[str, np.ndarray], spec: Mapping[str, RecordField]) -> bytes:
    """One batch as one serialised ``tf.train.Example``, each array cast to its field.

    Raises:
        ValueError: The arrays are not the ones `spec` names, or not of its shapes.
    """
    if arrays.keys() != spec.keys():
        raise ValueError(f"batch arrays {sorted(arrays)} differ from the record's {sorted(spec)}")
    features = {}
    for key, field in spec.items():
        value = np.asarray(arrays[key])
        if value.shape != field.shape:
            raise ValueError(f"{key} has shape {value.shape}; the record holds {field.shape}")
        data = np.ascontiguousarray(value, dtype=field.dtype).tobytes()
        features[key] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[data]))
    return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()


# No tensor-dependent control flow to convert; autograph fails on the comprehension's
# closure ("closure mismatch") and warns at every input pipeline built.
@tf.autograph.experimental.do_not_convert
def decode_record(record: tf.Tensor, spec: Mapping[str, RecordField]) -> dict[str, tf.Tensor]:
    """The arrays of `record` (from `encode_record`), with their static shapes."""
    parsed = tf.io.parse_single_example(
        record, {key: tf.io.FixedLenFeature([], tf.string) for key in spec}
    )
    return {
        key: tf.reshape(tf.io.decode_raw(parsed[key], tf.as_dtype(field.dtype)), field.shape)
        for key, field in spec.items()
    }
