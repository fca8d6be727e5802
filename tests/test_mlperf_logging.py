"""MLPerf compliance logs: real ncf-main runs checked by the official checker.

The checker and the scripts run as subprocesses, the way a user runs them.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import time

import pytest
import yaml
from absl import flags
from conftest import TINY_NCF_MAIN_FLAGS, tiny_ncf_config
from mlperf_logging import compliance_checker

from official.core import signals
from official.utils.flags import mlperf as mlperf_flags
from official.utils.logs import mlperf_helper
from recommendation.data.data_preprocessing import DataConfig
from recommendation.mlperf import mlperf_tags
from recommendation.training import cycles
from recommendation.training.ncf_common import NcfConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = os.path.join(ROOT, "recommendation", "mlperf", "ncf_rules.yaml")
CHECK_SCRIPT = os.path.join(ROOT, "scripts", "check_mlperf_log.sh")
SCORE_SCRIPT = os.path.join(ROOT, "scripts", "mlperf_score.py")
SHIPPED_COMMON = os.path.join(
    os.path.dirname(compliance_checker.__file__), "training_0.7.0", "common.yaml"
)
# The tiny experiment's HR@10 passes 0.4 at the last of 3 epochs (0.32, 0.33, 0.49).
HR_THRESHOLD = 0.4
ENV = {**os.environ, "PYTHONPATH": ROOT}
# The tags of a v0.5 NCF log (the mlperf_compliance package's NCF set).
V05_NCF_TAGS = set(
    """run_clear_caches run_start preproc_hp_min_ratings preproc_hp_num_eval
    preproc_hp_sample_eval_replacement input_hp_num_neg input_hp_sample_train_replacement
    input_step_train_neg_gen input_step_eval_neg_gen input_size input_batch_size
    model_hp_mf_dim model_hp_mlp_layer_sizes opt_learning_rate opt_hp_adam_beta1
    opt_hp_adam_beta2 opt_hp_adam_epsilon model_hp_loss_fn train_loop train_epoch
    eval_start eval_size eval_target eval_accuracy eval_hp_num_users eval_hp_num_neg
    eval_stop run_stop run_final""".split()
)


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300, **kwargs
    )


def _official_checker(log: str) -> subprocess.CompletedProcess:
    return _run(
        [
            sys.executable,
            "-m",
            "mlperf_logging.compliance_checker",
            "--usage",
            "training",
            "--ruleset",
            "0.7.0",
            "--config",
            RULES,
            "--log_output",
            os.devnull,
            log,
        ]
    )


@pytest.fixture(scope="module")
def mllog_run(tmp_path_factory) -> str:
    """ncf-main with compliance logging on (default format and place); the log's path."""
    folder = tmp_path_factory.mktemp("mllog_run")
    result = _run(
        [
            sys.executable,
            "-m",
            "recommendation.ncf_main",
            *TINY_NCF_MAIN_FLAGS,
            f"--data_dir={folder}",
            f"--model_dir={folder / 'model'}",
            "--train_epochs=3",
            f"--hr_threshold={HR_THRESHOLD}",
            "--output_ml_perf_compliance_logging",
            "--mlperf_submission_division=open",
            "--nomlperf_clear_caches",  # test_drop_page_cache drops it once for the suite
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "target reached" in result.stdout
    return str(folder / "model" / mlperf_helper.DEFAULT_LOG_FILE)


@pytest.mark.integration
def test_official_checker_accepts_a_real_run(mllog_run):
    result = _official_checker(mllog_run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "INFO - SUCCESS" in result.stderr


@pytest.mark.integration
def test_check_script_fails_without_run_stop(mllog_run, tmp_path):
    assert _run([CHECK_SCRIPT, mllog_run]).returncode == 0
    with open(mllog_run) as log:
        lines = [line for line in log if '"key": "run_stop"' not in line]
    truncated = tmp_path / "no_run_stop.log"
    truncated.write_text("".join(lines))
    result = _run([CHECK_SCRIPT, str(truncated)])
    assert result.returncode != 0
    assert "Required EXACTLY_ONE occurrence of 'run_stop' but found 0" in result.stderr
    assert "FAILED" in result.stderr


def test_producer_lines_are_merged_in_time_order(mllog_run):
    records = mlperf_helper.read_log(mllog_run)
    keys = [record.key for record in records]
    assert not os.path.exists(mllog_run + mlperf_helper.PART_SUFFIX)
    times = [record.time_s for record in records]
    assert times == sorted(times)
    producer = [r for r in records if r.metadata["file"].endswith("data_async_generation.py")]
    assert {r.key for r in producer} >= {"input_step_eval_neg_gen", "input_step_train_neg_gen"}
    # The producer is handed its work only after run_start.
    assert keys.index("run_start") < keys.index("input_step_eval_neg_gen")
    assert keys[:2] == ["cache_clear", "init_start"] and keys[-1] == "run_stop"
    assert records[-1].metadata["status"] == mlperf_helper.SUCCESS
    assert records[keys.index("run_start")].metadata["file"] == "recommendation/training/cycles.py"


@pytest.mark.integration
def test_v05_log_has_every_tag_in_order(tmp_path):
    log = str(tmp_path / "v05.log")
    config = tiny_ncf_config(
        tmp_path,
        train_epochs=3,
        hr_threshold=HR_THRESHOLD,
        mlperf=mlperf_helper.MlperfOptions(
            log_file=log, log_format=mlperf_helper.V05, clear_caches=False
        ),
    )
    cycles.run(config)
    with open(log) as stream:
        lines = stream.read().splitlines()
    records = [mlperf_helper.parse_line(line) for line in lines]
    assert None not in records and all(line.startswith(":::MLPv0.5.0 ncf ") for line in lines)
    tags = [record.key for record in records]
    assert set(tags) == V05_NCF_TAGS | {"run_set_random_seed"}
    assert [tags.count(tag) for tag in ("run_start", "run_stop", "run_final")] == [1, 1, 1]
    assert tags.index("run_start") < tags.index("run_stop") < tags.index("run_final")
    assert tags[-1] == "run_final"
    assert [r.time_s for r in records] == sorted(r.time_s for r in records)
    accuracies = [record.value for record in records if record.key == "eval_accuracy"]
    assert all(set(value) == {"epoch", "value"} for value in accuracies)
    assert [value["epoch"] for value in accuracies] == list(range(len(accuracies)))
    assert accuracies[-1]["value"] >= HR_THRESHOLD
    assert records[tags.index("run_stop")].value == {"success": True}


def test_run_stop_aborted_when_the_run_fails(tmp_path):
    log = str(tmp_path / "failed.log")
    config = NcfConfig(
        data=DataConfig(dataset="ml-1m", data_dir=str(tmp_path), download_if_missing=False),
        model_dir=str(tmp_path / "model"),
        mlperf=mlperf_helper.MlperfOptions(log_file=log, clear_caches=False),
    )
    with pytest.raises(Exception, match="ratings.dat"):
        cycles.run(config)
    records = mlperf_helper.read_log(log)
    assert [records[0].key, records[1].key] == ["cache_clear", "init_start"]
    assert records[-1].key == "run_stop" and records[-1].metadata["status"] == "aborted"


@pytest.mark.integration
def test_run_stop_aborted_on_sigterm(tmp_path):
    log = str(tmp_path / "terminated.log")
    options = mlperf_helper.MlperfOptions(log_file=log, clear_caches=False)
    with signals.stop_on_signals(), pytest.raises(signals.Interrupted) as stopped:
        with mlperf_helper.session(options), signals.interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # the handler interrupts this
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    records = mlperf_helper.read_log(log)
    assert records[0].value is False and "disabled" in records[0].metadata["reason"]
    assert records[-1].key == "run_stop" and records[-1].metadata["status"] == "aborted"


def test_merge_orders_by_time_and_drops_a_partial_line(tmp_path):
    def line(seconds: float, tag: str) -> str:
        return f":::MLPv0.5.0 ncf {seconds:.3f} (x.py:1) {tag}"

    main, part = tmp_path / "run.log", tmp_path / "run.log.part"
    main.write_text("".join(line(t, f"main_{t}") + "\n" for t in (1, 3, 5)))
    part.write_text(line(2, "part_2") + "\n" + line(3, "part_3") + "\n" + line(6, "cut")[:-3])
    mlperf_helper.merge_logs(str(main), str(part), [line(9, "run_final")])
    tags = [record.key for record in mlperf_helper.read_log(str(main))]
    assert tags == ["main_1", "part_2", "main_3", "part_3", "main_5", "run_final"]
    assert not part.exists()


def test_v05_writer_renames_reshapes_and_skips(tmp_path):
    path = str(tmp_path / "v05.log")
    logger = mlperf_helper.MlperfLogger(path, mlperf_helper.V05, v05_tags=mlperf_tags.V05_TAGS)
    logger.event("global_batch_size", 1024)
    logger.event("epoch_start", epoch_num=0)
    logger.event("epoch_stop", epoch_num=0)  # not a v0.5 tag
    logger.event("eval_accuracy", 0.5, epoch_num=0)
    logger.event("run_stop", status="aborted")
    logger.close()
    records = mlperf_helper.read_log(path)
    assert [(r.key, r.value) for r in records] == [
        ("input_batch_size", 1024),
        ("train_epoch", 0),
        ("eval_accuracy", {"epoch": 0, "value": 0.5}),
        ("run_stop", {"success": False}),
    ]
    assert records[0].metadata["callsite"].startswith("tests/test_mlperf_logging.py:")


def test_v05_writer_writes_the_tag_set_it_is_given(tmp_path):
    path = str(tmp_path / "v05.log")
    tag_set = mlperf_helper.V05TagSet(
        tags=frozenset({"their_batch", "eval_accuracy"}),
        renamed={"global_batch_size": "their_batch"},
    )
    logger = mlperf_helper.MlperfLogger(path, mlperf_helper.V05, "other", tag_set)
    for key in ("global_batch_size", "eval_accuracy", "input_batch_size", "run_start"):
        logger.event(key, 1)
    logger.close()
    assert [(r.key, r.value) for r in mlperf_helper.read_log(path)] == [
        ("their_batch", 1),
        ("eval_accuracy", 1),
    ]
    with open(path) as stream:
        assert stream.read().startswith(":::MLPv0.5.0 other ")


def test_a_v05_log_needs_a_tag_set(tmp_path):
    options = mlperf_helper.MlperfOptions(
        log_file=str(tmp_path / "v05.log"), log_format=mlperf_helper.V05, clear_caches=False
    )
    with pytest.raises(ValueError, match="needs the benchmark's v0.5 tag set"):
        with mlperf_helper.session(options):
            pass
    with mlperf_helper.session(options, mlperf_tags.V05_TAGS) as logger:
        logger.event("run_start")
    assert "run_start" in [record.key for record in mlperf_helper.read_log(options.log_file)]


def test_disabled_logger_writes_nothing(tmp_path):
    logger = mlperf_helper.MlperfLogger(None)
    logger.event("run_start")
    logger.close()
    assert not logger.enabled and logger.part_file == "" and os.listdir(tmp_path) == []


def test_drop_page_cache_says_why_it_could_not(tmp_path):
    done, reason = mlperf_helper.drop_page_cache(str(tmp_path / "missing" / "drop_caches"))
    assert not done and reason


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(mlperf_helper.DROP_CACHES_PATH, os.W_OK),
    reason="dropping the page cache needs root and a writable /proc/sys",
)
def test_drop_page_cache_as_root():
    assert mlperf_helper.drop_page_cache() == (True, "")


def test_rules_keep_the_shipped_common_rules():
    with open(SHIPPED_COMMON) as stream:
        shipped = yaml.load(stream, Loader=yaml.BaseLoader)
    with open(RULES) as stream:
        ours = yaml.load(stream, Loader=yaml.BaseLoader)
    ours_by_name = {entry["KEY"]["NAME"]: entry["KEY"] for entry in ours if "KEY" in entry}
    for entry in shipped:
        if "KEY" not in entry or entry["KEY"]["NAME"] == "submission_benchmark":
            continue
        key = entry["KEY"]
        mine = ours_by_name[key["NAME"]]
        assert mine["REQ"] == key["REQ"], key["NAME"]
        assert set(_checks(key)) <= set(_checks(mine)), key["NAME"]


def _checks(key: dict) -> list[str]:
    checks = key.get("CHECK", [])
    return [check.strip() for check in (checks if isinstance(checks, list) else [checks])]


def _parse_flags(*args: str) -> flags.FlagValues:
    flag_values = flags.FlagValues()
    mlperf_flags.define_mlperf(flag_values)
    flag_values(["prog", *args])
    return flag_values


def test_flags_default_to_model_dir_and_off():
    assert mlperf_flags.mlperf_options_from_flags(_parse_flags(), "/m", "ncf") is None
    options = mlperf_flags.mlperf_options_from_flags(
        _parse_flags("--output_ml_perf_compliance_logging", "--mlperf_log_format=v0.5"),
        "/m",
        "ncf",
    )
    assert options.log_file == "/m/mlperf_compliance.log" and options.log_format == "v0.5"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--mlperf_log_file=/x.log"], "need --output_ml_perf_compliance_logging"),
        (["--mlperf_log_format=v0.5"], "need --output_ml_perf_compliance_logging"),
        (["--mlperf_log_format=v0.6"], "value should be one of <mllog|v0.5>"),
        (["--mlperf_submission_org= "], "--mlperf_submission_org must not be empty"),
        (["--mlperf_submission_division=x"], "value should be one of <closed|open>"),
    ],
)
def test_bad_flags_fail_with_one_clear_line(args, message):
    with pytest.raises(flags.IllegalFlagValueError, match=message) as error:
        _parse_flags(*args)
    assert "\n" not in str(error.value)


def test_score_script_drops_fastest_and_slowest(tmp_path, capsys, monkeypatch):
    def write_log(name: str, seconds: float, status: str) -> None:
        start = ':::MLLOG {"time_ms": 100000, "key": "run_start", "value": null, "metadata": {}}'
        stop = (
            f':::MLLOG {{"time_ms": {(100 + seconds) * 1000:.0f}, "key": "run_stop", '
            f'"value": null, "metadata": {{"status": "{status}"}}}}'
        )
        (tmp_path / name).write_text(f"{start}\n{stop}\n")

    for index, seconds in enumerate((16, 12, 50, 10, 14)):
        write_log(f"run_{index}.log", seconds, "success")
    write_log("run_5.log", 8, "aborted")
    monkeypatch.setattr(sys, "argv", ["mlperf_score.py", str(tmp_path)])
    with pytest.raises(SystemExit) as finished:
        runpy.run_path(SCORE_SCRIPT, run_name="__main__")
    assert finished.value.code == 0
    printed = capsys.readouterr().out
    assert "| run_5.log | 8.00 | no |" in printed
    assert "MLPerf v0.5 score: 14.00 s (mean of 3 converged runs" in printed
    assert "convergence rate: 5/6 (83%)" in printed
