"""The data producer: samples negatives and writes training cycles and the eval set.

Runs as its own process (``python -m recommendation.producer.data_async_generation --run_dir
DIR``), started by the trainer (`data_pipeline.ProducerHandle`), so sampling overlaps
training. What it reads and writes in the run folder, and in which order, is the
protocol of `run_folder`.

Every piece of random work draws from its own stream (`stat_utils.rng_for`, keyed
by seed, epoch and chunk), so the files are byte-identical for a given seed whatever
the number of workers.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import tensorflow as tf
from absl import app, flags, logging

from official.utils.logs import mlperf_helper
from official.utils.misc import atomic, errors
from recommendation.data import constants, data_preprocessing
from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.mlperf import mlperf_tags
from recommendation.producer import run_folder, stat_utils
from recommendation.producer.run_folder import CycleInfo, EvalInfo, GenerationParams, RecordField

# Stream tags of `stat_utils.rng_for`, one per kind of random work.
_NEGATIVES, _SHUFFLE, _EVAL, _BUCKET, _VALIDATION = 1, 2, 3, 4, 5
_CHUNK = 1 << 20  # sampling work unit (points); fixed so output ignores worker count
_SHUFFLE_BUCKETS = 64  # output ranges of the scatter shuffle; fixed for the same reason
_EVAL_CHUNK_USERS = 4096


class ProducerStopped(Exception):
    """The trainer went away or asked the producer to stop."""


# ---------------------------------------------------------------------------
# What is generated (pure functions of data, parameters and seed)


@dataclasses.dataclass(frozen=True)
class TrainingEpoch:
    """One shuffled epoch: every positive once plus `num_neg` negatives each.

    Attributes:
        users, items: `(points,)` int32.
        labels: `(points,)` bool, True for positives.
    """

    users: np.ndarray
    items: np.ndarray
    labels: np.ndarray


def training_epoch(
    data: PreprocessedData,
    exclusion: stat_utils.ExclusionIndex,
    num_neg: int,
    seed: int,
    epoch: int,
    pool: concurrent.futures.Executor,
    chunk_points: int = _CHUNK,
) -> TrainingEpoch:
    """Samples negatives for every training positive and shuffles the epoch.

    Negatives are drawn uniformly from the items the user has no training
    interaction with (the held-out items, test and validation, may be drawn, as the
    reference draws its test item: excluding them would tell the model which they are).

    The shuffle is a scatter shuffle, so every stage runs in parallel: each chunk of
    points sends each point to one of `_SHUFFLE_BUCKETS` output ranges drawn
    uniformly, then each range is permuted on its own. Every outcome of that is
    equally likely (a uniform permutation), and each draw is keyed by its chunk or
    range, so the bytes do not depend on the number of workers. `chunk_points` is
    the work unit (a fixed constant in production; tests make it small).
    """
    positive_users = data.train_users()
    negative_users = np.repeat(positive_users, num_neg)  # user-major: cache-friendly lookups
    num_positives = len(positive_users)
    num_points = num_positives + len(negative_users)
    starts = range(0, num_points, chunk_points)

    def scatter(index: int, start: int) -> _ScatteredChunk:
        stop = min(start + chunk_points, num_points)
        users, items, labels = [], [], []
        if start < num_positives:  # the chunk's positives
            end = min(stop, num_positives)
            users.append(positive_users[start:end])
            items.append(data.train_items[start:end])
            labels.append(np.ones(end - start, dtype=bool))
        if stop > num_positives:  # its negatives
            begin = max(start, num_positives) - num_positives
            chunk_users = negative_users[begin : stop - num_positives]
            rng = stat_utils.rng_for(seed, _NEGATIVES, epoch, index)
            users.append(chunk_users)
            items.append(exclusion.sample(rng, chunk_users))
            labels.append(np.zeros(len(chunk_users), dtype=bool))
        bucket = stat_utils.rng_for(seed, _BUCKET, epoch, index).integers(
            0, _SHUFFLE_BUCKETS, stop - start, dtype=np.uint8
        )
        order = np.argsort(bucket, kind="stable")
        counts = np.bincount(bucket, minlength=_SHUFFLE_BUCKETS)
        return _ScatteredChunk(
            columns=[np.concatenate(column)[order] for column in (users, items, labels)],
            bounds=np.concatenate([[0], np.cumsum(counts)]),
        )

    chunks = list(pool.map(scatter, range(len(starts)), starts))
    sizes = np.sum([np.diff(chunk.bounds) for chunk in chunks], axis=0, dtype=np.int64)
    bucket_bounds = np.concatenate([[0], np.cumsum(sizes)])
    columns = [np.empty(num_points, np.int32), np.empty(num_points, np.int32)]
    columns.append(np.empty(num_points, bool))

    def permute(bucket: int) -> None:
        order = stat_utils.rng_for(seed, _SHUFFLE, epoch, bucket).permutation(sizes[bucket])
        target = slice(bucket_bounds[bucket], bucket_bounds[bucket + 1])
        for column, out in enumerate(columns):
            gathered = np.concatenate(
                [c.columns[column][c.bounds[bucket] : c.bounds[bucket + 1]] for c in chunks]
            )
            out[target] = gathered[order]

    list(pool.map(permute, range(_SHUFFLE_BUCKETS if chunks else 0)))
    return TrainingEpoch(users=columns[0], items=columns[1], labels=columns[2])


@dataclasses.dataclass(frozen=True)
class _ScatteredChunk:
    """One chunk's points (users, items, labels) ordered by output range;
    range ``b`` holds rows ``bounds[b] .. bounds[b + 1]``."""

    columns: list[np.ndarray]
    bounds: np.ndarray


@dataclasses.dataclass(frozen=True)
class EvalBlocks:
    """Per evaluation user, a block of negatives followed by the held-out item.

    Attributes:
        users: `(num_users,)` int32.
        items: `(num_users, block)` int32; the last column is the held-out item, so
            it loses ties against negatives with the same score (the reference's rule).
        duplicate_mask: `(num_users, block)` bool; True marks a repeat of an item
            earlier in the block (the held-out item is never masked).
    """

    users: np.ndarray
    items: np.ndarray
    duplicate_mask: np.ndarray

    @property
    def block_size(self) -> int:
        return self.items.shape[1]


def eval_blocks(
    data: PreprocessedData,
    num_eval_negatives: int,
    seed: int,
    pool: concurrent.futures.Executor,
    split: str = constants.TEST_SPLIT,
) -> EvalBlocks:
    """Builds every user's evaluation block of `split`, a chunk of users per task.

    Sampled negatives come uniformly, with replacement, from the items the user never
    interacted with (training or held out, test and validation). Datasets with fixed
    negatives (the NCF paper's split) use them as given for the test set; their
    validation set samples `num_eval_negatives`, as every other dataset does, from a
    stream of its own.
    """
    validation = split == constants.VALIDATION_SPLIT
    held_out = data.validation_items if validation else data.eval_items
    fixed = None if validation else data.eval_negatives
    users = np.arange(data.num_users, dtype=np.int32)
    exclusion = _all_interactions(data) if fixed is None else None
    block = 1 + (num_eval_negatives if fixed is None else fixed.shape[1])
    items = np.empty((data.num_users, block), dtype=np.int32)
    mask = np.empty((data.num_users, block), dtype=bool)

    def build(start: int) -> None:
        chunk = users[start : start + _EVAL_CHUNK_USERS]
        if fixed is not None:
            negatives = fixed[chunk].astype(np.int32)
        else:
            stream = _VALIDATION if validation else _EVAL
            rng = stat_utils.rng_for(seed, stream, start // _EVAL_CHUNK_USERS)
            negatives = exclusion.sample(rng, np.repeat(chunk, num_eval_negatives))
            negatives = negatives.reshape(len(chunk), num_eval_negatives)
        # The positive goes first while masking, so a negative equal to it is the one
        # masked, then moves to the last column.
        rows = np.concatenate([held_out[chunk, None].astype(np.int32), negatives], axis=1)
        items[chunk] = np.roll(rows, -1, axis=1)
        mask[chunk] = np.roll(stat_utils.mask_duplicates(rows), -1, axis=1)

    list(pool.map(build, range(0, data.num_users, _EVAL_CHUNK_USERS)))
    return EvalBlocks(users=users, items=items, duplicate_mask=mask)


def _all_interactions(data: PreprocessedData) -> stat_utils.ExclusionIndex:
    """Exclusion index of each user's training items plus the held-out items."""
    held_out = [data.eval_items]
    if data.validation_items is not None:
        held_out.append(data.validation_items)
    every_user = np.arange(data.num_users, dtype=np.int32)
    users = np.concatenate([data.train_users(), *(every_user for _ in held_out)])
    items = np.concatenate([data.train_items, *held_out])
    order = np.argsort(users, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(users, minlength=data.num_users))])
    return stat_utils.ExclusionIndex.from_csr(offsets, items[order], data.num_items)


# ---------------------------------------------------------------------------
# How it is written


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


# ---------------------------------------------------------------------------
# The producer loop


class Producer:
    """Generates everything `params` asks for into `run_dir`.

    Args:
        run_dir: The run folder shared with the trainer.
        params: What to generate.
        should_stop: Called between pieces of work; True ends the run.
        mlperf: Where its MLPerf compliance events go (merged by the trainer).
        open_writer: Opens one shard file (`tf.io.TFRecordWriter`); a wrapper sees
            each shard close before the folder's ready file is written.
    """

    def __init__(
        self,
        run_dir: str,
        params: GenerationParams,
        should_stop,
        mlperf: mlperf_helper.MlperfLogger,
        open_writer: Callable[[str], ShardWriter] = tf.io.TFRecordWriter,
    ) -> None:
        self.run_dir = run_dir
        self.params = params
        self.should_stop = should_stop
        self.mlperf = mlperf
        self.open_writer = open_writer

    def run(self) -> None:
        params = self.params
        self._progress("loading data")
        data = data_preprocessing.read_cache(params.cache_path)
        exclusion = stat_utils.ExclusionIndex.from_csr(
            data.train_offsets, data.train_items, data.num_items
        )
        # Each negative is drawn independently: an item may repeat for a user.
        self.mlperf.event("input_hp_sample_train_replacement", True)
        with concurrent.futures.ThreadPoolExecutor(params.num_workers) as pool:
            if data.validation_items is not None:  # what the trainer evaluates first
                self._write_eval(data, pool, constants.VALIDATION_SPLIT)
            self._write_eval(data, pool, constants.TEST_SPLIT)
            epoch = params.first_epoch
            for cycle, epochs in enumerate(params.epochs_per_cycle):
                self._wait_for_room(cycle)
                self._write_cycle(cycle, epoch, epochs, data, exclusion, pool)
                epoch += epochs
        self._progress("done")

    def _write_eval(
        self, data: PreprocessedData, pool: concurrent.futures.Executor, split: str
    ) -> None:
        params = self.params
        self._progress(f"sampling {split} evaluation negatives")
        start = time.monotonic()
        self.mlperf.event("input_step_eval_neg_gen")
        blocks = eval_blocks(data, params.num_eval_negatives, params.seed, pool, split)
        self.mlperf.event("preproc_hp_num_eval", blocks.block_size - 1)
        # Sampled negatives are drawn with replacement; fixed ones are used as given.
        self.mlperf.event("preproc_hp_sample_eval_replacement", data.eval_negatives is None)
        info = EvalInfo(
            folder=run_folder.eval_folder(self.run_dir, split),
            num_batches=-(-len(blocks.users) // params.eval_users_per_batch),
            users_per_batch=params.eval_users_per_batch,
            block_size=blocks.block_size,
            num_users=len(blocks.users),
            num_shards=params.num_shards,
        )
        writers = open_writers(info.folder, info.num_shards, self.open_writer)
        write_shards(
            writers,
            lambda b: eval_batch(blocks, b, info.users_per_batch),
            run_folder.eval_record(info.users_per_batch, info.block_size),
            info.num_batches,
            pool,
        )
        close_writers(writers)
        run_folder.write_ready(info)
        logging.info(
            "%s set: %d users x %d items in %.1f s",
            "Validation" if split == constants.VALIDATION_SPLIT else "Evaluation",
            len(blocks.users),
            blocks.block_size,
            time.monotonic() - start,
        )

    def _wait_for_room(self, cycle: int) -> None:
        """Blocks while `cycles_to_buffer` earlier cycles are still unread."""
        while True:
            pending = [
                c
                for c in range(max(0, cycle - self.params.cycles_to_buffer), cycle)
                if tf.io.gfile.exists(run_folder.cycle_folder(self.run_dir, c))
            ]
            if len(pending) < self.params.cycles_to_buffer:
                return
            if self.should_stop():
                raise ProducerStopped()
            time.sleep(run_folder.POLL_SEC)

    def _write_cycle(self, cycle, first_epoch, epochs, data, exclusion, pool) -> None:
        params = self.params
        folder = run_folder.cycle_folder(self.run_dir, cycle)
        record = run_folder.train_record(params.batch_size)
        start = time.monotonic()
        writers = open_writers(folder, params.num_shards, self.open_writer)
        batches_per_epoch = 0
        for offset in range(epochs):
            if self.should_stop():
                raise ProducerStopped()
            self._progress(f"cycle {cycle}: sampling epoch {first_epoch + offset}")
            self.mlperf.event("input_step_train_neg_gen", epoch_num=first_epoch + offset)
            epoch = training_epoch(
                data, exclusion, params.num_neg, params.seed, first_epoch + offset, pool
            )
            self.mlperf.event("input_size", len(epoch.users), epoch_num=first_epoch + offset)
            batches_per_epoch = -(-len(epoch.users) // params.batch_size)
            self._progress(f"cycle {cycle}: writing epoch {first_epoch + offset}")
            write_shards(
                writers,
                lambda b, e=epoch: train_batch(e, b, params.batch_size),
                record,
                batches_per_epoch,
                pool,
                first_batch=offset * batches_per_epoch,
            )
        close_writers(writers)
        info = CycleInfo(
            index=cycle,
            folder=folder,
            epochs=epochs,
            batches_per_epoch=batches_per_epoch,
            batch_size=params.batch_size,
            num_shards=params.num_shards,
        )
        run_folder.write_ready(info)
        self._progress(f"cycle {cycle} ready")
        logging.info(
            "Cycle %d: %d epoch(s) of %d batches in %.1f s",
            cycle,
            epochs,
            batches_per_epoch,
            time.monotonic() - start,
        )

    def _progress(self, step: str) -> None:
        atomic.write_file(
            os.path.join(self.run_dir, run_folder.PROGRESS_FILE),
            json.dumps({"step": step, "time": time.time()}, sort_keys=True),
        )


def wait_for_params(run_dir: str, should_stop) -> GenerationParams:
    path = os.path.join(run_dir, run_folder.PARAMS_FILE)
    while not tf.io.gfile.exists(path):
        if should_stop():
            raise ProducerStopped()
        time.sleep(run_folder.POLL_SEC)
    with tf.io.gfile.GFile(path) as stream:
        return GenerationParams.from_json(stream.read())


def run(run_dir: str, should_stop) -> None:
    """The producer's life: announce, wait for parameters, generate everything."""
    atomic.write_file(
        os.path.join(run_dir, run_folder.ALIVE_FILE),
        json.dumps({"pid": os.getpid(), "time": time.time()}, sort_keys=True),
    )
    params = wait_for_params(run_dir, should_stop)
    mlperf = mlperf_helper.MlperfLogger(
        params.mlperf_log_file or None,
        params.mlperf_log_format,
        constants.MLPERF_BENCHMARK,
        mlperf_tags.V05_TAGS,
    )
    try:
        Producer(run_dir, params, should_stop, mlperf).run()
    finally:
        mlperf.close()


def main(argv: list[str]) -> None:
    del argv
    run_dir, trainer = flags.FLAGS.run_dir, flags.FLAGS.trainer_pid

    def trainer_gone() -> bool:
        # Reparented: the trainer died without stopping us (e.g. kill -9). Its pid
        # comes from the trainer itself: one read here could come after its death.
        return os.getppid() != trainer or not tf.io.gfile.exists(run_dir)

    # Ctrl-C in a terminal reaches the whole process group: the trainer decides what
    # happens, and stops this process itself (SIGTERM) once it has.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run(run_dir, trainer_gone)
    except ProducerStopped:
        logging.info("Trainer is gone; producer exits")
        if os.getppid() != trainer and tf.io.gfile.exists(run_dir):
            tf.io.gfile.rmtree(run_dir)  # nobody else will clean up
        sys.exit(0)
    except (OSError, tf.errors.OpError) as error:
        # A full disk, a read-only folder: the trainer reports this line as the cause.
        print(f"{run_folder.FAILURE_PREFIX}{errors.os_message(error)}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    flags.DEFINE_string("run_dir", None, "Run folder shared with the trainer.", required=True)
    flags.DEFINE_integer("trainer_pid", None, "The trainer that started this.", required=True)
    app.run(main)
