"""Named ncf-main configurations: every experiment the project runs, defined once.

``ncf-main --config NAME`` sets the flags of experiment NAME that the command line (or
a --flagfile) leaves unset, so a flag given always wins; without --config, a dataset
with a tuned configuration (`DATASET_EXPERIMENTS`) gets that one. The values pass the
same checks and rules as a command line's (`ncf_common.ncf_config_from_flags`), and
the run's benchmark log records which came from the experiment. The benchmark scripts
and the tests run these experiments by name. (No TensorFlow import here: the benchmark
scripts' drivers read it.)

    ncf-main --config mlperf_ml20m --data_dir /tmp/movielens-data
    ncf-main --config ncf_paper_neumf_64 --data_dir DIR --seed 1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One named configuration.

    Attributes:
        name: What --config selects it by.
        description: What it is for (the flag's help lists it).
        values: Field values by flag name (a tuple for a list flag).
    """

    name: str
    description: str
    values: Mapping[str, object]


def as_arguments(values: Mapping[str, object]) -> list[str]:
    """`values` as command-line arguments (``--enable_xla``, ``--layers=64,32``), for
    programs that take the same flags (the Model Garden NCF among them)."""
    arguments = []
    for name, value in values.items():
        if isinstance(value, bool):
            arguments.append(f"--{'' if value else 'no'}{name}")
        elif isinstance(value, tuple):
            arguments.append(f"--{name}={','.join(_as_text(item) for item in value)}")
        else:
            arguments.append(f"--{name}={_as_text(value)}")
    return arguments


def _as_text(value: object) -> str:
    """A number as short as it reads exactly (``0`` for 0.0, ``65.536``)."""
    return repr(value).removesuffix(".0") if isinstance(value, float) else str(value)


# The MLPerf reference's NeuMF: 64 predictive factors, an MLP of 256-256-128-64, no L2.
MLPERF_MODEL: Mapping[str, object] = {
    "num_factors": 64,
    "layers": (256, 256, 128, 64),
    "mlp_regularization": (0.0, 0.0, 0.0, 0.0),
}

_ML1M_TUNED = Experiment(
    "ml1m_tuned",
    "ML-1M with 999 evaluation negatives: the MLPerf model, with the batch size, rate "
    "and epochs tuned on this project's CPU runs (the reference's defaults stop at HR@10 "
    "0.164); the default of --dataset ml-1m and synthetic",
    {
        "dataset": "ml-1m",
        **MLPERF_MODEL,
        "batch_size": 16384,
        "eval_batch_size": 160000,
        "learning_rate": 0.01,
        "train_epochs": 10,
        "enable_xla": True,
        "batches_per_step": 8,
    },
)

_MLPERF_ML20M = Experiment(
    "mlperf_ml20m",
    "The MLPerf v0.5 NCF run: ml-20m, 999 evaluation negatives, HR@10 target 0.635, the "
    "MLPerf reference's hyper-parameters, the compliance log in MODEL_DIR",
    {
        "dataset": "ml-20m",
        "ml_perf": True,
        **MLPERF_MODEL,
        "train_epochs": 14,
        "epochs_between_evals": 1,
        "batch_size": 98304,
        "eval_batch_size": 160000,
        "learning_rate": 0.00382059,
        "beta1": 0.783529,
        "beta2": 0.909003,
        "epsilon": 1.45439e-07,
        "num_neg": 4,
        "hr_threshold": 0.635,
        "enable_xla": True,
        "batches_per_step": 8,
        "output_ml_perf_compliance_logging": True,
    },
)

_THROUGHPUT = Experiment(
    "throughput",
    "The MLPerf model trained on random ML-1M-sized batches of 65,536 (no evaluation): "
    "what the training throughput benchmark times, here and in the Model Garden NCF",
    {
        "dataset": "ml-1m",
        "use_synthetic_data": True,
        "batch_size": 65536,
        **MLPERF_MODEL,
    },
)

_TINY = Experiment(
    "tiny",
    "Generated data of 300 users and a NeuMF of 8 factors: a whole run in seconds, for "
    "tests and for trying the commands",
    {
        "dataset": "synthetic",
        "synthetic_num_users": 300,
        "synthetic_num_items": 200,
        "synthetic_num_ratings": 12_000,
        "train_epochs": 2,
        "batch_size": 2048,
        "num_eval_negatives": 99,
        "seed": 1,
        "num_factors": 8,
        "layers": (16, 8),
        "mlp_regularization": (0.0, 0.0),
        "learning_rate": 0.01,
    },
)

# The NCF paper's protocol (He et al., WWW 2017) on its own ML-1M split, 99 test
# negatives: each model selected on a validation holdout (the latest training line) and
# tested once. Its code's NeuMF (normal(0.01) tables, a 4-layer tower 8x the factors
# wide, Adam at 0.001), at batches of 1,024 (the paper's 256 make a CPU run long).
PAPER_FACTORS = (8, 16, 32, 64)
PAPER_PARTS = ("neumf", "gmf", "mlp", "mf")
_PAPER_TOWER_DEPTH = 4


def paper_layers(factors: int, depth: int = _PAPER_TOWER_DEPTH) -> tuple[int, ...]:
    """The paper code's MLP tower for `factors`: `depth` halving layers ending at `factors`."""
    return tuple(factors * 2 ** (depth - 1 - i) for i in range(depth))


# What the paper protocol's runs share, whatever their factors.
PAPER_PROTOCOL: Mapping[str, object] = {
    "dataset": "ncf-ml-1m",
    "eval_split": "validation",
    "train_epochs": 12,
    "batch_size": 1024,
    "learning_rate": 0.001,
    "embedding_init": "normal",
    "num_neg": 4,
    "batches_per_step": 32,
    "enable_xla": True,
}


def paper_model_values(factors: int, depth: int = _PAPER_TOWER_DEPTH) -> dict[str, object]:
    """The sizes of the paper's NeuMF at `factors` with a tower of `depth` layers."""
    layers = paper_layers(factors, depth)
    return {
        "num_factors": factors,
        "layers": layers,
        "mlp_regularization": (0.0,) * len(layers),
    }


# Each paper part's own settings, over the protocol's. gmf and mlp: the paper's models
# alone (NeuMF's pre-training). mf: GMF's part trained in batches after Rendle et al.'s
# matrix factorisation (RecSys 2020): a dot product, plain SGD at 0.008 per example (x the
# batch: ncf-main's loss is a batch mean), their per-example L2 of 0.005
# (--row_regularization is half of it: Keras' convention), 8 negatives, 64 epochs; the
# rate, L2 and epochs chosen on validation (docs/benchmarks.md).
_MF_BATCH, _MF_RATE_PER_EXAMPLE = 8192, 0.008
PAPER_PART_VALUES: Mapping[str, Mapping[str, object]] = {
    "neumf": {},
    "gmf": {"model": "gmf"},
    "mlp": {"model": "mlp"},
    "mf": {
        "model": "mf",
        "optimizer": "sgd",
        "batch_size": _MF_BATCH,
        "learning_rate": _MF_RATE_PER_EXAMPLE * _MF_BATCH,
        "row_regularization": 0.0025,
        "num_neg": 8,
        "train_epochs": 64,
    },
}


def paper_experiment_name(part: str, factors: int) -> str:
    """The name of the paper protocol's `part` at `factors` (``ncf_paper_neumf_64``)."""
    return f"ncf_paper_{part}_{factors}"


_PAPER = tuple(
    Experiment(
        paper_experiment_name(part, factors),
        f"The NCF paper's protocol on its ML-1M split: {part} at {factors} factors, "
        "selected on validation, tested once",
        {**PAPER_PROTOCOL, **paper_model_values(factors), **PAPER_PART_VALUES[part]},
    )
    for part in PAPER_PARTS
    for factors in PAPER_FACTORS
)

EXPERIMENTS: Mapping[str, Experiment] = {
    experiment.name: experiment
    for experiment in (_ML1M_TUNED, _MLPERF_ML20M, _THROUGHPUT, _TINY, *_PAPER)
}

# The experiment a dataset gets when --config is not given. The synthetic data is
# ML-1M-sized: the same configuration suits it.
DATASET_EXPERIMENTS: Mapping[str, str] = {
    "ml-1m": _ML1M_TUNED.name,
    "synthetic": _ML1M_TUNED.name,
}


def experiment_named(config: str | None, dataset: str | None) -> str | None:
    """The experiment a run takes: its --config, else its --dataset's
    (`DATASET_EXPERIMENTS`); None for none or a name no experiment has."""
    name = config or DATASET_EXPERIMENTS.get(dataset)
    return name if name in EXPERIMENTS else None
