"""The NCF flags: each one's name, help and checks, and the config field it sets.

The tables (`DATA_FLAGS`, `GENERIC_FLAGS`, `NCF_FLAGS`) describe each flag once and
name the field it sets; `ncf_common` generates the absl flags and the configs from
them (`official.utils.flags.core`). `SHARED_FLAGS` are the rows ncf-online takes into
its own table (`online_main.ONLINE_FLAGS`), so a concept both programs have is one
flag.
"""

from __future__ import annotations

from official.utils import flags as flags_core
from official.utils.flags import core
from official.utils.flags.core import NON_NEGATIVE, POSITIVE, Check, FlagSpec, Rule
from recommendation.data import constants, movielens
from recommendation.model.hyperparams import (
    EMBEDDING_INITS,
    MODEL_KINDS,
    MODEL_RULES,
    OPTIMIZERS,
    ModelParams,
    valid_layers,
)
from recommendation.training import experiments


def _valid_layers(layers: list[str]) -> bool:
    """Whether `layers` are integers that can describe the NeuMF MLP
    (`hyperparams.valid_layers`)."""
    try:
        return valid_layers(tuple(int(width) for width in layers))
    except ValueError:
        return False


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


def _in_unit_interval(value: float) -> bool:
    return 0 < value <= 1


# The model, optimiser and run flags of ncf-main, on `NcfConfig`; then the model's
# rules (`hyperparams.MODEL_RULES`) on the flags that set its fields.
_NCF_FLAG_ROWS = (
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
        "config",
        "A named experiment (recommendation/training/experiments.py) whose values the "
        "flags left unset take; flags given, on the command line or in a --flagfile, "
        "keep theirs. Without it, --dataset ml-1m and synthetic take ml1m_tuned. "
        + "; ".join(
            f"{experiment.name}: {experiment.description}"
            for experiment in experiments.EXPERIMENTS.values()
            if not experiment.name.startswith("ncf_paper_")
        )
        + "; ncf_paper_{neumf,gmf,mlp,mf}_{8,16,32,64}: the NCF paper's protocol on its "
        "ML-1M split, one per model and factors.",
        field="experiment",
        choices=tuple(experiments.EXPERIMENTS),
    ),
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
    FlagSpec(
        "eval_ranking",
        "How each evaluation ranks a user's held-out item: sampled (against the sampled "
        "negatives, --num_eval_negatives or the NCF split's 99: the MLPerf and NCF "
        "protocol), full (against every item the user has not interacted with: HR@k, "
        "NDCG@k and Recall@k over the whole catalogue), or both. The run stops "
        "(--hr_threshold) and selects (--eval_split validation) on the sampled HR@k "
        "unless only full is computed.",
        choices=constants.EVAL_RANKINGS,
    ),
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
        ("output_ml_perf_compliance_logging", "eval_ranking"),
        lambda values: (
            not (
                values["output_ml_perf_compliance_logging"]
                and values["eval_ranking"] == constants.FULL_RANKING
            )
        ),
        "MLPerf's eval_accuracy is the sampled HR@10: with "
        "--output_ml_perf_compliance_logging use --eval_ranking both (or sampled)",
    ),
    Rule(
        ("distribution_strategy", "eval_ranking"),
        lambda values: (
            values["distribution_strategy"] != "tpu"
            or values["eval_ranking"] == constants.SAMPLED_RANKING
        ),
        "--eval_ranking full and both rank on the host, outside the TPU replicas, which "
        "is not supported: use --eval_ranking sampled with --distribution_strategy tpu",
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
NCF_FLAGS = (
    *_NCF_FLAG_ROWS,
    *core.flag_rules(MODEL_RULES, _NCF_FLAG_ROWS, "model", ModelParams(num_users=0, num_items=0)),
)
