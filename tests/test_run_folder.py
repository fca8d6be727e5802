"""The producer/trainer file protocol: ready files, parameters and batch records."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

from recommendation.data import constants
from recommendation.producer import run_folder
from recommendation.producer.run_folder import CycleInfo, EvalInfo, GenerationParams


def test_ready_files_hold_everything_but_the_location_and_read_back(tmp_path):
    cycle = CycleInfo(
        index=3,
        folder=run_folder.cycle_folder(str(tmp_path), 3),
        epochs=2,
        batches_per_epoch=5,
        batch_size=64,
        num_shards=8,
    )
    evaluation = EvalInfo(
        folder=run_folder.eval_folder(str(tmp_path)),
        num_batches=4,
        users_per_batch=48,
        block_size=1000,
        num_users=190,
        num_shards=8,
    )
    assert json.loads(cycle.to_json()) == {
        "epochs": 2,
        "batches_per_epoch": 5,
        "batch_size": 64,
        "num_shards": 8,
    }
    assert json.loads(evaluation.to_json()) == {
        "num_batches": 4,
        "users_per_batch": 48,
        "block_size": 1000,
        "num_users": 190,
        "num_shards": 8,
    }
    for info, location in ((cycle, {"index": 3}), (evaluation, {})):
        tf.io.gfile.makedirs(info.folder)
        run_folder.write_ready(info)
        with open(run_folder.ready_file(info.folder)) as ready:
            assert type(info).from_json(ready.read(), folder=info.folder, **location) == info


def test_generation_params_read_back_with_their_tuple():
    params = GenerationParams("c.npz", 1024, 48, 4, 999, (1, 2), seed=7, first_epoch=3)
    assert GenerationParams.from_json(params.to_json()) == params


def test_records_read_back_with_the_dtypes_and_static_shapes_of_their_spec():
    train = {
        constants.USER_COLUMN: np.array([1, 2, 0], np.int64),  # stored as int32
        constants.ITEM_COLUMN: np.array([7, 8, 0], np.int32),
        constants.LABELS: np.array([True, False, False]),  # stored as 0/1
        constants.VALID_POINT_MASK: np.array([True, True, False]),
    }
    evaluation = {
        constants.USER_COLUMN: np.array([4, 0], np.int32),
        constants.ITEM_COLUMN: np.array([[5, 6, 9], [0, 0, 0]], np.int32),
        constants.DUPLICATE_MASK: np.array([[False, True, False], [True, True, True]]),
        constants.VALID_POINT_MASK: np.array([True, False]),
    }
    for arrays, spec in (
        (train, run_folder.train_record(3)),
        (evaluation, run_folder.eval_record(2, 3)),
    ):
        decoded = run_folder.decode_record(
            tf.constant(run_folder.encode_record(arrays, spec)), spec
        )
        for key, field in spec.items():
            assert decoded[key].dtype == tf.as_dtype(field.dtype)
            assert tuple(decoded[key].shape) == field.shape
            np.testing.assert_array_equal(decoded[key].numpy(), arrays[key].astype(field.dtype))


def test_a_batch_that_does_not_fit_its_record_is_refused():
    spec = run_folder.eval_record(2, 3)
    arrays = {
        constants.USER_COLUMN: np.zeros(2),
        constants.ITEM_COLUMN: np.zeros(6),  # flat: not per user
        constants.DUPLICATE_MASK: np.zeros((2, 3)),
        constants.VALID_POINT_MASK: np.zeros(2),
    }
    with pytest.raises(ValueError, match=r"item_id has shape \(6,\); the record holds \(2, 3\)"):
        run_folder.encode_record(arrays, spec)
    del arrays[constants.DUPLICATE_MASK]
    with pytest.raises(ValueError, match="differ from the record's"):
        run_folder.encode_record(arrays, spec)
