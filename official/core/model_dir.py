"""model_dir and the checkpoints in it: what both trainers (the Runner and the online
RecModel) do the same way.

- `prepare` checks the folder before anything is written there;
- `restore_latest` restores the newest intact checkpoint (a damaged one is named, and
  the one before it restored), or says in one line that it was made with other model
  flags or other data;
- `save_checkpoint` writes a checkpoint numbered by the training step and, when the disk is full
  or the folder read-only, removes what it had written and says which checkpoint is
  still the latest (optionally flushing it to disk first, for a caller that commits
  something on the strength of it).
"""

from __future__ import annotations

import gc
import glob
import os
import re
import traceback
from collections.abc import Callable

import tensorflow as tf
from absl import logging

from official.utils.misc import atomic, errors

# The key of a checkpoint's object graph (`tf.train.Checkpoint` writes it).
_OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


class ModelDirError(Exception):
    """model_dir (or another folder a trainer writes, its --export_dir) cannot be used,
    or a checkpoint in it cannot be restored or written; the message says what to do."""


def prepare(folder: str, flag: str = "--model_dir", what: str = "checkpoints and logs") -> None:
    """Creates `folder` and checks that it takes files, before anything is written
    there (a model_dir's checkpoints, summaries and MLPerf log; exports) or any work is
    done for it.

    Args:
        folder: What `flag` names.
        flag: The flag, in the messages.
        what: What the folder is for, in the messages.

    Raises:
        ModelDirError: It is a file, or it cannot be created or written.
    """
    if tf.io.gfile.exists(folder) and not tf.io.gfile.isdir(folder):
        raise ModelDirError(
            f"{flag} {folder} is a file, not a folder: give a folder for the {what}"
        )
    probe = os.path.join(folder, f".write-test-{os.getpid()}")
    try:
        tf.io.gfile.makedirs(folder)
        with tf.io.gfile.GFile(probe, "w") as out:
            out.write("")
        tf.io.gfile.remove(probe)
    except (tf.errors.OpError, OSError) as error:
        raise ModelDirError(errors.write_failure(error, what, folder, flag)) from None


def restore_latest(
    new_checkpoint: Callable[[], tf.train.Checkpoint],
    directory: str,
    manager: tf.train.CheckpointManager | None = None,
    fallback_means: str = "",
) -> str | None:
    """Restores the newest intact checkpoint in `directory` into the objects that
    `new_checkpoint()` holds; returns its path, or None when there is none.

    A checkpoint is read once, by its restore (`_restore`): every tensor in it, those
    of objects not restored included, its checksums verified. One that does not read
    back (a truncated, changed or missing file) is damaged: it is named in a warning,
    with what is wrong, and the one before it is restored over it. That restore places
    every object again (a variable's value and shape, a table's contents), so nothing
    of the damaged one remains where some of it was placed before a read failed (on a
    cluster each task's tensors are placed as they are read; the tensors no object
    holds are read after the others are placed). Each restore goes through a
    checkpoint object of its own: a failed restore leaves that object holding the
    values it could not place, and it warns about each of them when freed. It is freed
    here, quietly; the error says all there is to say.

    Args:
        new_checkpoint: Makes a checkpoint object of the objects to restore.
        directory: The checkpoints' folder.
        manager: The manager that saves in `directory` from now on: it takes the
            restored checkpoint as its latest and leaves the damaged ones alone (never
            pruned in place of intact ones, nor counted among those it keeps; their
            files stay until a save of the same number replaces them).
        fallback_means: What restoring an older checkpoint means to the caller, for
            the warning.

    Raises:
        ModelDirError: The checkpoint does not fit these objects (another run's: no
            older one is tried), or every checkpoint there is damaged.
    """
    latest, damaged = None, []
    for path in _candidates(directory):
        checkpoint = new_checkpoint()
        with errors.quiet_tensorflow_warnings():
            try:
                problem = _restore(checkpoint, path)
            except _OtherModel as mismatch:
                # The restore's frames hold the checkpoint: freed now, quietly.
                traceback.clear_frames(mismatch.__traceback__)
                newer = f"{_named(damaged)}, and " if damaged else ""
                raise ModelDirError(
                    f"{newer}the checkpoint {path} was made with other model flags or other "
                    f"data ({mismatch}); resume with the flags it was trained with, or start "
                    "over with --clean or another --model_dir"
                ) from None
            finally:
                del checkpoint
                gc.collect()
        if problem is None:
            latest = path
            break
        damaged.append((path, problem))
    if latest is None:
        if damaged:
            raise _none_intact(directory, damaged)
        return None
    _remember_intact(latest)
    if damaged:
        logging.warning(
            "%s; restored %s, the newest intact checkpoint%s",
            _named(damaged),
            latest,
            f": {fallback_means}" if fallback_means else "",
        )
    if manager is not None:
        _go_on_from(manager, latest, [path for path, _ in damaged])
    return latest


class _OtherModel(Exception):
    """A checkpoint that reads back does not fit the objects restored from it."""


def _restore(checkpoint: tf.train.Checkpoint, prefix: str) -> str | None:
    """Restores checkpoint `prefix` into `checkpoint`'s objects, then reads the tensors
    they do not hold (`_read_unrestored`), so that every tensor in it is read once, its
    checksum verified; returns what makes it damaged (`checkpoint_damage`), or None
    once it is restored.

    Raises:
        _OtherModel: It reads back but does not fit the objects.
    """
    try:
        status = checkpoint.restore(prefix).assert_existing_objects_matched()
        status.expect_partial()  # every object matched; the values left are read below
        _read_unrestored(status, prefix)
    except (IndexError, ValueError, AssertionError, tf.errors.OpError) as error:
        # Damage, or other model flags: the checkpoint read whole tells them apart
        # and says what is damaged (a read again, after a failed restore only).
        problem = checkpoint_damage(prefix)
        if problem is None:
            raise _OtherModel(_first_line(error)) from None
        return problem
    return None


def _read_unrestored(status: tf.train.CheckpointLoadStatus, prefix: str) -> None:
    """Reads the tensors of checkpoint `prefix` that the restore behind `status` left
    unread (of objects the restore had none of: a weights-only restore leaves the
    optimiser's), in one read that verifies their checksums.

    Which ones it read is known to TensorFlow's restore coordinator only: its object
    graph, the nodes it matched and their attributes it left unused, as TensorFlow 2.21
    keeps them (setup.py pins that minor version). An attribute's key is the prefix of
    its tensors' keys (a table's ``.../table`` is saved as ``.../table-keys`` and
    ``.../table-values``).

    Raises:
        tf.errors.OpError: A tensor does not read back.
    """
    coordinator = status._checkpoint
    nodes = coordinator.object_graph_proto.nodes
    restored = tuple(
        attribute.checkpoint_key
        for node_id in coordinator.matched_proto_ids
        for attribute in nodes[node_id].attributes
        if attribute.name not in coordinator.unused_attributes.get(node_id, ())
    )
    dtypes = coordinator.dtype_map  # every tensor in the checkpoint, from its index
    unread = [
        key
        for key in dtypes
        if key != _OBJECT_GRAPH_KEY and not key.startswith(restored)  # (read first)
    ]
    if unread:
        tf.raw_ops.RestoreV2(
            prefix=prefix,
            tensor_names=unread,
            shape_and_slices=[""] * len(unread),
            dtypes=[dtypes[key] for key in unread],
        )


def newest_intact(directory: str) -> str | None:
    """The checkpoint in `directory` that `restore_latest` would restore (every tensor
    read back), or None when there is none.

    Candidates, newest first: the checkpoint state's latest, the rest of its list from
    the newest, then any other ``ckpt-<number>.index`` there, highest number first. One
    that this process restored, wrote or found intact before is not read again while
    its files keep the names, sizes and modification times they had then (a copy over
    it, a cut or a rewrite changes them; damage a disk does in place does not, and the
    next restore finds it): a stopped run names the checkpoint it leaves without
    reading it once more.

    Raises:
        ModelDirError: Every checkpoint there is damaged (naming each and what is wrong).
    """
    damaged = []
    for path in _candidates(directory):
        if path in _INTACT and _INTACT[path] == _files_of(path):
            return path
        problem = checkpoint_damage(path)
        if problem is None:
            _remember_intact(path)
            return path
        damaged.append((path, problem))
    if damaged:
        raise _none_intact(directory, damaged)
    return None


# Checkpoints this process read whole or wrote, by prefix: their files then (`_files_of`).
_INTACT: dict[str, tuple[tuple[str, int, int], ...]] = {}


def _files_of(prefix: str) -> tuple[tuple[str, int, int], ...]:
    """The name, size and modification time of each file of checkpoint `prefix`."""
    found = []
    for path in sorted(tf.io.gfile.glob(f"{prefix}.*")):
        stat = tf.io.gfile.stat(path)
        found.append((os.path.basename(path), stat.length, stat.mtime_nsec))
    return tuple(found)


def _remember_intact(prefix: str) -> None:
    _INTACT[prefix] = _files_of(prefix)


def _none_intact(directory: str, damaged: list[tuple[str, str]]) -> ModelDirError:
    return ModelDirError(
        f"no intact checkpoint in {directory}: {_named(damaged)}; train again with "
        f"--clean or another --model_dir (copy {directory} elsewhere first if its data "
        "matters)"
    )


def _candidates(directory: str) -> list[str]:
    """The checkpoints in `directory`, newest first: the state's (its latest, then its
    list from the end), then the other ``ckpt-<number>.index`` files, by number."""
    state = tf.train.get_checkpoint_state(directory)
    listed = (
        [state.model_checkpoint_path, *reversed(state.all_model_checkpoint_paths)]
        if state is not None
        else []
    )
    numbered = {}
    for index in tf.io.gfile.glob(os.path.join(directory, "ckpt-*.index")):
        found = re.fullmatch(r"ckpt-(\d+)\.index", os.path.basename(index))
        if found:
            numbered[index[: -len(".index")]] = int(found.group(1))
    by_number = sorted(numbered, key=numbered.get, reverse=True)
    return list(dict.fromkeys(listed + by_number))  # each once, in that order


def checkpoint_damage(prefix: str) -> str | None:
    """What makes checkpoint `prefix` unreadable (``"<file>: <what>"``), or None when
    every tensor in it reads back, its data checksums verified.

    TensorFlow's checkpoint reader raises an `OpError` for a missing data file, an
    index that is not a table, checksums that do not match, and an `IndexError` for
    a read past the end of a data file.
    """
    name = os.path.basename(prefix)
    if not tf.io.gfile.exists(f"{prefix}.index"):
        return f"{name}.index: missing"
    try:
        reader = tf.train.load_checkpoint(prefix)
    except tf.errors.OpError as error:
        return f"{name}.index: {_first_line(error)}"
    data_files = tf.io.gfile.glob(f"{prefix}.data-?????-of-?????")
    if not data_files:
        return f"{name}.data-*: missing"
    shard = os.path.basename(data_files[0]) if len(data_files) == 1 else f"{name}.data-*"
    try:
        for key in reader.get_variable_to_shape_map():
            reader.get_tensor(key)
    except IndexError:
        if len(data_files) > 1:
            return f"{shard}: truncated, shorter than the index lists"
        size = tf.io.gfile.stat(data_files[0]).length
        return f"{shard}: truncated, {size:,} bytes where the index lists more"
    except tf.errors.OpError as error:
        return f"{shard}: {_first_line(error)}"
    return None


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _named(damaged: list[tuple[str, str]]) -> str:
    """``X is damaged (file: what)``, or ``X (...) and Y (...) are damaged``."""
    listed = [f"{path} ({problem})" for path, problem in damaged]
    if len(listed) == 1:
        return f"{damaged[0][0]} is damaged ({damaged[0][1]})"
    return f"{', '.join(listed[:-1])} and {listed[-1]} are damaged"


def _go_on_from(manager: tf.train.CheckpointManager, restored: str, damaged: list[str]) -> None:
    """`manager` goes on from `restored`: its latest until it saves, and its damaged
    checkpoints leave its keeping (they drop out of the checkpoint state at its next
    save, and are not pruned in place of intact ones). CheckpointManager offers no
    public way to do this; its state is set as TensorFlow 2.21 keeps it (setup.py
    pins that minor version)."""
    for path in damaged:
        manager._maybe_delete.pop(path, None)
    manager._latest_checkpoint = restored


def save_checkpoint(
    manager: tf.train.CheckpointManager,
    step: int,
    durable: bool = False,
    written: Callable[[str], None] | None = None,
) -> str:
    """Writes checkpoint `step` through `manager`; returns its path.

    Args:
        manager: Owns the directory and what is kept.
        step: The checkpoint's number (the training step).
        durable: Flush its files and the folder to disk before returning (local
            paths; object stores make a finished write durable themselves).
        written: Write it on TensorFlow's checkpoint thread instead (its async
            checkpoint copies every value first, so the caller goes on at once), and
            call ``written(path)`` there once its files are on disk (flushed when
            `durable`); `wait_for_checkpoint` says when it is listed, or raises what
            failed.

    Raises:
        ModelDirError: It could not be written (a full disk, no permission); what it
            had written is removed and the previous checkpoint stays the latest.
    """
    if written is not None:
        _copy_keras_variables_once()

        def on_disk(path: str) -> None:
            if durable:
                flush_to_disk(path)
            _remember_intact(path)
            written(path)

        options = tf.train.CheckpointOptions(
            experimental_enable_async_checkpoint=True, experimental_write_callbacks=[on_disk]
        )
        return manager.save(checkpoint_number=step, options=options)
    try:
        path = manager.save(checkpoint_number=step)
        if durable:
            flush_to_disk(path)
    except (tf.errors.OpError, OSError) as error:
        raise _write_failure(manager, step, error) from None
    _remember_intact(path)
    return path


def _copy_keras_variables_once() -> None:
    """Lets TensorFlow's async checkpoint copy a Keras 3 variable more than once.

    Its copy to host memory, traced once, calls each trackable's
    ``_copy_trackable_to_cpu``; Keras 3's (keras/src/backend/tensorflow/core.py)
    makes a new ``tf.Variable`` at every call, which a traced function refuses after its
    first: the second async save of a Keras model failed. Here a Keras variable's copy
    is its value's copy, made once and assigned at every save (what is written is the
    value's tensors either way). Private to Keras: `tests/test_model_dir.py` saves twice
    and fails if this stops holding.
    """
    from keras.src.backend.tensorflow.core import Variable as KerasVariable

    def copy_to_cpu(self, object_map) -> None:
        self.value._copy_trackable_to_cpu(object_map)
        object_map[self] = object_map[self.value]

    KerasVariable._copy_trackable_to_cpu = copy_to_cpu


def wait_for_checkpoint(
    checkpoint: tf.train.Checkpoint, manager: tf.train.CheckpointManager, step: int
) -> None:
    """Waits for checkpoint `step`, written by `checkpoint` on TensorFlow's thread
    (`save_checkpoint` with `written`), until `manager` lists it, and flushes that list.

    Raises:
        ModelDirError: It could not be written (as `save_checkpoint`).
    """
    try:
        checkpoint.sync()
        flush_to_disk(os.path.join(manager.directory, "checkpoint"))
    except (tf.errors.OpError, OSError) as error:
        raise _write_failure(manager, step, error) from None


def _write_failure(
    manager: tf.train.CheckpointManager, step: int, error: Exception
) -> ModelDirError:
    """Removes what a failed save of checkpoint `step` left; the error that says so."""
    _remove_partial(manager.directory, step)
    kept = manager.latest_checkpoint
    failure = errors.write_failure(error, f"checkpoint {step}", manager.directory, "--model_dir")
    left = f"the last complete checkpoint is {kept}" if kept else "none was kept"
    return ModelDirError(f"{failure}; {left}")


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


def flush_to_disk(prefix: str) -> None:
    """Flushes the files of checkpoint `prefix`, the checkpoint state and the folder to
    disk (local paths), so that what is committed after it never outlives the data it
    vouches for."""
    if not atomic.is_local(prefix):
        return
    directory = os.path.dirname(prefix)
    for path in [*glob.glob(prefix + ".*"), os.path.join(directory, "checkpoint"), directory]:
        if os.path.exists(path):
            atomic.flush(path)
