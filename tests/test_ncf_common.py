"""NCF flags: Model Garden names keep working, bad combinations fail at start-up."""

from __future__ import annotations

import dataclasses

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
        (["--hr_threshold=2"], r"--hr_threshold must be in \(0, 1\]"),
        (["--hr_threshold=0"], r"--hr_threshold must be in \(0, 1\]"),
        (["--loss_scale=128"], "--loss_scale scales float16 gradients: it needs --dtype fp16"),
        (["--loss_scale=x", "--dtype=fp16"], "'dynamic' or a positive number"),
        (["--run_eagerly", "--enable_xla"], "nothing for --enable_xla to compile"),
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


# A value other than the default for every flag of ncf-main; a few need company to pass
# the validators (and --dataset keeps its presets out of the comparison).
_OTHER_VALUES = {
    "dataset": ["--dataset=ml-20m"],
    "layers": ["--layers=32,16", "--mlp_regularization=0,0"],
    "mlp_regularization": ["--mlp_regularization=0,0.5,0,0"],
    "ratings_file": ["--dataset=generic", "--ratings_file=/r.csv"],
    "distribution_strategy": ["--distribution_strategy=mirrored"],
    "tpu": ["--tpu=my-tpu"],
    "tpu_zone": ["--tpu_zone=us-central1-b"],
    "tpu_gcp_project": ["--tpu_gcp_project=my-project"],
    "worker_hosts": ["--worker_hosts=a:1,b:2", "--task_index=1"],
    "task_index": ["--worker_hosts=a:1,b:2", "--task_index=1"],
    "loss_scale": ["--loss_scale=128", "--dtype=fp16"],
    "export_onnx": ["--export_onnx", "--export_dir=/e"],
    "weight_decay": ["--weight_decay=0.1"],
    "output_ml_perf_compliance_logging": ["--output_ml_perf_compliance_logging"],
    **{
        name: ["--output_ml_perf_compliance_logging", f"--{name}={value}"]
        for name, value in (
            ("mlperf_log_file", "/l.log"),
            ("mlperf_log_format", "v0.5"),
            ("mlperf_submission_org", "Org"),
            ("mlperf_submission_platform", "Box"),
            ("mlperf_submission_division", "open"),
            ("mlperf_submission_status", "cloud"),
            ("mlperf_clear_caches", "false"),
        )
    },
}


def _other_value(flag: flags.Flag) -> list[str]:
    if flag.name in _OTHER_VALUES:
        return _OTHER_VALUES[flag.name]
    if isinstance(flag, flags.BooleanFlag):
        return [f"--{'no' if flag.default else ''}{flag.name}"]
    if isinstance(flag.parser, flags.EnumParser):
        return [f"--{flag.name}={next(v for v in flag.parser.enum_values if v != flag.default)}"]
    if isinstance(flag.parser, (flags.IntegerParser, flags.FloatParser)):
        base = flag.default if flag.default is not None else 0
        value = base / 2 if isinstance(base, float) and 0 < base <= 1 else base + 1
        return [f"--{flag.name}={value}"]
    return [f"--{flag.name}=/other"]


# Flags that only matter beside others: compared with and without, in that company.
_CONTEXT = {
    name: ["--dataset=generic", "--ratings_file=/r.csv"]
    for name in ("user_column", "item_column", "timestamp_column", "csv_separator")
}


def _config_without_flag_values(*args: str) -> ncf_common.NcfConfig:
    config = ncf_common.ncf_config_from_flags(_parse("--dataset=ml-20m", *args))
    return dataclasses.replace(config, flag_values={})


def test_every_flag_changes_the_run_it_describes():
    """No flag may be accepted and then ignored: each one changes the config."""
    parsed = _parse()
    ignored = []
    for name in sorted(parsed):
        flag = parsed[name]
        if name != flag.name or name in (
            "help",
            "helpfull",
            "helpshort",
            "helpxml",
            "flagfile",
            "undefok",
            "dataset",
            "use_xla",
        ):
            continue  # short names, aliases and absl's own flags; --dataset is the baseline
        context = _CONTEXT.get(name, [])
        changed = _config_without_flag_values(*context, *_other_value(flag))
        if changed == _config_without_flag_values(*context):
            ignored.append(name)
    assert ignored == []
