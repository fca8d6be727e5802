"""The Estimator-style runner: checkpoints, resume, steps per call, export."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from official.utils.misc import signals
from official.utils.misc.runner import ModelDirError, Runner, prepare_model_dir
from recommendation import constants, data_pipeline, neumf_model
from recommendation.neumf_model import ModelParams

PARAMS = ModelParams(
    num_users=50, num_items=40, mf_dim=4, layers=(8, 4), mlp_regularization=(0.0, 0.0)
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _runner(model_dir: str, steps_per_call: int = 1, **options) -> Runner:
    keras.utils.set_random_seed(0)
    return Runner(
        options.pop("model_fn", neumf_model.model_fn),
        neumf_model.build_state,
        PARAMS,
        model_dir,
        tf.distribute.OneDeviceStrategy("/cpu:0"),
        steps_per_call=steps_per_call,
        **options,
    )


def _input_fn():
    return data_pipeline.synthetic_train_input_fn(32, PARAMS.num_users, PARAMS.num_items, seed=3)


def _exports(folder) -> list[str]:
    """The export and any temporary or moved-aside siblings of it in `folder`."""
    return sorted(name for name in os.listdir(folder) if name.startswith("export"))


def _weights(runner: Runner) -> list[np.ndarray]:
    return [variable.numpy() for variable in runner.state.model.weights]


def test_steps_per_call_does_not_change_the_result(tmp_path):
    one = _runner(str(tmp_path / "a"), steps_per_call=1)
    four = _runner(str(tmp_path / "b"), steps_per_call=4)
    metrics_one = one.train(_input_fn, 10)
    metrics_four = four.train(_input_fn, 10)
    assert one.global_step == four.global_step == 10
    assert metrics_one["num_points"] == metrics_four["num_points"] == 320
    assert metrics_one["loss"] == pytest.approx(metrics_four["loss"], rel=1e-6)
    for left, right in zip(_weights(one), _weights(four), strict=True):
        np.testing.assert_array_equal(left, right)


def test_progress_is_reported_per_call(tmp_path):
    runner = _runner(str(tmp_path), steps_per_call=4)
    seen = []
    runner.train(_input_fn, 10, lambda steps, sums: seen.append(steps))
    assert seen == [4, 8, 10]


def test_the_reported_metrics_are_the_model_fns_summary_of_the_totals(tmp_path):
    def model_fn(features, labels, mode, params, state):
        spec = neumf_model.model_fn(features, labels, mode, params, state)
        return dataclasses.replace(spec, summarize=lambda totals: {"totals": dict(totals)})

    runner = _runner(str(tmp_path), steps_per_call=4, model_fn=model_fn)
    train = runner.train(_input_fn, 10)
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
    dataset = _runner(str(tmp_path)).distribute(_input_fn)
    assert isinstance(dataset, tf.data.Dataset)
    assert isinstance(iter(dataset), tf.data.Iterator)


def test_checkpoint_and_resume(tmp_path):
    runner = _runner(str(tmp_path))
    runner.train(_input_fn, 5)
    runner.completed_epochs.assign(2)
    path = runner.save_checkpoint()
    assert path.endswith("ckpt-5")
    resumed = _runner(str(tmp_path))
    assert resumed.restore()
    assert resumed.global_step == 5 and int(resumed.completed_epochs.numpy()) == 2
    for left, right in zip(_weights(runner), _weights(resumed), strict=True):
        np.testing.assert_array_equal(left, right)
    fresh = _runner(str(tmp_path / "empty"))
    assert not fresh.restore() and fresh.global_step == 0


SPECS = [
    tf.TensorSpec([None], tf.int32, constants.USER_COLUMN),
    tf.TensorSpec([None], tf.int32, constants.ITEM_COLUMN),
]


def _serving(predict, model):
    """The smallest serving module: the PREDICT outputs for dense ids."""
    module = tf.Module()
    module.model = model
    module.serve = tf.function(
        lambda user_id, item_id: predict(
            {constants.USER_COLUMN: user_id, constants.ITEM_COLUMN: item_id}
        ),
        input_signature=SPECS,
    )
    return module, {"serving_default": module.serve}


def test_export_reloads_in_a_fresh_process_with_the_same_scores(tmp_path):
    runner = _runner(str(tmp_path / "model"))
    runner.train(_input_fn, 3)
    export_dir = str(tmp_path / "export")
    runner.export_saved_model(export_dir, _serving)
    assert _exports(tmp_path) == ["export"]  # no temporary folder left behind
    users, items = [0, 7, 49], [39, 3, 0]
    expected = runner.state.model(
        {constants.USER_COLUMN: tf.constant(users), constants.ITEM_COLUMN: tf.constant(items)}
    )[:, 0]
    script = (
        "import sys, tensorflow as tf\n"
        "fn = tf.saved_model.load(sys.argv[1]).signatures['serving_default']\n"
        f"out = fn(user_id=tf.constant({users}), item_id=tf.constant({items}))\n"
        "print(' '.join(repr(float(v)) for v in out['logits'].numpy()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, export_dir],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    scores = [float(value) for value in result.stdout.split()]
    np.testing.assert_allclose(scores, expected.numpy(), rtol=1e-6)


def _fail(_):
    raise RuntimeError("injected failure after the SavedModel was written")


def test_failed_export_leaves_nothing_behind(tmp_path):
    runner = _runner(str(tmp_path / "model"))
    export_dir = str(tmp_path / "export")
    with pytest.raises(RuntimeError, match="injected"):
        runner.export_saved_model(export_dir, _serving, finalize=_fail)
    assert _exports(tmp_path) == []  # neither the export nor its temporary folder


def test_failed_export_keeps_the_earlier_one(tmp_path):
    runner = _runner(str(tmp_path / "model"))
    export_dir = str(tmp_path / "export")
    runner.export_saved_model(export_dir, _serving)
    before = sorted(os.listdir(export_dir))
    runner.train(_input_fn, 2)
    with pytest.raises(RuntimeError, match="injected"):
        runner.export_saved_model(export_dir, _serving, finalize=_fail)
    assert _exports(tmp_path) == ["export"]
    assert sorted(os.listdir(export_dir)) == before
    assert "serving_default" in tf.saved_model.load(export_dir).signatures


def test_export_never_replaces_a_folder_that_is_not_a_saved_model(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not a SavedModel"):
        _runner(str(tmp_path / "model")).export_saved_model(str(tmp_path / "export"), _serving)
    assert os.listdir(tmp_path / "export") == ["notes.txt"]


# An export killed (SIGKILL) after writing its temporary folder, before the rename.
_KILLED_EXPORT = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
import test_runner
runner = test_runner._runner(os.path.join(sys.argv[1], "model"))
runner.export_saved_model(
    os.path.join(sys.argv[1], "export"),
    test_runner._serving,
    finalize=lambda _: os.kill(os.getpid(), signal.SIGKILL),
)
"""


def test_killed_export_leaves_no_export_and_its_leftovers_are_removed(tmp_path):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run(
        [sys.executable, "-c", _KILLED_EXPORT, str(tmp_path), tests_dir],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == -9, result.stderr[-2000:]
    leftovers = _exports(tmp_path)
    assert len(leftovers) == 1 and leftovers[0].startswith("export.tmp-")  # never `export`
    _runner(str(tmp_path / "model")).export_saved_model(str(tmp_path / "export"), _serving)
    assert _exports(tmp_path) == ["export"]


def test_an_export_moved_aside_by_a_killed_export_is_put_back(tmp_path):
    runner = _runner(str(tmp_path / "model"))
    runner.export_saved_model(str(tmp_path / "export"), _serving)
    finished = subprocess.Popen([sys.executable, "-c", ""])
    finished.wait()  # its pid now belongs to no process
    # As a swap killed between its renames leaves it: aside, under the dead writer's pid.
    os.rename(tmp_path / "export", tmp_path / f"export.old-{finished.pid}-0badcafe")
    with pytest.raises(RuntimeError, match="injected"):
        runner.export_saved_model(str(tmp_path / "export"), _serving, finalize=_fail)
    assert _exports(tmp_path) == ["export"]
    assert tf.saved_model.contains_saved_model(str(tmp_path / "export"))


def test_run_eagerly_runs_the_step_as_python_every_step(tmp_path):
    calls = {"graph": 0, "eager": 0}

    def counting(kind):
        def model_fn(*args):
            calls[kind] += 1  # Python runs this once per trace, or once per eager step
            return neumf_model.model_fn(*args)

        return model_fn

    graph = _runner(str(tmp_path / "g"), steps_per_call=5, model_fn=counting("graph"))
    eager = _runner(str(tmp_path / "e"), 5, model_fn=counting("eager"), run_eagerly=True)
    for runner in (graph, eager):
        runner.train(_input_fn, 5)
    traced = calls["graph"]
    for runner in (graph, eager):
        runner.train(_input_fn, 5)
    assert calls == {"graph": traced, "eager": 10}  # graphs run without Python
    for left, right in zip(_weights(graph), _weights(eager), strict=True):
        np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-7)


def test_a_stop_signal_ends_training_and_evaluation_between_calls(tmp_path):
    runner = _runner(str(tmp_path), steps_per_call=2)
    done = []

    def stop_after_the_first_call(steps, sums):
        done.append(steps)
        os.kill(os.getpid(), signal.SIGTERM)  # recorded; raised before the next call

    with signals.stop_on_signals(), pytest.raises(signals.Interrupted):
        runner.train(_input_fn, 10, stop_after_the_first_call)
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
    block = PARAMS.eval_block_size
    features = {
        constants.USER_COLUMN: rng.integers(0, PARAMS.num_users, (9, 2 * block)).astype(np.int32),
        constants.ITEM_COLUMN: rng.integers(0, PARAMS.num_items, (9, 2 * block)).astype(np.int32),
        constants.DUPLICATE_MASK: np.zeros((9, 2 * block), bool),
        constants.VALID_POINT_MASK: np.ones((9, 2 * block), bool),
    }
    return tf.data.Dataset.from_tensor_slices(features)


def test_a_model_dir_that_cannot_hold_files_is_refused_up_front(tmp_path):
    regular_file = tmp_path / "model"
    regular_file.write_text("not a folder")
    with pytest.raises(ModelDirError, match=r"--model_dir .*model is a file, not a folder"):
        prepare_model_dir(str(regular_file))
    with pytest.raises(
        ModelDirError,
        match=r"cannot write checkpoints and logs in .*below: .*model is not a directory; "
        r"pass --model_dir with a writable folder",
    ):
        prepare_model_dir(str(regular_file / "below"))
    prepare_model_dir(str(tmp_path / "new" / "model"))
    assert os.listdir(tmp_path / "new" / "model") == []  # created, and the probe removed


def test_a_checkpoint_of_other_model_flags_is_named_as_such(tmp_path):
    trained = _runner(str(tmp_path))
    trained.train(_input_fn, 1)
    trained.save_checkpoint()
    wider = Runner(
        neumf_model.model_fn,
        neumf_model.build_state,
        dataclasses.replace(PARAMS, mf_dim=6),
        str(tmp_path),
        tf.distribute.OneDeviceStrategy("/cpu:0"),
    )
    with pytest.raises(
        ModelDirError,
        match=r"the checkpoint .*ckpt-1 was made with other model flags or other data "
        r"\(.*shape.*\); resume with the flags it was trained with, or start over with "
        r"--clean or another --model_dir",
    ):
        wider.restore()
