"""ncf-main end to end on a tiny synthetic dataset (the Flax-style test config)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import pytest
from conftest import TINY_NCF_MAIN_FLAGS, run_module, tiny_ncf_config

from official.utils.logs import mlperf_helper
from official.utils.logs.mlperf_helper import MlperfOptions
from recommendation import ncf_main
from recommendation.ncf_common import NcfConfig


def _config(tmp_path, **overrides) -> NcfConfig:
    return tiny_ncf_config(tmp_path, benchmark_log_dir=str(tmp_path / "bench"), **overrides)


def _records(tmp_path, kind: str) -> list[dict]:
    with open(tmp_path / "bench" / "benchmark.jsonl") as log:
        return [record for record in map(json.loads, log) if record["kind"] == kind]


def test_trains_evaluates_checkpoints_and_logs(tmp_path):
    summary = ncf_main.run(_config(tmp_path)).summary
    assert summary["epochs"] == 2
    assert 0.0 < summary["best_hr"] <= 1.0 and 0.0 < summary["best_ndcg"] <= summary["best_hr"]
    assert summary["train_points"] == 2 * (12_000 - 300) * 5
    evaluations = _records(tmp_path, "evaluation")
    assert [record["epoch"] for record in evaluations] == [0, 1]
    assert _records(tmp_path, "run_info")[0]["versions"]["tensorflow"].startswith("2.21")
    assert glob.glob(str(tmp_path / "model" / "events.out.tfevents.*"))
    assert os.path.exists(tmp_path / "model" / "checkpoint")
    assert os.listdir(tmp_path / "data" / "synthetic" / "runs") == []  # producer cleaned up

    resumed = ncf_main.run(_config(tmp_path, train_epochs=3)).summary
    assert resumed["epochs"] == 3
    assert [record["epoch"] for record in _records(tmp_path, "evaluation")] == [0, 1, 2]


def test_same_seed_same_metrics_on_cpu(tmp_path):
    first = ncf_main.run(_config(tmp_path / "a", train_epochs=1)).summary
    second = ncf_main.run(_config(tmp_path / "b", train_epochs=1)).summary
    assert first["best_hr"] == second["best_hr"]
    assert first["best_ndcg"] == second["best_ndcg"]
    loss = [_records(tmp_path / run, "evaluation")[0]["loss"] for run in ("a", "b")]
    assert loss[0] == loss[1]


def test_learning_rate_decay_resumes_a_constant_rate_run(tmp_path):
    # A checkpoint without decay, at another rate: the resumed run's flags decide.
    first = _config(tmp_path, train_epochs=1)
    fast = dataclasses.replace(first.model, learning_rate=0.1)
    ncf_main.run(dataclasses.replace(first, model=fast))
    model = dataclasses.replace(
        _config(tmp_path).model, learning_rate_decay=0.5, decay_start_epoch=1, weight_decay=0.01
    )
    log = str(tmp_path / "mlperf.log")
    mlperf = MlperfOptions(log, division="open", clear_caches=False)
    runner = ncf_main.run(_config(tmp_path, model=model, mlperf=mlperf, train_epochs=3)).runner
    steps = runner.params.steps_per_epoch
    assert steps == -(-(12_000 - 300) * 5 // 2048)
    optimizer = runner.state.optimizer
    assert int(optimizer.iterations) == 3 * steps
    # Epochs 0, 1 and 2 trained at 0.01, 0.005 and 0.0025 (the rate of the last step).
    assert float(optimizer.learning_rate) == pytest.approx(0.0025)
    logged = {record.key: record.value for record in mlperf_helper.read_log(log)}
    assert logged["opt_lr_decay_factor"] == 0.5 and logged["opt_adamw_weight_decay"] == 0.01
    assert logged["opt_lr_decay_start_step"] == steps


def test_stops_once_the_threshold_is_reached(tmp_path):
    summary = ncf_main.run(_config(tmp_path, train_epochs=5, hr_threshold=0.0)).summary
    assert summary["epochs"] == 1 and summary["time_to_target_s"] > 0


def test_synthetic_batches_measure_throughput_only(tmp_path):
    summary = ncf_main.run(_config(tmp_path, use_synthetic_data=True, train_epochs=1)).summary
    assert summary["best_hr"] is None and summary["examples_per_second"] > 0
    assert "throughput" in ncf_main.summary_line(summary, 10)


def test_cycles_cover_the_remaining_epochs():
    assert ncf_main._cycles(0, 5, 2) == (2, 2, 1)
    assert ncf_main._cycles(3, 5, 2) == (2,)
    assert ncf_main._cycles(5, 5, 1) == ()


@pytest.mark.parametrize("extra,expect_ok", [([], True), (["--layers=15,8"], False)])
def test_command_line(tmp_path, extra, expect_ok):
    result = run_module(
        "recommendation.ncf_main",
        *TINY_NCF_MAIN_FLAGS,
        f"--data_dir={tmp_path}",
        f"--model_dir={tmp_path / 'model'}",
        "--train_epochs=1",
        *extra,
    )
    if expect_ok:
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.startswith("best HR@10=")
    else:
        assert result.returncode != 0
        assert "--layers must be positive integers, the first even" in result.stderr


def test_config_is_frozen(tmp_path):
    with pytest.raises(dataclasses.FrozenInstanceError):
        _config(tmp_path).batch_size = 1
