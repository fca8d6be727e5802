"""scripts/profile_training_step.py: reading TensorFlow's profile and sorting its ops."""

from __future__ import annotations

import collections
import glob
import os
import subprocess
import sys

import pytest
import tensorflow as tf
from conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("profile_training_step")


def test_a_profiled_graph_call_is_read_back_op_by_op(script, tmp_path):
    """The profile proto the script reads (a private TensorFlow module) still parses
    and still names each executed op ``<name>:<type>``."""
    step = tf.function(lambda a: tf.reduce_sum(tf.matmul(a, a, name="the_matmul")))
    matrix = tf.ones([256, 256])
    step(matrix)
    tf.profiler.experimental.start(str(tmp_path))
    for _ in range(3):
        step(matrix).numpy()
    tf.profiler.experimental.stop()
    (path,) = glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
    seconds = script.op_seconds(path)
    matmuls = [name for name in seconds if name.startswith("the_matmul:")]
    # One op, its 3 calls summed under its name; its time is a measurement: only that
    # the profile timed it.
    assert len(matmuls) == 1 and seconds[matmuls[0]] > 0
    assert "MatMul" in matmuls[0].rpartition(":")[2]
    split = script.categorise(seconds)
    assert set(matmuls) <= set(split["matmuls (forward and backward)"])


def test_ops_fall_in_the_first_category_they_fit(script):
    seconds = collections.Counter(
        {
            "adam/Mul:Mul": 1.0,
            "gradient_tape/x:UnsortedSegmentSum": 1.5,
            "TensorScatterAdd_2:TensorScatterAdd": 0.5,  # kernels.dense_gradient's
            "dense/MatMul:_MklMatMul": 3.0,
            "embedding/GatherV2:GatherV2": 4.0,
            "gradient_tape/s:StridedSliceGrad": 5.0,
            "Cast:Cast": 6.0,
            "relu:Relu": 7.0,
            "MatMul.30": 8.0,  # an XLA kernel: no op type, its name stands for one
        }
    )
    totals = {c: sum(ops.values()) for c, ops in script.categorise(seconds).items()}
    assert totals == {
        "optimizer update (Adam)": 1.0,
        "embedding gradients (scatter-add)": 2.0,
        "matmuls (forward and backward)": 11.0,
        "embedding and table-term gathers": 4.0,
        "slicing and its gradients": 5.0,
        "casts": 6.0,
        "other element-wise and reductions": 7.0,
    }


_XLA_PROFILE = """
import glob, os, sys
sys.path.insert(0, {tests!r})
from conftest import load_script
script = load_script("profile_training_step")
os.environ["XLA_FLAGS"] = script.XLA_PROFILE_FLAGS + " --xla_dump_to={work}/hlo"
import tensorflow as tf
from recommendation.model import kernels
table = tf.Variable(tf.ones([50, 64]))
ids = tf.constant([i % 50 for i in range(4096)])
@tf.function(jit_compile=True)
def step():
    with tf.GradientTape() as tape:
        rows = tf.gather(table, ids)
        loss = tf.reduce_sum(tf.matmul(rows, rows, transpose_b=True, name="the_matmul"))
    return tf.convert_to_tensor(tape.gradient(loss, table))
step()
tf.profiler.experimental.start("{work}/profile")
for _ in range(3):
    step().numpy()
tf.profiler.experimental.stop()
(path,) = glob.glob("{work}/profile/plugins/profile/*/*.xplane.pb")
split = script.categorise(script.op_seconds(path, script.hlo_sources("{work}/hlo")))
for category, ops in split.items():
    for name, seconds in ops.items():
        print(category, "|", name, "|", seconds > 0)
"""


@pytest.mark.integration
def test_xla_kernels_are_counted_as_the_ops_they_came_from(tmp_path):
    """With XLA, each traced kernel is mapped through the optimised-HLO dump to the
    TensorFlow op it computes (a fresh process: XLA reads its flags once)."""
    code = _XLA_PROFILE.format(tests=os.path.dirname(__file__), work=tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    rows = [line.split(" | ") for line in result.stdout.splitlines() if " | " in line]
    matmuls = [name for category, name, _ in rows if category.startswith("matmuls")]
    assert matmuls and all("the_matmul" in name for name in matmuls), rows
    scatters = [name for category, name, _ in rows if category.startswith("embedding gradients")]
    assert scatters and all(name.endswith(":UnsortedSegmentSum") for name in scatters), rows
    assert all(positive == "True" for *_, positive in rows)
