"""NCF flags (Model Garden names and meanings) and the frozen configs built from them.

Only entry points (`create_ncf_data`, `ncf_main`) parse flags; they call
`data_config_from_flags` and pass the config inward, so library code never reads
``FLAGS``. Every ``define_*`` takes a `flag_values`, which lets tests parse command
lines without touching the process-wide flags.
"""

from __future__ import annotations

from absl import flags

from official.utils import flags as flags_core
from official.utils.flags import core
from recommendation import constants, movielens, synthetic_data
from recommendation.data_preprocessing import DataConfig


def define_data_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Flags that choose and prepare the dataset (used by every NCF entry point)."""
    fv = flag_values
    flags.DEFINE_enum(
        "dataset", movielens.ML_1M, list(movielens.DATASETS), "Dataset to train on.", flag_values=fv
    )
    flags.DEFINE_string(
        "data_dir",
        constants.DEFAULT_DATA_DIR,
        "Folder holding <dataset>/ (downloads land here too).",
        short_name="dd",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "cache_dir",
        "",
        "Where the preprocessing cache lives (default DATA_DIR/<dataset>); "
        "set it when DATA_DIR is read-only.",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "download_if_missing",
        True,
        "Download a missing MovieLens release from GroupLens.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "movielens_url",
        constants.MOVIELENS_URL,
        "Where MovieLens archives (and their .md5 files) are downloaded from.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "min_num_ratings",
        constants.MIN_NUM_RATINGS,
        "Users with fewer ratings are dropped.",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "ml_perf",
        False,
        "Match the MLPerf reference's data handling (ordering of same-second ratings).",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "seed",
        None,
        "Random seed; a fixed seed gives the same data and, on "
        "CPU, the same metrics. Synthetic data uses 0 when unset.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "cache_max_age_sec",
        constants.CACHE_INVALIDATION_SEC,
        "A preprocessing cache older than this is rebuilt.",
        flag_values=fv,
    )
    default = synthetic_data.SyntheticSpec()
    flags.DEFINE_integer(
        "synthetic_num_users", default.num_users, "Users of --dataset synthetic.", flag_values=fv
    )
    flags.DEFINE_integer(
        "synthetic_num_items", default.num_items, "Items of --dataset synthetic.", flag_values=fv
    )
    flags.DEFINE_integer(
        "synthetic_num_ratings",
        default.num_ratings,
        "Interactions of --dataset synthetic.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "ratings_file", None, "CSV or Parquet file of --dataset generic.", flag_values=fv
    )
    flags.DEFINE_string(
        "user_column", "user_id", "User id column of --ratings_file.", flag_values=fv
    )
    flags.DEFINE_string(
        "item_column", "item_id", "Item id column of --ratings_file.", flag_values=fv
    )
    flags.DEFINE_string(
        "timestamp_column",
        "timestamp",
        "Time column of --ratings_file ('' = file order is time order).",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "csv_separator", ",", "Field separator of a CSV --ratings_file.", flag_values=fv
    )
    for name in (
        "synthetic_num_users",
        "synthetic_num_items",
        "synthetic_num_ratings",
        "cache_max_age_sec",
    ):
        core.require_positive(name, flag_values=fv)
    flags.register_validator(
        "min_num_ratings",
        lambda value: value >= 2,
        message="--min_num_ratings must be at least 2 (one rating to train on, one to hold out)",
        flag_values=fv,
    )
    flags.register_multi_flags_validator(
        ["dataset", "ratings_file"],
        lambda values: values["dataset"] != movielens.GENERIC or bool(values["ratings_file"]),
        message="--dataset generic needs --ratings_file (a CSV or Parquet file)",
        flag_values=fv,
    )


def define_ncf_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Every flag of ``ncf_main``: data, model, optimiser, evaluation and run control."""
    fv = flag_values
    define_data_flags(fv)
    flags_core.define_base(default_model_dir=constants.DEFAULT_MODEL_DIR, flag_values=fv)
    flags_core.define_performance(fv)
    flags_core.define_distribution(fv)
    flags_core.define_benchmark(fv)
    flags.DEFINE_integer(
        "num_factors", 8, "Embedding width of the GMF (MF) part.", short_name="nf", flag_values=fv
    )
    flags.DEFINE_list(
        "layers",
        ["64", "32", "16", "8"],
        "Widths of the MLP layers; the first must be even (half user, half item embedding).",
        flag_values=fv,
    )
    flags.DEFINE_float("mf_regularization", 0.0, "L2 weight on the MF embeddings.", flag_values=fv)
    flags.DEFINE_list(
        "mlp_regularization",
        ["0.", "0.", "0.", "0."],
        "L2 weight of each MLP layer; one value per --layers entry.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "num_neg", 4, "Negatives sampled per training positive.", short_name="nn", flag_values=fv
    )
    flags.DEFINE_integer(
        "num_eval_negatives",
        constants.NUM_EVAL_NEGATIVES,
        "Negatives per evaluation user (the NCF paper split uses its own 99).",
        flag_values=fv,
    )
    flags.DEFINE_float(
        "learning_rate", 0.001, "Adam learning rate.", short_name="lr", flag_values=fv
    )
    flags.DEFINE_float("beta1", 0.9, "Adam beta1.", flag_values=fv)
    flags.DEFINE_float("beta2", 0.999, "Adam beta2.", flag_values=fv)
    flags.DEFINE_float("epsilon", 1e-8, "Adam epsilon.", flag_values=fv)
    flags.DEFINE_float(
        "hr_threshold",
        1.0,
        "Stop once HR@top_k reaches this value.",
        short_name="hr",
        flag_values=fv,
    )
    flags.DEFINE_integer("top_k", 10, "k of HR@k and NDCG@k.", flag_values=fv)
    flags.DEFINE_boolean(
        "output_ml_perf_compliance_logging",
        False,
        "Write an MLPerf compliance log.",
        flag_values=fv,
    )
    flags.DEFINE_boolean("use_xla_for_gpu", False, "Compile with XLA when on GPU.", flag_values=fv)
    for name in (
        "num_factors",
        "num_neg",
        "num_eval_negatives",
        "top_k",
        "learning_rate",
        "epsilon",
    ):
        core.require_positive(name, flag_values=fv)
    core.require_non_negative("mf_regularization", flag_values=fv)
    flags.register_validator(
        "layers",
        lambda value: layers_error(value) is None,
        message="--layers must be positive integers, the first even (e.g. 64,32,16,8)",
        flag_values=fv,
    )
    flags.register_multi_flags_validator(
        ["layers", "mlp_regularization"],
        lambda values: len(values["layers"]) == len(values["mlp_regularization"]),
        message="--mlp_regularization needs one value per --layers entry",
        flag_values=fv,
    )
    flags.register_validator(
        "mlp_regularization",
        lambda value: all(_is_non_negative_float(v) for v in value),
        message="--mlp_regularization values must be numbers >= 0",
        flag_values=fv,
    )
    for name in ("beta1", "beta2"):
        flags.register_validator(
            name,
            lambda value: 0 <= value < 1,
            message=f"--{name} must be in [0, 1)",
            flag_values=fv,
        )


def layers_error(layers: list[str]) -> str | None:
    """Why `layers` cannot describe the NeuMF MLP, or None if it can."""
    try:
        widths = [int(width) for width in layers]
    except ValueError:
        return "--layers must be integers"
    if not widths or min(widths) <= 0:
        return "--layers must be positive"
    if widths[0] % 2:
        return "--layers[0] must be even: it is split between user and item embeddings"
    return None


def _is_non_negative_float(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


def data_config_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> DataConfig:
    """The `DataConfig` described by parsed data flags."""
    fv = flag_values
    generic = None
    if fv.ratings_file:
        generic = movielens.GenericSource(
            path=fv.ratings_file,
            user_column=fv.user_column,
            item_column=fv.item_column,
            timestamp_column=fv.timestamp_column,
            separator=fv.csv_separator,
        )
    return DataConfig(
        dataset=fv.dataset,
        data_dir=fv.data_dir,
        cache_dir=fv.cache_dir,
        download_if_missing=fv.download_if_missing,
        url_base=fv.movielens_url,
        min_num_ratings=fv.min_num_ratings,
        ml_perf=fv.ml_perf,
        seed=fv.seed if fv.seed is not None else 0,
        synthetic=synthetic_data.SyntheticSpec(
            num_users=fv.synthetic_num_users,
            num_items=fv.synthetic_num_items,
            num_ratings=fv.synthetic_num_ratings,
            min_ratings_per_user=fv.min_num_ratings,
        ),
        generic=generic,
        cache_max_age_sec=fv.cache_max_age_sec,
    )
