"""The files of a serving export: their names, a SavedModel written atomically (a
reader never sees half of one, locally or on gs://), and an export read back, with what
is damaged named.

`load_export` reads an export back (``recommend``, the ONNX check): a missing, damaged
or incomplete one is an `ExportError` that names the file and how to export again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from official.core import writer_lease
from official.utils.misc import atomic, errors

ONNX_FILE = "model.onnx"


USER_IDS_FILE = "user_ids.txt"


ITEM_IDS_FILE = "item_ids.txt"


class ExportError(Exception):
    """An export could not be written, verified or read; the message says why and what
    to do."""


def write_saved_model(
    export_dir: str,
    module: tf.Module,
    signatures: dict[str, Callable],
    finalize: Callable[[str], None] | None = None,
) -> None:
    """Saves `module` as the SavedModel in `export_dir`, never leaving a half-written one.

    Everything is written to a temporary sibling folder, which is renamed into place
    only once complete (`atomic.replace_folder`): a reader never sees a partial
    export, and a failure removes the temporary folder and leaves any earlier export
    untouched. On ``gs://`` the rename is a copy, object by object: there
    ``saved_model.pb`` is written last (and an earlier export's removed first), so
    `tf.saved_model.contains_saved_model` is true only of a complete export. What
    exports killed mid-way (their process is gone) left is cleaned up by the next
    export: temporary folders removed, an earlier export put back.

    Args:
        export_dir: Destination; replaced if it holds an earlier SavedModel.
        module: What is saved; it holds the variables its signatures use.
        signatures: Signature name -> a `tf.function` of `module` with an input
            signature.
        finalize: Called with the temporary folder once the SavedModel is written,
            before the rename: to add files derived from it, or to verify it.

    Raises:
        ValueError: `export_dir` exists and is neither empty nor a SavedModel.
        ExportError: it could not be written (a read-only folder, a full disk).
        ModelDirError: Another process took over its lease (`writer_lease.check_held`).
    """
    export_dir = export_dir.rstrip("/")
    # Beside a folder the user named, a leftover should be seen: temporaries are
    # visible siblings (``<export_dir>.tmp-<pid>-<token>``).
    # On gs://, where the folder rename is a copy, saved_model.pb (what every SavedModel
    # reader looks for first) is written last and removed first when replaced.
    if tf.io.gfile.exists(export_dir) and not tf.io.gfile.isdir(export_dir):
        raise ValueError(f"export_dir {export_dir} is a file; choose a new or empty folder")
    writer_lease.check_held(export_dir)  # not taken over while this run trained
    try:
        with atomic.replace_folder(
            export_dir, hidden=False, markers=(tf.saved_model.SAVED_MODEL_FILENAME_PB,)
        ) as temp_dir:
            if (
                tf.io.gfile.exists(export_dir)
                and tf.io.gfile.listdir(export_dir)
                and not tf.saved_model.contains_saved_model(export_dir)
                and not _export_remains(export_dir)
            ):
                raise ValueError(
                    f"export_dir {export_dir} exists and is not a SavedModel; "
                    "choose a new or empty folder"
                )
            tf.saved_model.save(module, temp_dir, signatures=signatures)
            if finalize is not None:
                finalize(temp_dir)
    except (OSError, tf.errors.OpError) as error:
        raise ExportError(
            errors.write_failure(error, "the export", export_dir, "--export_dir")
        ) from None


def _export_remains(export_dir: str) -> bool:
    """Whether `export_dir`, no SavedModel, is what an export on gs:// interrupted while
    it replaced or copied one left (saved_model.pb comes last and goes first there)."""
    if atomic.is_local(export_dir):
        return False
    names = {name.rstrip("/") for name in tf.io.gfile.listdir(export_dir)}
    return bool(names) and names <= {"assets", "variables", "fingerprint.pb", ONNX_FILE}


def load_export(export_dir: str) -> Any:
    """The SavedModel in `export_dir`, loaded (`tf.saved_model.load`).

    Raises:
        ExportError: there is no SavedModel there, or it is damaged or incomplete; the
            message names the file and says how to export it again.
    """
    how = (
        f"with ncf-main --export_dir {export_dir} or python -m recommendation.export "
        f"--model_dir MODEL_DIR --export_dir {export_dir} (and the training run's flags)"
    )
    if not tf.saved_model.contains_saved_model(export_dir):
        raise ExportError(f"no SavedModel in {export_dir}; export one {how}")
    try:
        return tf.saved_model.load(export_dir)
    # Kept to the load, so that no error of this program passes for a damaged file.
    except (OSError, ValueError, RuntimeError, IndexError, tf.errors.OpError) as error:
        damage = _damage(export_dir, error)
        if damage is None:
            raise  # the export could not be read (permissions, network): not damage
        raise ExportError(
            f"the export in {export_dir} is damaged or incomplete: {damage}; export it again {how}"
        ) from None


# The codes of the TensorFlow errors that a damaged SavedModel makes its load raise.
_DAMAGE_CODES = (
    tf.errors.UNKNOWN,
    tf.errors.DATA_LOSS,
    tf.errors.NOT_FOUND,
    tf.errors.FAILED_PRECONDITION,
)


def _damage(export_dir: str, error: Exception) -> str | None:
    """Which file of the SavedModel in `export_dir` made its load fail with `error`,
    and how (relative to `export_dir`); None if `error` is no sign of damage.

    TensorFlow's errors (2.21; each damage tried for real) seldom name the file, so it
    is found from the kind of error and by reading the parts again. A truncated or
    corrupt ``saved_model.pb`` does not parse (OSError), holds no graph (ValueError)
    or names unknown ops (RuntimeError). A missing variables file is an OpError or a
    FileNotFoundError; a corrupt ``variables.index`` an OpError; variables data
    failing its checksum an OpError or DataLossError, and reading short when
    truncated an IndexError. A missing id map is a FileNotFoundError, a truncated one
    a FailedPreconditionError (an id read twice).
    """
    pb = tf.saved_model.SAVED_MODEL_FILENAME_PB
    if (
        isinstance(error, (ValueError, RuntimeError))
        or type(error) is OSError
        or tf.io.gfile.isdir(os.path.join(export_dir, pb))
    ):
        return f"{pb} is corrupt"
    if isinstance(error, tf.errors.OpError) and error.error_code not in _DAMAGE_CODES:
        return None
    if isinstance(error, OSError) and not isinstance(error, FileNotFoundError):
        return None
    variables = tf.saved_model.VARIABLES_DIRECTORY
    if not tf.io.gfile.isdir(os.path.join(export_dir, variables)):
        return f"{variables}/ is missing"
    prefix = os.path.join(variables, tf.saved_model.VARIABLES_FILENAME)
    if not tf.io.gfile.exists(os.path.join(export_dir, f"{prefix}.index")):
        return f"{prefix}.index is missing"
    data = sorted(tf.io.gfile.glob(os.path.join(export_dir, f"{prefix}.data-*")))
    if not data:
        return f"{prefix}.data-* is missing"
    try:
        tf.train.load_checkpoint(os.path.join(export_dir, prefix))  # the index; data exists
    except tf.errors.OpError:
        return f"{prefix}.index is corrupt"
    id_maps = [
        os.path.join(tf.saved_model.ASSETS_DIRECTORY, name)
        for name in (USER_IDS_FILE, ITEM_IDS_FILE)
    ]
    if isinstance(error, (FileNotFoundError, tf.errors.NotFoundError)):
        missing = [
            name for name in id_maps if not tf.io.gfile.exists(os.path.join(export_dir, name))
        ]
        return f"{missing[0] if missing else 'a file it reads'} is missing"
    if isinstance(error, tf.errors.FailedPreconditionError):
        return f"{' or '.join(id_maps)} is corrupt (an id listed twice)"
    return (
        f"{', '.join(os.path.relpath(path, export_dir) for path in data)} is truncated or corrupt"
    )
