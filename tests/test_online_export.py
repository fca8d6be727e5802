"""Versioned exports: the first a full SavedModel, later ones the same graph with new
values; old versions removed."""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from recommendation.online import export


class _Scaler(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = tf.Variable(1.0)
        self.table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, 0.0)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def serve(self, keys):
        return {"scores": self.weight * self.table.lookup(keys)}


def _served(path: str, keys) -> np.ndarray:
    signature = tf.saved_model.load(path).signatures["serving_default"]
    return signature(keys=tf.constant(keys, tf.int64))["scores"].numpy()


def test_later_versions_carry_new_values_and_old_ones_go(tmp_path):
    module = _Scaler()
    exporter = export.Exporter(str(tmp_path), module, {"serving_default": module.serve}, keep=2)
    module.table.insert(tf.constant([1], tf.int64), tf.constant([2.0]))
    first = exporter.export(10, {"position": "a"})
    module.weight.assign(3.0)
    module.table.insert(tf.constant([5], tf.int64), tf.constant([7.0]))
    second = exporter.export(20, {"position": "b"})
    np.testing.assert_allclose(_served(first, [1, 5]), [2.0, 0.0])
    np.testing.assert_allclose(_served(second, [1, 5]), [6.0, 21.0])
    exporter.export(30, {"position": "c"})
    assert export.versions(str(tmp_path)) == [20, 30]
    assert export.latest_export(str(tmp_path)) == os.path.join(str(tmp_path), "30")
    info = export.read_info(export.latest_export(str(tmp_path)))
    assert info["position"] == "c" and info["version"] == 30
    assert sorted(os.listdir(tmp_path)) == ["20", "30"]  # no temporary folders left


def test_no_versions_in_a_missing_folder(tmp_path):
    assert export.versions(str(tmp_path / "none")) == []
    assert export.latest_export(str(tmp_path / "none")) is None
