"""Versioned exports: the first a full SavedModel, later ones the same graph with new
values; old versions removed."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from recommendation.online.state import versioned_export


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
    exporter = versioned_export.Exporter(
        str(tmp_path), module, {"serving_default": module.serve}, keep=2
    )
    module.table.insert(tf.constant([1], tf.int64), tf.constant([2.0]))
    first = exporter.export(10, {"position": "a"})
    module.weight.assign(3.0)
    module.table.insert(tf.constant([5], tf.int64), tf.constant([7.0]))
    second = exporter.export(20, {"position": "b"})
    np.testing.assert_allclose(_served(first, [1, 5]), [2.0, 0.0])
    np.testing.assert_allclose(_served(second, [1, 5]), [6.0, 21.0])
    exporter.export(30, {"position": "c"})
    assert versioned_export.versions(str(tmp_path)) == [20, 30]
    assert versioned_export.latest_export(str(tmp_path)) == os.path.join(str(tmp_path), "30")
    info = versioned_export.read_info(versioned_export.latest_export(str(tmp_path)))
    assert info["position"] == "c" and info["version"] == 30
    assert sorted(os.listdir(tmp_path)) == ["20", "30"]  # no temporary folders left


def test_no_versions_in_a_missing_folder(tmp_path):
    assert versioned_export.versions(str(tmp_path / "none")) == []
    assert versioned_export.latest_export(str(tmp_path / "none")) is None


@pytest.mark.integration
def test_versions_keep_increasing_after_a_restart_from_an_older_step(tmp_path):
    crashed = _Scaler()
    exporter = versioned_export.Exporter(
        str(tmp_path), crashed, {"serving_default": crashed.serve}, keep=2
    )
    exporter.export(10, {"step": 10})
    exporter.export(20, {"step": 20})  # then killed before its checkpoint
    killed = subprocess.Popen([sys.executable, "-c", ""])
    killed.wait()  # its pid now belongs to no process
    os.makedirs(tmp_path / f".30.tmp-{killed.pid}-0badcafe" / "variables")  # killed mid-export
    os.makedirs(tmp_path / f".10.tmp-{killed.pid}-0badf00d")  # killed mid-prune
    resumed = _Scaler()  # restarted from step 0, with other values
    resumed.weight.assign(5.0)
    resumed.table.insert(tf.constant([1], tf.int64), tf.constant([1.0]))
    exporter = versioned_export.Exporter(
        str(tmp_path), resumed, {"serving_default": resumed.serve}, keep=2
    )
    assert sorted(os.listdir(tmp_path)) == ["10", "20"]  # the leftovers are gone
    exporter.export(5, {"step": 5})
    newest = exporter.export(15, {"step": 15})
    assert versioned_export.versions(str(tmp_path)) == [21, 22]  # the crashed run's 20 is pruned
    assert versioned_export.latest_export(str(tmp_path)) == newest
    assert (
        versioned_export.read_info(newest)["step"] == 15
        and versioned_export.read_info(newest)["version"] == 22
    )
    np.testing.assert_allclose(_served(newest, [1]), [5.0])  # the resumed model is served
    resumed.weight.assign(6.0)
    assert os.path.basename(exporter.export(40, {"step": 40})) == "40"  # past them: the step
