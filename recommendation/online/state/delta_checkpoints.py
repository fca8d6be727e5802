"""Incremental checkpoints of an online model: between full checkpoints, what changed.

A full checkpoint (``ckpt-<step>``, `model_dir.save_checkpoint`) holds the whole model,
as large as its tables. A delta (``delta-<step>``) holds what changed since the
checkpoint before it, full or delta:

- every variable of the model's checkpoint that has no value per table row: the dense
  weights and their optimiser state, the tables' sizes, counters and clocks, the step
  and the stream position (kilobytes);
- of each hash table, `table_changes.ChangeTracking.take_changes`: the rows changed,
  with their ids and state, and the pending sightings changed or removed.

The manifest (`MANIFEST`) names the full checkpoint and its deltas in order. A delta's
files are flushed to disk before the manifest is replaced (atomically, flushed too), so
a process killed while writing one leaves the manifest as it was: a restore applies
the full checkpoint and the deltas listed, never a half-written one, and the stream
position committed after a checkpoint is always one a restore returns to. A listed
delta that no longer reads back (damaged on disk) ends the restore at the one before
it, with a warning.

A full checkpoint is written every `full_every` checkpoints, and as soon as the deltas
since the last one add up to its size (so a restore reads at most about twice a full
checkpoint); once its manifest is in place, the deltas before it are deleted. It is
written on TensorFlow's checkpoint thread (its async checkpoint: every value copied
first), so that training goes on while the model's whole tables go to disk; the
manifest names it, and its stream position is committed, once it is on disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator

import keras
import tensorflow as tf
from absl import logging

from official.core import model_dir
from official.core.model_dir import ModelDirError
from official.utils.misc import atomic, errors
from recommendation.online.tables import row_shards

MANIFEST = "deltas.json"
_PREFIX = "delta-"
_MANIFEST_KEYS = {"full", "full_bytes", "deltas", "delta_bytes"}


def _folder_bytes(prefix: str) -> int:
    return sum(tf.io.gfile.stat(path).length for path in tf.io.gfile.glob(prefix + ".*"))


def tables_and_state(rec_model) -> tuple[dict[str, object], dict[str, tf.Variable]]:
    """The row tables and the variables without a value per row, each by its path
    in the model's checkpoint (stable across processes that build the same model)."""
    root = rec_model.checkpoint
    view = tf.train.TrackableView(root)
    tables = {id(table): table for table in rec_model.row_tables()}
    per_row = {
        id(variable)
        for table in tables.values()
        for rows in table.row_variables().values()
        for variable in row_shards.shard_variables(rows)
    }
    found_tables, state, seen, queue = {}, {}, {id(root)}, [("", root)]
    while queue:
        path, parent = queue.pop(0)
        for name, child in view.children(parent).items():
            if id(child) in seen or (parent is root and name == "save_counter"):
                continue  # the count of saves of that checkpoint object: not the model's
            seen.add(id(child))
            child_path = f"{path}.{name}" if path else name
            if id(child) in tables:
                found_tables[child_path] = child
            if isinstance(child, (tf.Variable, keras.Variable)) and id(child) not in per_row:
                state[child_path] = child
            queue.append((child_path, child))
    return found_tables, state


def check_row_layout(rec_model, checkpoint: str) -> None:
    """Refuses a checkpoint whose tables' rows are split otherwise than the model's
    (one process against a cluster's ps tasks, or another ps count): a restore would
    match the tables and leave their rows unread.

    Raises:
        ModelDirError: Naming both layouts and what to do.
    """
    try:
        reader = tf.train.load_checkpoint(checkpoint)
    except (tf.errors.OpError, ValueError):
        return  # damaged: `model_dir.restore_latest` says so, or restores an older one
    tables, _ = tables_and_state(rec_model)

    def layout(count: int) -> str:
        return f"split over {count} ps tasks" if count else "in one process"

    for path, table in tables.items():
        rows_path = path.replace(".", "/") + "/embeddings"
        held = row_shards.shards_in_checkpoint(reader, rows_path)
        wanted = row_shards.num_shards(table.embeddings)
        if held != wanted:
            where = f"on a cluster of {held} ps tasks" if held else "without TF_CONFIG"
            raise ModelDirError(
                f"the checkpoint {checkpoint} holds the {table.name} rows {layout(held)}, "
                f"this run has them {layout(wanted)}: resume it {where}, or start over "
                "with --clean or another --model_dir"
            )


class DeltaCheckpoints:
    """Saves and restores a RecModel's checkpoints in `manager`'s folder, full or delta.

    Args:
        rec_model: The model (its `checkpoint` and its `row_tables`).
        manager: Where full checkpoints go and what is kept of them.
        full_every: Every how many checkpoints one is full (1: all of them).
    """

    def __init__(self, rec_model, manager: tf.train.CheckpointManager, full_every: int) -> None:
        if full_every <= 0:
            raise ValueError(f"full_every must be a positive number, got {full_every}")
        self.rec_model, self.manager, self.full_every = rec_model, manager, full_every
        self.directory = manager.directory
        # {"full": name, "full_bytes": n, "deltas": [names], "delta_bytes": n}; None: the
        # next checkpoint is full.
        self.manifest: dict | None = None
        # The full checkpoint being written: (path, step, set once on disk).
        self.writing: tuple[str, int, threading.Event] | None = None
        self._written_full: tuple[str, int] | None = None

    @staticmethod
    def _delta_checkpoint(
        state: dict[str, tf.Variable], changes: dict[str, dict[str, tf.Tensor]]
    ) -> tuple[tf.train.Checkpoint, dict[str, tf.Module]]:
        """A delta's checkpoint object: `state` and each table's `changes` (values to
        write, or empty ones of the right dtypes to read into), with the holders of
        the latter by table path."""
        holders = {}
        for path, tensors in changes.items():
            holders[path] = tf.Module()
            holders[path].changes = {
                name: tf.Variable(value, shape=[None, *value.shape[1:]], trainable=False)
                for name, value in tensors.items()
            }
        return tf.train.Checkpoint(state=state, tables=holders), holders

    # -- saving ---------------------------------------------------------------

    def next_is_full(self) -> bool:
        """Whether the next checkpoint is full: the first, the `full_every`-th since
        the last full one, once the deltas add up to it, or after a failed one."""
        manifest = self.manifest
        return (
            manifest is None
            or len(manifest["deltas"]) + 1 >= self.full_every
            or manifest["delta_bytes"] >= manifest["full_bytes"]
        )

    def save(self, step: int) -> tuple[str, str, int | None]:
        """Starts checkpoint `step`, full or delta; returns its path, ``"full"`` or
        ``"delta"``, and its bytes once written (None: later).

        A delta (what changed: small) is written here, durably: files, then manifest,
        each flushed to disk. A full checkpoint (the whole model: a second at 10^6 ids,
        seconds at 10^7) is written on TensorFlow's checkpoint thread while training
        goes on (every value copied first, `model_dir.save_checkpoint`), durably, its
        manifest last; `finish` says when, and no checkpoint starts before it.

        Raises:
            ModelDirError: It could not be written; the checkpoints before it stand,
                and the next one is full.
        """
        if self.writing is not None:
            raise RuntimeError(f"checkpoint {self.writing[0]} is being written: finish it first")
        full = self.next_is_full()
        self.manifest, manifest = None, self.manifest  # until this one is in place
        if full:
            self.rec_model.before_save()
            for table in self.rec_model.row_tables():
                table.clear_changes()
            written = threading.Event()

            def on_disk(path: str) -> None:  # on TensorFlow's checkpoint thread
                self._written_full = (path, _folder_bytes(path))
                written.set()

            path = model_dir.save_checkpoint(self.manager, step, durable=True, written=on_disk)
            self.writing = (path, step, written)
            return path, "full", None
        self.rec_model.before_save(trim=False)
        tables, state = tables_and_state(self.rec_model)
        changes = {path: table.take_changes() for path, table in tables.items()}
        prefix = os.path.join(self.directory, f"{_PREFIX}{step}")
        with self._write_failures(f"delta {step}", prefix):
            self._delta_checkpoint(state, changes)[0].write(prefix)
            model_dir.flush_to_disk(prefix)
            size = _folder_bytes(prefix)
            manifest = dict(manifest)
            manifest["deltas"] = [*manifest["deltas"], os.path.basename(prefix)]
            manifest["delta_bytes"] += size
            self._replace_manifest(manifest)
        return prefix, "delta", size

    def finish(self, wait: bool = True) -> tuple[str, int] | None:
        """Once the full checkpoint being written is on disk (at once, or after waiting
        for it with `wait`): lists it in the manifest, drops the deltas before it, and
        returns its path and bytes; None while it is being written, or if none is.

        Raises:
            ModelDirError: It could not be written; the checkpoints before it stand,
                and the next one is full.
        """
        if self.writing is None or not (wait or self.writing[2].is_set()):
            return None
        path, step, _ = self.writing
        self.writing = None
        model_dir.wait_for_checkpoint(self.rec_model.checkpoint, self.manager, step)
        path, size = self._written_full
        with self._write_failures(f"the manifest of checkpoint {step}"):
            name = os.path.basename(path)
            self._replace_manifest(
                {"full": name, "full_bytes": size, "deltas": [], "delta_bytes": 0}
            )
        self._remove_unlisted_deltas(self.manifest)
        return path, size

    @contextlib.contextmanager
    def _write_failures(self, what: str, prefix: str | None = None) -> Iterator[None]:
        """A write that fails (a full disk, no permission) becomes one ModelDirError
        naming `what`, and the files of delta `prefix` are removed."""
        try:
            yield
        except (tf.errors.OpError, OSError) as error:
            for leftover in tf.io.gfile.glob(prefix + ".*") if prefix else ():
                tf.io.gfile.remove(leftover)
            failure = errors.write_failure(error, what, self.directory, "--model_dir")
            raise ModelDirError(f"{failure}; the last complete checkpoint stands") from None

    def _replace_manifest(self, manifest: dict) -> None:
        atomic.write_file(
            os.path.join(self.directory, MANIFEST), json.dumps(manifest), durable=True
        )
        self.manifest = manifest

    def _remove_unlisted_deltas(self, manifest: dict) -> None:
        """Deletes the delta files `manifest` does not list (of an earlier full
        checkpoint, or left by a process killed while writing them)."""
        listed = set(manifest["deltas"])
        for path in tf.io.gfile.glob(os.path.join(self.directory, f"{_PREFIX}*")):
            if os.path.basename(path).split(".")[0] not in listed:
                try:
                    tf.io.gfile.remove(path)
                except tf.errors.OpError as error:  # only space is lost; the next may do
                    logging.warning("could not remove %s: %s", path, error)

    # -- restoring ------------------------------------------------------------

    def restore(self, full: str | None) -> str | None:
        """After `full` (the full checkpoint restored, or None) is restored: applies its
        deltas in order and rebuilds the tables' indexes from their rows; returns the
        last delta applied (None: none).

        Raises:
            ModelDirError: A delta does not fit this model (another run's flags).
        """
        manifest = self._read_manifest()
        if manifest is not None:  # (an unreadable one's deltas are left for a person)
            self._remove_unlisted_deltas(manifest)
        if full is None:
            return None
        tables, state = tables_and_state(self.rec_model)
        applied = []
        if manifest is None or manifest["full"] != os.path.basename(full):
            manifest = None  # the next checkpoint is full: no deltas build on `full`
        for name in manifest["deltas"] if manifest else ():
            prefix = os.path.join(self.directory, name)
            problem = self._apply(prefix, tables, state)
            if problem is not None:
                logging.warning(
                    "%s is damaged (%s): restored up to %s; the events trained after it "
                    "are trained again where their source can deliver them again",
                    prefix,
                    problem,
                    applied[-1] if applied else full,
                )
                break
            applied.append(prefix)
        for table in tables.values():
            # Also after a full checkpoint alone: the index it saved is rebuilt from
            # the rows' ids, which repairs one saved with an id held twice.
            table.reindex()
            table.clear_changes()
        if manifest and len(applied) == len(manifest["deltas"]):
            self.manifest = manifest  # later deltas build on it; else the next is full
        return applied[-1] if applied else None

    def _apply(self, prefix: str, tables: dict, state: dict[str, tf.Variable]) -> str | None:
        """Reads delta `prefix` whole into variables of its own (one read, its checksums
        verified), then applies it to the model; returns what makes it damaged instead
        (`model_dir.checkpoint_damage`), the model untouched, or None once applied.

        Raises:
            ModelDirError: It reads back but does not fit this model (another run's flags).
        """
        held = {
            path: tf.Variable(tf.zeros(variable.shape, variable.dtype), trainable=False)
            for path, variable in state.items()
        }
        empty = {
            path: {
                name: tf.zeros([0, *spec.shape[1:]], spec.dtype)
                for name, spec in table.change_specs().items()
            }
            for path, table in tables.items()
        }
        checkpoint, holders = self._delta_checkpoint(held, empty)
        try:
            checkpoint.read(prefix).assert_consumed()
        except (IndexError, AssertionError, ValueError, tf.errors.OpError) as error:
            # Damage, or other model flags: the delta read whole tells them apart and
            # says what is damaged (a read again, after a failed read only).
            problem = model_dir.checkpoint_damage(prefix)
            if problem is not None:
                return problem
            raise ModelDirError(
                f"the delta {prefix} was made with other model flags ({error}); resume "
                "with the flags it was trained with, or start over with --clean"
            ) from None
        for path, variable in state.items():
            variable.assign(held[path])
        for path, table in tables.items():
            table.apply_changes({k: v.read_value() for k, v in holders[path].changes.items()})
        return None

    def _read_manifest(self) -> dict | None:
        path = os.path.join(self.directory, MANIFEST)
        if not tf.io.gfile.exists(path):
            return None
        try:
            with tf.io.gfile.GFile(path) as file:
                manifest = json.load(file)
            if not isinstance(manifest, dict) or set(manifest) != _MANIFEST_KEYS:
                raise ValueError(f"not a manifest of {sorted(_MANIFEST_KEYS)}")
        except (ValueError, tf.errors.OpError) as error:
            logging.warning(
                "%s cannot be read (%s): its deltas are not restored; the events trained "
                "after the full checkpoint are trained again where their source can "
                "deliver them again",
                path,
                error,
            )
            return None
        return manifest
