"""tf.distribute strategies from the Model Garden's flags.

``--distribution_strategy off|one_device|mirrored|multi_worker_mirrored|tpu`` with
``--num_gpus``, ``--tpu`` and, for several workers, ``TF_CONFIG`` or ``--worker_hosts``
plus ``--task_index`` (turned into ``TF_CONFIG`` here).
"""

from __future__ import annotations

import json
import os

import tensorflow as tf


def configure_cluster(worker_hosts: list[str] | None, task_index: int) -> int:
    """Writes ``TF_CONFIG`` for `worker_hosts` (if given); returns the number of workers."""
    if worker_hosts:
        os.environ["TF_CONFIG"] = json.dumps(
            {
                "cluster": {"worker": list(worker_hosts)},
                "task": {"type": "worker", "index": task_index},
            }
        )
        return len(worker_hosts)
    config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    return len(config.get("cluster", {}).get("worker", [])) or 1


def configure_threads(inter_op: int, intra_op: int) -> None:
    """Sets TensorFlow's thread pools (0 leaves TensorFlow's choice).

    They can only be set before TensorFlow runs its first op; asking for other counts
    after that is an error rather than a silent no-op.

    Raises:
        ValueError: TensorFlow has started with other counts.
    """
    threading = tf.config.threading
    for name, wanted, get, set_count in (
        (
            "inter",
            inter_op,
            threading.get_inter_op_parallelism_threads,
            threading.set_inter_op_parallelism_threads,
        ),
        (
            "intra",
            intra_op,
            threading.get_intra_op_parallelism_threads,
            threading.set_intra_op_parallelism_threads,
        ),
    ):
        if not wanted or get() == wanted:
            continue
        try:
            set_count(wanted)
        except RuntimeError:
            raise ValueError(
                f"--{name}_op_parallelism_threads={wanted} came too late: TensorFlow "
                f"already runs with {get() or 'its own choice of'} threads"
            ) from None


def get_distribution_strategy(
    distribution_strategy: str = "one_device",
    num_gpus: int | None = None,
    tpu_address: str | None = None,
    tpu_zone: str | None = None,
    tpu_project: str | None = None,
) -> tf.distribute.Strategy:
    """Returns the strategy the flags describe.

    Args:
        distribution_strategy: ``off`` (default strategy), ``one_device``,
            ``mirrored``, ``multi_worker_mirrored`` or ``tpu``.
        num_gpus: GPUs to use; None means all visible, 0 the CPU.
        tpu_address: TPU name or ``grpc://`` address for ``tpu``.
        tpu_zone, tpu_project: Where a TPU named by `tpu_address` lives (None: the
            resolver looks them up from the GCE metadata).

    Raises:
        ValueError: an unknown strategy, or more GPUs asked for than exist.
    """
    available = len(tf.config.list_physical_devices("GPU"))
    if num_gpus is None:
        num_gpus = available
    if num_gpus > available:
        raise ValueError(f"--num_gpus={num_gpus} but only {available} GPU(s) are visible")
    if distribution_strategy == "off":
        return tf.distribute.get_strategy()
    if distribution_strategy == "one_device":
        return tf.distribute.OneDeviceStrategy("/gpu:0" if num_gpus else "/cpu:0")
    if distribution_strategy == "mirrored":
        devices = [f"/gpu:{index}" for index in range(num_gpus)] or ["/cpu:0"]
        return tf.distribute.MirroredStrategy(devices)
    if distribution_strategy == "multi_worker_mirrored":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if distribution_strategy == "tpu":
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
            tpu=tpu_address, zone=tpu_zone, project=tpu_project
        )
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    raise ValueError(f"unknown --distribution_strategy {distribution_strategy!r}")


def device_types(strategy: tf.distribute.Strategy) -> set[str]:
    """The kinds of device the strategy's replicas run on (``{"CPU"}``, ``{"GPU"}``...)."""
    if strategy is tf.distribute.get_strategy():  # the default: where ops land
        return {"GPU"} if tf.config.list_logical_devices("GPU") else {"CPU"}
    return {
        tf.DeviceSpec.from_string(device).device_type for device in strategy.extended.worker_devices
    }


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this worker writes checkpoints, summaries and logs."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    return resolver.task_type in ("chief", None) or (
        resolver.task_type == "worker"
        and resolver.task_id == 0
        and "chief" not in resolver.cluster_spec().as_dict()
    )
