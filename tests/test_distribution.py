"""Multi-worker training: two processes on loopback (MultiWorkerMirroredStrategy, CPU),
against one process on one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import ROOT, free_ports

# One training run; argv: strategy, worker hosts ("" for none), task index, model dir,
# output file. Every run builds the same synthetic data with the same seed, so reads the
# same global batches. The embedding L2 term is there because Adam is nearly blind to a
# constant scale of the gradient: a loss normalised per replica (each replica's mean
# instead of its share of the global mean) doubles the data gradient, which without L2
# showed only through Adam's epsilon (1e-3 in the weights) and with it shows plainly;
# it also catches an L2 term added once per replica instead of once.
_RUN = textwrap.dedent("""
    import sys
    import numpy as np
    from absl import flags
    from recommendation.training import cycles, ncf_common

    strategy, hosts, index, model_dir, out = sys.argv[1:6]
    flag_values = flags.FlagValues()
    ncf_common.define_ncf_flags(flag_values)
    ncf_common.parse_ncf_flags(["ncf-main", "--config=tiny", f"--data_dir={out}.data",
                 f"--model_dir={model_dir}", "--train_epochs=1", "--seed=4",
                 "--mf_regularization=0.001", "--eval_ranking=both",
                 f"--distribution_strategy={strategy}",
                 f"--worker_hosts={hosts}", f"--task_index={index}"], flag_values)
    config = ncf_common.ncf_config_from_flags(flag_values)
    result = cycles.run(config)
    weights = result.runner.state.model.get_weights()
    np.savez(out, *weights, hr=result.summary["best_hr"],
             full_hr=result.summary["best_full_hr"], step=result.runner.global_step)
""")

# Two workers each sum half of every global batch's gradient and all-reduce; one device
# sums it whole. The float32 sums differ in order, by a few ulps a step, orders of
# magnitude below this tolerance; a per-replica loss or L2 normalisation moves the
# weights by far more than it.
_WEIGHT_TOLERANCE = 1e-5


@pytest.mark.integration
def test_two_workers_end_with_the_weights_of_one_device(tmp_path):
    """Splitting each global batch over replicas must not change the training step:
    the workers agree exactly, and with one device to `_WEIGHT_TOLERANCE`."""
    hosts = ",".join(f"127.0.0.1:{port}" for port in free_ports(2))
    env = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
    runs = {
        "worker0": ("multi_worker_mirrored", hosts, "0", "model"),
        "worker1": ("multi_worker_mirrored", hosts, "1", "model"),
        "single": ("one_device", "", "0", "single_model"),
    }
    processes = {}
    for name, (strategy, cluster, index, model_dir) in runs.items():
        # To a file, not a pipe: a worker blocked on a full pipe would stall the other.
        with open(tmp_path / f"{name}.log", "w") as log:
            processes[name] = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _RUN,
                    strategy,
                    cluster,
                    index,
                    str(tmp_path / model_dir),
                    str(tmp_path / f"{name}.npz"),
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    try:
        for name, process in processes.items():
            process.wait(timeout=600)
            log = (tmp_path / f"{name}.log").read_text()
            assert process.returncode == 0, f"{name}: {log[-3000:]}"
    finally:
        for process in processes.values():
            if process.poll() is None:  # its peer failed: it would wait for it forever
                process.kill()
                process.wait()
    chief, other, single = (np.load(tmp_path / f"{name}.npz") for name in runs)
    weight_keys = [key for key in chief.files if key.startswith("arr_")]
    assert len(weight_keys) >= 6
    for key in weight_keys:
        np.testing.assert_array_equal(chief[key], other[key])
        np.testing.assert_allclose(chief[key], single[key], rtol=0, atol=_WEIGHT_TOLERANCE)
    # 11,700 positives x 5 points / 2,048 per global step, split over the two workers.
    assert int(chief["step"]) == int(other["step"]) == int(single["step"]) == 29
    # Seed 4: 109 of the 300 users' held-out items in their top 10 on the CPUs this was
    # written on; another CPU's rounding may move a near-tie, a user or two. One device's
    # weights are a few ulps away, so it may differ by a near-tie too.
    assert float(chief["hr"]) == float(other["hr"])
    for hr in (chief["hr"], single["hr"]):
        assert abs(float(hr) * 300 - 109) <= 2
    # Every worker ranks the whole catalogue itself (each must call save_best): the same
    # model, the same ranks. Seed 4: 75 of the 300 users' held-out items in their top 10
    # of the whole catalogue on the same CPUs, with the same near-tie allowance.
    assert float(chief["full_hr"]) == float(other["full_hr"])
    for full_hr in (chief["full_hr"], single["full_hr"]):
        assert abs(float(full_hr) * 300 - 75) <= 2
    assert os.path.exists(tmp_path / "model" / "checkpoint")
    assert not [name for name in os.listdir(tmp_path / "model") if "worker_temp" in name]


@pytest.mark.integration
def test_thread_counts_are_set_before_tensorflow_starts_and_refused_after():
    script = textwrap.dedent("""
        import tensorflow as tf
        from official.core import distribution_utils
        distribution_utils.configure_threads(inter_op=2, intra_op=3)
        tf.constant(1.0) + 1.0  # TensorFlow starts with those pools
        threading = tf.config.threading
        print(threading.get_inter_op_parallelism_threads(),
              threading.get_intra_op_parallelism_threads())
        try:
            distribution_utils.configure_threads(inter_op=5, intra_op=3)
        except ValueError as error:
            print(error)
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == [
        "2 3",
        "--inter_op_parallelism_threads=5 came too late: TensorFlow already runs with 2 threads",
    ]


_ACCELERATOR_PATH = textwrap.dedent("""
    import json, sys
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    sys.path.insert(0, sys.argv[1])
    from conftest import TINY_PARAMS
    from official.core.runner import Runner
    from recommendation.producer import data_pipeline
    from recommendation.model import kernels, neumf_model

    def input_fn():  # 128 points: the 90 table rows are fewer than 2 x 64 per replica
        return data_pipeline.synthetic_train_input_fn(128, 50, 40, seed=3)

    if sys.argv[3] == "compiled":  # the XLA-compiled loops that large steps take
        kernels.COMPILE_MIN_ELEMENTS = 0

    def trained(strategy, **options):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            runner = Runner(neumf_model.model_fn, neumf_model.build_state, TINY_PARAMS,
                            sys.argv[2] + "/" + str(len(results)), strategy, steps_per_call=4,
                            **options)
        metrics = runner.train(input_fn, 8)
        return runner, metrics

    results = {}
    one = tf.distribute.OneDeviceStrategy("/cpu:0")
    two = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    for name, strategy, options in (("plain", one, {}), ("to_device", one,
            {"accelerator_input": True}), ("two_replicas", two, {"accelerator_input": True})):
        runner, metrics = trained(strategy, **options)
        fed = runner.distribute(input_fn)
        kind = "distributed" if isinstance(fed, tf.distribute.DistributedDataset) else "plain"
        weights = [w.numpy().ravel().tolist() for w in runner.state.model.weights]
        results[name] = {"loss": metrics["loss"], "points": metrics["num_points"],
                         "input": kind, "weights": weights}
    print(json.dumps(results))
""")


@pytest.mark.integration
@pytest.mark.parametrize("loops", ["op_by_op", "compiled"])
def test_the_accelerator_input_path_trains_what_the_plain_path_trains(tmp_path, loops):
    # The path accelerators take (distribute_datasets_from_function, fetched to the
    # device), forced on for CPU replicas: one replica, and two on two logical CPUs;
    # with the tiny model's loops run op by op, and compiled as large steps run them.
    tests = os.path.join(ROOT, "tests")
    result = subprocess.run(
        [sys.executable, "-c", _ACCELERATOR_PATH, tests, str(tmp_path), loops],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(result.stdout.splitlines()[-1])
    inputs = [runs[name]["input"] for name in ("plain", "to_device", "two_replicas")]
    assert inputs == ["plain", "distributed", "distributed"]
    assert runs["plain"]["points"] == runs["to_device"]["points"] == runs["two_replicas"]["points"]
    plain = runs["plain"]
    for name, tolerance in (("to_device", 0.0), ("two_replicas", 1e-6)):
        assert runs[name]["loss"] == pytest.approx(plain["loss"], rel=1e-6, abs=tolerance)
        for left, right in zip(plain["weights"], runs[name]["weights"], strict=True):
            np.testing.assert_allclose(left, right, rtol=0, atol=tolerance + 1e-7)
