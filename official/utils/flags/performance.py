"""Performance flags: precision, XLA, threading and synthetic input.

Rows set the config fields of the same names; each program's config holds the defaults.
"""

from __future__ import annotations

from official.utils.flags.core import NON_NEGATIVE, Check, FlagSpec

DTYPES = ("fp32", "bf16", "fp16")


def loss_scale_from_flag(value: str) -> float | None:
    """The fixed loss scale --loss_scale asks for, or None for dynamic scaling."""
    return None if value == "dynamic" else float(value)


def _positive_number(value: str) -> bool:
    try:
        return float(value) > 0
    except ValueError:
        return False


# TensorFlow's thread pools (ncf-online takes these alone).
THREAD_FLAGS = (
    FlagSpec(
        "inter_op_parallelism_threads",
        "Threads running independent TensorFlow ops side by side (0: TensorFlow decides).",
        short_name="inter",
        checks=(NON_NEGATIVE,),
    ),
    FlagSpec(
        "intra_op_parallelism_threads",
        "Threads inside one TensorFlow op, e.g. a matmul (0: TensorFlow decides).",
        short_name="intra",
        checks=(NON_NEGATIVE,),
    ),
)

PERFORMANCE_FLAGS = (
    FlagSpec(
        "dtype",
        "Compute precision: fp32, bf16 (mixed) or fp16 (mixed, loss scaled).",
        short_name="dt",
        choices=DTYPES,
    ),
    # A float field (None: dynamic) read from a text flag.
    FlagSpec(
        "loss_scale",
        "Loss scale of --dtype fp16: 'dynamic' (grows and shrinks; skips steps whose "
        "gradients overflow) or a fixed positive number (the same every step, no skipping).",
        short_name="ls",
        checks=(
            Check(
                lambda value: value == "dynamic" or _positive_number(value),
                "--loss_scale must be 'dynamic' or a positive number",
            ),
        ),
        kind=str,
        parse=loss_scale_from_flag,
        format=lambda scale: "dynamic" if scale is None else str(scale),
    ),
    FlagSpec("enable_xla", "Compile the training step with XLA.", short_name="xla"),
    FlagSpec(
        "use_synthetic_data",
        "Feed random batches instead of real data (pure throughput).",
        short_name="synth",
    ),
    *THREAD_FLAGS,
)
# --loss_scale needs --dtype fp16: the rule is the model's (a config the flags set checks
# it, and its table turns it into a flag rule: `core.flag_rules`).
