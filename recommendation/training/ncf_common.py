"""NCF flags (Model Garden names and meanings) and the frozen configs built from them.

Each default is written once, in the config dataclasses (`NcfConfig` and the configs it
holds); the tables of `ncf_flags` describe each flag once and name the field it sets,
and both the absl flags and the configs are generated from them here
(`official.utils.flags.core`). ncf-main and export parse their command line with
`parse_ncf_flags`, which puts the named experiment's values (`experiments`) in front of
it. Flags are read only in the entry points' ``main()``: `create_ncf_data`, ``ncf_main``
and ``export`` call the builders here, ``online_main`` its own; the config goes inward,
so library code never reads ``FLAGS``. Every ``define_*`` takes a `flag_values`, which
lets tests parse command lines without the process-wide flags.
"""

from __future__ import annotations

import dataclasses
import re

from absl import flags, logging

from official.utils import flags as flags_core
from official.utils.flags import core
from official.utils.logs.mlperf_helper import MlperfOptions
from official.utils.misc import errors
from recommendation.data import constants, ratings_readers
from recommendation.data.data_preprocessing import DataConfig
from recommendation.model.hyperparams import ModelParams
from recommendation.training import experiments, ncf_flags


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
        eval_ranking: Against which items each evaluation ranks the held-out ones
            (`constants.EVAL_RANKINGS`: the sampled negatives, the whole catalogue, or
            both).
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
        experiment: The named configuration (`experiments.EXPERIMENTS`) applied to
            the flags the user left unset: --config, or the dataset's (None: none).
        preset: The flags whose values came from `experiment` (name -> value as a
            flag), because the user did not set them.
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
    eval_ranking: str = constants.SAMPLED_RANKING
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
    experiment: str | None = None
    preset: dict[str, object] = dataclasses.field(default_factory=dict)
    flag_values: dict = dataclasses.field(default_factory=dict)


# The config `ncf_flags.GENERIC_FLAGS` are defined on and parsed into.
_GENERIC_DEFAULTS = ratings_readers.GenericSource(path="")

# Other names of flags (alias -> flag), the Model Garden's.
_ALIASES = {"use_xla": "enable_xla"}


def define_data_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Flags that choose and prepare the dataset (ncf-create-data; ncf-main and export
    through `define_ncf_flags`)."""
    core.define_flags(ncf_flags.DATA_FLAGS, NcfConfig(), flag_values)
    core.define_flags(ncf_flags.GENERIC_FLAGS, _GENERIC_DEFAULTS, flag_values)


def define_ncf_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Every flag of ``ncf_main``: data, model, optimiser, evaluation and run control."""
    define_data_flags(flag_values)
    flags_core.define_mlperf(flag_values)
    core.define_flags(ncf_flags.NCF_FLAGS, NcfConfig(), flag_values)
    for alias, name in _ALIASES.items():
        flags.DEFINE_alias(alias, name, flag_values=flag_values)


def data_config_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> DataConfig:
    """The `DataConfig` described by parsed data flags."""
    return _data_config(
        core.config_from_flags(ncf_flags.DATA_FLAGS, NcfConfig(), flag_values), flag_values
    )


def _data_config(config: NcfConfig, flag_values: flags.FlagValues) -> DataConfig:
    """`config.data` with the fields that follow from other flags: the generator's seed
    (--seed, 0 when unset), the synthetic users' minimum (--min_num_ratings) and the
    generic source (--ratings_file)."""
    data = config.data
    generic = None
    if flag_values.ratings_file:
        generic = core.config_from_flags(ncf_flags.GENERIC_FLAGS, _GENERIC_DEFAULTS, flag_values)
    return dataclasses.replace(
        data,
        seed=config.seed if config.seed is not None else 0,
        synthetic=dataclasses.replace(data.synthetic, min_ratings_per_user=data.min_num_ratings),
        generic=generic,
    )


def parse_ncf_flags(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
    """Parses an ncf-main command line with the named experiment's values in front of
    it (--config, or else the one of --dataset in `experiments.DATASET_EXPERIMENTS`), so
    that a flag given wins and every check and rule runs once, on the values the run
    uses; a rule the experiment's values break names them. Returns absl's leftover
    arguments (the program name first)."""
    argv = flag_values.read_flags_from_files(argv, force_gnu=flag_values.is_gnu_getopt())
    name = _experiment_of(argv)
    values = experiments.EXPERIMENTS[name].values if name else {}
    try:
        return flag_values([argv[0], *experiments.as_arguments(values), *argv[1:]])
    except flags.IllegalFlagValueError as error:
        # absl names the flags of a failed check "--name=value" or "name=value".
        involved = {
            flag: value
            for flag, value in values.items()
            if flag_values[flag].present == 1 and re.search(rf"\b{flag}=", str(error))
        }
        if not involved:
            raise
        raise flags.IllegalFlagValueError(
            f"{error} ({' '.join(experiments.as_arguments(involved))} came from --config "
            f"{name}: set it on the command line, or choose another --config)"
        ) from error


# `parse_ncf_flags` for ``app.run``: a bad command line ends with one `error:` line.
flags_parser = errors.command_line_parser(parse_ncf_flags)


def _experiment_of(argv: list[str]) -> str | None:
    """The experiment a command line asks for: its --config, or its --dataset's (the
    last of each wins, as in absl); None for none or an unknown name (the parse says so)."""
    probe = flags.FlagValues()
    flags.DEFINE_string("config", None, "", flag_values=probe)
    flags.DEFINE_string("dataset", NcfConfig().data.dataset, "", flag_values=probe)
    probe(argv, known_only=True)
    return experiments.experiment_named(probe.config, probe.dataset)


def ncf_config_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> NcfConfig:
    """The `NcfConfig` described by NCF flags parsed by `parse_ncf_flags`; `preset` holds
    the values that came from the experiment (the flags given once, by it)."""
    fv = flag_values
    name = experiments.experiment_named(fv.config, fv.dataset)
    values = experiments.EXPERIMENTS[name].values if name else {}
    if any(not fv[flag].present for flag in values):
        raise ValueError("NCF flags must be parsed by ncf_common.parse_ncf_flags")
    preset = {flag: fv[flag].value for flag in values if fv[flag].present == 1}
    if preset:
        logging.info("Experiment %s for the flags left unset: %s", name, preset)
    table = (*ncf_flags.DATA_FLAGS, *ncf_flags.NCF_FLAGS)
    config = core.config_from_flags(table, NcfConfig(), fv)
    return dataclasses.replace(
        config,
        data=_data_config(config, fv),
        mlperf=flags_core.mlperf_options_from_flags(
            fv, default_dir=config.model_dir, benchmark=constants.MLPERF_BENCHMARK
        ),
        experiment=name,
        preset=preset,
        flag_values=_flag_values_used(fv),
    )


def _flag_values_used(flag_values: flags.FlagValues) -> dict:
    """Every set flag (short names and aliases too) with the value the run used."""
    used = {}
    for name in flag_values:
        value = flag_values[name].value
        if value is not None and not name.startswith(("help", "?")):
            used[name] = value
    return used
