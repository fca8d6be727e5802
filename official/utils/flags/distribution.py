"""Distribution flags: strategy, devices, TPUs and multi-worker clusters.

Rows set the config fields of the same names; each program's config holds the defaults.
"""

from official.utils.flags.core import NON_NEGATIVE_OR_UNSET, FlagSpec, Rule

STRATEGIES = ("off", "one_device", "mirrored", "multi_worker_mirrored", "tpu")

DISTRIBUTION_FLAGS = (
    FlagSpec(
        "distribution_strategy",
        "tf.distribute strategy; 'off' uses the default strategy.",
        short_name="ds",
        choices=STRATEGIES,
    ),
    FlagSpec(
        "num_gpus",
        "GPUs to use (default: all visible; 0 = CPU).",
        short_name="ng",
        checks=(NON_NEGATIVE_OR_UNSET,),
    ),
    FlagSpec("tpu", "TPU name or grpc:// address."),
    FlagSpec("tpu_zone", "GCE zone of the TPU (optional)."),
    FlagSpec("tpu_gcp_project", "GCP project of the TPU."),
    FlagSpec(
        "worker_hosts", "host:port of every worker, for multi-worker training without TF_CONFIG."
    ),
    FlagSpec("task_index", "This worker's index in --worker_hosts."),
    Rule(
        ("worker_hosts", "task_index"),
        lambda values: (
            not values["worker_hosts"] or 0 <= values["task_index"] < len(values["worker_hosts"])
        ),
        "--task_index must index into --worker_hosts (0 .. number of hosts - 1)",
    ),
    Rule(
        ("distribution_strategy", "tpu"),
        lambda values: values["distribution_strategy"] != "tpu" or bool(values["tpu"]),
        "--distribution_strategy=tpu needs --tpu (a TPU name or address)",
    ),
)
