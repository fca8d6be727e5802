"""Named experiments (--config): each one is the command line it stands for, flags
given win, and its values meet the rules a command line meets."""

from __future__ import annotations

import os

import pytest
from absl import flags
from conftest import ROOT, run_module

from official.utils.flags import core
from recommendation.model.hyperparams import ModelParams
from recommendation.training import experiments, ncf_common, ncf_flags
from recommendation.training.ncf_common import NcfConfig


def _parse(*args: str) -> flags.FlagValues:
    flag_values = flags.FlagValues()
    ncf_common.define_ncf_flags(flag_values)
    ncf_common.parse_ncf_flags(["ncf_main", *args], flag_values)
    return flag_values


def _config(*args: str) -> NcfConfig:
    return ncf_common.ncf_config_from_flags(_parse(*args))


# Where each flag an experiment sets lands in the config.
_PATHS = {
    spec.name: spec.path for spec in core.specs((*ncf_flags.DATA_FLAGS, *ncf_flags.NCF_FLAGS))
}


@pytest.mark.parametrize("name", sorted(experiments.EXPERIMENTS))
def test_an_experiment_by_name_sets_each_of_its_values(name):
    values = experiments.EXPERIMENTS[name].values
    by_name = _config(f"--config={name}")
    # Spelled out as flags (for programs without --config), the same values.
    spelled_out = _config(*experiments.as_arguments(values))
    assert by_name.experiment == name and set(by_name.preset) == set(values)
    for config in (by_name, spelled_out):
        for flag, value in values.items():
            if flag == "output_ml_perf_compliance_logging":
                assert (config.mlperf is not None) == value
            else:
                assert core.get_field(config, _PATHS[flag]) == value, flag


def test_the_mlperf_experiment_is_the_mlperf_v05_run():
    config = _config("--config=mlperf_ml20m")
    assert (config.data.dataset, config.data.ml_perf, config.hr_threshold) == (
        "ml-20m",
        True,
        0.635,
    )
    assert (config.batch_size, config.train_epochs, config.num_eval_negatives) == (98304, 14, 999)
    assert config.model.layers == (256, 256, 128, 64) and config.model.mf_dim == 64
    assert (config.model.learning_rate, config.model.beta1) == (0.00382059, 0.783529)
    assert config.mlperf is not None


def test_flags_given_win_over_the_experiment():
    config = _config("--config=mlperf_ml20m", "--batch_size=1024", "--nouse_xla")
    assert (config.batch_size, config.enable_xla, config.train_epochs) == (1024, False, 14)
    assert "batch_size" not in config.preset and "enable_xla" not in config.preset
    assert config.flag_values["batch_size"] == 1024 and config.flag_values["train_epochs"] == 14


def test_a_flagfile_can_name_the_experiment_and_override_it(tmp_path):
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("--config=tiny\n--seed=7\n")
    config = _config(f"--flagfile={flagfile}")
    assert (config.experiment, config.data.dataset, config.seed) == ("tiny", "synthetic", 7)
    assert config.data.synthetic.num_users == 300 and config.data.seed == 7


def test_without_config_a_dataset_takes_its_tuned_experiment_if_it_has_one():
    assert _config("--dataset=ml-1m").experiment == "ml1m_tuned"
    assert _config("--dataset=synthetic").batch_size == 16384
    plain = _config("--dataset=ml-20m")
    assert (plain.experiment, plain.preset, plain.batch_size) == (None, {}, 99000)


def test_an_experiment_value_that_breaks_a_rule_is_a_flag_error_naming_it():
    message = (
        "flags output_ml_perf_compliance_logging=True, use_synthetic_data=True: "
        "--output_ml_perf_compliance_logging needs real training (--use_synthetic_data has "
        "no evaluation to log) (--output_ml_perf_compliance_logging came from --config "
        "mlperf_ml20m: set it on the command line, or choose another --config)"
    )
    with pytest.raises(flags.IllegalFlagValueError) as error:
        _parse("--config=mlperf_ml20m", "--use_synthetic_data")
    assert str(error.value) == message


@pytest.mark.integration
def test_ncf_main_ends_with_one_error_line_when_an_experiment_breaks_a_rule(tmp_path):
    result = run_module(
        "recommendation.ncf_main",
        "--config=mlperf_ml20m",
        "--use_synthetic_data",
        f"--data_dir={tmp_path}",
        f"--model_dir={tmp_path / 'model'}",
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: flags output_ml_perf_compliance_logging")
    assert error.endswith(
        "came from --config mlperf_ml20m: set it on the command line, or choose another "
        "--config) (--helpshort lists the flags)"
    )


# A model rule, the command line that breaks it, and its words on the flags and in the
# params (written once, in `hyperparams.MODEL_RULES`).
_BROKEN_RULES = [
    (
        ["--weight_decay=0.1", "--sparse_embedding_updates"],
        dict(weight_decay=0.1, sparse_updates=True),
        "{weight_decay} shrinks every embedding row each step: it needs dense updates "
        "(drop {sparse_updates})",
        dict(weight_decay="weight_decay", sparse_updates="sparse_embedding_updates"),
    ),
    (
        ["--layers=16,8"],
        dict(layers=(16, 8)),
        "{mlp_regularization} needs one value per {layers} entry",
        dict(mlp_regularization="mlp_regularization", layers="layers"),
    ),
    (
        ["--embedding_stddev=0.1"],
        dict(embedding_stddev=0.1),
        "{embedding_stddev} is the spread of {embedding_init} normal: add {embedding_init} "
        "normal, or drop {embedding_stddev}",
        dict(embedding_stddev="embedding_stddev", embedding_init="embedding_init"),
    ),
    (
        ["--embedding_init=normal", "--embedding_stddev=0"],
        dict(embedding_init="normal", embedding_stddev=0.0),
        "{embedding_stddev} must be a positive number",
        dict(embedding_stddev="embedding_stddev"),
    ),
    (
        ["--loss_scale=128"],
        dict(loss_scale=128.0),
        "{loss_scale} scales float16 gradients: it needs {dtype} fp16",
        dict(loss_scale="loss_scale", dtype="dtype"),
    ),
]


@pytest.mark.parametrize("arguments,fields,message,flag_names", _BROKEN_RULES)
def test_a_model_rule_is_a_flag_error_on_the_command_line_and_a_value_error_in_code(
    arguments, fields, message, flag_names
):
    on_flags = message.format(**{field: f"--{flag}" for field, flag in flag_names.items()})
    with pytest.raises(flags.IllegalFlagValueError) as error:
        _parse("--dataset=ml-20m", *arguments)
    assert str(error.value).endswith(f": {on_flags}")
    in_code = message.format(**{field: field for field in flag_names})
    with pytest.raises(ValueError) as error:
        ModelParams(num_users=1, num_items=1, **fields)
    assert str(error.value).startswith(f"{in_code} (got ")


def test_the_offline_guide_names_every_experiment():
    with open(os.path.join(ROOT, "docs", "offline.md")) as guide:
        text = guide.read()
    for name in experiments.EXPERIMENTS:
        if not name.startswith("ncf_paper_"):
            assert f"`{name}`" in text, name
    assert "`ncf_paper_{neumf,gmf,mlp,mf}_{8,16,32,64}`" in text
