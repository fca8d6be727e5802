"""The Estimator-style runner: checkpoints, resume, steps per call, metric summaries."""

from __future__ import annotations

import dataclasses
import os
import signal

import numpy as np
import pytest
import tensorflow as tf
from conftest import TINY_PARAMS, damage_checkpoint, tiny_runner, tiny_train_input_fn

from official.core import signals
from official.core.model_dir import ModelDirError
from official.core.runner import Mode, Runner, sum_over_steps, traced
from recommendation.data import constants
from recommendation.model import neumf_model
from recommendation.producer import data_pipeline


def _weights(runner: Runner) -> list[np.ndarray]:
    return [variable.numpy() for variable in runner.state.model.weights]


def test_steps_per_call_does_not_change_the_result(tmp_path):
    one = tiny_runner(str(tmp_path / "a"), steps_per_call=1)
    four = tiny_runner(str(tmp_path / "b"), steps_per_call=4)
    metrics_one = one.train(tiny_train_input_fn, 10)
    metrics_four = four.train(tiny_train_input_fn, 10)
    assert one.global_step == four.global_step == 10
    assert metrics_one["num_points"] == metrics_four["num_points"] == 320
    assert metrics_one["loss"] == pytest.approx(metrics_four["loss"], rel=1e-6)
    for left, right in zip(_weights(one), _weights(four), strict=True):
        np.testing.assert_array_equal(left, right)


def test_every_dataset_the_runner_reads_runs_without_autotuning(tmp_path):
    # An autotuned iterator's model thread holds the iterator's deletion until its next
    # optimisation: up to a minute at the end of each cycle, synthetic runs included
    # (a throughput run reported 474k examples/s for 780k).
    runner = tiny_runner(str(tmp_path))
    synthetic = data_pipeline.synthetic_train_input_fn(32, 5, 7)
    assert synthetic.options().autotune.enabled is not False  # tf.data's default
    for input_fn in (lambda: synthetic, tiny_train_input_fn):
        assert runner.distribute(input_fn).options().autotune.enabled is False


def test_progress_is_reported_per_call(tmp_path):
    runner = tiny_runner(str(tmp_path), steps_per_call=4)
    seen = []
    runner.train(tiny_train_input_fn, 10, lambda steps, sums: seen.append(steps))
    assert seen == [4, 8, 10]


def test_the_reported_metrics_are_the_model_fns_summary_of_the_totals(tmp_path):
    def model_fn(features, labels, mode, params, state):
        spec = neumf_model.model_fn(features, labels, mode, params, state)
        return dataclasses.replace(spec, summarize=lambda totals: {"totals": dict(totals)})

    runner = tiny_runner(str(tmp_path), steps_per_call=4, model_fn=model_fn)
    train = runner.train(tiny_train_input_fn, 10)
    assert set(train) == {"totals", "seconds"}  # the runner adds only its own timing
    # Summed over every step (calls of 4, 4 and 2): 10 batches of 32 points.
    assert set(train["totals"]) == {"loss_sum", "num_points"}
    assert train["totals"]["num_points"] == 320.0
    evaluation = runner.evaluate(_eval_input_fn, 9)
    assert set(evaluation) == {"totals", "seconds"}
    # Summed over every step: 9 batches of 2 valid users each.
    assert set(evaluation["totals"]) == {"hits", "ndcg", "num_users"}
    assert evaluation["totals"]["num_users"] == 18.0


def test_one_cpu_replica_reads_the_plain_dataset(tmp_path):
    # tf.distribute's multi-device iterator took up to a minute to delete after each
    # cycle (its autotuning thread is not woken); one CPU replica does not need it.
    dataset = tiny_runner(str(tmp_path)).distribute(tiny_train_input_fn)
    assert isinstance(dataset, tf.data.Dataset)
    assert isinstance(iter(dataset), tf.data.Iterator)


def test_checkpoint_and_resume(tmp_path):
    runner = tiny_runner(str(tmp_path))
    runner.train(tiny_train_input_fn, 5)
    runner.completed_epochs.assign(2)
    path = runner.save_checkpoint()
    assert path.endswith("ckpt-5")
    resumed = tiny_runner(str(tmp_path))
    assert resumed.restore()
    assert resumed.global_step == 5 and int(resumed.completed_epochs.numpy()) == 2
    for left, right in zip(_weights(runner), _weights(resumed), strict=True):
        np.testing.assert_array_equal(left, right)
    fresh = tiny_runner(str(tmp_path / "empty"))
    assert not fresh.restore() and fresh.global_step == 0


def test_run_eagerly_runs_the_step_as_python_every_step(tmp_path):
    calls = {"graph": 0, "eager": 0}

    def counting(kind):
        def model_fn(*args):
            calls[kind] += 1  # Python runs this once per trace, or once per eager step
            return neumf_model.model_fn(*args)

        return model_fn

    graph = tiny_runner(str(tmp_path / "g"), steps_per_call=5, model_fn=counting("graph"))
    eager = tiny_runner(str(tmp_path / "e"), 5, model_fn=counting("eager"), run_eagerly=True)
    for runner in (graph, eager):
        runner.train(tiny_train_input_fn, 5)
    traced = calls["graph"]
    for runner in (graph, eager):
        runner.train(tiny_train_input_fn, 5)
    assert calls == {"graph": traced, "eager": 10}  # graphs run without Python
    for left, right in zip(_weights(graph), _weights(eager), strict=True):
        np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-7)


@pytest.mark.integration
def test_a_stop_signal_ends_training_and_evaluation_between_calls(tmp_path):
    runner = tiny_runner(str(tmp_path), steps_per_call=2)
    done = []

    def stop_after_the_first_call(steps, sums):
        done.append(steps)
        os.kill(os.getpid(), signal.SIGTERM)  # recorded; raised before the next call

    with signals.stop_on_signals(), pytest.raises(signals.Interrupted):
        runner.train(tiny_train_input_fn, 10, stop_after_the_first_call)
    assert done == [2] and runner.global_step == 2
    eval_calls = []
    original = runner._make_call

    def counted(mode):
        call = original(mode)

        def wrapped(iterator, num_steps):
            eval_calls.append(int(num_steps))
            os.kill(os.getpid(), signal.SIGINT)
            return call(iterator, num_steps)

        return wrapped

    runner._make_call = counted
    with signals.stop_on_signals(), pytest.raises(signals.Interrupted):
        runner.evaluate(_eval_input_fn, 9)
    assert eval_calls == [2]  # evaluation runs in calls of steps_per_call too


def _eval_input_fn():
    rng = np.random.default_rng(0)
    block, params = TINY_PARAMS.eval_block_size, TINY_PARAMS
    features = {
        constants.USER_COLUMN: rng.integers(0, params.num_users, (9, 2 * block)).astype(np.int32),
        constants.ITEM_COLUMN: rng.integers(0, params.num_items, (9, 2 * block)).astype(np.int32),
        constants.DUPLICATE_MASK: np.zeros((9, 2 * block), bool),
        constants.VALID_POINT_MASK: np.ones((9, 2 * block), bool),
    }
    return tf.data.Dataset.from_tensor_slices(features)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_traced_call_runs_without_tracing_again_and_trains_the_same(tmp_path, jit_compile):
    traced = []

    def model_fn(features, labels, mode, params, state):
        traced.append(mode)  # Python runs only while a call is traced
        return neumf_model.model_fn(features, labels, mode, params, state)

    runner = tiny_runner(
        str(tmp_path / "a"), steps_per_call=4, model_fn=model_fn, jit_compile=jit_compile
    )
    runner.prepare(Mode.TRAIN, tiny_train_input_fn().element_spec)
    runner.prepare(Mode.EVAL, _eval_input_fn().element_spec)
    assert set(traced) == {Mode.TRAIN, Mode.EVAL} and runner.global_step == 0
    before = list(traced)
    trained = runner.train(tiny_train_input_fn, 10)
    evaluated = runner.evaluate(_eval_input_fn, 9)
    assert traced == before  # the first calls used the traces
    untraced = tiny_runner(str(tmp_path / "b"), steps_per_call=4, jit_compile=jit_compile)
    assert untraced.train(tiny_train_input_fn, 10)["loss"] == trained["loss"]
    assert untraced.evaluate(_eval_input_fn, 9)["hr"] == evaluated["hr"]
    for left, right in zip(_weights(runner), _weights(untraced), strict=True):
        np.testing.assert_array_equal(left, right)


def test_a_checkpoint_of_other_model_flags_is_named_as_such(tmp_path):
    trained = tiny_runner(str(tmp_path))
    trained.train(tiny_train_input_fn, 1)
    trained.save_checkpoint()
    wider = tiny_runner(str(tmp_path), params=dataclasses.replace(TINY_PARAMS, mf_dim=6))
    with pytest.raises(
        ModelDirError,
        match=r"the checkpoint .*ckpt-1 was made with other model flags or other data "
        r"\(.*shape.*\); resume with the flags it was trained with, or start over with "
        r"--clean or another --model_dir",
    ):
        wider.restore()


def _saved_at(runner: Runner, steps: int) -> str:
    runner.train(tiny_train_input_fn, steps - runner.global_step)
    return runner.save_checkpoint()


def _checkpoint_files(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("ckpt-"))


def _state(directory) -> tuple[str, list[str]]:
    state = tf.train.get_checkpoint_state(str(directory))
    return state.model_checkpoint_path, list(state.all_model_checkpoint_paths)


def test_after_a_damaged_checkpoint_the_next_saves_are_the_latest_and_the_fallback_is_kept(
    tmp_path, caplog
):
    first = tiny_runner(str(tmp_path), keep_checkpoints=2)
    for steps in (2, 4, 6):
        _saved_at(first, steps)  # ckpt-2 pruned: ckpt-4 and ckpt-6 kept
    damage_checkpoint(str(tmp_path / "ckpt-6"), "truncated")
    damaged = (tmp_path / "ckpt-6.data-00000-of-00001").read_bytes()
    resumed = tiny_runner(str(tmp_path), keep_checkpoints=2)
    assert resumed.restore() and resumed.restored_from == str(tmp_path / "ckpt-4")
    newer = _saved_at(resumed, 5)
    # The new checkpoint is the latest; the damaged one takes no place among the two
    # kept (the fallback stays) and is left as it was, out of the checkpoint state.
    assert _state(tmp_path) == (newer, [str(tmp_path / "ckpt-4"), newer])
    assert _checkpoint_files(tmp_path) == [
        f"ckpt-{step}.{kind}" for step in (4, 5, 6) for kind in ("data-00000-of-00001", "index")
    ]
    assert (tmp_path / "ckpt-6.data-00000-of-00001").read_bytes() == damaged
    caplog.clear()
    again = tiny_runner(str(tmp_path), keep_checkpoints=2)
    assert again.restore() and again.restored_from == newer and again.global_step == 5
    assert "newest intact" not in caplog.text  # no longer a candidate once newer ones exist
    replaced = _saved_at(again, 6)  # the same number as the damaged one: written anew
    assert _state(tmp_path) == (replaced, [newer, replaced])
    last = tiny_runner(str(tmp_path), keep_checkpoints=2)
    assert last.restore() and last.restored_from == replaced and last.global_step == 6
    for left, right in zip(_weights(again), _weights(last), strict=True):
        np.testing.assert_array_equal(left, right)


def test_several_steps_per_call_trace_the_step_once():
    # The graph holds one step, called num_steps times, not a first step and a loop's.
    traces = []

    def step(index: tf.Tensor) -> dict[str, tf.Tensor]:
        traces.append(index)
        return {"sum": tf.cast(index, tf.float32), "count": tf.constant(1.0)}

    total = tf.function(lambda steps: sum_over_steps(step, steps))(tf.constant(4))
    assert len(traces) == 1
    assert (float(total["sum"]), float(total["count"])) == (0.0 + 1 + 2 + 3, 4.0)
    # Eagerly the step stays Python: a call per step.
    assert float(sum_over_steps(step, tf.constant(3))["sum"]) == 3.0 and len(traces) == 4


def test_steps_run_in_a_call_traced_without_autograph():
    """As Keras 3 traces its steps: a call traced without AutoGraph runs any number of
    steps, one trace for every count (a Python loop over a symbolic count cannot)."""
    traced_call = traced(lambda steps: sum_over_steps(lambda index: {"n": index + 1}, steps))
    assert [int(traced_call(tf.constant(count))["n"]) for count in (1, 3, 5)] == [1, 6, 15]
    assert traced_call.experimental_get_tracing_count() == 1
