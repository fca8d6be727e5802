"""model_dir and its checkpoints, as both trainers use them: the folder checked up
front, a failed save cleaned up and named, a checkpoint of other model flags named."""

from __future__ import annotations

import os

import keras
import pytest
import tensorflow as tf

from official.utils.misc import model_dir, precision
from official.utils.misc.model_dir import ModelDirError
from recommendation.online import callbacks, online_ncf

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
