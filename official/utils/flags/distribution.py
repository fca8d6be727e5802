"""Distribution flags: strategy, devices, TPUs and multi-worker clusters."""

from absl import flags

from official.utils.flags import core

STRATEGIES = ("off", "one_device", "mirrored", "multi_worker_mirrored", "tpu")


def define_distribution(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines --distribution_strategy --num_gpus --tpu --worker_hosts --task_index."""
    flags.DEFINE_enum(
        "distribution_strategy",
        "one_device",
        list(STRATEGIES),
        "tf.distribute strategy; 'off' uses the default strategy.",
        short_name="ds",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "num_gpus",
        None,
        "GPUs to use (default: all visible; 0 = CPU).",
        short_name="ng",
        flag_values=flag_values,
    )
    flags.DEFINE_string("tpu", None, "TPU name or grpc:// address.", flag_values=flag_values)
    flags.DEFINE_string(
        "tpu_zone", None, "GCE zone of the TPU (optional).", flag_values=flag_values
    )
    flags.DEFINE_string("tpu_gcp_project", None, "GCP project of the TPU.", flag_values=flag_values)
    flags.DEFINE_list(
        "worker_hosts",
        None,
        "host:port of every worker, for multi-worker training without TF_CONFIG.",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "task_index", -1, "This worker's index in --worker_hosts.", flag_values=flag_values
    )
    core.require_non_negative("num_gpus", allow_none=True, flag_values=flag_values)
    flags.register_multi_flags_validator(
        ["worker_hosts", "task_index"],
        lambda values: (
            not values["worker_hosts"] or 0 <= values["task_index"] < len(values["worker_hosts"])
        ),
        message="--task_index must index into --worker_hosts (0 .. number of hosts - 1)",
        flag_values=flag_values,
    )
    flags.register_multi_flags_validator(
        ["distribution_strategy", "tpu"],
        lambda values: values["distribution_strategy"] != "tpu" or bool(values["tpu"]),
        message="--distribution_strategy=tpu needs --tpu (a TPU name or address)",
        flag_values=flag_values,
    )
