"""Trains NeuMF in train/eval cycles until HR@k reaches --hr_threshold (``ncf-main``).

    ncf-main --dataset synthetic --train_epochs 3          # offline
    ncf-main --dataset ml-1m --data_dir DIR                # tuned ML-1M defaults

Flags are parsed here only; `NcfConfig` carries them inward. The loop: prepare the
data (cached), start the negative-sampling producer, then per cycle of
--epochs_between_evals epochs train on its shards, checkpoint, evaluate HR/NDCG on
the held-out items, log, and stop early once the threshold is reached.

With ``--eval_split validation`` the cycles evaluate on the validation items (the
threshold too), each epoch's metrics are kept in model_dir (`ValidationHistory`) and
the best epoch's weights beside them (`Runner.save_best`); at the end that epoch is
restored and the test holdout evaluated once, on it.

With ``--pretrain_gmf_dir`` and ``--pretrain_mlp_dir`` a fresh NeuMF run starts from the
models of a finished ``--model gmf`` and ``--model mlp`` run (`start_from_pretrained`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import tensorflow as tf
from absl import app, flags, logging

from official.core import distribution_utils, model_dir, precision, signals, writer_lease
from official.core.model_dir import ModelDirError
from official.core.runner import (
    BEST_FOLDER,
    Mode,
    Runner,
    completed_epochs_of,
    restore_model,
)
from official.utils.logs import mlperf_helper
from official.utils.logs.logger import BenchmarkLogger
from official.utils.logs.mlperf_helper import MlperfLogger
from official.utils.logs.summaries import ScalarSummaries
from official.utils.misc import atomic, errors
from official.utils.misc.progress import ProgressBar
from recommendation import export
from recommendation.data import constants, data_preprocessing, movielens
from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.mlperf import mlperf_tags
from recommendation.model import neumf_model
from recommendation.producer import data_pipeline, run_folder
from recommendation.producer.run_folder import EvalInfo, GenerationParams
from recommendation.training import ncf_common
from recommendation.training.ncf_common import NcfConfig

VALIDATION_HISTORY_FILE = "validation_history.json"  # in model_dir


def _cycles(first_epoch: int, train_epochs: int, epochs_between_evals: int) -> tuple[int, ...]:
    remaining = range(first_epoch, train_epochs, epochs_between_evals)
    return tuple(min(epochs_between_evals, train_epochs - start) for start in remaining)


def _eval_users_per_batch(config: NcfConfig, block: int, replicas: int, num_users: int) -> int:
    """Whole users per evaluation batch: a multiple of the replica count, and no more
    than the dataset needs (padding users cost as much as real ones)."""
    points = config.eval_batch_size or config.batch_size
    users = min(max(1, points // block), num_users)
    return -(-users // replicas) * replicas


class _EpochProgressAndEvents:
    """What a user and the MLPerf log see of one `Runner.train` call's epochs: a
    progress bar per epoch (if `show`) and the MLPerf ``epoch_start``/``epoch_stop``
    events. Both follow the epoch boundaries in the runner's cumulative step counts (as
    seen after each call), so one object tracks them for both."""

    def __init__(
        self,
        first_epoch: int,
        epochs: int,
        batches_per_epoch: int,
        show: bool,
        mlperf: MlperfLogger | None = None,
    ) -> None:
        self.first_epoch, self.epochs, self.batches = first_epoch, epochs, batches_per_epoch
        self.show = show
        self.mlperf = mlperf if mlperf is not None else MlperfLogger(None)
        self.bar: ProgressBar | None = None
        self.epoch = 0  # within this call
        self._begin()

    def _begin(self) -> None:
        number = self.first_epoch + self.epoch
        self.mlperf.event("epoch_start", epoch_num=number)
        if self.show:
            self.bar = ProgressBar(self.batches, f"epoch {number}", unit=" batches")

    def _end(self) -> None:
        if self.bar is not None:
            self.bar.update(self.batches - self.bar.done)
            self.bar.close()
        self.mlperf.event("epoch_stop", epoch_num=self.first_epoch + self.epoch)

    def __call__(self, steps_done: int, sums: dict) -> None:
        while self.epoch + 1 < self.epochs and steps_done >= (self.epoch + 1) * self.batches:
            self._end()
            self.epoch += 1
            self._begin()
        if self.bar is not None:
            self.bar.update(steps_done - self.epoch * self.batches - self.bar.done)

    def close(self) -> None:
        self._end()


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
    """
    start = time.perf_counter()
    _check_eval_split(config)
    _check_pretrain(config)
    if config.export_onnx:
        export.require_onnx()  # before training, not after it
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
    # The chief writes model_dir for the cluster. Held before --clean empties the
    # folder (never another live run's) and before the compliance log opens there.
    if not chief:
        return _run_holding_model_dir(config, strategy, chief, start)
    with writer_lease.hold(config.model_dir, "ncf-main", clean=config.clean):
        return _run_holding_model_dir(config, strategy, chief, start)


def _run_holding_model_dir(
    config: NcfConfig, strategy: tf.distribute.Strategy, chief: bool, start: float
) -> RunResult:
    try:
        with mlperf_helper.session(
            config.mlperf if chief else None, mlperf_tags.V05_TAGS
        ) as mlperf:
            with signals.interruptible():  # numpy and file reads only: may stop anywhere
                data = data_preprocessing.load_or_build(config.data).data
            runner = _make_runner(config, data, strategy)
            benchmark = BenchmarkLogger(config.benchmark_log_dir if chief else None)
            benchmark.log_run_info(config.flag_values, config.benchmark_test_id, config.preset)
            if config.use_synthetic_data:
                return RunResult(_run_synthetic(config, data, runner, start), runner)
            summary = _train_and_evaluate(config, data, runner, benchmark, mlperf, start)
    except signals.Interrupted as stop:
        stop.kept = _kept_for_resume(config)
        raise
    if config.export_dir and chief:
        parity = export.export_serving(runner, data, config.export_dir, config.export_onnx)
        summary["export_dir"] = config.export_dir
        if parity is not None:
            summary["onnx_max_score_difference"] = parity
    summary["failed_benchmark_log_writes"] = benchmark.failures.count
    benchmark.log("summary", **summary)
    return RunResult(summary, runner)


def _check_eval_split(config: NcfConfig) -> None:
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


def _check_pretrain(config: NcfConfig) -> None:
    """Rejects pre-training flags that cannot work together.

    Raises:
        ValueError: One pretrained model without the other, pre-training for a model
            other than NeuMF, or an alpha with nothing to weigh.
    """
    given = [bool(config.pretrain_gmf_dir), bool(config.pretrain_mlp_dir)]
    if not any(given):
        if config.pretrain_alpha != NcfConfig.pretrain_alpha:
            raise ValueError(
                "--pretrain_alpha weighs the pretrained GMF and MLP models: give "
                "--pretrain_gmf_dir and --pretrain_mlp_dir, or drop it"
            )
        return
    if not all(given):
        missing = "--pretrain_mlp_dir" if given[0] else "--pretrain_gmf_dir"
        raise ValueError(
            "NeuMF starts from a pretrained GMF and a pretrained MLP model together: give "
            f"{missing} too (or neither)"
        )
    if config.model.model_kind != neumf_model.NEUMF:
        raise ValueError(
            f"--pretrain_gmf_dir and --pretrain_mlp_dir start a NeuMF model, not "
            f"--model {config.model.model_kind}: drop them, or train --model neumf"
        )


class ValidationHistory:
    """Each epoch's validation HR and NDCG of the run in model_dir, so that a resumed
    run selects over every epoch, those of the runs before it included.

    Kept in ``model_dir/validation_history.json``, rewritten atomically after each
    evaluation and created before the first checkpoint, so a model_dir with
    checkpoints and no history holds a run of the test split. The best epoch's weights
    are kept beside it (`Runner.save_best`), saved before the history names them.

    Args:
        path: The JSON file.
        epochs: ``{"epoch", "hr", "ndcg"}`` per evaluated epoch, in epoch order.
        writer: Whether this task writes the file (the chief).
    """

    def __init__(self, path: str, epochs: list[dict], writer: bool) -> None:
        self.path = path
        self.epochs = epochs
        self.writer = writer

    @classmethod
    def open(
        cls, config: NcfConfig, completed_epochs: int, chief: bool
    ) -> ValidationHistory | None:
        """The history of the run in model_dir (a new one for a fresh run), or None
        for the test split.

        Raises:
            ModelDirError: model_dir holds checkpoints of a run of the other split:
                its epochs trained on other data.
        """
        path = os.path.join(config.model_dir, VALIDATION_HISTORY_FILE)
        resumed = completed_epochs > 0
        if config.data.eval_split != constants.VALIDATION_SPLIT:
            if resumed and tf.io.gfile.exists(path):
                raise ModelDirError(
                    f"{config.model_dir} holds a run of --eval_split validation (it trained "
                    "without the validation items): resume it with --eval_split validation, "
                    "or start over with --clean or another --model_dir"
                )
            return None
        if not resumed:
            history = cls(path, [], chief)
            history.save()
            return history
        if not tf.io.gfile.exists(path):
            raise ModelDirError(
                f"{config.model_dir} holds a run of --eval_split test (it has no "
                f"{VALIDATION_HISTORY_FILE}; it trained on the validation items): resume it "
                "with --eval_split test, or start over with --clean or another --model_dir"
            )
        with tf.io.gfile.GFile(path) as stream:
            epochs = json.load(stream)["epochs"]
        # Epochs past the restored checkpoint were not kept: they are trained again.
        return cls(path, [e for e in epochs if e["epoch"] < completed_epochs], chief)

    def has(self, epoch: int) -> bool:
        return any(record["epoch"] == epoch for record in self.epochs)

    def best(self) -> dict:
        """The epoch with the highest validation HR (ties: the earliest)."""
        return max(self.epochs, key=lambda record: record["hr"])

    def record(self, runner: Runner, epoch: int, evaluation: dict) -> None:
        """Adds `epoch`'s validation metrics, first keeping the model as the best if
        its HR beats every earlier epoch's (all tasks must call).

        Raises:
            ModelDirError: The best checkpoint or the history could not be written.
        """
        if not self.epochs or evaluation["hr"] > self.best()["hr"]:
            runner.save_best()
        self.epochs.append({"epoch": epoch, "hr": evaluation["hr"], "ndcg": evaluation["ndcg"]})
        self.save()

    def save(self) -> None:
        if not self.writer:
            return
        text = json.dumps({"eval_split": constants.VALIDATION_SPLIT, "epochs": self.epochs})
        try:
            atomic.write_file(self.path, text)
        except (tf.errors.OpError, OSError) as error:
            folder = os.path.dirname(self.path)
            raise ModelDirError(
                errors.write_failure(error, "the validation history", folder, "--model_dir")
            ) from None


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
        start_from_pretrained(config, runner)
    return runner


# "holds a GMF model": each kind with its article.
_A_KIND = {neumf_model.NEUMF: "a NeuMF", neumf_model.GMF: "a GMF", neumf_model.MLP: "an MLP"}


def start_from_pretrained(config: NcfConfig, runner: Runner) -> None:
    """Sets the runner's NeuMF from the GMF and MLP models of the runs in
    ``config.pretrain_gmf_dir`` and ``config.pretrain_mlp_dir`` (`combine_pretrained`,
    alpha ``config.pretrain_alpha``); the optimiser starts afresh.

    Raises:
        ModelDirError: A folder holds no checkpoint, a run of the other --eval_split, or
            a model of another kind or other sizes than this run's.
    """
    models = {}
    for kind, directory in (
        (neumf_model.GMF, config.pretrain_gmf_dir),
        (neumf_model.MLP, config.pretrain_mlp_dir),
    ):
        params = dataclasses.replace(runner.params, model_kind=kind)
        models[kind] = neumf_model.build_model(params)
        path, best = _pretrained_checkpoint(config, kind, directory)
        _check_pretrained_sizes(kind, directory, path, params)
        restore_model(models[kind], directory, best)
        logging.info("Pretrained %s model: %s", kind.upper(), path)
    neumf_model.combine_pretrained(
        runner.state.model,
        models[neumf_model.GMF],
        models[neumf_model.MLP],
        config.pretrain_alpha,
    )
    logging.info("NeuMF starts from the pretrained models (alpha %g)", config.pretrain_alpha)


def _pretrained_checkpoint(config: NcfConfig, kind: str, directory: str) -> tuple[str, bool]:
    """The checkpoint of the run in `directory` that pre-training reads, and whether it
    is a kept best: the latest, or of a validation run the selected one
    (``MODEL_DIR/best``).

    Raises:
        ModelDirError: There is none, every one is damaged, or the run evaluated on the
            other split (so it trained on other data: with or without the validation
            items).
    """
    flag = f"--pretrain_{kind}_dir"
    if tf.train.latest_checkpoint(directory) is None:
        raise ModelDirError(
            f"{flag} {directory} holds no checkpoint: train it first with "
            f"ncf-main --model {kind} --model_dir {directory} (and this run's data flags)"
        )
    validated = tf.io.gfile.exists(os.path.join(directory, VALIDATION_HISTORY_FILE))
    split = config.data.eval_split
    if validated != (split == constants.VALIDATION_SPLIT):
        theirs = constants.VALIDATION_SPLIT if validated else "test"
        raise ModelDirError(
            f"{flag} {directory} holds a run of --eval_split {theirs}, which trained on "
            f"other data than this run of --eval_split {split}: pretrain with "
            f"--eval_split {split}"
        )
    # The newest intact one: what `restore_model` restores (a damaged one is passed over).
    if not validated:
        return model_dir.newest_intact(directory), False
    best = model_dir.newest_intact(os.path.join(directory, BEST_FOLDER))
    if best is None:
        raise ModelDirError(
            f"{flag} {directory} has no selected checkpoint in {BEST_FOLDER}/ (stopped "
            "before its first evaluation): resume that run first"
        )
    return best, True


def _check_pretrained_sizes(
    kind: str, directory: str, path: str, params: neumf_model.ModelParams
) -> None:
    """Checks that the model in checkpoint `path` is a `kind` model of `params`' sizes.

    Raises:
        ModelDirError: It is another kind of model, or of other sizes (saying which).
    """
    flag = f"--pretrain_{kind}_dir"
    found = describe_checkpoint(path)
    if found["kind"] != kind:
        # An MF model is a GMF model (its weights fixed at 1): both pretrain the GMF part.
        models = "gmf or mf" if kind == neumf_model.GMF else kind
        raise ModelDirError(
            f"{flag} {directory} holds {_A_KIND[found['kind']]} model ({path}), not "
            f"{_A_KIND[kind]} one: give the model_dir of an ncf-main --model {models} run"
        )
    if (found["users"], found["items"]) != (params.num_users, params.num_items):
        raise ModelDirError(
            f"{flag} {directory} holds a model of {found['users']:,} users and "
            f"{found['items']:,} items, this run's data has {params.num_users:,} and "
            f"{params.num_items:,}: pretrain on the same --dataset and data flags"
        )
    flag_name, ours = (
        ("--num_factors", params.mf_dim) if kind == neumf_model.GMF else ("--layers", params.layers)
    )
    theirs = found["factors"] if kind == neumf_model.GMF else found["layers"]
    if theirs != ours:
        raise ModelDirError(
            f"{flag} {directory} holds {_A_KIND[kind]} model of {flag_name} "
            f"{_flag_text(theirs)}, this run has {flag_name} {_flag_text(ours)}: pretrain "
            f"with the same {flag_name}"
        )


def _flag_text(value: int | tuple[int, ...]) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def describe_checkpoint(path: str) -> dict:
    """The kind and sizes of the NeuMF, GMF or MLP model in a Runner checkpoint (the
    latest of a run or its kept best), read from the shapes of its weights.

    The kinds tell apart by the logit layer's input: a GMF model's is its table width,
    an MLP model's its last layer (or, without hidden layers, both table halves), and
    NeuMF's their sum. Returns ``kind``, ``users``, ``items``, ``factors`` (None for
    MLP) and ``layers`` (None for GMF).
    """
    user, item, *hidden, logit = _matrix_shapes(path)
    width, rows = user[1], logit[0]
    if hidden:
        layers = (hidden[0][0], *(kernel[1] for kernel in hidden))
        factors = rows - layers[-1]
    elif rows == width:
        layers, factors = None, width
    else:  # the MLP input straight to the logit: rows = factors + 2 x (width - factors)
        layers, factors = (2 * (rows - width),), 2 * width - rows
    kind = neumf_model.NEUMF
    if layers is None:
        kind = neumf_model.GMF
    elif factors == 0:
        kind, factors = neumf_model.MLP, None
    return {"kind": kind, "users": user[0], "items": item[0], "factors": factors, "layers": layers}


def _matrix_shapes(path: str) -> list[list[int]]:
    """The shapes of the user and item tables, the MLP kernels and the logit kernel in
    checkpoint `path`, in that order: a kept best lists the weights as the model does,
    a run's checkpoint by attribute (``model/<layer>/...``)."""
    shapes = dict(tf.train.list_variables(path))
    listed = sorted(
        (int(key.split("/")[1]), shape)
        for key, shape in shapes.items()
        if key.startswith("weights/")
    )
    if listed:
        return [shape for _, shape in listed if len(shape) == 2]
    by_layer = {
        key.split("/")[1]: shape
        for key, shape in shapes.items()
        if key.startswith("model/") and len(shape) == 2
    }
    hidden = sorted(
        (name for name in by_layer if name.startswith("mlp_")), key=lambda n: int(n[4:])
    )
    names = ["user_embedding", "item_embedding", *hidden, "logit"]
    return [by_layer[name] for name in names]


def _train_and_evaluate(
    config: NcfConfig,
    data: PreprocessedData,
    runner: Runner,
    benchmark: BenchmarkLogger,
    mlperf: MlperfLogger,
    start: float,
) -> dict:
    first_epoch = int(runner.completed_epochs.numpy())
    history = ValidationHistory.open(config, first_epoch, runner.is_chief)
    split = config.data.eval_split
    cycles = _cycles(first_epoch, config.train_epochs, config.epochs_between_evals)
    params = _generation_params(config, data, runner, cycles, first_epoch, mlperf)
    _log_hparams(mlperf, config, runner.params, data, params)
    summaries = ScalarSummaries(config.model_dir if runner.is_chief else None)
    best = {"hr": 0.0, "ndcg": 0.0, "epoch": first_epoch}
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
        eval_info = producer.eval_data(split)
        if history is not None and first_epoch and not history.has(first_epoch - 1):
            # Stopped between its checkpoint and the history: the restored model is
            # that epoch's, so its evaluation is the one missed.
            restored = _evaluate(runner, eval_info, first_epoch - 1, mlperf)
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
            epoch_reports = _EpochProgressAndEvents(
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
            evaluation = _evaluate(runner, eval_info, epoch - 1, mlperf)
            if history is not None:
                history.record(runner, epoch - 1, evaluation)
            summary["epochs"] = epoch
            summary["train_points"] += train["num_points"]
            summary["train_seconds"] += train["seconds"]
            _report(config, runner, summaries, benchmark, epoch - 1, train, evaluation)
            if evaluation["hr"] > best["hr"]:
                best = {"hr": evaluation["hr"], "ndcg": evaluation["ndcg"], "epoch": epoch - 1}
            if evaluation["hr"] >= config.hr_threshold:
                summary["time_to_target_s"] = time.perf_counter() - start
                break
        if not cycles:
            # A finished run resumed: nothing to train, so report its restored model.
            summary["resumed_finished_run"] = runner.restored_from
            if history is None:
                evaluation = _evaluate(runner, eval_info, first_epoch - 1, mlperf)
                best = {
                    "hr": evaluation["hr"],
                    "ndcg": evaluation["ndcg"],
                    "epoch": first_epoch - 1,
                }
        summary["eval_split"] = split
        if history is not None:
            best = history.best()
            test = _test_selected(runner, best["epoch"], producer.eval_data(), mlperf)
            summary.update(test_hr=test["hr"], test_ndcg=test["ndcg"])
            summaries.write(runner.global_step, {"test_hr": test["hr"], "test_ndcg": test["ndcg"]})
        reached = summary["time_to_target_s"] is not None
        mlperf.event("run_stop", status=mlperf_helper.SUCCESS if reached else mlperf_helper.ABORTED)
    trained = summary["train_seconds"] > 0
    summary.update(
        best_hr=best["hr"],
        best_ndcg=best["ndcg"],
        best_epoch=best["epoch"],
        total_seconds=time.perf_counter() - start,
        examples_per_second=summary["train_points"] / summary["train_seconds"] if trained else None,
        failed_tensorboard_writes=summaries.failures.count,
    )
    return summary


def _test_selected(runner: Runner, epoch: int, test_info: EvalInfo, mlperf: MlperfLogger) -> dict:
    """Restores the weights of `epoch` (kept as the best) and evaluates the test set.

    Raises:
        ModelDirError: The kept checkpoint is not that epoch's.
    """
    path = runner.restore_best()
    kept = completed_epochs_of(path) - 1
    if kept != epoch:
        raise ModelDirError(
            f"{path} holds epoch {kept}, but the validation history of {runner.model_dir} "
            f"selects epoch {epoch}; start over with --clean or another --model_dir"
        )
    test = _evaluate(runner, test_info, epoch, mlperf)
    logging.info(
        "epoch %d, selected on validation, restored from %s: test HR@%d=%.4f NDCG@%d=%.4f",
        epoch,
        path,
        runner.params.top_k,
        test["hr"],
        runner.params.top_k,
        test["ndcg"],
    )
    return test


def _evaluate(runner: Runner, eval_info: EvalInfo, epoch: int, mlperf: MlperfLogger) -> dict:
    """HR and NDCG of the model as it is, logged as the evaluation after `epoch`."""
    mlperf.event("eval_start", epoch_num=epoch)
    evaluation = runner.evaluate(
        lambda: data_pipeline.eval_input_fn(eval_info), eval_info.num_batches
    )
    mlperf.event("eval_accuracy", evaluation["hr"], epoch_num=epoch)
    mlperf.event("eval_stop", epoch_num=epoch)
    return evaluation


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
        cache_path=os.path.join(config.data.resolved_cache_dir(), data_preprocessing.CACHE_FILE),
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


def _log_hparams(
    mlperf: MlperfLogger,
    config: NcfConfig,
    model: neumf_model.ModelParams,
    data: PreprocessedData,
    params: GenerationParams,
) -> None:
    """The run's hyper-parameters and data sizes, once, as MLPerf NCF reported them."""
    block = params.num_eval_negatives + 1
    # Beyond the reference (logged only when used, so reference runs log what it did).
    extras: dict[str, object] = {}
    if model.weight_decay:
        extras["opt_adamw_weight_decay"] = model.weight_decay
    if model.learning_rate_decay != 1.0:
        extras["opt_lr_decay_factor"] = model.learning_rate_decay
        extras["opt_lr_decay_start_step"] = model.decay_start_epoch * model.steps_per_epoch
    for key, value in {
        "global_batch_size": config.batch_size,
        "opt_name": _optimizer_name(model),
        "opt_base_learning_rate": model.learning_rate,
        "opt_adam_beta_1": model.beta1,
        "opt_adam_beta_2": model.beta2,
        "opt_adam_epsilon": model.epsilon,
        "seed": params.seed,
        "preproc_hp_min_ratings": config.data.min_num_ratings,
        "input_hp_num_neg": config.num_neg,
        "eval_hp_num_neg": params.num_eval_negatives,
        "model_hp_mf_dim": model.mf_dim,
        "model_hp_mlp_layer_sizes": list(model.layers),
        "model_hp_loss_fn": "binary_cross_entropy",
        "train_samples": data.num_train_positives,
        "eval_samples": data.num_users,
        "eval_size": data.num_users * block,
        "eval_target": config.hr_threshold,
        **extras,
    }.items():
        mlperf.event(key, value)


def _optimizer_name(model: neumf_model.ModelParams) -> str:
    if model.optimizer == "sgd":
        return "sgd"
    return "lazy_adam" if model.sparse_updates else "adam"


def _report(
    config: NcfConfig,
    runner: Runner,
    summaries: ScalarSummaries,
    benchmark: BenchmarkLogger,
    epoch: int,
    train: dict,
    evaluation: dict,
) -> None:
    """One evaluation to the log, TensorBoard and the benchmark log (the validation
    split's under names that say so)."""
    rate = train["num_points"] / train["seconds"]
    top_k = config.model.top_k
    split = config.data.eval_split
    validating = split == constants.VALIDATION_SPLIT
    logging.info(
        "epoch %d: loss=%.4f %sHR@%d=%.4f NDCG@%d=%.4f (%.0f examples/s, eval %.1f s)",
        epoch,
        train["loss"],
        "validation " if validating else "",
        top_k,
        evaluation["hr"],
        top_k,
        evaluation["ndcg"],
        rate,
        evaluation["seconds"],
    )
    prefix = "validation_" if validating else ""
    summaries.write(
        runner.global_step,
        {
            "loss": train["loss"],
            f"{prefix}hr": evaluation["hr"],
            f"{prefix}ndcg": evaluation["ndcg"],
            "examples_per_second": rate,
        },
    )
    benchmark.log(
        "evaluation",
        epoch=epoch,
        split=split,
        loss=train["loss"],
        hr=evaluation["hr"],
        ndcg=evaluation["ndcg"],
        examples_per_second=rate,
        train_seconds=train["seconds"],
        eval_seconds=evaluation["seconds"],
        global_step=runner.global_step,
    )


def _run_synthetic(config: NcfConfig, data: PreprocessedData, runner: Runner, start: float) -> dict:
    """Pure throughput: random in-memory batches, the real model and step, no eval."""
    steps = _batches_per_epoch(config, data)
    epoch_reports = _EpochProgressAndEvents(0, config.train_epochs, steps, runner.is_chief)
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


def summary_line(summary: dict, top_k: int) -> str:
    """The one-line result a user reads at the end."""
    if summary.get("best_hr") is None:
        return (
            f"synthetic throughput: {summary['examples_per_second']:,.0f} training "
            f"examples/s over {summary['epochs']} epoch(s)"
        )
    metrics = f"HR@{top_k}={summary['best_hr']:.4f} NDCG@{top_k}={summary['best_ndcg']:.4f}"
    validated = summary.get("test_hr") is not None
    if validated:
        metrics = (
            f"validation {metrics}; test HR@{top_k}={summary['test_hr']:.4f} "
            f"NDCG@{top_k}={summary['test_ndcg']:.4f}"
        )
    if summary.get("resumed_finished_run"):
        scores = (
            f"epoch {summary['best_epoch']}, selected on validation, scores {metrics}"
            if validated
            else f"its model scores {metrics}"
        )
        return (
            f"nothing left to train: {summary['resumed_finished_run']} holds all "
            f"{summary['epochs']} epochs; {scores}. --train_epochs above "
            f"{summary['epochs']} trains on, --clean starts over"
        )
    target = summary.get("time_to_target_s")
    reached = f"target reached in {target:.1f} s" if target else "target not reached"
    if validated:
        best = f"selected epoch {summary['best_epoch']}: {metrics}"
    else:
        best = f"best {metrics} (epoch {summary['best_epoch']})"
    return (
        f"{best}, {summary['epochs']} epochs, {reached}, "
        f"{summary['examples_per_second']:,.0f} training examples/s, "
        f"{summary['total_seconds']:.1f} s in all{_failed_writes(summary)}"
    )


def _failed_writes(summary: dict) -> str:
    """What the run went on without (logged as it happened), for the final line."""
    failed = [
        f"{summary.get(key, 0)} {what} writes failed"
        for key, what in (
            ("failed_tensorboard_writes", "TensorBoard"),
            ("failed_benchmark_log_writes", "benchmark log"),
        )
        if summary.get(key)
    ]
    return f" ({', '.join(failed)}: see the warnings)" if failed else ""


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    config = ncf_common.ncf_config_from_flags(flags.FLAGS)
    with (
        signals.stop_on_signals(),
        errors.exit_on_user_errors(
            movielens.DataError,
            data_pipeline.ProducerError,
            export.ExportError,
            ModelDirError,
            ValueError,
        ),
    ):
        summary = run(config).summary
    print(summary_line(summary, config.model.top_k))


def run_main() -> None:
    """Console-script entry point (``ncf-main``)."""
    ncf_common.define_ncf_flags()
    app.run(main)


if __name__ == "__main__":
    run_main()
