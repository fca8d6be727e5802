"""The metrics RecModel's `eval` reports, by name or as Keras metric objects; HR@k and
NDCG@k of score blocks (`BlockMetric`) with the offline trainer's arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import keras

from recommendation.model import neumf_model


@keras.saving.register_keras_serializable(package="ncf")
class BlockMetric(keras.metrics.Mean):
    """Mean HR@k or NDCG@k over `(users, block)` score blocks, held-out item last.

    Labels are ignored: the block layout says which item is the positive one.
    """

    def __init__(self, kind: str = "hit_rate", k: int = 10, name: str | None = None, **kwargs):
        super().__init__(name=name or kind, **kwargs)
        self.kind, self.k = kind, k

    def update_state(self, y_true, y_pred, sample_weight=None):
        hits, gains = neumf_model.compute_hr_ndcg(y_pred, None, self.k)
        return super().update_state(hits if self.kind == "hit_rate" else gains, sample_weight)

    def get_config(self) -> dict:
        return {**super().get_config(), "kind": self.kind, "k": self.k}


_METRICS: dict[str, Callable[[], keras.metrics.Metric]] = {
    "accuracy": lambda: keras.metrics.BinaryAccuracy(name="accuracy"),
    "auc": lambda: keras.metrics.AUC(name="auc"),
    "precision": lambda: keras.metrics.Precision(name="precision"),
    "recall": lambda: keras.metrics.Recall(name="recall"),
    "loss": lambda: keras.metrics.Mean(name="loss"),
    "hit_rate": lambda: BlockMetric("hit_rate"),
    "ndcg": lambda: BlockMetric("ndcg"),
}


def build_metrics(metrics: dict | Iterable | None) -> dict[str, keras.metrics.Metric]:
    """`metrics` (names or objects, as a set, list or dict) as metric objects by name,
    built once so that `eval` updates the same ones."""
    if metrics is None:
        return {}
    items = metrics.items() if isinstance(metrics, dict) else ((None, m) for m in metrics)
    built = {}
    for key, metric in items:
        if isinstance(metric, str):
            if metric not in _METRICS:
                raise ValueError(f"unknown metric {metric!r}; known: {sorted(_METRICS)}")
            metric = _METRICS[metric]()
        built[key or metric.name] = metric
    return built
