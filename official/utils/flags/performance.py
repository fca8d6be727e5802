"""Performance flags: precision, XLA, threading and synthetic input."""

from absl import flags

from official.utils.flags import core

DTYPES = ("fp32", "bf16", "fp16")


def define_performance(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines --dtype --loss_scale --enable_xla --use_synthetic_data and thread counts."""
    flags.DEFINE_enum(
        "dtype",
        "fp32",
        list(DTYPES),
        "Compute precision: fp32, bf16 (mixed) or fp16 (mixed, loss scaled).",
        short_name="dt",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "loss_scale",
        "dynamic",
        "fp16 loss scale: 'dynamic' or a positive number.",
        short_name="ls",
        flag_values=flag_values,
    )
    flags.DEFINE_boolean(
        "enable_xla",
        False,
        "Compile the training step with XLA.",
        short_name="xla",
        flag_values=flag_values,
    )
    flags.DEFINE_boolean(
        "use_synthetic_data",
        False,
        "Feed random batches instead of real data (pure throughput).",
        short_name="synth",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "inter_op_parallelism_threads",
        0,
        "TensorFlow inter-op threads (0: let TensorFlow decide).",
        short_name="inter",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "intra_op_parallelism_threads",
        0,
        "TensorFlow intra-op threads (0: let TensorFlow decide).",
        short_name="intra",
        flag_values=flag_values,
    )
    core.require_non_negative("inter_op_parallelism_threads", flag_values=flag_values)
    core.require_non_negative("intra_op_parallelism_threads", flag_values=flag_values)
    flags.register_validator(
        "loss_scale",
        _valid_loss_scale,
        message="--loss_scale must be 'dynamic' or a positive number",
        flag_values=flag_values,
    )


def _valid_loss_scale(value: str) -> bool:
    if value == "dynamic":
        return True
    try:
        return float(value) > 0
    except ValueError:
        return False
