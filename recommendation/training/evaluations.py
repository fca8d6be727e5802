"""The evaluations of an ``ncf-main`` run, as --eval_ranking asks: HR@k and NDCG@k
against the producer's sampled negatives (the MLPerf and NCF protocol), over the whole
catalogue (`full_ranking`), or both.

Every evaluation returns ``hr`` and ``ndcg``, the metrics the run stops and selects on:
the sampled ones unless only the full ranking is computed. The full ranking's are
``full_hr``, ``full_ndcg`` and ``full_recall``.
"""

from __future__ import annotations

from official.core.runner import Runner
from official.utils.logs.mlperf_helper import MlperfLogger
from recommendation.data import constants
from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.evaluation import full_ranking
from recommendation.producer import data_pipeline


def metric_names(ranking: str) -> tuple[str, ...]:
    """The keys of an evaluation's metrics with `ranking`: ``hr``, ``ndcg`` and, when
    the full ranking is computed, ``full_hr``, ``full_ndcg``, ``full_recall``."""
    full = () if ranking == constants.SAMPLED_RANKING else full_ranking.METRICS
    return ("hr", "ndcg", *(f"full_{name}" for name in full))


def metrics_text(evaluation: dict, top_k: int, ranking: str) -> str:
    """``HR@10=0.7000 NDCG@10=0.4000``, then the full ranking's when computed."""
    parts = []
    if ranking != constants.FULL_RANKING:
        parts.append(f"HR@{top_k}={evaluation['hr']:.4f} NDCG@{top_k}={evaluation['ndcg']:.4f}")
    if ranking != constants.SAMPLED_RANKING:
        parts.append(
            f"full-catalogue HR@{top_k}={evaluation['full_hr']:.4f} "
            f"NDCG@{top_k}={evaluation['full_ndcg']:.4f} "
            f"Recall@{top_k}={evaluation['full_recall']:.4f}"
        )
    return ", ".join(parts)


class Evaluations:
    """Evaluates the runner's model on a split as --eval_ranking asks.

    Args:
        runner: Whose model is evaluated (all tasks evaluate: selection saves on all).
        data: The preprocessed data (the full ranking's held-out and excluded items).
        producer: Where the sampled evaluation sets come from.
        ranking: One of `constants.EVAL_RANKINGS`.
        mlperf: The compliance log (eval_start, eval_accuracy, eval_stop).
    """

    def __init__(
        self,
        runner: Runner,
        data: PreprocessedData,
        producer: data_pipeline.ProducerHandle,
        ranking: str,
        mlperf: MlperfLogger,
    ) -> None:
        self.runner = runner
        self.data = data
        self.producer = producer
        self.ranking = ranking
        self.mlperf = mlperf
        self._rankings: dict[str, full_ranking.FullRanking] = {}
        self._scores = full_ranking.ModelScores(runner.state.model)

    def evaluate(self, split: str, epoch: int) -> dict:
        """The metrics of the model as it is, logged as the evaluation after `epoch`."""
        self.mlperf.event("eval_start", epoch_num=epoch)
        evaluation: dict = {"seconds": 0.0}
        if self.ranking != constants.FULL_RANKING:
            info = self.producer.eval_data(split)
            evaluation = self.runner.evaluate(
                lambda: data_pipeline.eval_input_fn(info), info.num_batches
            )
        if self.ranking != constants.SAMPLED_RANKING:
            ranked = self._full(split)
            evaluation["seconds"] += ranked.seconds
            evaluation.update(ranked.full_metrics())
            if self.ranking == constants.FULL_RANKING:
                evaluation.update(hr=evaluation["full_hr"], ndcg=evaluation["full_ndcg"])
        self.mlperf.event("eval_accuracy", evaluation["hr"], epoch_num=epoch)
        self.mlperf.event("eval_stop", epoch_num=epoch)
        return evaluation

    def _full(self, split: str) -> full_ranking.RankedUsers:
        if split not in self._rankings:
            self._rankings[split] = full_ranking.FullRanking.of(self.data, split)
        ranking = self._rankings[split]
        return ranking.rank(
            self._scores.for_evaluation(),
            self._scores.users_per_block(ranking.num_users),
            self.runner.params.top_k,
        )
