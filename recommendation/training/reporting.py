"""What ``ncf-main`` reports: epoch progress and MLPerf epoch events, the run's
hyper-parameters in the MLPerf log, each evaluation in the log, TensorBoard and the
benchmark log, and the final line.
"""

from __future__ import annotations

from absl import logging

from official.core.runner import (
    Runner,
)
from official.utils.logs.logger import BenchmarkLogger
from official.utils.logs.mlperf_helper import MlperfLogger
from official.utils.logs.summaries import ScalarSummaries
from official.utils.misc.progress import ProgressBar
from recommendation.data import constants
from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.model import hyperparams
from recommendation.producer.run_folder import GenerationParams
from recommendation.training.evaluations import metric_names, metrics_text
from recommendation.training.ncf_common import NcfConfig


class EpochProgressAndEvents:
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


def log_hparams(
    mlperf: MlperfLogger,
    config: NcfConfig,
    model: hyperparams.ModelParams,
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


def _optimizer_name(model: hyperparams.ModelParams) -> str:
    if model.optimizer == "sgd":
        return "sgd"
    return "lazy_adam" if model.sparse_updates else "adam"


def report(
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
        "epoch %d: loss=%.4f %s%s (%.0f examples/s, eval %.1f s)",
        epoch,
        train["loss"],
        "validation " if validating else "",
        metrics_text(evaluation, top_k, config.eval_ranking),
        rate,
        evaluation["seconds"],
    )
    prefix = "validation_" if validating else ""
    metrics = {name: evaluation[name] for name in metric_names(config.eval_ranking)}
    summaries.write(
        runner.global_step,
        {
            "loss": train["loss"],
            **{f"{prefix}{name}": value for name, value in metrics.items()},
            "examples_per_second": rate,
        },
    )
    benchmark.log(
        "evaluation",
        epoch=epoch,
        split=split,
        loss=train["loss"],
        **metrics,
        examples_per_second=rate,
        train_seconds=train["seconds"],
        eval_seconds=evaluation["seconds"],
        global_step=runner.global_step,
    )


def summary_line(summary: dict, top_k: int) -> str:
    """The one-line result a user reads at the end."""
    if summary.get("best_hr") is None:
        return (
            f"synthetic throughput: {summary['examples_per_second']:,.0f} training "
            f"examples/s over {summary['epochs']} epoch(s)"
        )
    ranking = summary.get("eval_ranking", constants.SAMPLED_RANKING)
    metrics = metrics_text(_prefixed(summary, "best_"), top_k, ranking)
    validated = summary.get("test_hr") is not None
    if validated:
        test = metrics_text(_prefixed(summary, "test_"), top_k, ranking)
        metrics = f"validation {metrics}; test {test}"
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


def _prefixed(summary: dict, prefix: str) -> dict:
    """The summary's metrics named `prefix` + name, by name."""
    return {key[len(prefix) :]: value for key, value in summary.items() if key.startswith(prefix)}


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
