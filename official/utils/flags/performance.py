"""Performance flags: precision, XLA, threading and synthetic input."""

from __future__ import annotations

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
        "Loss scale of --dtype fp16: 'dynamic' (grows and shrinks; skips steps whose "
        "gradients overflow) or a fixed positive number (the same every step, no skipping).",
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
        "Threads running independent TensorFlow ops side by side (0: TensorFlow decides).",
        short_name="inter",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "intra_op_parallelism_threads",
        0,
        "Threads inside one TensorFlow op, e.g. a matmul (0: TensorFlow decides).",
        short_name="intra",
        flag_values=flag_values,
    )
    core.require_non_negative("inter_op_parallelism_threads", flag_values=flag_values)
    core.require_non_negative("intra_op_parallelism_threads", flag_values=flag_values)
    flags.register_validator(
        "loss_scale",
        lambda value: value == "dynamic" or _positive_number(value),
        message="--loss_scale must be 'dynamic' or a positive number",
        flag_values=flag_values,
    )
    flags.register_multi_flags_validator(
        ["loss_scale", "dtype"],
        lambda values: values["loss_scale"] == "dynamic" or values["dtype"] == "fp16",
        message="--loss_scale scales float16 gradients: it needs --dtype fp16",
        flag_values=flag_values,
    )


def loss_scale_from_flag(value: str) -> float | None:
    """The fixed loss scale --loss_scale asks for, or None for dynamic scaling."""
    return None if value == "dynamic" else float(value)


def _positive_number(value: str) -> bool:
    try:
        return float(value) > 0
    except ValueError:
        return False
