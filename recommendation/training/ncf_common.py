"""NCF flags (Model Garden names and meanings) and the frozen configs built from them.

Each default is written once, in the config dataclasses (`NcfConfig` and the configs it
holds); the tables here (`DATA_FLAGS`, `GENERIC_FLAGS`, `NCF_FLAGS`) describe each flag
once and name the field it sets, and both the absl flags and the configs are generated
from them (`official.utils.flags.core`). `SHARED_FLAGS` are the rows ncf-online takes
into its own table (`online_main.ONLINE_FLAGS`), so a concept both programs have is one
flag. Flags are read only in the entry points' ``main()``: `create_ncf_data`,
``ncf_main`` and ``export`` call the builders here, ``online_main`` its own; the config
goes inward, so library code never reads ``FLAGS``. Every ``define_*`` takes a
`flag_values`, which lets tests parse command lines without the process-wide flags.
"""

from __future__ import annotations

import dataclasses

from absl import flags, logging

from official.utils import flags as flags_core
from official.utils.flags import core
from official.utils.flags.core import NON_NEGATIVE, POSITIVE, Check, FlagSpec, Rule
from official.utils.logs.mlperf_helper import MlperfOptions
from recommendation.data import constants, movielens, ratings_readers
from recommendation.data.data_preprocessing import DataConfig
from recommendation.model.hyperparams import EMBEDDING_INITS, MODEL_KINDS, OPTIMIZERS, ModelParams


@dataclasses.dataclass(frozen=True)
class NcfConfig:
    """One training run, built from flags by `ncf_config_from_flags`; it holds every
    default, and the flags take theirs from it.

    Attributes:
        data: Which data, and how it is prepared.
        model_dir: Checkpoints, summaries; resumed from unless `clean`.
        clean: Start from scratch (delete model_dir).
        train_epochs, epochs_between_evals: Run length and evaluation cadence.
        batch_size, eval_batch_size: Global batch sizes (points).
        num_neg, num_eval_negatives: Negatives per positive / per evaluation user.
        hr_threshold: Stop once HR@top_k reaches it.
        model: NeuMF and optimiser hyper-parameters (sizes filled in from the data).
        pretrain_gmf_dir, pretrain_mlp_dir: model_dirs of finished GMF and MLP runs on
            the same data, whose models start a fresh NeuMF run (both or neither).
        pretrain_alpha: The GMF model's weight in NeuMF's initial logit layer (the MLP
            model's is 1 - alpha).
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
        preset: The flags whose values came from the `DATASET_DEFAULTS` of the dataset
            (name -> value as a flag), because the user did not set them.
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
    pretrain_gmf_dir: str | None = None
    pretrain_mlp_dir: str | None = None
    pretrain_alpha: float = 0.5
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
    preset: dict[str, object] = dataclasses.field(default_factory=dict)
    flag_values: dict = dataclasses.field(default_factory=dict)


# What `ncf-main --dataset X` uses for flags left unset (field values by flag name): the
# reference's defaults stop at HR@10 0.164 on ML-1M; these were tuned on this project's
# CPU runs (see docs/benchmarks.md). A flag the user set, on the command line or in a
# flagfile, keeps its value. The MLPerf ml-20m configuration is scripts/mlperf_ml20m.flags.
DATASET_DEFAULTS: dict[str, dict[str, object]] = {
    movielens.ML_1M: {
        "num_factors": 64,
        "layers": (256, 256, 128, 64),
        "mlp_regularization": (0.0, 0.0, 0.0, 0.0),
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


def _valid_layers(layers: list[str]) -> bool:
    """Whether `layers` can describe the NeuMF MLP: positive integers, the first even
    (it is split between the user and the item embedding)."""
    try:
        widths = [int(width) for width in layers]
    except ValueError:
        return False
    return bool(widths) and min(widths) > 0 and widths[0] % 2 == 0


def _is_non_negative_float(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


# Concepts ncf-main and ncf-online share: one flag each (name, help, checks); each
# program's config holds its default (`online_main` moves --num_neg into its model).
NUM_FACTORS = FlagSpec(
    "num_factors",
    "Embedding width of the GMF (MF) part.",
    field="model.mf_dim",
    short_name="nf",
    checks=(POSITIVE,),
)
LAYERS = FlagSpec(
    "layers",
    "Widths of the MLP layers; the first must be even (half user, half item embedding).",
    field="model.layers",
    checks=(
        Check(
            _valid_layers,
            "--layers must be positive integers, the first even (e.g. 64,32,16,8)",
        ),
    ),
)
NUM_NEG = FlagSpec(
    "num_neg", "Negatives sampled per training positive.", short_name="nn", checks=(POSITIVE,)
)
LEARNING_RATE = FlagSpec(
    "learning_rate",
    "Learning rate of the optimiser.",
    field="model.learning_rate",
    short_name="lr",
    checks=(POSITIVE,),
)
TOP_K = FlagSpec("top_k", "k of HR@k and NDCG@k.", field="model.top_k", checks=(POSITIVE,))
SEED = FlagSpec(
    "seed",
    "Random seed of the initial weights, the sampling and generated data; with a fixed "
    "seed ncf-main gives the same data and, on CPU, the same metrics. Synthetic data uses "
    "0 when unset.",
)
SHARED_FLAGS = (NUM_FACTORS, LAYERS, NUM_NEG, LEARNING_RATE, TOP_K, SEED)

# Flags that choose and prepare the dataset (ncf-create-data, ncf-main, export), on
# `NcfConfig`.
DATA_FLAGS = (
    FlagSpec(
        "dataset", "Dataset to train on.", field="data.dataset", choices=tuple(movielens.DATASETS)
    ),
    FlagSpec(
        "data_dir",
        "Folder holding <dataset>/ (downloads land here too).",
        field="data.data_dir",
        short_name="dd",
    ),
    FlagSpec(
        "cache_dir",
        "Where the preprocessing cache lives (default DATA_DIR/<dataset>); "
        "set it when DATA_DIR is read-only.",
        field="data.cache_dir",
    ),
    FlagSpec(
        "download_if_missing",
        "Download a missing MovieLens release from GroupLens.",
        field="data.download_if_missing",
    ),
    FlagSpec(
        "movielens_url",
        "Where MovieLens archives (and their .md5 files) are downloaded from.",
        field="data.url_base",
    ),
    FlagSpec(
        "min_num_ratings",
        "Users with fewer ratings are dropped.",
        field="data.min_num_ratings",
        checks=(
            Check(
                lambda value: value >= 2,
                "--min_num_ratings must be at least 2 (one rating to train on, one to hold out)",
            ),
        ),
    ),
    FlagSpec(
        "ml_perf",
        "Match the MLPerf reference's data handling (ordering of same-second ratings).",
        field="data.ml_perf",
    ),
    FlagSpec(
        "eval_split",
        "What each train/eval cycle evaluates on. test: every user's last interaction "
        "(the MLPerf and NCF protocol). validation: the second-to-last (on the NCF paper "
        "split, the latest training line) is held out too; cycles evaluate on it "
        "(--hr_threshold included), and the run restores the epoch with the best "
        "validation HR and evaluates the test holdout once, on it.",
        field="data.eval_split",
        choices=constants.EVAL_SPLITS,
    ),
    SEED,
    FlagSpec(
        "cache_max_age_sec",
        "A preprocessing cache older than this is rebuilt.",
        field="data.cache_max_age_sec",
        checks=(POSITIVE,),
        kind=int,  # whole seconds, as ever (the field takes any number)
    ),
    FlagSpec(
        "synthetic_num_users",
        "Users of --dataset synthetic.",
        field="data.synthetic.num_users",
        checks=(POSITIVE,),
    ),
    FlagSpec(
        "synthetic_num_items",
        "Items of --dataset synthetic.",
        field="data.synthetic.num_items",
        checks=(POSITIVE,),
    ),
    FlagSpec(
        "synthetic_num_ratings",
        "Interactions of --dataset synthetic.",
        field="data.synthetic.num_ratings",
        checks=(POSITIVE,),
    ),
)

# The file of --dataset generic, on `ratings_readers.GenericSource` (built only with a file).
GENERIC_FLAGS = (
    FlagSpec(
        "ratings_file",
        "CSV or Parquet file of --dataset generic.",
        field="path",
        **core.EMPTY_AS_UNSET,
    ),
    FlagSpec("user_column", "User id column of --ratings_file."),
    FlagSpec("item_column", "Item id column of --ratings_file."),
    FlagSpec("timestamp_column", "Time column of --ratings_file ('' = file order is time order)."),
    FlagSpec("csv_separator", "Field separator of a CSV --ratings_file.", field="separator"),
    Rule(
        ("dataset", "ratings_file"),
        lambda values: values["dataset"] != movielens.GENERIC or bool(values["ratings_file"]),
        "--dataset generic needs --ratings_file (a CSV or Parquet file)",
    ),
)
_GENERIC_DEFAULTS = ratings_readers.GenericSource(path="")


def _in_unit_interval(value: float) -> bool:
    return 0 < value <= 1


# The model, optimiser and run flags of ncf-main, on `NcfConfig`.
NCF_FLAGS = (
    *flags_core.BASE_FLAGS,
    *core.at(
        flags_core.PERFORMANCE_FLAGS,
        dtype="model.dtype",
        loss_scale="model.loss_scale",
        inter_op_parallelism_threads="inter_op_threads",
        intra_op_parallelism_threads="intra_op_threads",
    ),
    *core.at(flags_core.DISTRIBUTION_FLAGS, tpu_gcp_project="tpu_project"),
    *flags_core.BENCHMARK_FLAGS,
    FlagSpec(
        "model",
        "What to train: neumf (GMF and MLP parts, one table per side of width "
        "--num_factors + --layers[0]/2), or the NCF paper's gmf (--num_factors wide "
        "tables, their element-wise product, a logit) or mlp (--layers[0]/2 wide tables, "
        "the MLP tower, a logit) alone, e.g. to pretrain NeuMF (--pretrain_gmf_dir); mf "
        "is gmf with the logit's weights fixed at 1 (a dot product plus a bias), whose "
        "tables --row_regularization holds back (a gmf logit's free weights undo it); an "
        "mf run pretrains the GMF part as a gmf run does.",
        field="model.model_kind",
        choices=MODEL_KINDS,
    ),
    *(
        FlagSpec(
            f"pretrain_{kind}_dir",
            f"model_dir of a finished ncf-main --model {kind} run on the same data and "
            "sizes; with --pretrain_gmf_dir and --pretrain_mlp_dir (both) a fresh "
            "--model neumf run starts from their models (the NCF paper's pre-training: "
            "tables side by side, the MLP's layers, the logit layers weighed by "
            "--pretrain_alpha), from the latest checkpoint, or for an --eval_split "
            "validation run the selected one (MODEL_DIR/best). A resumed run restores its "
            "own checkpoint instead.",
        )
        for kind in ("gmf", "mlp")
    ),
    FlagSpec(
        "pretrain_alpha",
        "Weight of the pretrained GMF model in NeuMF's initial logit layer, the MLP's "
        "being 1 - alpha: NeuMF's first logit is alpha x GMF's + (1 - alpha) x MLP's.",
        checks=(Check(lambda value: 0 <= value <= 1, "--pretrain_alpha must be in [0, 1]"),),
    ),
    FlagSpec(
        "optimizer",
        "adam (the reference), or sgd: plain SGD at --learning_rate (the NCF paper "
        "fine-tunes a pretrained NeuMF with it, having no Adam moments for the "
        "pretrained weights); --beta1, --beta2 and --epsilon are Adam's.",
        field="model.optimizer",
        choices=OPTIMIZERS,
    ),
    NUM_FACTORS,
    LAYERS,
    FlagSpec(
        "mf_regularization",
        "L2 weight on the MF embeddings (whole tables, once per step).",
        field="model.mf_regularization",
        checks=(NON_NEGATIVE,),
    ),
    FlagSpec(
        "row_regularization",
        "L2 weight on the embedding rows each training example looks up: every example "
        "adds it x (|user row|^2 + |item row|^2) to its loss, so a row is held back in "
        "proportion to its use, as per-example SGD matrix factorisation regularises "
        "(Rendle et al. 2020, whose reg is twice this); --mf_regularization weighs whole "
        "tables once a step.",
        field="model.row_regularization",
        checks=(NON_NEGATIVE,),
    ),
    FlagSpec(
        "mlp_regularization",
        "L2 weight of each MLP layer; one value per --layers entry.",
        field="model.mlp_regularization",
        checks=(
            Check(
                lambda value: all(_is_non_negative_float(v) for v in value),
                "--mlp_regularization values must be numbers >= 0",
            ),
        ),
    ),
    FlagSpec(
        "embedding_init",
        "Embedding-table initialiser: glorot_uniform (the MLPerf reference) or normal "
        "(N(0, --embedding_stddev^2)).",
        field="model.embedding_init",
        choices=tuple(EMBEDDING_INITS),
    ),
    FlagSpec(
        "embedding_stddev",
        "Standard deviation of --embedding_init normal: 0.01, the NCF paper's code's; "
        "Rendle et al.'s SGD matrix factorisation starts from 0.1.",
        field="model.embedding_stddev",
        checks=(POSITIVE,),
    ),
    NUM_NEG,
    FlagSpec(
        "num_eval_negatives",
        "Negatives per evaluation user (the NCF paper split uses its own 99).",
        checks=(POSITIVE,),
    ),
    LEARNING_RATE,
    *(
        FlagSpec(
            name,
            f"Adam {name}.",
            field=f"model.{name}",
            checks=(Check(lambda value: 0 <= value < 1, "--{flag} must be in [0, 1)"),),
        )
        for name in ("beta1", "beta2")
    ),
    FlagSpec("epsilon", "Adam epsilon.", field="model.epsilon", checks=(POSITIVE,)),
    FlagSpec(
        "weight_decay",
        "Decoupled weight decay (AdamW, or SGD's): each step shrinks every weight by "
        "weight_decay x learning rate of itself. Needs dense embedding updates.",
        field="model.weight_decay",
        checks=(NON_NEGATIVE,),
    ),
    FlagSpec(
        "learning_rate_decay",
        "Multiply the learning rate by this once per epoch from --decay_start_epoch on "
        "(1 keeps it constant).",
        field="model.learning_rate_decay",
        checks=(
            Check(
                _in_unit_interval,
                "--learning_rate_decay must be in (0, 1]: the factor applied each epoch",
            ),
        ),
    ),
    FlagSpec(
        "decay_start_epoch",
        "First epoch (0-based) trained at a rate decayed by --learning_rate_decay.",
        field="model.decay_start_epoch",
        checks=(NON_NEGATIVE,),
    ),
    FlagSpec(
        "hr_threshold",
        "Stop once HR@top_k reaches this value.",
        short_name="hr",
        checks=(
            Check(
                _in_unit_interval,
                "--hr_threshold must be in (0, 1]: HR@k is the fraction of users hit",
            ),
        ),
    ),
    TOP_K,
    FlagSpec("use_xla_for_gpu", "Compile with XLA when on GPU."),
    FlagSpec(
        "batches_per_step",
        "Training steps per compiled call (fewer Python round trips).",
        checks=(POSITIVE,),
    ),
    FlagSpec(
        "sparse_embedding_updates",
        "Update only the embedding rows in each batch (lazy Adam) instead of "
        "dense Adam over whole tables (the MLPerf reference).",
        field="model.sparse_updates",
    ),
    FlagSpec(
        "export_onnx",
        "With --export_dir, also write the scoring signature as EXPORT_DIR/model.onnx "
        "(tf2onnx; needs pip install -e '.[onnx]').",
    ),
    FlagSpec(
        "use_subprocess",
        "Run the data producer as its own process (false: in-process, for debugging).",
    ),
    FlagSpec(
        "data_stall_timeout_sec",
        "Fail if the data producer makes no progress for this long.",
        checks=(POSITIVE,),
    ),
    Rule(
        ("run_eagerly", "enable_xla"),
        lambda values: not (values["run_eagerly"] and values["enable_xla"]),
        "--run_eagerly runs no graphs, so there is nothing for --enable_xla to compile",
    ),
    Rule(
        ("export_onnx", "export_dir"),
        lambda values: not values["export_onnx"] or bool(values["export_dir"]),
        "--export_onnx needs --export_dir: the ONNX model is written into it",
    ),
    Rule(
        ("distribution_strategy", "sparse_embedding_updates"),
        lambda values: (
            not (values["distribution_strategy"] == "tpu" and values["sparse_embedding_updates"])
        ),
        "--sparse_embedding_updates finds a batch's rows with tf.unique, whose output "
        "shape depends on the data, and TPUs need static shapes: use dense updates (the "
        "MLPerf reference's) on TPU",
    ),
    Rule(
        ("weight_decay", "sparse_embedding_updates"),
        lambda values: not (values["weight_decay"] and values["sparse_embedding_updates"]),
        "--weight_decay shrinks every embedding row each step: it needs dense "
        "updates (drop --sparse_embedding_updates)",
    ),
    Rule(
        ("embedding_init", "embedding_stddev"),
        lambda values: (
            values["embedding_init"] == "normal"
            or values["embedding_stddev"] == ModelParams.embedding_stddev
        ),
        "--embedding_stddev is the spread of --embedding_init normal: add --embedding_init "
        "normal, or drop --embedding_stddev",
    ),
    Rule(
        ("layers", "mlp_regularization"),
        lambda values: len(values["layers"]) == len(values["mlp_regularization"]),
        "--mlp_regularization needs one value per --layers entry",
    ),
    Rule(
        ("output_ml_perf_compliance_logging", "use_synthetic_data"),
        lambda values: (
            not (values["output_ml_perf_compliance_logging"] and values["use_synthetic_data"])
        ),
        "--output_ml_perf_compliance_logging needs real training "
        "(--use_synthetic_data has no evaluation to log)",
    ),
)

# Other names of flags (alias -> flag), the Model Garden's.
_ALIASES = {"use_xla": "enable_xla"}


def define_data_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Flags that choose and prepare the dataset (ncf-create-data; ncf-main and export
    through `define_ncf_flags`)."""
    core.define_flags(DATA_FLAGS, NcfConfig(), flag_values)
    core.define_flags(GENERIC_FLAGS, _GENERIC_DEFAULTS, flag_values)


def define_ncf_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Every flag of ``ncf_main``: data, model, optimiser, evaluation and run control."""
    define_data_flags(flag_values)
    flags_core.define_mlperf(flag_values)
    core.define_flags(NCF_FLAGS, NcfConfig(), flag_values)
    for alias, name in _ALIASES.items():
        flags.DEFINE_alias(alias, name, flag_values=flag_values)


def data_config_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> DataConfig:
    """The `DataConfig` described by parsed data flags."""
    return _data_config(core.config_from_flags(DATA_FLAGS, NcfConfig(), flag_values), flag_values)


def _data_config(config: NcfConfig, flag_values: flags.FlagValues) -> DataConfig:
    """`config.data` with the fields that follow from other flags: the generator's seed
    (--seed, 0 when unset), the synthetic users' minimum (--min_num_ratings) and the
    generic source (--ratings_file)."""
    data = config.data
    generic = None
    if flag_values.ratings_file:
        generic = core.config_from_flags(GENERIC_FLAGS, _GENERIC_DEFAULTS, flag_values)
    return dataclasses.replace(
        data,
        seed=config.seed if config.seed is not None else 0,
        synthetic=dataclasses.replace(data.synthetic, min_ratings_per_user=data.min_num_ratings),
        generic=generic,
    )


def ncf_config_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> NcfConfig:
    """The `NcfConfig` described by parsed NCF flags, with the `DATASET_DEFAULTS` of
    --dataset for the flags the user left unset (logged, and kept in `preset`)."""
    fv = flag_values
    table = (*DATA_FLAGS, *NCF_FLAGS)
    config = core.config_from_flags(table, NcfConfig(), fv)
    config, preset = core.apply_preset(
        table, config, DATASET_DEFAULTS.get(config.data.dataset, {}), fv
    )
    if preset:
        logging.info("Preset of --dataset %s for the flags left unset: %s", fv.dataset, preset)
    return dataclasses.replace(
        config,
        data=_data_config(config, fv),
        mlperf=flags_core.mlperf_options_from_flags(
            fv, default_dir=config.model_dir, benchmark=constants.MLPERF_BENCHMARK
        ),
        preset=preset,
        flag_values=_flag_values_used(fv, preset),
    )


def _flag_values_used(flag_values: flags.FlagValues, preset: dict[str, object]) -> dict:
    """Every set flag (short names and aliases too) with the value the run used: the
    preset's where it applied."""
    used = {}
    for name in flag_values:
        flag = _ALIASES.get(name, flag_values[name].name)
        value = preset[flag] if flag in preset else flag_values[name].value
        if value is not None and not name.startswith(("help", "?")):
            used[name] = value
    return used
