"""Prepares a dataset (download, preprocess, cache) and prints its statistics.

    python -m recommendation.create_ncf_data --dataset ml-1m --data_dir DIR
    python -m recommendation.create_ncf_data --dataset synthetic   # offline

Exits non-zero with one line on bad input (missing, empty or malformed files, failed
downloads, corrupt archives, checksum mismatches, a folder that cannot be written or is
full); nothing half-written is left behind.
"""

from __future__ import annotations

from absl import app, flags

from official.utils.misc import errors
from recommendation.data import movielens, preprocessing_cache
from recommendation.training import ncf_common


def summary_lines(result: preprocessing_cache.LoadResult, dataset: str) -> list[str]:
    """Human-readable statistics of a prepared dataset."""
    data = result.data
    source = "loaded from cache" if result.from_cache else f"built ({result.reason})"
    negatives = (
        f"{data.eval_negatives.shape[1]} fixed per user"
        if data.eval_negatives is not None
        else "sampled"
    )
    return [
        f"dataset:             {dataset}",
        f"users:               {data.num_users:,}",
        f"items:               {data.num_items:,}",
        f"training positives:  {data.num_train_positives:,}",
        f"evaluation users:    {len(data.eval_items):,}",
        *(
            [f"validation users:    {len(data.validation_items):,}"]
            if data.validation_items is not None
            else []
        ),
        f"evaluation negatives: {negatives}",
        f"cache:               {result.cache_path} ({source})",
        f"time:                {result.seconds:.2f} s",
    ]


def main(argv: list[str]) -> None:
    del argv  # the flags parser refused any other argument
    config = ncf_common.data_config_from_flags(flags.FLAGS)
    with errors.exit_on_user_errors(movielens.DataError):
        result = preprocessing_cache.load_or_build(config)
    print("\n".join(summary_lines(result, config.dataset)))


def run_main() -> None:
    """Console-script entry point."""
    ncf_common.define_data_flags()
    app.run(main, flags_parser=errors.command_line_parser())


if __name__ == "__main__":
    run_main()
