"""The stages of an online training step, as name scopes of its graph ops, and the
callback that profiles chosen steps (`ProfileSteps`, ``--profile_steps``): the profile
then shows where a step's time goes (`scripts/profile_online_step.py` sums one by
stage). A stage's ops inside another's belong to the
inner one (eviction runs inside admission), except the prequential scoring's (a probe
run before each step, in the sink's graph call), which are all its own."""

from __future__ import annotations

import re

import tensorflow as tf
from absl import logging

from recommendation.online.callback_base import Callback

ID_LOOKUP = "id_lookup"  # ids to rows, refreshing the rows' priorities, index upkeep
ADMISSION = "admission"  # sightings counted, rows given to new ids
EVICTION = "eviction"  # the candidate pool: victims chosen, expired rows taken
ROW_GATHER = "row_gather"  # the step's rows read from the tables (and their gradients)
ROW_UPDATE = "row_update"  # lazy Adam (or SGD) on the rows the step read
PREQUENTIAL = "prequential_scoring"  # test-then-train: scored before training

STAGES = (ID_LOOKUP, ADMISSION, EVICTION, ROW_GATHER, ROW_UPDATE, PREQUENTIAL)
DENSE = "dense network, loss and its optimiser"


# A scope opened again in one graph is numbered: ``row_update_1``.
_SCOPE = re.compile(rf"({'|'.join(STAGES)})(?:_\d+)?")


def of_op(name: str) -> str:
    """The stage of the op named `name` (its innermost stage scope), else `DENSE`."""
    stages = [scope.group(1) for scope in map(_SCOPE.fullmatch, name.split("/")) if scope]
    if PREQUENTIAL in stages:
        return PREQUENTIAL
    return stages[-1] if stages else DENSE


class ProfileSteps(Callback):
    """TensorFlow's profiler over the sinks that train steps `first` to `last` (counted
    from 1 over the model's life, as the step in the log lines), written to `log_dir`
    for TensorBoard's profile tab. A sink runs its steps in one graph call, so the
    profile covers whole sinks: from the one holding `first` to the one reaching
    `last`. Each op is named by its step's stage (`STAGES`).

    Args:
        first, last: The steps profiled.
        log_dir: Where the profile goes (any `tf.io.gfile` path).
    """

    def __init__(self, first: int, last: int, log_dir: str) -> None:
        super().__init__()
        if not 0 < first <= last:
            raise ValueError(f"profile steps {first} to {last}: give 0 < FIRST <= LAST")
        self.first, self.last, self.log_dir = first, last, log_dir
        self.profiling = self.done = False

    def on_sink_begin(self, group) -> None:
        reached = int(self.rec_model.step.numpy()) + group.num_steps
        if not (self.profiling or self.done) and reached >= self.first:
            tf.profiler.experimental.start(self.log_dir)
            self.profiling = True

    def on_train_batch_end(self, batch, logs=None) -> None:
        if self.profiling and batch >= self.last:
            self._stop(batch)

    def on_train_end(self, logs=None) -> None:
        if self.profiling:
            self._stop(int(self.rec_model.step.numpy()))

    def _stop(self, step: int) -> None:
        tf.profiler.experimental.stop()
        self.profiling, self.done = False, True
        logging.info("profiled the sinks up to step %d into %s", step, self.log_dir)
