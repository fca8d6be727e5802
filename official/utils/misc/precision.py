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

from official.utils.misc import machine

# --dtype -> Keras policy: variables stay float32 in the mixed ones.
POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def cpu_bf16_warning(policy: str | None, isa: str, asked: str) -> str | None:
    """What to tell a user whose setting `asked` (``--dtype bf16``, ``amp_level O2``)
    computes in bfloat16 (Keras `policy`) on a CPU with the vector flags `isa`
    (`machine.describe_cpu`): without bf16 matrix instructions every product converts
    to fp32, and bf16 trained at 0.73-0.96x fp32's rate on an AVX2 AMD EPYC
    (docs/benchmarks.md). None where there is nothing to say."""
    flags = set(isa.split())
    if "bfloat16" not in (policy or "") or flags & set(machine.BF16_CPU_FLAGS):
        return None
    if isa in ("unknown", "none"):  # no x86 flags to read: say nothing
        return None
    return (
        f"{asked} computes in bf16 on a CPU without bf16 matrix instructions (none of "
        f"{', '.join(machine.BF16_CPU_FLAGS)} in its flags): expect it slower than fp32 "
        "(0.73-0.96x measured on an AVX2 CPU); use fp32 here"
    )


def with_loss_scaling(
    optimizer: keras.optimizers.Optimizer, policy: str, fixed_scale: float | None = None
) -> keras.optimizers.Optimizer:
    """`optimizer`, wrapped in dynamic loss scaling when `policy` is ``mixed_float16``
    and no `fixed_scale` is given; as it is otherwise."""
    if policy == POLICIES["fp16"] and fixed_scale is None:
        return keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer
