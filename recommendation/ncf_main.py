"""Trains NeuMF in train/eval cycles until HR@k reaches --hr_threshold (``ncf-main``).

    ncf-main --dataset synthetic --train_epochs 3          # offline
    ncf-main --dataset ml-1m --data_dir DIR                # tuned ML-1M defaults
    ncf-main --config mlperf_ml20m --data_dir DIR          # a named experiment

Flags are parsed here only: `NcfConfig` carries them to the cycles
(`recommendation.training.cycles`), which say what a run does.
"""

from __future__ import annotations

from absl import app, flags

from official.core import signals
from official.core.model_dir import ModelDirError
from official.utils.misc import errors
from recommendation.data import movielens
from recommendation.producer import data_pipeline
from recommendation.serving import export_files
from recommendation.training import cycles, ncf_common, reporting


def main(argv: list[str]) -> None:
    del argv  # the flags parser refused any other argument
    config = ncf_common.ncf_config_from_flags(flags.FLAGS)
    with (
        signals.stop_on_signals(),
        errors.exit_on_user_errors(
            movielens.DataError,
            data_pipeline.ProducerError,
            export_files.ExportError,
            ModelDirError,
            ValueError,
        ),
    ):
        summary = cycles.run(config).summary
    print(reporting.summary_line(summary, config.model.top_k))


def run_main() -> None:
    """Console-script entry point (``ncf-main``)."""
    ncf_common.define_ncf_flags()
    app.run(main, flags_parser=ncf_common.flags_parser)


if __name__ == "__main__":
    run_main()
