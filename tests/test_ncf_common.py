"""NCF flags: Model Garden names keep working, bad combinations fail at start-up."""

from __future__ import annotations

import pytest
from absl import flags

from recommendation import ncf_common


def _parse(*args: str) -> flags.FlagValues:
    flag_values = flags.FlagValues()
    ncf_common.define_ncf_flags(flag_values)
    flag_values(["ncf_main", *args])
    return flag_values


def test_model_garden_command_line_still_parses():
    parsed = _parse(
        "--dataset=ml-20m",
        "--data_dir=/d",
        "--model_dir=/m",
        "--clean",
        "-te",
        "14",
        "-bs",
        "98304",
        "--eval_batch_size=160000",
        "--learning_rate=0.00382059",
        "--beta1=0.783529",
        "--beta2=0.909003",
        "--epsilon=1.45439e-07",
        "--layers=256,256,128,64",
        "--num_factors=64",
        "--hr_threshold=0.635",
        "--ml_perf",
        "--mlp_regularization=0,0,0,0",
        "--num_gpus=0",
        "--distribution_strategy=off",
        "--seed=1",
    )
    assert parsed.train_epochs == 14 and parsed.batch_size == 98304
    assert parsed.layers == ["256", "256", "128", "64"] and parsed.ml_perf


@pytest.mark.parametrize(
    "args,message",
    [
        (["--layers=63,32,16,8"], "the first even"),
        (["--layers=64,32"], "one value per --layers entry"),
        (["--layers=64,0,16,8"], "must be positive integers"),
        (["--num_factors=0"], "--num_factors must be a positive number"),
        (["--batch_size=-5"], "--batch_size must be a positive number"),
        (["--mlp_regularization=0,0,x,0"], "values must be numbers >= 0"),
        (["--beta1=1.5"], r"--beta1 must be in \[0, 1\)"),
        (["--dataset=ml-2m"], "value should be one of"),
        (["--dataset=generic"], "--dataset generic needs --ratings_file"),
        (["--min_num_ratings=1"], "must be at least 2"),
        (["--distribution_strategy=tpu"], "needs --tpu"),
        (["--export_onnx"], "--export_onnx needs --export_dir"),
        (["--learning_rate_decay=0"], r"--learning_rate_decay must be in \(0, 1\]"),
        (["--learning_rate_decay=1.5"], r"--learning_rate_decay must be in \(0, 1\]"),
        (["--decay_start_epoch=-1"], "--decay_start_epoch must not be negative"),
        (["--embedding_init=zeros"], "value should be one of"),
        (["--weight_decay=-0.1"], "--weight_decay must not be negative"),
        (
            ["--weight_decay=0.1", "--sparse_embedding_updates"],
            "--weight_decay shrinks every embedding row each step: it needs dense updates",
        ),
    ],
)
def test_invalid_flags_are_rejected(args, message):
    with pytest.raises(flags.IllegalFlagValueError, match=message):
        _parse(*args)


def test_data_config_from_flags():
    parsed = _parse(
        "--dataset=synthetic",
        "--synthetic_num_users=50",
        "--seed=9",
        "--min_num_ratings=5",
        "--cache_dir=/c",
    )
    config = ncf_common.data_config_from_flags(parsed)
    assert config.synthetic.num_users == 50 and config.synthetic.min_ratings_per_user == 5
    assert (config.seed, config.resolved_cache_dir()) == (9, "/c")


def test_ml1m_defaults_apply_only_to_unset_flags():
    parsed = _parse("--dataset=ml-1m", "--batch_size=4096")
    config = ncf_common.ncf_config_from_flags(parsed)
    assert config.batch_size == 4096  # set by the user: kept
    assert config.model.mf_dim == 64 and config.model.layers == (256, 256, 128, 64)
    assert config.enable_xla and config.train_epochs == 10
    other = ncf_common.ncf_config_from_flags(_parse("--dataset=ml-20m"))
    assert other.model.mf_dim == 8 and other.batch_size == 99000  # the reference's
