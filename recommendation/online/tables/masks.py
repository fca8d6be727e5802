"""The hash tables' mask selections, in few graph ops.

``tf.boolean_mask`` builds shape arithmetic for masks of any rank along any axis, tens
of ops per call, and the hash tables' step applies 1-D masks along the first axis
dozens of times. Tracing a step, optimising its graph and instantiating it cost in
proportion to its ops, at every trainer start: `keep` selects the same entries with a
``where`` and a gather per tensor.
"""

from __future__ import annotations

import tensorflow as tf


def positions(mask: tf.Tensor) -> tf.Tensor:
    """Indices `(n,)` (int64) where the 1-D `mask` holds, in order."""
    return tf.squeeze(tf.where(mask), axis=1)


def keep(mask: tf.Tensor, *tensors: tf.Tensor) -> tf.Tensor | tuple[tf.Tensor, ...]:
    """``tf.boolean_mask(tensor, mask)`` of each of `tensors` for a 1-D `mask` over
    their first axis: the tensor itself when one is given, else a tuple."""
    where = positions(mask)
    kept = tuple(tf.gather(tensor, where) for tensor in tensors)
    return kept[0] if len(kept) == 1 else kept
