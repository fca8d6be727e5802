"""The data producer: samples negatives and writes training cycles and the eval set.

Runs as its own process (``python -m recommendation.producer.data_async_generation --run_dir
DIR``), started by the trainer (`data_pipeline.ProducerHandle`), so sampling overlaps
training. What it reads and writes in the run folder, and in which order, is the
protocol of `run_folder`; the epochs and evaluation blocks come from
`negative_sampling`, and `shard_writing` writes them.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import sys
import time
from collections.abc import Callable

import tensorflow as tf
from absl import app, flags, logging

from official.utils.logs import mlperf_helper
from official.utils.misc import atomic, errors
from recommendation.data import constants, preprocessing_cache
from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.mlperf import mlperf_tags
from recommendation.producer import negative_sampling, run_folder, shard_writing, stat_utils
from recommendation.producer.run_folder import CycleInfo, EvalInfo, GenerationParams
from recommendation.producer.shard_writing import ShardWriter


class ProducerStopped(Exception):
    """The trainer went away or asked the producer to stop."""


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
        data = preprocessing_cache.read_cache(params.cache_path)
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
        blocks = negative_sampling.eval_blocks(
            data, params.num_eval_negatives, params.seed, pool, split
        )
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
        writers = shard_writing.open_writers(info.folder, info.num_shards, self.open_writer)
        shard_writing.write_shards(
            writers,
            lambda b: shard_writing.eval_batch(blocks, b, info.users_per_batch),
            run_folder.eval_record(info.users_per_batch, info.block_size),
            info.num_batches,
            pool,
        )
        shard_writing.close_writers(writers)
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
        writers = shard_writing.open_writers(folder, params.num_shards, self.open_writer)
        batches_per_epoch = 0
        for offset in range(epochs):
            if self.should_stop():
                raise ProducerStopped()
            self._progress(f"cycle {cycle}: sampling epoch {first_epoch + offset}")
            self.mlperf.event("input_step_train_neg_gen", epoch_num=first_epoch + offset)
            epoch = negative_sampling.training_epoch(
                data, exclusion, params.num_neg, params.seed, first_epoch + offset, pool
            )
            self.mlperf.event("input_size", len(epoch.users), epoch_num=first_epoch + offset)
            batches_per_epoch = -(-len(epoch.users) // params.batch_size)
            self._progress(f"cycle {cycle}: writing epoch {first_epoch + offset}")
            shard_writing.write_shards(
                writers,
                lambda b, e=epoch: shard_writing.train_batch(e, b, params.batch_size),
                record,
                batches_per_epoch,
                pool,
                first_batch=offset * batches_per_epoch,
            )
        shard_writing.close_writers(writers)
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
