"""The trainer's side of the data pipeline: the producer handle and `tf.data` inputs.

`ProducerHandle` starts the producer (`data_async_generation`) as a separate process,
hands it the generation parameters and waits for its ready files. While waiting it
watches the process and its progress file: if the producer exits or makes no
progress for `stall_timeout_sec`, the wait raises `ProducerError` naming the exit
status and the producer's log, so the trainer never hangs and never reads a folder
before its ready file exists. The producer and the run folder are removed on normal
exit and on exceptions, `signals.Interrupted` (SIGINT/SIGTERM, raised while waiting)
included.

The input functions read a folder's shards with parallel, deterministic interleaving,
parse one record into one whole batch and give static shapes, so steps compile once
(XLA, TPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import tensorflow as tf
from absl import logging

from official.core import signals
from official.core.runner import without_autotuning
from official.utils.misc import atomic, errors
from recommendation.data import constants
from recommendation.producer import data_async_generation, run_folder
from recommendation.producer.run_folder import CycleInfo, EvalInfo, GenerationParams

_STARTUP_TIMEOUT_SEC = 120.0
PREFETCH_BATCHES = 2  # batches decoded ahead of the step that needs them


class ProducerError(RuntimeError):
    """The data producer died or stopped making progress."""


class ProducerHandle:
    """The trainer's handle on the data producer of one training run (the producer
    itself is `data_async_generation.Producer`, in its own process): starts it, hands it
    its work, waits for its files and stops it. Entering starts the process and returns
    at once; `hand_over` (or the first wait for data) waits for it to be up and hands it
    `params`.

    Use as a context manager::

        with ProducerHandle(params, run_root) as producer:
            ...  # the trainer's own start-up, while the producer starts
            eval_info = producer.eval_data()
            for cycle in range(len(params.epochs_per_cycle)):
                info = producer.cycle(cycle)
                ...  # train on train_input_fn(info)
                producer.release(cycle)

    Args:
        params: What to generate.
        run_root: Parent of the per-run folder (a unique run id is appended, so runs
            sharing a data_dir never touch each other's files).
        use_subprocess: False runs the producer in a thread of this process (debugging).
        stall_timeout_sec: Longest wait without producer progress before failing.
        on_alive: Called once the producer is up, just before it is handed its work
            (where MLPerf starts the run's clock).
    """

    def __init__(
        self,
        params: GenerationParams,
        run_root: str,
        use_subprocess: bool = True,
        stall_timeout_sec: float = 300.0,
        on_alive: Callable[[], None] | None = None,
    ) -> None:
        self.params = params
        self.on_alive = on_alive
        self.run_dir = run_folder.new_run_dir(run_root)
        self.use_subprocess = use_subprocess
        self.stall_timeout_sec = stall_timeout_sec
        self.log_path = _producer_log_path(self.run_dir)
        self._process: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._stop_thread = threading.Event()
        self._handed_over = False

    # -- life cycle ---------------------------------------------------------

    def __enter__(self) -> ProducerHandle:
        try:
            self.launch()
        except BaseException:
            self.stop()  # a failed or interrupted start leaves no process or folder either
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def launch(self) -> None:
        """Starts the producer without waiting for it: it takes seconds to import
        TensorFlow, which the trainer can spend on its own start (`Runner.prepare`);
        `hand_over` then gives it its work.

        Raises:
            ProducerError: The run folder cannot be written.
        """
        try:
            tf.io.gfile.makedirs(self.run_dir)
        except (tf.errors.OpError, OSError) as error:
            folder = os.path.dirname(self.run_dir)
            raise ProducerError(
                errors.write_failure(error, "the producer's run folder", folder, "--cache_dir")
            ) from None
        if self.use_subprocess:
            with open(self.log_path, "ab") as log:
                self._process = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "recommendation.producer.data_async_generation",
                        f"--run_dir={self.run_dir}",
                        f"--trainer_pid={os.getpid()}",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
        else:
            self._thread = threading.Thread(
                target=self._run_in_thread, daemon=True, name="ncf-data-producer"
            )
            self._thread.start()

    def hand_over(self) -> None:
        """Waits for the producer to be alive and hands it the parameters; the first
        wait for data does it too, if not done yet.

        Raises:
            ProducerError: The producer failed or stalled on its way up.
        """
        if self._handed_over:
            return
        # Importing TensorFlow in a new process takes seconds: allow more than a stall.
        self._wait_for_file(
            os.path.join(self.run_dir, run_folder.ALIVE_FILE),
            "start-up",
            timeout_sec=max(self.stall_timeout_sec, _STARTUP_TIMEOUT_SEC),
        )
        if self.on_alive is not None:
            self.on_alive()
        atomic.write_file(os.path.join(self.run_dir, run_folder.PARAMS_FILE), self.params.to_json())
        self._handed_over = True
        logging.info(
            "Data producer started (%s); log: %s",
            f"pid {self._process.pid}" if self._process else "in-process",
            self.log_path,
        )

    def stop(self) -> None:
        """Stops the producer and removes the run folder (safe to call twice)."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._thread is not None:
            self._stop_thread.set()
            self._thread.join(timeout=60)
        if tf.io.gfile.exists(self.run_dir):
            tf.io.gfile.rmtree(self.run_dir)
        if not self.log_path.startswith(self.run_dir) and os.path.exists(self.log_path):
            os.remove(self.log_path)

    def _run_in_thread(self) -> None:
        try:
            data_async_generation.run(self.run_dir, self._stop_thread.is_set)
        except data_async_generation.ProducerStopped:
            pass
        except BaseException as error:  # reported to the trainer by the next wait
            logging.exception("Data producer failed")
            self._thread_error = error

    # -- waiting for data ---------------------------------------------------

    def eval_data(self, split: str = constants.TEST_SPLIT) -> EvalInfo:
        """Waits for the evaluation set of `split` (the validation set exists only when
        the data holds validation items)."""
        self.hand_over()
        folder = run_folder.eval_folder(self.run_dir, split)
        ready = self._wait_for_file(run_folder.ready_file(folder), f"the {split} set")
        return EvalInfo.from_json(ready, folder=folder)

    def cycle(self, index: int) -> CycleInfo:
        """Waits for training cycle `index` to be complete."""
        self.hand_over()
        folder = run_folder.cycle_folder(self.run_dir, index)
        ready = self._wait_for_file(run_folder.ready_file(folder), f"training cycle {index}")
        return CycleInfo.from_json(ready, index=index, folder=folder)

    def release(self, index: int) -> None:
        """Deletes a consumed cycle, making room for the producer to write ahead."""
        tf.io.gfile.rmtree(run_folder.cycle_folder(self.run_dir, index))

    def _wait_for_file(self, path: str, what: str, timeout_sec: float | None = None) -> str:
        """Waits for `path` and returns its text; fails once the producer exits or stalls
        for `timeout_sec`."""
        timeout_sec = timeout_sec or self.stall_timeout_sec
        progress_path = os.path.join(self.run_dir, run_folder.PROGRESS_FILE)
        last_progress, last_change = None, time.monotonic()
        while not tf.io.gfile.exists(path):
            signals.check()
            self._check_producer(what)
            progress = _mtime(progress_path)
            if progress != last_progress:
                last_progress, last_change = progress, time.monotonic()
            elif time.monotonic() - last_change > timeout_sec:
                raise ProducerError(
                    f"the data producer made no progress for {timeout_sec:g} s "
                    f"while the trainer waited for {what}; see {self.log_path} (raise "
                    f"--data_stall_timeout_sec if it is just slow)"
                )
            time.sleep(run_folder.POLL_SEC)
        with tf.io.gfile.GFile(path) as stream:
            return stream.read()

    def _check_producer(self, what: str) -> None:
        if self._process is not None:
            status = self._process.poll()
            if status is not None:
                cause = _failure(self.log_path)
                if cause:
                    raise ProducerError(
                        f"the data producer failed while the trainer waited for {what}: "
                        f"{cause}; it writes under {self.run_dir} (move it with --cache_dir "
                        f"to a writable folder with free space); its log is {self.log_path}"
                    )
                raise ProducerError(
                    f"the data producer exited with status {status} while the trainer waited "
                    f"for {what}; its log is {self.log_path}:\n{_tail(self.log_path)}"
                )
        elif self._thread_error is not None:
            raise ProducerError(f"the data producer failed: {self._thread_error!r}") from (
                self._thread_error
            )
        elif self._thread is not None and not self._thread.is_alive():
            raise ProducerError(f"the data producer stopped while the trainer waited for {what}")


def _producer_log_path(run_dir: str) -> str:
    """Where the producer's stdout and stderr go: a file the operating system can append
    to, so in the run folder when that is local, else (``gs://``) in a local
    temporary folder, named after the run; removed with the run folder either way."""
    if atomic.is_local(run_dir):
        return os.path.join(run_dir, run_folder.PRODUCER_LOG)
    name = f"{os.path.basename(run_dir)}.{run_folder.PRODUCER_LOG}"
    return os.path.join(tempfile.gettempdir(), name)


def _mtime(path: str) -> int | None:
    try:
        return tf.io.gfile.stat(path).mtime_nsec
    except tf.errors.NotFoundError:
        return None


def _failure(path: str) -> str:
    """The producer's own account of why it could not go on (its last `error:` line)."""
    try:
        with open(path, errors="replace") as log:
            found = [line for line in log if line.startswith(run_folder.FAILURE_PREFIX)]
    except OSError:
        return ""
    return found[-1][len(run_folder.FAILURE_PREFIX) :].strip() if found else ""


def _tail(path: str, lines: int = 10) -> str:
    try:
        with open(path, errors="replace") as log:
            return "".join(log.readlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------
# Input functions


def _read_records(folder: str, num_shards: int) -> tf.data.Dataset:
    """Records in batch order: one from each shard in turn, read in parallel."""
    files = tf.data.Dataset.from_tensor_slices(run_folder.shard_paths(folder, num_shards))
    return files.interleave(
        tf.data.TFRecordDataset,
        cycle_length=num_shards,
        block_length=1,
        num_parallel_calls=num_shards,
        deterministic=True,
    )


def _parsed_batches(records: tf.data.Dataset, parse: Callable) -> tf.data.Dataset:
    """`records` parsed in parallel and prefetched, with fixed parallelism and without
    tf.data's autotuning (`runner.without_autotuning` says why), wherever the dataset is
    iterated: the runner, or a script reading a cycle directly. Parsing is a few copies
    per batch; fixed parallelism keeps up."""
    batches = records.map(parse, num_parallel_calls=os.cpu_count() or 1, deterministic=True)
    return without_autotuning(batches.prefetch(PREFETCH_BATCHES))


def train_input_fn(info: CycleInfo) -> tf.data.Dataset:
    """`(features, labels)` batches of a cycle, in the order they were generated.

    features: ``user_id``, ``item_id`` `(batch,)` int32 and ``valid_point_mask``
    `(batch,)` bool (False on padding); labels: `(batch,)` float32 (1 = positive).
    """
    spec = run_folder.train_record(info.batch_size)

    def parse(record):
        batch = run_folder.decode_record(record, spec)
        features = {
            constants.USER_COLUMN: batch[constants.USER_COLUMN],
            constants.ITEM_COLUMN: batch[constants.ITEM_COLUMN],
            constants.VALID_POINT_MASK: tf.cast(batch[constants.VALID_POINT_MASK], tf.bool),
        }
        return features, tf.cast(batch[constants.LABELS], tf.float32)

    return _parsed_batches(_read_records(info.folder, info.num_shards), parse)


def train_batch_spec(batch_size: int) -> tuple[dict[str, tf.TensorSpec], tf.TensorSpec]:
    """The element spec of `train_input_fn`'s batches of `batch_size`, before any cycle
    exists (the pipeline is built, not read)."""
    return train_input_fn(CycleInfo(0, "", 1, 1, batch_size, 1)).element_spec


def eval_batch_spec(users_per_batch: int, block_size: int) -> dict[str, tf.TensorSpec]:
    """The element spec of `eval_input_fn`'s batches, before the evaluation set exists."""
    return eval_input_fn(EvalInfo("", 1, users_per_batch, block_size, 0, 1)).element_spec


def eval_input_fn(info: EvalInfo) -> tf.data.Dataset:
    """Evaluation batches of `users_per_batch` user blocks, flattened to points.

    features: ``user_id``, ``item_id``, ``duplicate_mask`` (bool) and
    ``valid_point_mask`` (bool, False for padding users), each `(users * block,)`;
    within each block of `block_size` points the last is the held-out item.
    """
    block = info.block_size
    spec = run_folder.eval_record(info.users_per_batch, block)

    def parse(record):
        batch = run_folder.decode_record(record, spec)
        return {
            constants.USER_COLUMN: tf.repeat(batch[constants.USER_COLUMN], block),
            constants.ITEM_COLUMN: tf.reshape(batch[constants.ITEM_COLUMN], [-1]),
            constants.DUPLICATE_MASK: tf.cast(
                tf.reshape(batch[constants.DUPLICATE_MASK], [-1]), tf.bool
            ),
            constants.VALID_POINT_MASK: tf.repeat(
                tf.cast(batch[constants.VALID_POINT_MASK], tf.bool), block
            ),
        }

    return _parsed_batches(_read_records(info.folder, info.num_shards), parse)


def synthetic_train_input_fn(
    batch_size: int, num_users: int, num_items: int, seed: int = 0, distinct_batches: int = 16
) -> tf.data.Dataset:
    """Endless random batches from memory, for pure throughput runs (no files).

    A few distinct batches are made once and repeated, so the input costs nothing.
    """
    generator = tf.random.Generator.from_seed(seed)
    shape = [distinct_batches, batch_size]
    features = {
        constants.USER_COLUMN: generator.uniform(shape, 0, num_users, dtype=tf.int32),
        constants.ITEM_COLUMN: generator.uniform(shape, 0, num_items, dtype=tf.int32),
        constants.VALID_POINT_MASK: tf.ones(shape, tf.bool),
    }
    labels = tf.cast(generator.uniform(shape, 0, 5, dtype=tf.int32) == 0, tf.float32)
    return tf.data.Dataset.from_tensor_slices((features, labels)).repeat()
