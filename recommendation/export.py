"""Serving exports of a trained NeuMF: a self-contained SavedModel and, from it, ONNX.

    python -m recommendation.export --model_dir M --dataset ml-1m --data_dir D \
        --export_dir E [--export_onnx]

takes the latest checkpoint in ``--model_dir`` (with the same dataset and model flags
as the ``ncf-main`` run that wrote it) and exports it; ``ncf-main --export_dir E
[--export_onnx]`` does the same at the end of training.

The SavedModel speaks the dataset's raw ids (the ids of the ratings file), mapped
through the id maps of preprocessing:

- ``serving_default(user_id int64 [n], item_id int64 [n])`` -> ``logits``, ``scores``
  (probabilities) float32 `[n]` and ``known`` bool `[n]`;
- ``recommend(user_id int64 [n], k int32 [], exclude_seen bool [])`` -> ``item_ids``
  int64 `[n, k]` and ``scores`` float32 `[n, k]`, best first, and ``known`` bool `[n]`.
  With ``exclude_seen`` the user's training items are never returned.

Unknown ids are never looked up as some other row: their ``known`` is False, their
logits and scores are NaN and their recommended item ids -1. Slots past the last
item a user can still be recommended also hold -1 and NaN; k above the number of
items is cut to it.

Everything serving needs is inside the export: the id maps as assets
(``assets/user_ids.txt``, ``assets/item_ids.txt``: line i holds the raw id of index i),
the training interactions (CSR ``train_offsets`` / ``train_items``) and the index ->
raw item id map as variables beside the weights, and with ``--export_onnx`` the
scoring signature converted by tf2onnx as ``model.onnx`` (same inputs and outputs,
id maps included), checked against the SavedModel with onnxruntime before the export
is renamed into place.

`load_export` reads an export back (``recommend``, the ONNX check): a missing, damaged
or incomplete one is an `ExportError` that names the file and how to export again.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
from absl import app, flags, logging

from official.core import distribution_utils
from official.core.model_dir import ModelDirError
from official.core.runner import Runner
from official.utils.misc import atomic, errors
from recommendation.data import constants, movielens, preprocessing_cache
from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.model import neumf_model
from recommendation.model.network import NeuMF
from recommendation.training import ncf_common

ONNX_FILE = "model.onnx"
USER_IDS_FILE = "user_ids.txt"
ITEM_IDS_FILE = "item_ids.txt"
# The ONNX model must give the SavedModel's scores to this absolute tolerance.
ONNX_TOLERANCE = 1e-5
ONNX_OPSET = 17
_PARITY_SAMPLE = 1000


class ExportError(Exception):
    """An export could not be written, verified or read; the message says why and what
    to do."""


class ServingModule(tf.Module):
    """NeuMF behind the raw-id signatures described in the module docstring.

    Args:
        model: The trained model (its variables are shared, not copied).
        predict: ``features -> {"logits", "scores"}`` for dense indexes (the runner's
            PREDICT computation).
        data: The preprocessed data the model was trained on.
        asset_dir: Where the id-map files are written before the export copies them.
    """

    def __init__(
        self,
        model: NeuMF,
        predict: Callable[[dict], dict],
        data: PreprocessedData,
        asset_dir: str,
    ) -> None:
        super().__init__()
        self.model = model
        self._predict = predict
        self.num_items = data.num_items
        self.user_table = _id_table(_write_ids(asset_dir, USER_IDS_FILE, data.user_ids))
        self.item_table = _id_table(_write_ids(asset_dir, ITEM_IDS_FILE, data.item_ids))
        self.item_ids = tf.Variable(data.item_ids, trainable=False, name="item_ids")
        self.train_offsets = tf.Variable(data.train_offsets, trainable=False, name="offsets")
        self.train_items = tf.Variable(data.train_items, trainable=False, name="train_items")

    @tf.function(
        input_signature=[
            tf.TensorSpec([None], tf.int64, constants.USER_COLUMN),
            tf.TensorSpec([None], tf.int64, constants.ITEM_COLUMN),
        ]
    )
    def score(self, user_id: tf.Tensor, item_id: tf.Tensor) -> dict[str, tf.Tensor]:
        """``serving_default``: probabilities of (user, item) pairs given by raw id."""
        users, user_known = _lookup(self.user_table, user_id)
        items, item_known = _lookup(self.item_table, item_id)
        known = user_known & item_known
        predictions = self._predict({constants.USER_COLUMN: users, constants.ITEM_COLUMN: items})
        # Adds 0 (0 / 1) to known pairs and NaN (0 / 0) to unknown ones. tf2onnx turns
        # tf.where into a multiply-add, which would spread the NaN to every pair.
        nan_if_unknown = 0.0 / tf.cast(known, tf.float32)
        outputs = {key: value + nan_if_unknown for key, value in predictions.items()}
        return {**outputs, "known": known}

    @tf.function(
        input_signature=[
            tf.TensorSpec([None], tf.int64, constants.USER_COLUMN),
            tf.TensorSpec([], tf.int32, "k"),
            tf.TensorSpec([], tf.bool, "exclude_seen"),
        ]
    )
    def recommend(
        self, user_id: tf.Tensor, k: tf.Tensor, exclude_seen: tf.Tensor
    ) -> dict[str, tf.Tensor]:
        """``recommend``: each user's top-k items, scored against every item at once."""
        tf.debugging.assert_positive(k, message="k must be at least 1")
        users, known = _lookup(self.user_table, user_id)
        logits = tf.cast(self.model.score_all_items(users), tf.float32)
        logits = tf.where(self._seen(users) & exclude_seen, -np.inf, logits)
        top = tf.math.top_k(logits, tf.minimum(k, self.num_items))
        valid = (top.values > -np.inf) & known[:, None]
        return {
            "item_ids": tf.where(valid, tf.gather(self.item_ids, top.indices), -1),
            "scores": tf.where(valid, tf.sigmoid(top.values), np.nan),
            "known": known,
        }

    def _seen(self, users):
        """`(n, num_items)` bool: True where the item is among the user's training items."""
        starts = tf.gather(self.train_offsets, users)
        ends = tf.gather(self.train_offsets, users + 1)
        positions = tf.ragged.range(starts, ends)
        items = tf.cast(tf.gather(self.train_items, positions.flat_values), tf.int64)
        indices = tf.stack([positions.value_rowids(), items], axis=1)
        return tf.tensor_scatter_nd_update(
            tf.zeros([tf.size(users), self.num_items], tf.bool),
            indices,
            tf.ones_like(items, tf.bool),
        )


def _write_ids(asset_dir: str, name: str, raw_ids: np.ndarray) -> tf.saved_model.Asset:
    path = os.path.join(asset_dir, name)
    with tf.io.gfile.GFile(path, "w") as out:
        out.write("\n".join(map(str, raw_ids.tolist())) + "\n")
    return tf.saved_model.Asset(path)


def _id_table(asset: tf.saved_model.Asset) -> tf.lookup.StaticHashTable:
    """raw id (as a decimal string) -> index, -1 if unknown.

    String keys because tf2onnx turns only string <-> int64 tables into ONNX
    (``CategoryMapper``); the lookup is the same either way.
    """
    initializer = tf.lookup.TextFileInitializer(
        asset,
        tf.string,
        tf.lookup.TextFileIndex.WHOLE_LINE,
        tf.int64,
        tf.lookup.TextFileIndex.LINE_NUMBER,
    )
    return tf.lookup.StaticHashTable(initializer, default_value=-1)


def _lookup(table: tf.lookup.StaticHashTable, raw_ids: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(int32 indexes, known); unknown ids get index 0, to be masked by `known`.

    Never -1: Keras embeddings wrap negative indexes round to the last row.
    """
    # The reshape states the rank, which tf2onnx cannot infer for a table lookup.
    indexes = tf.reshape(table.lookup(tf.strings.as_string(raw_ids)), [-1])
    return tf.cast(tf.maximum(indexes, 0), tf.int32), indexes >= 0


def export_serving(
    runner: Runner, data: PreprocessedData, export_dir: str, onnx: bool = False
) -> float | None:
    """Exports `runner`'s model for serving, atomically (`write_saved_model`).

    Args:
        runner: Holds the trained NeuMF; its PREDICT computation is what is served.
        data: The data it was trained on (id maps, training interactions).
        export_dir: Destination folder.
        onnx: Also write ``model.onnx`` (tf2onnx) and check it against the SavedModel.
    Returns:
        With `onnx`, the largest absolute score difference of ONNX against the
        SavedModel on a sample of pairs; else None.
    Raises:
        ExportError: the ONNX conversion failed or does not match.
        ValueError: `export_dir` exists and is neither empty nor a SavedModel.
    """
    if onnx:
        require_onnx()
    parity: list[float] = []

    def add_onnx(saved_model_dir: str) -> None:
        onnx_path = os.path.join(saved_model_dir, ONNX_FILE)
        convert_to_onnx(saved_model_dir, onnx_path)
        parity.append(check_onnx_parity(saved_model_dir, onnx_path, _parity_sample(data)))

    with tempfile.TemporaryDirectory() as asset_dir:
        module = ServingModule(runner.state.model, runner.predict, data, asset_dir)
        signatures = {"serving_default": module.score, "recommend": module.recommend}
        write_saved_model(export_dir, module, signatures, add_onnx if onnx else None)
    logging.info("Exported a SavedModel for serving to %s", export_dir)
    return parity[0] if parity else None


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
    """
    export_dir = export_dir.rstrip("/")
    # Beside a folder the user named, a leftover should be seen: temporaries are
    # visible siblings (``<export_dir>.tmp-<pid>-<token>``).
    # On gs://, where the folder rename is a copy, saved_model.pb (what every SavedModel
    # reader looks for first) is written last and removed first when replaced.
    if tf.io.gfile.exists(export_dir) and not tf.io.gfile.isdir(export_dir):
        raise ValueError(f"export_dir {export_dir} is a file; choose a new or empty folder")
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


def require_onnx() -> None:
    """Fails early (before training) if the ONNX packages are missing."""
    try:
        import onnxruntime  # noqa: F401
        import tf2onnx  # noqa: F401
    except ImportError as error:
        raise ExportError(
            f"--export_onnx needs tf2onnx and onnxruntime ({error}); "
            "install them with pip install -e '.[onnx]'"
        ) from None


def convert_to_onnx(saved_model_dir: str, onnx_path: str) -> None:
    """Converts the ``serving_default`` signature with tf2onnx's command line.

    Its command line is tf2onnx's supported way to convert a SavedModel with lookup
    tables (its Python API has no SavedModel entry point); running it in a child
    process also keeps its graph resets and logging out of this one.
    """
    with tempfile.TemporaryDirectory() as scratch:
        local_path = os.path.join(scratch, ONNX_FILE)
        command = [
            sys.executable,
            "-m",
            "tf2onnx.convert",
            "--saved-model",
            saved_model_dir,
            "--signature_def",
            "serving_default",
            "--opset",
            str(ONNX_OPSET),
            "--output",
            local_path,
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not os.path.exists(local_path):
            raise ExportError(
                f"tf2onnx could not convert {saved_model_dir}: "
                f"{result.stderr.strip().splitlines()[-1:]}"
            )
        tf.io.gfile.copy(local_path, onnx_path, overwrite=True)


def check_onnx_parity(
    saved_model_dir: str, onnx_path: str, sample: tuple[np.ndarray, np.ndarray]
) -> float:
    """Largest |score difference| of the ONNX model against the SavedModel on `sample`.

    Raises:
        ExportError: a difference above `ONNX_TOLERANCE`, unknown ids treated
            differently (NaN in one, a score in the other), or a SavedModel that does
            not load (`load_export`).
    """
    import onnxruntime

    users, items = sample
    serving = load_export(saved_model_dir).signatures["serving_default"]
    expected = serving(user_id=tf.constant(users), item_id=tf.constant(items))["scores"].numpy()
    with tf.io.gfile.GFile(onnx_path, "rb") as stream:
        session = onnxruntime.InferenceSession(stream.read(), providers=["CPUExecutionProvider"])
    (scores,) = session.run(["scores"], {"user_id": users, "item_id": items})
    if not np.array_equal(np.isnan(scores), np.isnan(expected)):
        raise ExportError(f"{onnx_path} and the SavedModel disagree on which ids are unknown")
    known = ~np.isnan(expected)
    difference = float(np.max(np.abs(scores[known] - expected[known]), initial=0.0))
    if difference > ONNX_TOLERANCE:
        raise ExportError(
            f"{onnx_path} scores differ from the SavedModel's by up to {difference:.3g} "
            f"(tolerance {ONNX_TOLERANCE})"
        )
    logging.info("ONNX parity: max |score difference| %.3g over %d pairs", difference, len(users))
    return difference


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


def _parity_sample(data: PreprocessedData) -> tuple[np.ndarray, np.ndarray]:
    """Random known (user, item) raw-id pairs, plus one unknown id on each side."""
    rng = np.random.default_rng(0)
    users = rng.choice(data.user_ids, _PARITY_SAMPLE)
    items = rng.choice(data.item_ids, _PARITY_SAMPLE)
    users[0] = data.user_ids.max() + 1
    items[1] = data.item_ids.max() + 1
    return users.astype(np.int64), items.astype(np.int64)


# ---------------------------------------------------------------------------
# The command line


def export_from_checkpoint(config: ncf_common.NcfConfig) -> float | None:
    """Exports the latest checkpoint in ``config.model_dir`` (see `export_serving`);
    with ``--eval_split validation`` the weights of the epoch validation selected.

    Raises:
        ExportError: no checkpoint.
        ModelDirError: a checkpoint that does not fit the model flags.
        DataError: the data cannot be read.
    """
    if not config.export_dir:
        raise ExportError("--export_dir is required: where to write the export")
    if config.export_onnx:
        require_onnx()
    data = preprocessing_cache.load_or_build(config.data).data
    params = dataclasses.replace(config.model, num_users=data.num_users, num_items=data.num_items)
    strategy = distribution_utils.get_distribution_strategy("one_device", config.num_gpus)
    runner = Runner(
        neumf_model.model_fn, neumf_model.build_state, params, config.model_dir, strategy
    )
    if not runner.restore():
        raise ExportError(
            f"no checkpoint in --model_dir {config.model_dir}; train with ncf-main first"
        )
    if config.data.eval_split == constants.VALIDATION_SPLIT:
        runner.restore_best()
    return export_serving(runner, data, config.export_dir, config.export_onnx)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    config = ncf_common.ncf_config_from_flags(flags.FLAGS)
    with errors.exit_on_user_errors(ExportError, movielens.DataError, ModelDirError, ValueError):
        parity = export_from_checkpoint(config)
    line = f"exported {config.model_dir} to {config.export_dir}"
    if parity is not None:
        line += f" with {ONNX_FILE} (max |score difference| vs SavedModel {parity:.2g})"
    print(line)


if __name__ == "__main__":
    ncf_common.define_ncf_flags()
    app.run(main)
