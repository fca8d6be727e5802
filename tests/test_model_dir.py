"""model_dir and its checkpoints, as both trainers use them: the folder checked up
front, a failed save cleaned up and named, a checkpoint of other model flags named, a
damaged one (really damaged on disk) named and the newest intact one restored."""

from __future__ import annotations

import dataclasses
import glob
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    CHECKPOINT_DAMAGES,
    TINY_PARAMS,
    bytes_read,
    damage_checkpoint,
    tiny_runner,
    tiny_train_input_fn,
)

from official.core import model_dir, precision
from official.core.model_dir import ModelDirError
from official.core.runner import Runner, restore_model
from recommendation.data import constants
from recommendation.online import callbacks, online_ncf
from recommendation.online.sources.stream_batches import StreamBatch

ONLINE = online_ncf.OnlineParams(
    mf_dim=4, layers=(8, 4), mlp_regularization=(0.0, 0.0), user_capacity=64, item_capacity=32
)


def test_a_model_dir_that_cannot_hold_files_is_refused_up_front(tmp_path):
    regular_file = tmp_path / "model"
    regular_file.write_text("not a folder")
    with pytest.raises(ModelDirError, match=r"--model_dir .*model is a file, not a folder"):
        model_dir.prepare(str(regular_file))
    with pytest.raises(
        ModelDirError,
        match=r"cannot write checkpoints and logs in .*below: .*model is not a directory; "
        r"pass --model_dir with a writable folder",
    ):
        model_dir.prepare(str(regular_file / "below"))
    model_dir.prepare(str(tmp_path / "new" / "model"))
    assert os.listdir(tmp_path / "new" / "model") == []  # created, and the probe removed


def _manager(directory) -> tf.train.CheckpointManager:
    checkpoint = tf.train.Checkpoint(value=tf.Variable(tf.ones([256])))
    return tf.train.CheckpointManager(checkpoint, str(directory), max_to_keep=3)


def test_a_failed_save_leaves_nothing_and_names_the_checkpoint_still_kept(tmp_path):
    manager = _manager(tmp_path)
    kept = model_dir.save_checkpoint(manager, 4, durable=True)
    # TensorFlow writes checkpoint 5 into ckpt-5_temp/ first: a file of that name
    # makes the save fail where a full disk would, after it has begun.
    (tmp_path / "ckpt-5_temp").write_text("in the way")
    with pytest.raises(
        ModelDirError,
        match=rf"cannot write checkpoint 5 in {tmp_path}: .*; pass --model_dir with a "
        rf"writable folder; the last complete checkpoint is {kept}$",
    ):
        model_dir.save_checkpoint(manager, 5)
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoint",
        "ckpt-4.data-00000-of-00001",
        "ckpt-4.index",
    ]
    assert tf.train.latest_checkpoint(str(tmp_path)) == kept


def test_the_online_trainer_names_a_checkpoint_of_other_model_flags(tmp_path):
    first = online_ncf.build_rec_model(ONLINE)
    saver = callbacks.CheckpointCallback(str(tmp_path), every_steps=1)
    saver.set_rec_model(first)
    saver.on_train_begin()
    saver.act()
    saver.finish()
    wider = online_ncf.build_rec_model(online_ncf.OnlineParams(**{**ONLINE.__dict__, "mf_dim": 6}))
    restorer = callbacks.CheckpointCallback(str(tmp_path), every_steps=1)
    restorer.set_rec_model(wider)
    with pytest.raises(
        ModelDirError,
        match=r"the checkpoint .*ckpt-0 was made with other model flags or other data "
        r"\(.*\); resume with the flags it was trained with, or start over with --clean",
    ):
        restorer.on_train_begin()


def test_float16_compute_with_float32_variables_is_the_one_that_scales_its_loss():
    adam = keras.optimizers.Adam()
    scaled = precision.with_loss_scaling(adam, "mixed_float16")
    assert isinstance(scaled, keras.optimizers.LossScaleOptimizer)
    assert precision.with_loss_scaling(adam, "mixed_float16", fixed_scale=128.0) is adam
    for policy in ("float32", "mixed_bfloat16", "float16", "bfloat16"):
        assert precision.with_loss_scaling(adam, policy) is adam


def _weights(runner: Runner) -> list[np.ndarray]:
    return [variable.numpy() for variable in runner.state.model.weights]


def _warnings(caplog) -> list[str]:
    """The warnings the project logged (absl), not TensorFlow's."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "absl" and record.levelname == "WARNING"
    ]


def _two_checkpoints(directory) -> tuple[str, list[np.ndarray], str]:
    """A runner's checkpoints after epochs 1 (step 3) and 2 (step 6): the first's path
    and weights, the second's path."""
    runner = tiny_runner(str(directory))
    runner.train(tiny_train_input_fn, 3)
    runner.completed_epochs.assign(1)
    first = runner.save_checkpoint()
    weights = _weights(runner)
    runner.train(tiny_train_input_fn, 3)
    runner.completed_epochs.assign(2)
    return first, weights, runner.save_checkpoint()


@pytest.mark.parametrize("how", CHECKPOINT_DAMAGES)
def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_restored(tmp_path, caplog, how):
    intact, weights, newest = _two_checkpoints(tmp_path)
    problem = damage_checkpoint(newest, how)
    resumed = tiny_runner(str(tmp_path))  # weights of its own, neither checkpoint's
    assert resumed.restore()
    assert resumed.restored_from == intact == str(tmp_path / "ckpt-3")
    assert resumed.global_step == 3 and int(resumed.completed_epochs.numpy()) == 1
    for kept, restored in zip(weights, _weights(resumed), strict=True):
        np.testing.assert_array_equal(kept, restored)
    (warning,) = _warnings(caplog)
    assert re.fullmatch(
        rf"{re.escape(newest)} is damaged \({problem}\); restored {re.escape(intact)}, the "
        "newest intact checkpoint",
        warning,
    ), warning


def _flip_a_byte_of(prefix: str, key: str) -> None:
    """Changes a byte in the middle of tensor `key` of checkpoint `prefix` on disk."""
    value = tf.train.load_checkpoint(prefix).get_tensor(key).tobytes()
    (data,) = glob.glob(f"{prefix}.data-*")
    with open(data, "r+b") as stream:
        content = stream.read()
        assert content.count(value) == 1  # (its bytes found where they are)
        at = content.index(value) + len(value) // 2
        stream.seek(at)
        stream.write(bytes([content[at] ^ 0xFF]))


def test_a_damaged_tensor_the_restore_does_not_place_is_named_too(tmp_path, caplog):
    """A weights-only restore reads the optimiser state it leaves (so that every tensor
    is verified once): damaged there, the checkpoint is named and the one before it is
    restored over the weights already placed."""
    intact, weights, newest = _two_checkpoints(tmp_path)
    shapes = tf.train.load_checkpoint(newest).get_variable_to_shape_map()
    optimizer_state = max(
        (key for key in shapes if key.startswith("optimizer/")),
        key=lambda key: np.prod(shapes[key]),
    )
    _flip_a_byte_of(newest, optimizer_state)
    model = tiny_runner(str(tmp_path / "other")).state.model
    assert restore_model(model, str(tmp_path)) == intact
    for kept, restored in zip(weights, model.weights, strict=True):
        np.testing.assert_array_equal(kept, restored.numpy())
    (warning,) = _warnings(caplog)
    assert warning.startswith(f"{newest} is damaged (") and "Checksum does not match" in warning


@pytest.mark.parametrize("restored", ["every object", "weights only"])
def test_a_restore_reads_the_checkpoint_once(tmp_path, restored):
    """Its restore is what verifies a checkpoint: every tensor read once, checksums
    checked, those the objects do not hold included (the optimiser state a weights-only
    restore leaves), never read twice."""
    size = 1 << 21  # floats: 8 MiB a tensor
    saved = tf.train.Checkpoint(
        weights=tf.Variable(tf.random.uniform([size])),
        moments=tf.Variable(tf.random.uniform([size])),
    )
    manager = tf.train.CheckpointManager(saved, str(tmp_path), max_to_keep=1)
    path = model_dir.save_checkpoint(manager, 1)
    on_disk = sum(os.path.getsize(name) for name in glob.glob(f"{path}.*"))
    objects = {"weights": tf.Variable(tf.zeros([size]))}
    if restored == "every object":
        objects["moments"] = tf.Variable(tf.zeros([size]))
    model_dir.restore_latest(lambda: tf.train.Checkpoint(**objects), str(tmp_path))  # (warm)
    objects["weights"].assign(tf.zeros([size]))
    before = bytes_read()
    assert model_dir.restore_latest(lambda: tf.train.Checkpoint(**objects), str(tmp_path)) == path
    read = bytes_read() - before
    assert on_disk <= read < 1.25 * on_disk, (read, on_disk)
    np.testing.assert_array_equal(objects["weights"].numpy(), saved.weights.numpy())


def test_a_stopped_run_names_its_checkpoint_without_reading_it_again(tmp_path):
    """What a stop reports (`newest_intact`): a checkpoint this process wrote or restored
    is not read a third time while its files are as they were; one cut short since is."""
    saved = tf.train.Checkpoint(weights=tf.Variable(tf.random.uniform([1 << 21])))
    manager = tf.train.CheckpointManager(saved, str(tmp_path), max_to_keep=1)
    path = model_dir.save_checkpoint(manager, 1)
    (data,) = glob.glob(f"{path}.data-*")
    before = bytes_read()
    assert model_dir.newest_intact(str(tmp_path)) == path
    assert bytes_read() - before < os.path.getsize(data) / 100
    problem = damage_checkpoint(path, "truncated")
    with pytest.raises(
        ModelDirError, match=rf"no intact checkpoint in .*: .*ckpt-1 is damaged \({problem}\)"
    ):
        model_dir.newest_intact(str(tmp_path))


def test_with_every_checkpoint_damaged_the_error_names_each_and_nothing_is_deleted(tmp_path):
    intact, _, newest = _two_checkpoints(tmp_path)
    newest_problem = damage_checkpoint(newest, "truncated")
    damage_checkpoint(intact, "no data file")
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    with pytest.raises(ModelDirError) as raised:
        tiny_runner(str(tmp_path)).restore()
    assert re.fullmatch(
        rf"no intact checkpoint in {re.escape(str(tmp_path))}: {re.escape(newest)} "
        rf"\({newest_problem}\) and {re.escape(intact)} \(ckpt-3\.data-\*: missing\) are "
        rf"damaged; train again with --clean or another --model_dir \(copy "
        rf"{re.escape(str(tmp_path))} elsewhere first if its data matters\)",
        str(raised.value),
    ), raised.value
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before


def test_a_readable_checkpoint_of_other_flags_is_not_damage_and_no_older_one_is_tried(tmp_path):
    narrow = tiny_runner(str(tmp_path))
    narrow.train(tiny_train_input_fn, 3)
    narrow.save_checkpoint()  # ckpt-3, of this model
    wider = tiny_runner(str(tmp_path), params=dataclasses.replace(TINY_PARAMS, mf_dim=6))
    wider.train(tiny_train_input_fn, 6)
    other_flags = wider.save_checkpoint()  # ckpt-6, of other model flags
    wider.train(tiny_train_input_fn, 3)
    newest = wider.save_checkpoint()  # ckpt-9, damaged below
    problem = damage_checkpoint(newest, "truncated")
    with pytest.raises(ModelDirError) as raised:
        tiny_runner(str(tmp_path)).restore()
    assert re.fullmatch(
        rf"{re.escape(newest)} is damaged \({problem}\), and the checkpoint "
        rf"{re.escape(other_flags)} was made with other model flags or other data \(.*shape.*\); "
        r"resume with the flags it was trained with, or start over with --clean or another "
        r"--model_dir",
        str(raised.value),
    ), raised.value


def _events(count: int, size: int = 16):
    """`count` steps of random (user, item) events, each with its source position."""
    rng = np.random.default_rng(0)
    for index in range(count):
        events = {
            constants.USER_COLUMN: rng.integers(1, 40, size),
            constants.ITEM_COLUMN: rng.integers(1, 25, size),
        }
        yield StreamBatch(events, {"offset": (index + 1) * size}, size)


def test_the_online_trainer_resumes_from_the_newest_intact_checkpoint(tmp_path, caplog, capsys):
    trained = online_ncf.build_rec_model(ONLINE)
    trained.online_train(_events(4), [callbacks.CheckpointCallback(str(tmp_path), every_steps=2)])
    intact, newest = str(tmp_path / "ckpt-2"), str(tmp_path / "ckpt-4")
    expected = online_ncf.build_rec_model(ONLINE)  # ckpt-2 as a fresh model reads it
    expected.checkpoint.read(intact).assert_existing_objects_matched()
    expected.after_restore()
    problem = damage_checkpoint(newest, "truncated")
    resumed = online_ncf.build_rec_model(ONLINE)
    checkpoint = callbacks.CheckpointCallback(str(tmp_path), every_steps=2)
    resumed.online_train([], [checkpoint, callbacks.ReportRestore(checkpoint)])
    assert checkpoint.restored_from == intact
    assert int(resumed.step.numpy()) == 2 and resumed.position == {"offset": 32}
    for kept, restored in zip(expected.network.weights, resumed.network.weights, strict=True):
        np.testing.assert_array_equal(kept.numpy(), restored.numpy())
    digest = callbacks.table_digest(expected.network)
    assert callbacks.table_digest(resumed.network) == digest
    assert f"restored {intact}: step=2 " in capsys.readouterr().out
    (warning,) = _warnings(caplog)
    assert re.fullmatch(
        rf"{re.escape(newest)} is damaged \({problem}\); restored {re.escape(intact)}, the "
        "newest intact checkpoint: the events trained after it are trained again where their "
        "source can deliver them again",
        warning,
    ), warning


def test_a_checkpoint_written_beside_training_holds_the_model_as_it_was_when_saved(tmp_path):
    """`save_checkpoint` with `written`: TensorFlow's async checkpoint copies every
    value first (a Keras 3 model's, at every save: `_copy_keras_variables_once`), so
    what is written is the model when it was called, whatever trains after; `written`
    hears of it once its files are on disk, and `wait_for_checkpoint` lists it."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    checkpoint = tf.train.Checkpoint(model=model)
    manager = tf.train.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=3)
    for step in (1, 2):
        saved = [weight.numpy() for weight in model.weights]
        heard = []
        path = model_dir.save_checkpoint(manager, step, durable=True, written=heard.append)
        for weight in model.weights:  # training goes on
            weight.assign(weight + 1.0)
        model_dir.wait_for_checkpoint(checkpoint, manager, step)
        assert heard == [path] == [str(tmp_path / f"ckpt-{step}")]
        restored = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        tf.train.Checkpoint(model=restored).read(path).assert_existing_objects_matched()
        for weight, value in zip(restored.weights, saved, strict=True):
            np.testing.assert_array_equal(weight.numpy(), value)
    assert manager.checkpoints == [str(tmp_path / "ckpt-1"), str(tmp_path / "ckpt-2")]
