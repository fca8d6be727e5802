"""model_dir and the checkpoints in it: what both trainers (the Runner and the online
RecModel) do the same way.

- `prepare` checks the folder before anything is written there;
- `restore_latest` restores the newest checkpoint, or says in one line that it was
  made with other model flags or other data;
- `save_checkpoint` writes a checkpoint numbered by the training step and, when the disk is full
  or the folder read-only, removes what it had written and says which checkpoint is
  still the latest (optionally flushing it to disk first, for a caller that commits
  something on the strength of it).
"""

from __future__ import annotations

import contextlib
import gc
import glob
import logging as py_logging
import os
from collections.abc import Callable, Iterator

import tensorflow as tf
from absl import logging

from official.utils.misc import atomic, errors


class ModelDirError(Exception):
    """model_dir cannot be used, or a checkpoint in it cannot be restored or written;
    the message says what to do."""


def prepare(model_dir: str) -> None:
    """Creates `model_dir` and checks that it takes files, before anything is written
    there (checkpoints, summaries, the MLPerf log).

    Raises:
        ModelDirError: It is a file, or it cannot be created or written.
    """
    if tf.io.gfile.exists(model_dir) and not tf.io.gfile.isdir(model_dir):
        raise ModelDirError(
            f"--model_dir {model_dir} is a file, not a folder: give a folder for the "
            "checkpoints and logs"
        )
    probe = os.path.join(model_dir, f".write-test-{os.getpid()}")
    try:
        tf.io.gfile.makedirs(model_dir)
        with tf.io.gfile.GFile(probe, "w") as out:
            out.write("")
        tf.io.gfile.remove(probe)
    except (tf.errors.OpError, OSError) as error:
        raise ModelDirError(
            errors.write_failure(error, "checkpoints and logs", model_dir, "--model_dir")
        ) from None


def restore_latest(new_checkpoint: Callable[[], tf.train.Checkpoint], directory: str) -> str | None:
    """Restores the newest checkpoint in `directory` into the objects that
    `new_checkpoint()` holds; returns its path, or None when there is none.

    The restore goes through a checkpoint object of its own: a failed restore leaves
    that object holding the values it could not place, and it warns about each of them
    when freed. It is freed here, quietly; the error says all there is to say.

    Raises:
        ModelDirError: The checkpoint does not fit these objects.
    """
    latest = tf.train.latest_checkpoint(directory)
    if latest is None:
        return None
    mismatch = None
    checkpoint = new_checkpoint()
    with _quiet_tensorflow_warnings():
        try:
            status = checkpoint.restore(latest).assert_existing_objects_matched()
            status.expect_partial()  # every object matched; extras (save_counter) unused
        except (ValueError, AssertionError, tf.errors.OpError) as error:
            mismatch = str(error).strip().splitlines()[0] if str(error).strip() else ""
        del checkpoint
        gc.collect()
    if mismatch is not None:
        raise ModelDirError(
            f"the checkpoint {latest} was made with other model flags or other data "
            f"({mismatch}); resume with the flags it was trained with, or start over "
            "with --clean or another --model_dir"
        )
    return latest


def save_checkpoint(manager: tf.train.CheckpointManager, step: int, durable: bool = False) -> str:
    """Writes checkpoint `step` through `manager`; returns its path.

    Args:
        manager: Owns the directory and what is kept.
        step: The checkpoint's number (the training step).
        durable: Flush its files and the folder to disk before returning (local
            paths; object stores make a finished write durable themselves).

    Raises:
        ModelDirError: It could not be written (a full disk, no permission); what it
            had written is removed and the previous checkpoint stays the latest.
    """
    try:
        path = manager.save(checkpoint_number=step)
        if durable:
            _fsync_local(path)
    except (tf.errors.OpError, OSError) as error:
        _remove_partial(manager.directory, step)
        kept = manager.latest_checkpoint
        failure = errors.write_failure(
            error, f"checkpoint {step}", manager.directory, "--model_dir"
        )
        left = f"the last complete checkpoint is {kept}" if kept else "none was kept"
        raise ModelDirError(f"{failure}; {left}") from None
    return path


def _remove_partial(directory: str, step: int) -> None:
    """Deletes what a failed save of checkpoint `step` left (its ``_temp`` folder,
    files the checkpoint state does not point to)."""
    prefix = os.path.join(directory, f"ckpt-{step}")
    if prefix == tf.train.latest_checkpoint(directory):
        return  # an earlier, complete checkpoint of the same step
    for path in tf.io.gfile.glob(f"{prefix}_temp*") + tf.io.gfile.glob(f"{prefix}.*"):
        try:
            if tf.io.gfile.isdir(path):
                tf.io.gfile.rmtree(path)
            else:
                tf.io.gfile.remove(path)
        except tf.errors.OpError as error:
            logging.warning("could not remove %s: %s", path, error)


def _fsync_local(prefix: str) -> None:
    """Flushes a checkpoint's files and folder to disk (local paths), so that what is
    committed after it never outlives the data it vouches for."""
    if not atomic.is_local(prefix):
        return
    directory = os.path.dirname(prefix)
    for path in [*glob.glob(prefix + ".*"), os.path.join(directory, "checkpoint"), directory]:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


@contextlib.contextmanager
def _quiet_tensorflow_warnings() -> Iterator[None]:
    """TensorFlow's Python warnings are dropped while active (errors still show)."""
    tf_logger = py_logging.getLogger("tensorflow")
    level = tf_logger.level
    tf_logger.setLevel(py_logging.ERROR)
    try:
        yield
    finally:
        tf_logger.setLevel(level)
