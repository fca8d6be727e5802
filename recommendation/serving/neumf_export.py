"""A trained NeuMF exported for serving: from the runner at the end of ncf-main, or
from the latest checkpoint of a model_dir (``python -m recommendation.export``)."""

from __future__ import annotations

import dataclasses
import os
import tempfile

from absl import logging

from official.core import distribution_utils
from official.core.runner import Runner
from recommendation.data import constants, preprocessing_cache
from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.model import neumf_model
from recommendation.serving.export_files import ONNX_FILE, ExportError, write_saved_model
from recommendation.serving.onnx_model import (
    check_onnx_parity,
    convert_to_onnx,
    parity_sample,
    require_onnx,
)
from recommendation.serving.serving_module import ServingModule
from recommendation.training import ncf_common


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
        parity.append(check_onnx_parity(saved_model_dir, onnx_path, parity_sample(data)))

    with tempfile.TemporaryDirectory() as asset_dir:
        module = ServingModule(runner.state.model, runner.predict, data, asset_dir)
        signatures = {"serving_default": module.score, "recommend": module.recommend}
        write_saved_model(export_dir, module, signatures, add_onnx if onnx else None)
    logging.info("Exported a SavedModel for serving to %s", export_dir)
    return parity[0] if parity else None


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
