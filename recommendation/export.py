"""Serving exports of a trained NeuMF: a self-contained SavedModel and, from it, ONNX.

    python -m recommendation.export --model_dir M --dataset ml-1m --data_dir D \
        --export_dir E [--export_onnx]

takes the latest checkpoint in ``--model_dir`` (with the same dataset and model flags
as the ``ncf-main`` run that wrote it) and exports it; ``ncf-main --export_dir E
[--export_onnx]`` does the same at the end of training. An export folder that a live
trainer writes (its lease, `writer_lease.hold_export`) is refused before any work.

What the export holds is described in `recommendation.serving.serving_module`.
"""

from __future__ import annotations

from absl import app, flags

from official.core import writer_lease
from official.core.model_dir import ModelDirError
from official.utils.misc import errors
from recommendation.data import movielens
from recommendation.serving.export_files import ONNX_FILE, ExportError
from recommendation.serving.neumf_export import export_from_checkpoint
from recommendation.training import ncf_common


def main(argv: list[str]) -> None:
    del argv  # the flags parser refused any other argument
    config = ncf_common.ncf_config_from_flags(flags.FLAGS)
    with (
        errors.exit_on_user_errors(ExportError, movielens.DataError, ModelDirError, ValueError),
        writer_lease.hold_export(config.export_dir, "python -m recommendation.export"),
    ):
        parity = export_from_checkpoint(config)
    line = f"exported {config.model_dir} to {config.export_dir}"
    if parity is not None:
        line += f" with {ONNX_FILE} (max |score difference| vs SavedModel {parity:.2g})"
    print(line)


if __name__ == "__main__":
    ncf_common.define_ncf_flags()
    app.run(main, flags_parser=ncf_common.flags_parser)
