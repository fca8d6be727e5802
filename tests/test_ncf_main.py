"""ncf-main end to end on a tiny synthetic dataset (the Flax-style test config)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import tensorflow as tf
from absl import logging
from conftest import (
    ROOT,
    TINY_NCF_MAIN_FLAGS,
    damage_checkpoint,
    run_module,
    run_module_on_a_tmpfs,
    the_error_line,
    tiny_ncf_config,
)

from official.core import model_dir
from official.core.model_dir import ModelDirError
from official.utils.logs import mlperf_helper
from official.utils.logs.mlperf_helper import MlperfOptions
from official.utils.misc import machine
from recommendation.model import neumf_model
from recommendation.producer import data_pipeline
from recommendation.training import cycles, experiments, reporting
from recommendation.training.ncf_common import NcfConfig


def _config(tmp_path, **overrides) -> NcfConfig:
    return tiny_ncf_config(tmp_path, benchmark_log_dir=str(tmp_path / "bench"), **overrides)


def _records(tmp_path, kind: str) -> list[dict]:
    with open(tmp_path / "bench" / "benchmark.jsonl") as log:
        return [record for record in map(json.loads, log) if record["kind"] == kind]


def test_trains_evaluates_checkpoints_and_logs(tmp_path):
    summary = cycles.run(_config(tmp_path)).summary
    assert summary["epochs"] == 2
    assert 0.0 < summary["best_hr"] <= 1.0 and 0.0 < summary["best_ndcg"] <= summary["best_hr"]
    assert summary["train_points"] == 2 * (12_000 - 300) * 5
    evaluations = _records(tmp_path, "evaluation")
    assert [record["epoch"] for record in evaluations] == [0, 1]
    run_info = _records(tmp_path, "run_info")[0]
    assert run_info["versions"]["tensorflow"].startswith("2.21")
    assert (
        run_info["preset"]["synthetic_num_users"] == 300 and run_info["flags"]["config"] == "tiny"
    )
    assert glob.glob(str(tmp_path / "model" / "events.out.tfevents.*"))
    assert os.path.exists(tmp_path / "model" / "checkpoint")
    assert os.listdir(tmp_path / "data" / "synthetic" / "runs") == []  # producer cleaned up

    resumed = cycles.run(_config(tmp_path, train_epochs=3)).summary
    assert resumed["epochs"] == 3
    assert [record["epoch"] for record in _records(tmp_path, "evaluation")] == [0, 1, 2]


def test_the_steps_are_traced_while_the_producer_starts_and_not_again(tmp_path, monkeypatch):
    events = []
    model_fn, hand_over = neumf_model.model_fn, data_pipeline.ProducerHandle.hand_over

    def recording_model_fn(features, labels, mode, params, state):
        events.append(mode.value)  # Python runs only while a call is traced
        return model_fn(features, labels, mode, params, state)

    def recording_hand_over(producer):
        events.append("hand over")
        hand_over(producer)

    monkeypatch.setattr(neumf_model, "model_fn", recording_model_fn)
    monkeypatch.setattr(data_pipeline.ProducerHandle, "hand_over", recording_hand_over)
    cycles.run(_config(tmp_path))
    first = events.index("hand over")
    assert set(events[:first]) == {"train", "eval"}  # before the producer is given its work
    assert set(events[first:]) == {"hand over"}  # and the two epochs traced nothing more


def test_same_seed_same_metrics_on_cpu(tmp_path):
    first = cycles.run(_config(tmp_path / "a", train_epochs=1)).summary
    second = cycles.run(_config(tmp_path / "b", train_epochs=1)).summary
    assert first["best_hr"] == second["best_hr"]
    assert first["best_ndcg"] == second["best_ndcg"]
    loss = [_records(tmp_path / run, "evaluation")[0]["loss"] for run in ("a", "b")]
    assert loss[0] == loss[1]


def test_learning_rate_decay_resumes_a_constant_rate_run(tmp_path):
    # A checkpoint without decay, at another rate: the resumed run's flags decide.
    first = _config(tmp_path, train_epochs=1)
    fast = dataclasses.replace(first.model, learning_rate=0.1)
    cycles.run(dataclasses.replace(first, model=fast))
    model = dataclasses.replace(
        _config(tmp_path).model, learning_rate_decay=0.5, decay_start_epoch=1, weight_decay=0.01
    )
    log = str(tmp_path / "mlperf.log")
    mlperf = MlperfOptions(log, division="open", clear_caches=False)
    runner = cycles.run(_config(tmp_path, model=model, mlperf=mlperf, train_epochs=3)).runner
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
    summary = cycles.run(_config(tmp_path, train_epochs=5, hr_threshold=0.0)).summary
    assert summary["epochs"] == 1
    # Wall times: the target is reached after epoch 0's training and evaluation, and
    # before the run ends.
    assert summary["train_seconds"] < summary["time_to_target_s"] <= summary["total_seconds"]


def test_synthetic_batches_measure_throughput_only(tmp_path):
    summary = cycles.run(_config(tmp_path, use_synthetic_data=True, train_epochs=1)).summary
    assert summary["best_hr"] is None
    # One epoch of (12,000 - 300 held out) x 5 points is 29 batches of 2,048; synthetic
    # batches are never padded, so all 29 x 2,048 train.
    assert summary["train_points"] == 29 * 2048 and summary["train_seconds"] > 0
    assert summary["examples_per_second"] == summary["train_points"] / summary["train_seconds"]
    assert "throughput" in reporting.summary_line(summary, 10)


@pytest.mark.parametrize(
    "isa, warned", [("sse4_2 avx avx2 fma", True), ("avx avx2 fma avx512f avx512_bf16", False)]
)
def test_bf16_on_a_cpu_without_bf16_instructions_says_to_use_fp32(
    tmp_path, monkeypatch, isa, warned
):
    monkeypatch.setattr(machine, "describe_cpu", lambda: machine.CpuInfo("a CPU", isa))
    said = []
    monkeypatch.setattr(logging, "warning", lambda text, *args: said.append(text % args))
    config = _config(tmp_path, use_synthetic_data=True, train_epochs=1)
    cycles.run(dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bf16")))
    about_bf16 = [line for line in said if "--dtype bf16" in line]
    if warned:
        assert len(about_bf16) == 1 and "use fp32 here" in about_bf16[0]
        assert "amx_bf16, avx512_bf16" in about_bf16[0]
    else:
        assert about_bf16 == []


def test_cycles_cover_the_remaining_epochs():
    assert cycles._cycles(0, 5, 2) == (2, 2, 1)
    assert cycles._cycles(3, 5, 2) == (2,)
    assert cycles._cycles(5, 5, 1) == ()


@pytest.mark.integration
@pytest.mark.parametrize("extra,expect_ok", [([], True), (["--layers=15,8"], False)])
def test_command_line(tmp_path, extra, expect_ok):
    result = run_module(
        "recommendation.ncf_main",
        *TINY_NCF_MAIN_FLAGS,
        f"--data_dir={tmp_path}",
        f"--model_dir={tmp_path / 'model'}",
        "--train_epochs=1",
        f"--benchmark_log_dir={tmp_path / 'bench'}",
        *extra,
    )
    if expect_ok:
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.startswith("best HR@10=")
        assert _info_sources(result.stderr) <= _OUR_FILES | _WRITTEN_WHILE_LOADING
        # The experiment fills what the command line leaves unset, and says so.
        run_info = _records(tmp_path, "run_info")[0]
        tiny = experiments.EXPERIMENTS["tiny"].values
        assert run_info["preset"] == json.loads(
            json.dumps({name: run_info["flags"][name] for name in tiny if name != "train_epochs"})
        )
        assert run_info["flags"]["learning_rate"] == 0.01 and run_info["flags"]["train_epochs"] == 1
        assert "Experiment tiny for the flags left unset: {'dataset': 'synthetic'" in result.stderr
    else:
        assert result.returncode != 0
        assert "--layers must be positive integers, the first even" in result.stderr


# INFO lines TensorFlow writes while its libraries load, before any setting is read.
_WRITTEN_WHILE_LOADING = {"port.cc", "cudart_stub.cc"}
_OUR_FILES = {
    name
    for folder in ("official", "recommendation")
    for _, _, names in os.walk(os.path.join(ROOT, folder))
    for name in names
    if name.endswith(".py")
}


def _info_sources(stderr: str) -> set[str]:
    """The files that wrote INFO lines (``I1201 08:02:12.537235 140 ncf_main.py:473] ...``)."""
    return set(re.findall(r"^I\d{4} [\d:.]+ +\d+ ([\w.]+):\d+\]", stderr, re.MULTILINE))


def test_config_is_frozen(tmp_path):
    with pytest.raises(dataclasses.FrozenInstanceError):
        _config(tmp_path).batch_size = 1


def test_a_finished_run_resumed_reports_its_restored_model(tmp_path):
    first = cycles.run(_config(tmp_path, train_epochs=1)).summary
    again = cycles.run(_config(tmp_path, train_epochs=1)).summary
    checkpoint = tf.train.latest_checkpoint(str(tmp_path / "model"))
    assert again["resumed_finished_run"] == checkpoint
    # The restored model on the same evaluation set: the first run's numbers exactly.
    assert (again["best_hr"], again["best_ndcg"]) == (first["best_hr"], first["best_ndcg"])
    assert again["train_points"] == 0 and again["examples_per_second"] is None
    assert reporting.summary_line(again, 10) == (
        f"nothing left to train: {checkpoint} holds all 1 epochs; its model scores "
        f"HR@10={first['best_hr']:.4f} NDCG@10={first['best_ndcg']:.4f}. --train_epochs "
        "above 1 trains on, --clean starts over"
    )


def _ncf_main(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    return run_module(
        "recommendation.ncf_main", *TINY_NCF_MAIN_FLAGS, f"--data_dir={tmp_path / 'data'}", *flags
    )


@pytest.mark.integration
def test_a_model_dir_that_is_a_file_ends_with_one_error_line(tmp_path):
    (tmp_path / "model").write_text("")
    result = _ncf_main(tmp_path, f"--model_dir={tmp_path / 'model'}")
    assert the_error_line(result) == (
        f"error: --model_dir {tmp_path / 'model'} is a file, not a folder: give a folder for "
        "the checkpoints and logs"
    )


def test_an_export_dir_in_the_way_is_refused_before_any_data_or_training(tmp_path):
    (tmp_path / "export").write_text("")
    with pytest.raises(ModelDirError) as refused:
        cycles.run(_config(tmp_path, export_dir=str(tmp_path / "export")))
    assert str(refused.value) == (
        f"--export_dir {tmp_path / 'export'} is a file, not a folder: give a folder for the exports"
    )
    assert not (tmp_path / "data").exists() and os.listdir(tmp_path / "model") == []


@pytest.mark.integration
def test_a_read_only_export_dir_ends_with_one_line_before_training(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    result, left = run_module_on_a_tmpfs(
        disk,
        "ro",
        "recommendation.ncf_main",
        *TINY_NCF_MAIN_FLAGS,
        f"--data_dir={tmp_path / 'data'}",
        f"--model_dir={tmp_path / 'model'}",
        f"--export_dir={disk / 'export'}",
    )
    line = the_error_line(result)
    assert left == [] and not (tmp_path / "data").exists()
    assert os.listdir(tmp_path / "model") == []  # nothing trained
    assert line == (
        f"error: cannot write exports in {disk / 'export'}: Read-only file system; pass "
        "--export_dir with a writable folder"
    )


@pytest.mark.integration
def test_a_full_disk_under_model_dir_ends_with_one_line_and_no_partial_checkpoint(tmp_path):
    # A real full disk: a 64 KiB tmpfs, and a model whose checkpoint needs about 600 KB.
    disk = tmp_path / "disk"
    disk.mkdir()
    result, left = run_module_on_a_tmpfs(
        disk,
        "size=64k",
        "recommendation.ncf_main",
        *TINY_NCF_MAIN_FLAGS,
        f"--data_dir={tmp_path / 'data'}",
        f"--model_dir={disk}",
        "--num_factors=64",
        "--layers=128,64",
        "--train_epochs=1",
    )
    assert re.fullmatch(
        rf"error: cannot write checkpoint \d+ in {disk}: no space left on the "
        r"device; free space there or pass --model_dir with a folder on a disk with room; "
        r"none was kept",
        the_error_line(result),
    )
    assert [name for name in left if "ckpt" in name or name == "checkpoint"] == [], left


def _stop_at(tmp_path, signum: int, milestone: str, name: str) -> tuple[str, int]:
    """Runs a long ncf-main, sends `signum` once stderr shows `milestone`, checks the
    stop was clean; returns its last line and the producer's pid."""
    process = subprocess.Popen(
        [sys.executable, "-m", "recommendation.ncf_main", *TINY_NCF_MAIN_FLAGS]
        + [f"--data_dir={tmp_path / 'data'}", f"--model_dir={tmp_path / name}"]
        + ["--train_epochs=60"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    seen, producer = [], None
    for line in process.stderr:
        seen.append(line)
        found = re.search(r"Data producer started \(pid (\d+)\)", line)
        producer = int(found.group(1)) if found else producer
        if milestone in line:
            process.send_signal(signum)
            break
    seen += process.stderr.readlines()
    process.wait(timeout=120)
    text = "".join(seen)
    assert process.returncode == 128 + signum, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert not os.path.exists(f"/proc/{producer}"), "the producer outlived the trainer"
    assert os.listdir(tmp_path / "data" / "synthetic" / "runs") == []
    return seen[-1].rstrip("\n"), producer


@pytest.mark.integration
@pytest.mark.parametrize(
    "signum, milestone, resume, checkpointed",  # checkpointed: epochs kept at the milestone
    [
        (signal.SIGINT, "Data producer started", False, 0),  # before any checkpoint
        (signal.SIGTERM, "epoch 1: loss=", True, 2),  # training goes on after the 2nd evaluation
        (signal.SIGINT, "epoch 3 [", False, 3),  # in the middle of an epoch's progress
    ],
)
def test_a_stop_signal_keeps_the_checkpoint_and_says_how_to_resume(
    tmp_path, signum, milestone, resume, checkpointed
):
    last, _ = _stop_at(tmp_path, signum, milestone, "model")
    name = signal.Signals(signum).name
    if last == f"stopped by {name}: no checkpoint yet; the same command starts over":
        assert tf.train.latest_checkpoint(str(tmp_path / "model")) is None
        return
    kept = re.fullmatch(
        rf"stopped by {name}: kept (\S+) \((\d+) of 60 epochs done\); the same command "
        "resumes from it, --clean starts over",
        last,
    )
    assert kept, last
    checkpoint, done = kept.group(1), int(kept.group(2))
    assert checkpoint == tf.train.latest_checkpoint(str(tmp_path / "model"))
    # The signal lands a little after the milestone (timing): at least the epochs kept
    # by then, and always an epoch's end (29 steps an epoch, checkpoints named by step).
    assert done >= max(checkpointed, 1) and checkpoint.endswith(f"ckpt-{done * 29}")
    if not resume:
        return
    resumed = _ncf_main(tmp_path, f"--model_dir={tmp_path / 'model'}", f"--train_epochs={done + 1}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from {checkpoint} " in resumed.stderr
    assert f"{done + 1} epochs" in resumed.stdout


@dataclasses.dataclass(frozen=True)
class _Trained:
    folder: str  # data/ and model/ of a finished run of two epochs
    checkpoints: tuple[str, str]  # after epoch 1 and epoch 2, as names in model/
    stdout: str


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory) -> _Trained:
    """An ncf-main run of two epochs (a checkpoint after each), to damage copies of."""
    folder = tmp_path_factory.mktemp("two_epochs")
    result = _ncf_main(folder, f"--model_dir={folder / 'model'}", "--train_epochs=2")
    assert result.returncode == 0, result.stderr[-3000:]
    state = tf.train.get_checkpoint_state(str(folder / "model"))
    first, second = (os.path.basename(path) for path in state.all_model_checkpoint_paths)
    return _Trained(str(folder), (first, second), result.stdout)


def _copy(trained: _Trained, tmp_path) -> tuple[str, str]:
    """A copy of the trained run in tmp_path; its checkpoints' paths there."""
    shutil.copytree(trained.folder, tmp_path, dirs_exist_ok=True)
    first, second = trained.checkpoints
    return str(tmp_path / "model" / first), str(tmp_path / "model" / second)


@pytest.mark.integration
def test_a_truncated_checkpoint_is_named_and_the_run_resumes_from_the_one_before(
    tmp_path, two_epochs
):
    first, newest = _copy(two_epochs, tmp_path)
    problem = damage_checkpoint(newest, "truncated")
    result = _ncf_main(tmp_path, f"--model_dir={tmp_path / 'model'}", "--train_epochs=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(
        rf"^W.*\] {re.escape(newest)} is damaged \({problem}\); restored {re.escape(first)}, "
        "the newest intact checkpoint$",
        result.stderr,
        re.MULTILINE,
    ), result.stderr[-3000:]
    assert re.search(rf"Resumed from {re.escape(first)} \(step \d+, 1 epochs done\)", result.stderr)
    # Epoch 2 trained again from epoch 1's checkpoint: the same model as the first run's.
    assert result.stdout.split(", target")[0] == two_epochs.stdout.split(", target")[0]
    assert result.stdout.split(", target")[0].endswith(", 2 epochs")
    assert model_dir.newest_intact(str(tmp_path / "model")) == newest  # written anew


def test_with_every_checkpoint_damaged_ncf_main_refuses_and_deletes_nothing(tmp_path, two_epochs):
    first, newest = _copy(two_epochs, tmp_path)
    problem = damage_checkpoint(newest, "truncated")
    damage_checkpoint(first, "no data file")
    model = tmp_path / "model"
    kept = {name: (model / name).read_bytes() for name in os.listdir(model)}
    # In this process: the scan refuses before any weight is restored, and a
    # ModelDirError ends the command in one line as the tests above show.
    with pytest.raises(ModelDirError) as refused:
        cycles.run(_config(tmp_path, model_dir=str(model), train_epochs=3))
    assert re.fullmatch(
        rf"no intact checkpoint in {re.escape(str(model))}: {re.escape(newest)} "
        rf"\({problem}\) and {re.escape(first)} \({re.escape(os.path.basename(first))}"
        r"\.data-\*: missing\) are damaged; train again with --clean or another --model_dir "
        rf"\(copy {re.escape(str(model))} elsewhere first if its data matters\)",
        str(refused.value),
    )
    assert {name: (model / name).read_bytes() for name in kept} == kept


@pytest.mark.integration
def test_a_stopped_or_finished_run_names_the_checkpoint_that_is_restored(tmp_path, two_epochs):
    first, newest = _copy(two_epochs, tmp_path)
    damage_checkpoint(newest, "flipped bytes")
    # What a stop signal reports: the checkpoint the same command then resumes from.
    assert cycles._kept_for_resume(_config(tmp_path)) == (
        f"kept {first} (1 of 2 epochs done); the same command resumes from it, --clean starts over"
    )
    result = _ncf_main(tmp_path, f"--model_dir={tmp_path / 'model'}", "--train_epochs=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(
        f"nothing left to train: {first} holds all 1 epochs; its model scores HR@10="
    ), result.stdout
    assert f"{newest} is damaged (" in result.stderr
