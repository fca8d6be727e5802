"""Model selection on the validation split: each epoch's validation metrics kept in
model_dir (`ValidationHistory`) with the best epoch's weights beside them
(`Runner.save_best`); at the end that epoch is restored and the test holdout evaluated
once, on it (`test_selected`).
"""

from __future__ import annotations

import json
import os

import tensorflow as tf
from absl import logging

from official.core.model_dir import ModelDirError
from official.core.runner import (
    Runner,
    completed_epochs_of,
)
from official.utils.misc import atomic, errors
from recommendation.data import constants
from recommendation.training.evaluations import Evaluations, metric_names, metrics_text
from recommendation.training.ncf_common import NcfConfig

VALIDATION_HISTORY_FILE = "validation_history.json"  # in model_dir


class ValidationHistory:
    """Each epoch's validation HR and NDCG of the run in model_dir, so that a resumed
    run selects over every epoch, those of the runs before it included.

    Kept in ``model_dir/validation_history.json``, rewritten atomically after each
    evaluation and created before the first checkpoint, so a model_dir with
    checkpoints and no history holds a run of the test split. The best epoch's weights
    are kept beside it (`Runner.save_best`), saved before the history names them.

    Args:
        path: The JSON file.
        epochs: ``{"epoch", "hr", "ndcg"}`` per evaluated epoch, in epoch order, and
            the full ranking's metrics when computed (`evaluations.metric_names`).
        writer: Whether this task writes the file (the chief).
        ranking: The run's --eval_ranking: its epochs are comparable only under one.
    """

    def __init__(self, path: str, epochs: list[dict], writer: bool, ranking: str) -> None:
        self.path = path
        self.epochs = epochs
        self.writer = writer
        self.ranking = ranking

    @classmethod
    def open(
        cls, config: NcfConfig, completed_epochs: int, chief: bool
    ) -> ValidationHistory | None:
        """The history of the run in model_dir (a new one for a fresh run), or None
        for the test split.

        Raises:
            ModelDirError: model_dir holds checkpoints of a run of the other split
                (its epochs trained on other data), or of a validation run evaluated
                with another --eval_ranking (its epochs' metrics are other ones).
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
        ranking = config.eval_ranking
        if not resumed:
            history = cls(path, [], chief, ranking)
            history.save()
            return history
        if not tf.io.gfile.exists(path):
            raise ModelDirError(
                f"{config.model_dir} holds a run of --eval_split test (it has no "
                f"{VALIDATION_HISTORY_FILE}; it trained on the validation items): resume it "
                "with --eval_split test, or start over with --clean or another --model_dir"
            )
        with tf.io.gfile.GFile(path) as stream:
            kept = json.load(stream)
        # Histories written before --eval_ranking existed hold sampled metrics.
        kept_ranking = kept.get("eval_ranking", constants.SAMPLED_RANKING)
        if kept_ranking != ranking:
            raise ModelDirError(
                f"{config.model_dir} holds a run evaluated with --eval_ranking "
                f"{kept_ranking}, whose epochs' metrics are not this run's: resume it with "
                f"--eval_ranking {kept_ranking}, or start over with --clean or another "
                "--model_dir"
            )
        # Epochs past the restored checkpoint were not kept: they are trained again.
        epochs = [e for e in kept["epochs"] if e["epoch"] < completed_epochs]
        return cls(path, epochs, chief, ranking)

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
        metrics = {name: evaluation[name] for name in metric_names(self.ranking)}
        self.epochs.append({"epoch": epoch, **metrics})
        self.save()

    def save(self) -> None:
        if not self.writer:
            return
        text = json.dumps(
            {
                "eval_split": constants.VALIDATION_SPLIT,
                "eval_ranking": self.ranking,
                "epochs": self.epochs,
            }
        )
        try:
            atomic.write_file(self.path, text)
        except (tf.errors.OpError, OSError) as error:
            folder = os.path.dirname(self.path)
            raise ModelDirError(
                errors.write_failure(error, "the validation history", folder, "--model_dir")
            ) from None


def test_selected(evaluator: Evaluations, epoch: int) -> dict:
    """Restores the weights of `epoch` (kept as the best) and evaluates the test set.

    Raises:
        ModelDirError: The kept checkpoint is not that epoch's.
    """
    runner = evaluator.runner
    path = runner.restore_best()
    kept = completed_epochs_of(path) - 1
    if kept != epoch:
        raise ModelDirError(
            f"{path} holds epoch {kept}, but the validation history of {runner.model_dir} "
            f"selects epoch {epoch}; start over with --clean or another --model_dir"
        )
    test = evaluator.evaluate(constants.TEST_SPLIT, epoch)
    logging.info(
        "epoch %d, selected on validation, restored from %s: test %s",
        epoch,
        path,
        metrics_text(test, runner.params.top_k, evaluator.ranking),
    )
    return test
