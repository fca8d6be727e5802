"""Mixed precision as both trainers use it: Keras policies by name, and the loss
scaling that float16 compute needs.

ncf-main names precisions as the Model Garden did (``--dtype fp32|bf16|fp16``);
RecModel by MindSpore's amp levels, which pick a policy per device. Both come to a
Keras dtype policy here and to one rule: float16 compute with float32 variables
(``mixed_float16``) trains with dynamic loss scaling, unless the step applies a fixed
scale itself.
"""

from __future__ import annotations

import keras
from absl import logging

from official.utils.misc import machine

# --dtype -> Keras policy: variables stay float32 in the mixed ones.
POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def warn_if_bf16_is_slow_here(policy: str | None, asked: str) -> str | None:
    """Logs (and returns) one warning when the setting `asked` (``--dtype bf16``,
    ``amp_level O2``) computes in bfloat16 (Keras `policy`) on this CPU without bf16
    matrix instructions: there every product converts to fp32, and bf16 trains slower
    than fp32 (docs/benchmarks.md, "oneDNN and bf16 on an AVX2 CPU"). None where there
    is nothing to say (fp32, bf16 instructions present, or no x86 flags to read)."""
    if "bfloat16" not in (policy or ""):
        return None
    isa = machine.describe_cpu().isa
    if set(isa.split()) & set(machine.BF16_CPU_FLAGS) or isa in ("unknown", "none"):
        return None
    warning = (
        f"{asked} computes in bf16 on a CPU without bf16 matrix instructions (none of "
        f"{', '.join(machine.BF16_CPU_FLAGS)} in its flags): expect it slower than fp32 "
        "(docs/benchmarks.md, 'oneDNN and bf16 on an AVX2 CPU'); use fp32 here"
    )
    logging.warning(warning)
    return warning


def with_loss_scaling(
    optimizer: keras.optimizers.Optimizer, policy: str, fixed_scale: float | None = None
) -> keras.optimizers.Optimizer:
    """`optimizer`, wrapped in dynamic loss scaling when `policy` is ``mixed_float16``
    and no `fixed_scale` is given; as it is otherwise."""
    if policy == POLICIES["fp16"] and fixed_scale is None:
        return keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer
