"""Multi-worker training: two processes on loopback (MultiWorkerMirroredStrategy, CPU)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WORKER = textwrap.dedent("""
    import sys
    import numpy as np
    from recommendation import ncf_main, synthetic_data
    from recommendation.data_preprocessing import DataConfig
    from recommendation.ncf_common import NcfConfig
    from recommendation.neumf_model import ModelParams

    hosts, index, work, out = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    spec = synthetic_data.SyntheticSpec(num_users=200, num_items=150, num_ratings=8000)
    config = NcfConfig(
        data=DataConfig(dataset="synthetic", data_dir=f"{work}/data{index}", synthetic=spec),
        model_dir=f"{work}/model", train_epochs=1, batch_size=1024, num_eval_negatives=49,
        seed=4, distribution_strategy="multi_worker_mirrored", worker_hosts=tuple(hosts),
        task_index=index,
        model=ModelParams(num_users=0, num_items=0, mf_dim=4, layers=(8, 4),
                          mlp_regularization=(0.0, 0.0)))
    result = ncf_main.run(config)
    weights = result.runner.state.model.get_weights()
    np.savez(out, *weights, hr=result.summary["best_hr"], step=result.runner.global_step)
""")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def test_two_workers_end_with_identical_weights(tmp_path):
    hosts = ",".join(f"127.0.0.1:{port}" for port in _free_ports(2))
    env = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WORKER,
                hosts,
                str(index),
                str(tmp_path),
                str(tmp_path / f"worker{index}.npz"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for index in range(2)
    ]
    outputs = [worker.communicate(timeout=600)[0] for worker in workers]
    for worker, output in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, output[-3000:]
    chief, other = (np.load(tmp_path / f"worker{index}.npz") for index in range(2))
    weight_keys = [key for key in chief.files if key.startswith("arr_")]
    assert len(weight_keys) >= 6
    for key in weight_keys:
        np.testing.assert_array_equal(chief[key], other[key])
    # 7,800 positives x 5 points / 1,024 per global step, split over the two workers.
    assert int(chief["step"]) == int(other["step"]) == 39
    assert float(chief["hr"]) == float(other["hr"]) > 0
    assert os.path.exists(tmp_path / "model" / "checkpoint")
    assert not [name for name in os.listdir(tmp_path / "model") if "worker_temp" in name]
