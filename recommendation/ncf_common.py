"""NCF flags (Model Garden names and meanings) and the frozen configs built from them.

Only entry points (`create_ncf_data`, `ncf_main`) parse flags; they call
`data_config_from_flags` and pass the config inward, so library code never reads
``FLAGS``. Every ``define_*`` takes a `flag_values`, which lets tests parse command
lines without touching the process-wide flags.
"""

from __future__ import annotations

import dataclasses

from absl import flags, logging

from official.utils import flags as flags_core
from official.utils.flags import core
from official.utils.logs.mlperf_helper import MlperfOptions
from recommendation import constants, movielens, synthetic_data
from recommendation.data_preprocessing import DataConfig
from recommendation.neumf_model import EMBEDDING_INITS, ModelParams

# What `ncf-main --dataset X` uses for flags left unset: the reference's defaults
# stop at HR@10 0.164 on ML-1M; these were tuned on this project's CPU runs (see
# docs/benchmarks.md). The MLPerf ml-20m configuration is scripts/mlperf_ml20m.flags.
DATASET_DEFAULTS: dict[str, dict[str, object]] = {
    movielens.ML_1M: {
        "num_factors": 64,
        "layers": ["256", "256", "128", "64"],
        "mlp_regularization": ["0", "0", "0", "0"],
        "batch_size": 16384,
        "eval_batch_size": 160000,
        "learning_rate": 0.01,
        "train_epochs": 10,
        "enable_xla": True,
        "batches_per_step": 8,
    },
}
# The synthetic data is ML-1M-sized: the same configuration suits it.
DATASET_DEFAULTS[movielens.SYNTHETIC] = DATASET_DEFAULTS[movielens.ML_1M]


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


@dataclasses.dataclass(frozen=True)
class NcfConfig:
    """One training run, built from flags by `ncf_common.ncf_config_from_flags`; its
    defaults are the flags' defaults.

    Attributes:
        data: Which data, and how it is prepared.
        model_dir: Checkpoints, summaries; resumed from unless `clean`.
        clean: Start from scratch (delete model_dir).
        train_epochs, epochs_between_evals: Run length and evaluation cadence.
        batch_size, eval_batch_size: Global batch sizes (points).
        num_neg, num_eval_negatives: Negatives per positive / per evaluation user.
        hr_threshold: Stop once HR@top_k reaches it.
        model: NeuMF and optimiser hyper-parameters (sizes filled in from the data).
        seed: Fixes data and initialisation (None: random).
        use_synthetic_data: Train on random in-memory batches, no evaluation.
        batches_per_step: Training steps per compiled call.
        enable_xla: XLA-compile the step.
        use_xla_for_gpu: XLA-compile the step when the strategy runs on GPUs.
        run_eagerly: Run the steps as plain Python (debugging; no graphs, no XLA).
        inter_op_threads, intra_op_threads: TensorFlow thread pools (0: its choice).
        distribution_strategy, num_gpus, tpu: Where to run (`num_gpus` None: all).
        tpu_zone, tpu_project: Where the TPU named by `tpu` lives.
        worker_hosts, task_index: Multi-worker cluster without TF_CONFIG.
        use_subprocess: Run the data producer as its own process.
        data_stall_timeout_sec: Longest wait for a stalled producer.
        benchmark_log_dir, benchmark_test_id: JSON-lines benchmark log.
        export_dir: Export a SavedModel for serving there at the end.
        export_onnx: Also export the scoring signature as ONNX (into export_dir).
        mlperf: The MLPerf compliance log (None: none).
        flag_values: Every flag with the value the run used, for the benchmark log.
    """

    # The commands download a missing MovieLens release; DataConfig's own default (for
    # library callers) never touches the network.
    data: DataConfig = DataConfig(download_if_missing=True)
    model_dir: str = constants.DEFAULT_MODEL_DIR
    clean: bool = False
    train_epochs: int = 1
    epochs_between_evals: int = 1
    batch_size: int = 99000  # the reference's: a large batch, since NCF examples are tiny
    eval_batch_size: int | None = None
    num_neg: int = 4
    num_eval_negatives: int = constants.NUM_EVAL_NEGATIVES
    hr_threshold: float = 1.0
    model: ModelParams = ModelParams(num_users=0, num_items=0)
    seed: int | None = None
    use_synthetic_data: bool = False
    batches_per_step: int = 1
    enable_xla: bool = False
    use_xla_for_gpu: bool = False
    run_eagerly: bool = False
    inter_op_threads: int = 0
    intra_op_threads: int = 0
    distribution_strategy: str = "one_device"
    num_gpus: int | None = None
    tpu: str | None = None
    tpu_zone: str | None = None
    tpu_project: str | None = None
    worker_hosts: tuple[str, ...] = ()
    task_index: int = -1
    use_subprocess: bool = True
    data_stall_timeout_sec: float = 300.0
    benchmark_log_dir: str | None = None
    benchmark_test_id: str | None = None
    export_dir: str | None = None
    export_onnx: bool = False
    mlperf: MlperfOptions | None = None
    flag_values: dict = dataclasses.field(default_factory=dict)


def define_ncf_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Every flag of ``ncf_main``: data, model, optimiser, evaluation and run control."""
    fv = flag_values
    define_data_flags(fv)
    # The reference's NCF defaults: a large batch, since NCF examples are tiny.
    flags_core.define_base(
        default_model_dir=constants.DEFAULT_MODEL_DIR, default_batch_size=99000, flag_values=fv
    )
    flags_core.define_performance(fv)
    flags_core.define_distribution(fv)
    flags_core.define_benchmark(fv)
    flags_core.define_mlperf(fv)
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
    flags.DEFINE_enum(
        "embedding_init",
        "glorot_uniform",
        list(EMBEDDING_INITS),
        "Embedding-table initialiser: glorot_uniform (the MLPerf reference) or normal "
        "(N(0, 0.01^2), the NCF paper's code).",
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
        "weight_decay",
        0.0,
        "Decoupled weight decay (AdamW): each step shrinks every weight by "
        "weight_decay x learning rate of itself. Needs dense embedding updates.",
        flag_values=fv,
    )
    flags.DEFINE_float(
        "learning_rate_decay",
        1.0,
        "Multiply the learning rate by this once per epoch from --decay_start_epoch on "
        "(1 keeps it constant).",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "decay_start_epoch",
        0,
        "First epoch (0-based) trained at a rate decayed by --learning_rate_decay.",
        flag_values=fv,
    )
    flags.DEFINE_float(
        "hr_threshold",
        1.0,
        "Stop once HR@top_k reaches this value.",
        short_name="hr",
        flag_values=fv,
    )
    flags.register_validator(
        "hr_threshold",
        lambda value: 0.0 < value <= 1.0,
        message="--hr_threshold must be in (0, 1]: HR@k is the fraction of users hit",
        flag_values=fv,
    )
    flags.DEFINE_integer("top_k", 10, "k of HR@k and NDCG@k.", flag_values=fv)
    flags.DEFINE_boolean("use_xla_for_gpu", False, "Compile with XLA when on GPU.", flag_values=fv)
    flags.DEFINE_alias("use_xla", "enable_xla", flag_values=fv)
    flags.register_multi_flags_validator(
        ["run_eagerly", "enable_xla"],
        lambda values: not (values["run_eagerly"] and values["enable_xla"]),
        message="--run_eagerly runs no graphs, so there is nothing for --enable_xla to compile",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "batches_per_step",
        1,
        "Training steps per compiled call (fewer Python round trips).",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "sparse_embedding_updates",
        False,
        "Update only the embedding rows in each batch (lazy Adam) instead of "
        "dense Adam over whole tables (the MLPerf reference).",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "export_onnx",
        False,
        "With --export_dir, also write the scoring signature as EXPORT_DIR/model.onnx "
        "(tf2onnx; needs pip install -e '.[onnx]').",
        flag_values=fv,
    )
    flags.register_multi_flags_validator(
        ["export_onnx", "export_dir"],
        lambda values: not values["export_onnx"] or bool(values["export_dir"]),
        message="--export_onnx needs --export_dir: the ONNX model is written into it",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "use_subprocess",
        True,
        "Run the data producer as its own process (false: in-process, for debugging).",
        flag_values=fv,
    )
    flags.DEFINE_float(
        "data_stall_timeout_sec",
        300.0,
        "Fail if the data producer makes no progress for this long.",
        flag_values=fv,
    )
    for name in (
        "num_factors",
        "num_neg",
        "num_eval_negatives",
        "top_k",
        "learning_rate",
        "epsilon",
        "batches_per_step",
        "data_stall_timeout_sec",
    ):
        core.require_positive(name, flag_values=fv)
    core.require_non_negative("mf_regularization", flag_values=fv)
    core.require_non_negative("decay_start_epoch", flag_values=fv)
    core.require_non_negative("weight_decay", flag_values=fv)
    flags.register_multi_flags_validator(
        ["weight_decay", "sparse_embedding_updates"],
        lambda values: not (values["weight_decay"] and values["sparse_embedding_updates"]),
        message="--weight_decay shrinks every embedding row each step: it needs dense "
        "updates (drop --sparse_embedding_updates)",
        flag_values=fv,
    )
    flags.register_validator(
        "learning_rate_decay",
        lambda value: 0.0 < value <= 1.0,
        message="--learning_rate_decay must be in (0, 1]: the factor applied each epoch",
        flag_values=fv,
    )
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
    flags.register_multi_flags_validator(
        ["output_ml_perf_compliance_logging", "use_synthetic_data"],
        lambda values: (
            not (values["output_ml_perf_compliance_logging"] and values["use_synthetic_data"])
        ),
        message="--output_ml_perf_compliance_logging needs real training "
        "(--use_synthetic_data has no evaluation to log)",
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


def apply_dataset_defaults(flag_values: flags.FlagValues) -> dict[str, object]:
    """Sets the tuned defaults of --dataset for flags the user left unset."""
    applied = {}
    for name, value in DATASET_DEFAULTS.get(flag_values.dataset, {}).items():
        if not flag_values[name].present:
            flag_values[name].value = value
            applied[name] = value
    if applied:
        logging.info("Defaults for %s: %s", flag_values.dataset, applied)
    return applied


def ncf_config_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> NcfConfig:
    """The `NcfConfig` described by parsed NCF flags (with per-dataset defaults)."""
    fv = flag_values
    apply_dataset_defaults(fv)
    model = ModelParams(
        num_users=0,
        num_items=0,
        mf_dim=fv.num_factors,
        layers=tuple(int(width) for width in fv.layers),
        mf_regularization=fv.mf_regularization,
        mlp_regularization=tuple(float(value) for value in fv.mlp_regularization),
        embedding_init=fv.embedding_init,
        learning_rate=fv.learning_rate,
        beta1=fv.beta1,
        beta2=fv.beta2,
        epsilon=fv.epsilon,
        weight_decay=fv.weight_decay,
        learning_rate_decay=fv.learning_rate_decay,
        decay_start_epoch=fv.decay_start_epoch,
        top_k=fv.top_k,
        sparse_updates=fv.sparse_embedding_updates,
        dtype=fv.dtype,
        loss_scale=flags_core.loss_scale_from_flag(fv.loss_scale),
    )
    return NcfConfig(
        data=data_config_from_flags(fv),
        model_dir=fv.model_dir,
        clean=fv.clean,
        train_epochs=fv.train_epochs,
        epochs_between_evals=fv.epochs_between_evals,
        batch_size=fv.batch_size,
        eval_batch_size=fv.eval_batch_size,
        num_neg=fv.num_neg,
        num_eval_negatives=fv.num_eval_negatives,
        hr_threshold=fv.hr_threshold,
        model=model,
        seed=fv.seed,
        use_synthetic_data=fv.use_synthetic_data,
        batches_per_step=fv.batches_per_step,
        enable_xla=fv.enable_xla,
        use_xla_for_gpu=fv.use_xla_for_gpu,
        run_eagerly=fv.run_eagerly,
        inter_op_threads=fv.inter_op_parallelism_threads,
        intra_op_threads=fv.intra_op_parallelism_threads,
        distribution_strategy=fv.distribution_strategy,
        num_gpus=fv.num_gpus,
        tpu=fv.tpu,
        tpu_zone=fv.tpu_zone,
        tpu_project=fv.tpu_gcp_project,
        worker_hosts=tuple(fv.worker_hosts or ()),
        task_index=fv.task_index,
        use_subprocess=fv.use_subprocess,
        data_stall_timeout_sec=fv.data_stall_timeout_sec,
        benchmark_log_dir=fv.benchmark_log_dir,
        benchmark_test_id=fv.benchmark_test_id,
        export_dir=fv.export_dir,
        export_onnx=fv.export_onnx,
        mlperf=flags_core.mlperf_options_from_flags(
            fv, default_dir=fv.model_dir, benchmark=constants.MLPERF_BENCHMARK
        ),
        flag_values={
            name: fv[name].value
            for name in fv
            if fv[name].value is not None and not name.startswith(("help", "?"))
        },
    )
