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

# --dtype -> Keras policy: variables stay float32 in the mixed ones.
POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def with_loss_scaling(
    optimizer: keras.optimizers.Optimizer, policy: str, fixed_scale: float | None = None
) -> keras.optimizers.Optimizer:
    """`optimizer`, wrapped in dynamic loss scaling when `policy` is ``mixed_float16``
    and no `fixed_scale` is given; as it is otherwise."""
    if policy == POLICIES["fp16"] and fixed_scale is None:
        return keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer
