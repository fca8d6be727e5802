"""scripts/profile_training_step.py: reading TensorFlow's profile and sorting its ops."""

from __future__ import annotations

import collections
import glob

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
    assert matmuls and all(seconds[name] > 0 for name in matmuls)
    assert "MatMul" in matmuls[0].rpartition(":")[2]
    split = script.categorise(seconds)
    assert set(matmuls) <= set(split["matmuls (forward and backward)"])


def test_ops_fall_in_the_first_category_they_fit(script):
    seconds = collections.Counter(
        {
            "adam/Mul:Mul": 1.0,
            "gradient_tape/x:UnsortedSegmentSum": 2.0,
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
