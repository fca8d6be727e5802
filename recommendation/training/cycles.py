"""The train/eval cycles of ``ncf-main``: prepare the data (cached), start the
negative-sampling producer, then per cycle of --epochs_between_evals epochs train on its
shards, checkpoint, evaluate HR/NDCG on the held-out items, report, and stop early once
HR@k reaches --hr_threshold.

With ``--eval_split validation`` the cycles evaluate on the validation items (the
threshold too) and the selected epoch is tested once at the end (`selection`); with
``--pretrain_gmf_dir`` and ``--pretrain_mlp_dir`` a fresh NeuMF run starts from
pretrained models (`pretrain`).
"""

from __future__ import annotations

import dataclasses
import os
import time

import tensorflow as tf
from absl import logging

from official.core import distribution_utils, model_dir, precision, signals, writer_lease
from official.core.model_dir import ModelDirError
from official.core.runner import (
    Mode,
    Runner,
    completed_epochs_of,
)
from official.utils.logs import mlperf_helper
from official.utils.logs.logger import BenchmarkLogger
from official.utils.logs.mlperf_helper import MlperfLogger
from official.utils.logs.summaries import ScalarSummaries
from recommendation.data import constants, preprocessing_cache
from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.mlperf import mlperf_tags
from recommendation.model import neumf_model
from recommendation.producer import data_pipeline, run_folder
from recommendation.producer.run_folder import GenerationParams
from recommendation.serving import neumf_export, onnx_model
from recommendation.training import pretrain, reporting, selection
from recommendation.training.evaluations import Evaluations, metric_names
from recommendation.training.ncf_common import NcfConfig


def _cycles(first_epoch: int, train_epochs: int, epochs_between_evals: int) -> tuple[int, ...]:
    remaining = range(first_epoch, train_epochs, epochs_between_evals)
    return tuple(min(epochs_between_evals, train_epochs - start) for start in remaining)


def _eval_users_per_batch(config: NcfConfig, block: int, replicas: int, num_users: int) -> int:
    """Whole users per evaluation batch: a multiple of the replica count, and no more
    than the dataset needs (padding users cost as much as real ones)."""
    points = config.eval_batch_size or config.batch_size
    users = min(max(1, points // block), num_users)
    return -(-users // replicas) * replicas


@dataclasses.dataclass
class RunResult:
    """What `run` returns.

    Attributes:
        summary: Best HR/NDCG, epochs, timings (what the final line and log show).
        runner: The trained runner (its model, optimiser and checkpoints).
    """

    summary: dict
    runner: Runner


def run(config: NcfConfig) -> RunResult:
    """Runs training as `config` says.

    Raises:
        signals.Interrupted: A stop signal arrived (with what was kept, for a resume).
        ModelDirError: model_dir or export_dir cannot be written, or another live
            process writes it (its lease names it).
    """
    start = time.perf_counter()
    check_eval_split(config)
    pretrain.check_pretrain(config)
    if config.export_onnx:
        onnx_model.require_onnx()  # before training, not after it
    distribution_utils.configure_threads(config.inter_op_threads, config.intra_op_threads)
    if config.seed is not None:
        # Same seed, same initial weights; with op determinism, same metrics on CPU.
        tf.keras.utils.set_random_seed(config.seed)
        tf.config.experimental.enable_op_determinism()
    if config.worker_hosts:
        distribution_utils.configure_cluster(config.worker_hosts, config.task_index)
    strategy = distribution_utils.get_distribution_strategy(
        config.distribution_strategy,
        config.num_gpus,
        config.tpu,
        config.tpu_zone,
        config.tpu_project,
    )
    replicas = strategy.num_replicas_in_sync
    if all("CPU" in device.upper() for device in strategy.extended.worker_devices):
        dtype = config.model.dtype
        precision.warn_if_bf16_is_slow_here(precision.POLICIES[dtype], f"--dtype {dtype}")
    if config.batch_size % replicas:
        raise ValueError(f"--batch_size {config.batch_size} must divide by {replicas} replicas")
    model_dir.prepare(config.model_dir)
    chief = distribution_utils.is_chief(strategy)
    # The chief writes model_dir and the export for the cluster. Both checked and held
    # before any data is prepared, before --clean empties model_dir (never another live
    # run's) and before the compliance log opens there.
    if not chief:
        return _run_holding_model_dir(config, strategy, chief, start)
    if config.export_dir:
        model_dir.prepare(config.export_dir, "--export_dir", "exports")
    with (
        writer_lease.hold(config.model_dir, "ncf-main") as lease,
        writer_lease.hold_export(config.export_dir, "ncf-main"),
    ):
        if config.clean:
            lease.clear_folder()
        return _run_holding_model_dir(config, strategy, chief, start)


def _run_holding_model_dir(
    config: NcfConfig, strategy: tf.distribute.Strategy, chief: bool, start: float
) -> RunResult:
    try:
        with mlperf_helper.session(
            config.mlperf if chief else None, mlperf_tags.V05_TAGS
        ) as mlperf:
            with signals.interruptible():  # numpy and file reads only: may stop anywhere
                data = preprocessing_cache.load_or_build(config.data).data
            runner = _make_runner(config, data, strategy)
            benchmark = BenchmarkLogger(config.benchmark_log_dir if chief else None)
            benchmark.log_run_info(config.flag_values, config.benchmark_test_id, config.preset)
            if config.use_synthetic_data:
                return RunResult(_run_synthetic(config, data, runner, start), runner)
            summary = train_and_evaluate(config, data, runner, benchmark, mlperf, start)
    except signals.Interrupted as stop:
        stop.kept = _kept_for_resume(config)
        raise
    if config.export_dir and chief:
        parity = neumf_export.export_serving(runner, data, config.export_dir, config.export_onnx)
        summary["export_dir"] = config.export_dir
        if parity is not None:
            summary["onnx_max_score_difference"] = parity
    summary["failed_benchmark_log_writes"] = benchmark.failures.count
    benchmark.log("summary", **summary)
    return RunResult(summary, runner)


def restore_selected(config: NcfConfig) -> tuple[Runner, PreprocessedData]:
    """The model a finished ``--eval_split validation`` run in `config.model_dir` tested:
    the epoch validation selected (MODEL_DIR/best), on one device, with its data.

    Raises:
        ModelDirError: model_dir holds no selected model.
    """
    data = preprocessing_cache.load_or_build(config.data).data
    runner = _make_runner(config, data, tf.distribute.get_strategy())
    runner.restore_best()
    return runner, data


def check_eval_split(config: NcfConfig) -> None:
    """Rejects what cannot go with ``--eval_split validation``.

    Raises:
        ValueError: MLPerf compliance logging (its protocol evaluates every cycle on
            the test holdout), or synthetic batches (nothing is evaluated).
    """
    if config.data.eval_split != constants.VALIDATION_SPLIT:
        return
    if config.mlperf is not None:
        raise ValueError(
            "--output_ml_perf_compliance_logging records the MLPerf protocol, which "
            "evaluates every cycle on the test holdout: drop --eval_split validation for "
            "a compliance run"
        )
    if config.use_synthetic_data:
        raise ValueError(
            "--use_synthetic_data measures training throughput and evaluates nothing: "
            "drop --eval_split validation"
        )


def _kept_for_resume(config: NcfConfig) -> str:
    """What a stopped run leaves in model_dir for the next one, and how to use it."""
    try:
        latest = model_dir.newest_intact(config.model_dir)  # what the next run restores
    except ModelDirError as none_intact:
        return str(none_intact)
    if latest is None:
        return "no checkpoint yet; the same command starts over"
    done = completed_epochs_of(latest)
    return (
        f"kept {latest} ({done} of {config.train_epochs} epochs done); the same "
        "command resumes from it, --clean starts over"
    )


def _batches_per_epoch(config: NcfConfig, data: PreprocessedData) -> int:
    """Global batches in one epoch: every positive with its negatives, the last padded."""
    return -(-data.num_train_positives * (1 + config.num_neg) // config.batch_size)


def _make_runner(
    config: NcfConfig, data: PreprocessedData, strategy: tf.distribute.Strategy
) -> Runner:
    """The runner for NeuMF sized to `data`, resumed from model_dir if it holds a run."""
    block = (
        data.eval_negatives.shape[1]
        if data.eval_negatives is not None
        else config.num_eval_negatives
    ) + 1
    model_params = dataclasses.replace(
        config.model,
        num_users=data.num_users,
        num_items=data.num_items,
        eval_block_size=block,
        steps_per_epoch=_batches_per_epoch(config, data),
    )
    runner = Runner(
        neumf_model.model_fn,
        neumf_model.build_state,
        model_params,
        config.model_dir,
        strategy,
        steps_per_call=config.batches_per_step,
        jit_compile=config.enable_xla
        or (config.use_xla_for_gpu and "GPU" in distribution_utils.device_types(strategy)),
        run_eagerly=config.run_eagerly,
    )
    resumed = runner.restore()
    if config.pretrain_gmf_dir and resumed:
        logging.info(
            "Resumed from %s's own checkpoint: --pretrain_gmf_dir and --pretrain_mlp_dir "
            "start a fresh run only",
            config.model_dir,
        )
    elif config.pretrain_gmf_dir:
        pretrain.start_from_pretrained(config, runner)
    return runner


def train_and_evaluate(
    config: NcfConfig,
    data: PreprocessedData,
    runner: Runner,
    benchmark: BenchmarkLogger,
    mlperf: MlperfLogger,
    start: float,
) -> dict:
    first_epoch = int(runner.completed_epochs.numpy())
    history = selection.ValidationHistory.open(config, first_epoch, runner.is_chief)
    split = config.data.eval_split
    cycles = _cycles(first_epoch, config.train_epochs, config.epochs_between_evals)
    params = _generation_params(config, data, runner, cycles, first_epoch, mlperf)
    reporting.log_hparams(mlperf, config, runner.params, data, params)
    summaries = ScalarSummaries(config.model_dir if runner.is_chief else None)
    best: dict | None = None  # the evaluation with the best HR, the earliest on ties
    summary = {
        "epochs": first_epoch,
        "time_to_target_s": None,
        "train_points": 0.0,
        "train_seconds": 0.0,
        "first_wait_seconds": 0.0,
        "wait_seconds": 0.0,
    }

    def start_run() -> None:
        # Data is prepared and the producer is up: MLPerf's clock starts as it gets work.
        mlperf.event("init_stop")
        mlperf.event("run_start")

    run_root = os.path.join(config.data.resolved_cache_dir(), run_folder.RUNS_FOLDER)
    with data_pipeline.ProducerHandle(
        params, run_root, config.use_subprocess, config.data_stall_timeout_sec, start_run
    ) as producer:
        # While the producer process imports TensorFlow: the first training call then
        # only compiles (XLA) and runs, the first evaluation only runs.
        if cycles:
            runner.prepare(Mode.TRAIN, data_pipeline.train_batch_spec(params.batch_size))
        runner.prepare(
            Mode.EVAL,
            data_pipeline.eval_batch_spec(
                params.eval_users_per_batch, runner.params.eval_block_size
            ),
        )
        producer.hand_over()
        mlperf.event("train_loop")
        evaluator = Evaluations(runner, data, producer, config.eval_ranking, mlperf)
        if history is not None and first_epoch and not history.has(first_epoch - 1):
            # Stopped between its checkpoint and the history: the restored model is
            # that epoch's, so its evaluation is the one missed.
            restored = evaluator.evaluate(split, first_epoch - 1)
            history.record(runner, first_epoch - 1, restored)
        epoch = first_epoch
        for index, epochs in enumerate(cycles):
            signals.check()
            waited = time.perf_counter()
            info = producer.cycle(index)
            if info.batches_per_epoch != runner.params.steps_per_epoch:
                # The learning-rate schedule counts epochs in steps: they must agree.
                raise RuntimeError(
                    f"the producer wrote {info.batches_per_epoch} batches per epoch, the "
                    f"trainer expects {runner.params.steps_per_epoch}"
                )
            # The first cycle cannot overlap training; later waits are pipeline stalls.
            key = "first_wait_seconds" if index == 0 else "wait_seconds"
            summary[key] += time.perf_counter() - waited
            epoch_reports = reporting.EpochProgressAndEvents(
                epoch, epochs, info.batches_per_epoch, runner.is_chief, mlperf
            )
            train = runner.train(
                lambda i=info: data_pipeline.train_input_fn(i), info.num_batches, epoch_reports
            )
            epoch_reports.close()
            producer.release(index)
            epoch += epochs
            runner.completed_epochs.assign(epoch)
            runner.save_checkpoint()
            evaluation = evaluator.evaluate(split, epoch - 1)
            if history is not None:
                history.record(runner, epoch - 1, evaluation)
            summary["epochs"] = epoch
            summary["train_points"] += train["num_points"]
            summary["train_seconds"] += train["seconds"]
            reporting.report(config, runner, summaries, benchmark, epoch - 1, train, evaluation)
            if best is None or evaluation["hr"] > best["hr"]:
                best = {**evaluation, "epoch": epoch - 1}
            if evaluation["hr"] >= config.hr_threshold:
                summary["time_to_target_s"] = time.perf_counter() - start
                break
        if not cycles:
            # A finished run resumed: nothing to train, so report its restored model.
            summary["resumed_finished_run"] = runner.restored_from
            if history is None:
                evaluation = evaluator.evaluate(split, first_epoch - 1)
                best = {**evaluation, "epoch": first_epoch - 1}
        summary["eval_split"] = split
        if history is not None:
            best = history.best()
            test = selection.test_selected(evaluator, best["epoch"])
            tested = {f"test_{name}": test[name] for name in metric_names(config.eval_ranking)}
            summary.update(tested)
            summaries.write(runner.global_step, tested)
        reached = summary["time_to_target_s"] is not None
        mlperf.event("run_stop", status=mlperf_helper.SUCCESS if reached else mlperf_helper.ABORTED)
    trained = summary["train_seconds"] > 0
    summary.update({f"best_{name}": best[name] for name in metric_names(config.eval_ranking)})
    summary.update(
        eval_ranking=config.eval_ranking,
        best_epoch=best["epoch"],
        total_seconds=time.perf_counter() - start,
        examples_per_second=summary["train_points"] / summary["train_seconds"] if trained else None,
        failed_tensorboard_writes=summaries.failures.count,
    )
    return summary


def _generation_params(
    config: NcfConfig,
    data: PreprocessedData,
    runner: Runner,
    cycles: tuple[int, ...],
    first_epoch: int,
    mlperf: MlperfLogger,
) -> GenerationParams:
    """What the producer is asked to generate for the remaining `cycles`."""
    block = runner.params.eval_block_size
    replicas = runner.strategy.num_replicas_in_sync
    return GenerationParams(
        cache_path=os.path.join(config.data.resolved_cache_dir(), preprocessing_cache.CACHE_FILE),
        batch_size=config.batch_size,
        eval_users_per_batch=_eval_users_per_batch(config, block, replicas, data.num_users),
        num_neg=config.num_neg,
        num_eval_negatives=block - 1,
        epochs_per_cycle=cycles,
        seed=config.seed if config.seed is not None else int.from_bytes(os.urandom(4), "big"),
        first_epoch=first_epoch,
        mlperf_log_file=mlperf.part_file,
        mlperf_log_format=mlperf.log_format,
    )


def _run_synthetic(config: NcfConfig, data: PreprocessedData, runner: Runner, start: float) -> dict:
    """Pure throughput: random in-memory batches, the real model and step, no eval."""
    steps = _batches_per_epoch(config, data)
    epoch_reports = reporting.EpochProgressAndEvents(0, config.train_epochs, steps, runner.is_chief)
    result = runner.train(
        lambda: data_pipeline.synthetic_train_input_fn(
            config.batch_size, data.num_users, data.num_items, config.seed or 0
        ),
        steps * config.train_epochs,
        epoch_reports,
    )
    epoch_reports.close()
    return {
        "epochs": config.train_epochs,
        "train_points": result["num_points"],
        "train_seconds": result["seconds"],
        "best_hr": None,
        "best_ndcg": None,
        "examples_per_second": result["num_points"] / result["seconds"],
        "total_seconds": time.perf_counter() - start,
    }
