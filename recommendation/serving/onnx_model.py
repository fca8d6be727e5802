"""The ONNX model beside a SavedModel export: converted by tf2onnx from the
``serving_default`` signature, then checked against the SavedModel with onnxruntime
before the export is renamed into place."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
import tensorflow as tf
from absl import logging

from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.serving.export_files import ONNX_FILE, ExportError, load_export

# The ONNX model must give the SavedModel's scores to this absolute tolerance.
ONNX_TOLERANCE = 1e-5


ONNX_OPSET = 17


_PARITY_SAMPLE = 1000


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


def parity_sample(data: PreprocessedData) -> tuple[np.ndarray, np.ndarray]:
    """Random known (user, item) raw-id pairs, plus one unknown id on each side."""
    rng = np.random.default_rng(0)
    users = rng.choice(data.user_ids, _PARITY_SAMPLE)
    items = rng.choice(data.item_ids, _PARITY_SAMPLE)
    users[0] = data.user_ids.max() + 1
    items[1] = data.item_ids.max() + 1
    return users.astype(np.int64), items.astype(np.int64)
