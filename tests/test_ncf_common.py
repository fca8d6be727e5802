"""NCF flags: Model Garden names keep working, bad combinations fail at start-up."""

from __future__ import annotations

import dataclasses

import pytest
from absl import flags

from official.utils.flags import core, mlperf
from official.utils.logs.mlperf_helper import MlperfOptions
from recommendation.data import ratings_readers
from recommendation.training import experiments, ncf_common, ncf_flags
from recommendation.training.ncf_common import NcfConfig


def _parse(*args: str, define=ncf_common.define_ncf_flags) -> flags.FlagValues:
    """`args` parsed as ncf-main parses them (the data flags alone as absl does)."""
    flag_values = flags.FlagValues()
    define(flag_values)
    if define is ncf_common.define_ncf_flags:
        ncf_common.parse_ncf_flags(["ncf_main", *args], flag_values)
    else:
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
        (["--embedding_stddev=0"], "--embedding_stddev must be a positive number"),
        (["--embedding_stddev=0.1"], "add --embedding_init normal, or drop --embedding_stddev"),
        (["--weight_decay=-0.1"], "--weight_decay must not be negative"),
        (
            ["--weight_decay=0.1", "--sparse_embedding_updates"],
            "--weight_decay shrinks every embedding row each step: it needs dense updates",
        ),
        (
            ["--distribution_strategy=tpu", "--tpu=t", "--sparse_embedding_updates"],
            "TPUs need static shapes: use dense updates",
        ),
        (["--hr_threshold=2"], r"--hr_threshold must be in \(0, 1\]"),
        (["--hr_threshold=0"], r"--hr_threshold must be in \(0, 1\]"),
        (["--loss_scale=128"], "--loss_scale scales float16 gradients: it needs --dtype fp16"),
        (["--loss_scale=x", "--dtype=fp16"], "'dynamic' or a positive number"),
        (["--run_eagerly", "--enable_xla"], "nothing for --enable_xla to compile"),
        (["--eval_ranking=all"], "value should be one of"),
        (
            ["--eval_ranking=both", "--distribution_strategy=tpu", "--tpu=t"],
            "use --eval_ranking sampled with --distribution_strategy tpu",
        ),
        (
            ["--eval_ranking=full", "--output_ml_perf_compliance_logging"],
            "MLPerf's eval_accuracy is the sampled HR@10: with "
            "--output_ml_perf_compliance_logging use --eval_ranking both",
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
_CONTEXT["embedding_stddev"] = ["--embedding_init=normal"]


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


# Each table of ncf-main's flags and the config instance holding its defaults.
_TABLES = [
    ((*ncf_flags.DATA_FLAGS, *ncf_flags.NCF_FLAGS), NcfConfig()),
    (ncf_flags.GENERIC_FLAGS, ratings_readers.GenericSource(path="")),
    (mlperf.MLPERF_FLAGS, MlperfOptions(log_file="")),
]
# Flags that set no field: absl's own, the Model Garden's alias, the switch of the
# compliance log (its options are None when off).
_NOT_ROWS = {"help", "helpfull", "helpshort", "helpxml", "flagfile", "undefok", "use_xla"}
_NOT_ROWS |= {"output_ml_perf_compliance_logging"}


@pytest.mark.parametrize(
    "define", [ncf_common.define_ncf_flags, ncf_common.define_data_flags], ids=["ncf", "data"]
)
def test_every_flag_is_one_table_row_whose_default_is_its_fields(define):
    """Each default is written once: in the config, never beside a flag definition."""
    parsed = _parse(define=define)
    rows = {}
    for table, defaults in _TABLES:
        for spec in core.specs(table):
            assert spec.name not in rows, f"--{spec.name} is defined twice"
            rows[spec.name] = (spec, defaults)
    names = {parsed[name].name for name in parsed} - _NOT_ROWS
    assert names <= set(rows), f"flags without a table row: {sorted(names - set(rows))}"
    for name in names:
        spec, defaults = rows[name]
        assert parsed[name].default == core.flag_default(spec, defaults), name


def test_the_default_command_line_runs_the_config_defaults():
    config = ncf_common.ncf_config_from_flags(_parse("--dataset=ml-20m"))
    data = dataclasses.replace(NcfConfig().data, dataset="ml-20m")
    assert dataclasses.replace(config, flag_values={}) == NcfConfig(data=data)
    parsed = _parse(define=ncf_common.define_data_flags)
    assert ncf_common.data_config_from_flags(parsed) == NcfConfig().data


def test_the_defaults_a_user_sees_are_the_references():
    parsed = _parse()
    expected = {
        "batch_size": 99000,
        "num_factors": 8,
        "layers": ["64", "32", "16", "8"],
        "learning_rate": 0.001,
        "beta1": 0.9,
        "beta2": 0.999,
        "epsilon": 1e-8,
        "num_neg": 4,
        "top_k": 10,
        "seed": None,
        "model_dir": "/tmp/ncf/",
        "dataset": "ml-1m",
        "download_if_missing": True,
        "eval_batch_size": None,
        "train_epochs": 1,
        "loss_scale": "dynamic",
        "num_gpus": None,
        "worker_hosts": None,
        "cache_max_age_sec": 86400,
    }
    assert {name: parsed[name].default for name in expected} == expected
    assert [float(value) for value in parsed["mlp_regularization"].default] == [0.0] * 4


def _argument(flag: flags.Flag, value) -> str:
    """`value` of `flag` as a command-line argument."""
    if isinstance(flag, flags.BooleanFlag):
        return f"--{'' if value else 'no'}{flag.name}"
    if isinstance(value, list):
        return f"--{flag.name}={','.join(value)}"
    return f"--{flag.name}={value}"


def _user_argument(flag: flags.Flag) -> str:
    """The flag set to its default (None cannot be written: then to another value)."""
    return _argument(flag, 1000 if flag.default is None else flag.default)


# The tuned ML-1M experiment but its --dataset, which the tests give.
_PRESET = {
    name: value
    for name, value in experiments.EXPERIMENTS["ml1m_tuned"].values.items()
    if name != "dataset"
}
_ROWS = {spec.name: spec for spec in core.specs(ncf_flags.NCF_FLAGS)}


@pytest.mark.parametrize("name", sorted(_PRESET))
def test_a_preset_never_overrides_a_flag_the_user_set(name):
    # Even to its default: a flag given is a flag set.
    argument = _user_argument(_parse()[name])
    path = _ROWS[name].path
    config = ncf_common.ncf_config_from_flags(_parse("--dataset=ml-1m", argument))
    without_preset = ncf_common.ncf_config_from_flags(_parse("--dataset=ml-20m", argument))
    assert core.get_field(config, path) == core.get_field(without_preset, path)
    assert set(config.preset) == set(_PRESET) - {name}


def test_a_preset_never_overrides_a_flagfile_or_an_alias(tmp_path):
    flagfile = tmp_path / "preset_flags.flags"
    parsed = _parse()
    flagfile.write_text("\n".join(_user_argument(parsed[name]) for name in _PRESET))

    def config(dataset: str) -> NcfConfig:
        built = ncf_common.ncf_config_from_flags(_parse(dataset, f"--flagfile={flagfile}"))
        return dataclasses.replace(built, data=NcfConfig().data, experiment=None, flag_values={})

    assert config("--dataset=ml-1m") == config("--dataset=ml-20m")
    assert config("--dataset=ml-1m").preset == {}
    aliased = ncf_common.ncf_config_from_flags(_parse("--dataset=ml-1m", "--use_xla=false"))
    assert not aliased.enable_xla and "enable_xla" not in aliased.preset


def test_the_run_info_says_which_values_came_from_the_preset():
    config = ncf_common.ncf_config_from_flags(_parse("--dataset=ml-1m", "--batch_size=4096"))
    assert config.preset == {
        "num_factors": 64,
        "layers": ["256", "256", "128", "64"],
        "mlp_regularization": ["0", "0", "0", "0"],
        "eval_batch_size": 160000,
        "learning_rate": 0.01,
        "train_epochs": 10,
        "enable_xla": True,
        "batches_per_step": 8,
    }
    # The flags recorded are the values the run used, under every name of each flag.
    used = config.flag_values
    assert used["batch_size"] == used["bs"] == 4096
    assert used["train_epochs"] == used["te"] == 10
    assert used["enable_xla"] is used["use_xla"] is True
    assert used["layers"] == ["256", "256", "128", "64"]
