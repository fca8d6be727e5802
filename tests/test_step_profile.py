"""Where an online step's time goes: its ops named by stage, the profile of chosen
steps (`step_stages.ProfileSteps`, ``--profile_steps``), and the steady rate the speed
scripts read from a run's summary."""

from __future__ import annotations

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl import flags as absl_flags
from conftest import load_script

from recommendation import online_main
from recommendation.data import constants
from recommendation.online import callbacks, evaluation, online_ncf, prequential, step_stages


def test_an_op_belongs_to_its_innermost_stage_and_scoring_ops_to_the_scoring():
    of_op = step_stages.of_op
    assert of_op("while/body/_76/admission/eviction/StatefulPartitionedCall/eviction/x") == (
        "eviction"
    )
    assert of_op("StatefulPartitionedCall/row_update_1/ResourceScatterSub") == "row_update"
    assert of_op("prequential_scoring/embedding_item_1/row_gather/Gather") == (
        "prequential_scoring"
    )
    assert of_op("online_neu_mf_1/mlp_1_1/Relu") == step_stages.DENSE
    assert of_op("row_updates/x") == step_stages.DENSE  # a scope's name, not a prefix


def _batches(count: int, size: int = 8) -> list[dict]:
    """`count` batches of new users (each a full table's worth past the capacity)."""
    users = np.arange(count * size, dtype=np.int64).reshape(count, size)
    return [
        {
            constants.USER_COLUMN: row,
            constants.ITEM_COLUMN: row % 5,
            constants.TIME_COLUMN: np.zeros(size, np.int64),
        }
        for row in users
    ]


def _profiled_training(log_dir: str, first: int, last: int, steps: int) -> None:
    keras.utils.set_random_seed(0)
    params = online_ncf.OnlineParams(
        mf_dim=2, layers=(4, 2), mlp_regularization=(0.0, 0.0), user_capacity=4
    )
    rec_model = online_ncf.build_rec_model(params)
    chosen = [
        step_stages.ProfileSteps(first, last, log_dir),
        evaluation.PrequentialEvaluation(prequential.Prequential(every=1, negatives=2, top_k=1)),
    ]
    rec_model.online_train(_batches(steps), chosen, sink_size=1)


def test_the_profile_of_chosen_steps_shows_every_stage(tmp_path):
    """A user table of 4 rows and 8 new users a step: from the second step on, every
    stage runs (eviction included)."""
    script = load_script("profile_online_step")
    _profiled_training(str(tmp_path), first=2, last=3, steps=4)
    stages = script.stage_seconds(str(tmp_path))
    assert set(stages) == {*step_stages.STAGES, step_stages.DENSE}
    assert all(seconds > 0 for seconds in stages.values())


def test_steps_never_reached_are_not_profiled(tmp_path):
    _profiled_training(str(tmp_path), first=5, last=6, steps=3)
    assert not glob.glob(os.path.join(str(tmp_path), "**", "*.xplane.pb"), recursive=True)


@pytest.mark.parametrize("value", ["5,2", "0,3", "4", "a,b", "1,2,3"])
def test_a_profile_window_that_is_no_range_is_refused(value):
    flag_values = absl_flags.FlagValues()
    online_main.define_online_flags(flag_values)
    with pytest.raises(absl_flags.IllegalFlagValueError, match="FIRST,LAST with 0 < FIRST"):
        flag_values(["online_main", "--events_dir=/e", f"--profile_steps={value}"])


def test_the_steady_rate_ends_at_the_last_report_before_the_stop():
    """The final report comes after an idle timeout's wait (here 5 s with 1,000 more
    events): the rate is that of the reports before it."""
    online_runs = load_script("online_runs")
    history = [
        {"events": 0, "seconds": 1.0},
        {"events": 10_000, "seconds": 2.0},  # the first report with events: tracing before
        {"events": 30_000, "seconds": 3.0},
        {"events": 50_000, "seconds": 4.0},
        {"events": 51_000, "seconds": 9.2},  # the stop, after the idle wait
    ]
    summary = {"history": history, "events": 51_000, "seconds": 9.3}
    assert online_runs.sustained_events_per_second(summary) == 20_000.0


def test_the_steady_rate_counts_sinks_from_1_s_in_whatever_the_report_cadence(monkeypatch):
    """A short run whose one metric report is its last, after an idle wait: the rate is
    counted at the grain of sinks, from the first ending 1 s into the run (tracing
    before it) to the last, as the peer harnesses count theirs; the speed scripts read
    it from the summary."""
    clock = [0.0]
    monkeypatch.setattr(callbacks.time, "monotonic", lambda: clock[0])
    logger = callbacks.MetricLogger(every_seconds=10.0)
    logger.set_rec_model(type("Model", (), {"step": tf.Variable(0, dtype=tf.int64)})())
    logger.on_train_begin()
    sinks = [(0.6, 4_096), (4.0, 20_480), (4.1, 36_864), (4.2, 53_248), (4.3, 57_344)]
    for step, (seconds, events) in enumerate(sinks, 1):
        clock[0] = seconds
        logger.on_train_batch_end(step, {"events": events, "step": step, "loss": 0.5})
    clock[0] = 9.4  # the stop, after the idle timeout's wait
    logger.on_train_end({"events": 57_344, "step": 5})
    assert [report["seconds"] for report in logger.history] == [9.4]
    assert logger.steady_events_per_second == pytest.approx((57_344 - 20_480) / 0.3)
    summary = {"history": logger.history, "events": 57_344, "seconds": 9.4}
    summary["steady_events_per_second"] = logger.steady_events_per_second
    online_runs = load_script("online_runs")
    assert online_runs.sustained_events_per_second(summary) == logger.steady_events_per_second
