"""One split's evaluation protocol for any model that scores every item: the sampled
ranking (the producer's evaluation blocks, ranked by NeuMF's own `compute_hr_ndcg`) and
the full ranking (`full_ranking`), both from one scoring pass, kept per user so that two
models can be compared user by user (`paired`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np
import tensorflow as tf

from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.evaluation.full_ranking import FullRanking, RankedUsers, ScoreUsers
from recommendation.model.neumf_model import compute_hr_ndcg
from recommendation.producer import negative_sampling


@dataclasses.dataclass(frozen=True)
class UserResults:
    """A model's per-user results on one split.

    Attributes:
        sampled_hits, sampled_ndcgs: `(num_users,)` HR@k and NDCG@k against the
            sampled negatives.
        full: The full ranking's per-user ranks (its seconds: the whole evaluation's).
    """

    sampled_hits: np.ndarray
    sampled_ndcgs: np.ndarray
    full: RankedUsers

    def metrics(self) -> dict[str, float]:
        """``hr``, ``ndcg`` (sampled) and ``full_hr``, ``full_ndcg``, ``full_recall``."""
        return {
            "hr": float(self.sampled_hits.mean()),
            "ndcg": float(self.sampled_ndcgs.mean()),
            **self.full.full_metrics(),
        }


class SplitProtocol:
    """The evaluation of `split` as ncf-main runs it: the same sampled blocks (the
    producer's `negative_sampling.eval_blocks`, same seed and negatives; the NCF
    split's fixed negatives for its test set) and the same full ranking.

    Args:
        data: The preprocessed data the model trained on.
        split: `constants.TEST_SPLIT` or `constants.VALIDATION_SPLIT`.
        num_eval_negatives: Sampled negatives per user (unused with fixed ones).
        seed: The run's --seed (the sampled negatives' stream).
        k: The cut-off.
    """

    def __init__(
        self,
        data: PreprocessedData,
        split: str,
        num_eval_negatives: int,
        seed: int,
        k: int = 10,
    ) -> None:
        with concurrent.futures.ThreadPoolExecutor() as pool:
            self.blocks = negative_sampling.eval_blocks(data, num_eval_negatives, seed, pool, split)
        self.full = FullRanking.of(data, split)
        self.k = k
        self.split = split

    def evaluate(self, score_users: ScoreUsers, users_per_block: int) -> UserResults:
        """Every user's results with the model `score_users` (users -> `(block,
        num_items)` scores)."""
        num_users = self.full.num_users
        hits = np.zeros(num_users)
        ndcgs = np.zeros(num_users)

        def scored_both_ways(users: np.ndarray):
            scores = tf.convert_to_tensor(score_users(users), dtype=tf.float32)
            blocks = tf.gather(scores, self.blocks.items[users], axis=1, batch_dims=1)
            hit, ndcg = compute_hr_ndcg(
                blocks, tf.constant(self.blocks.duplicate_mask[users]), self.k
            )
            hits[users], ndcgs[users] = hit.numpy(), ndcg.numpy()
            return scores

        return UserResults(hits, ndcgs, self.full.rank(scored_both_ways, users_per_block, self.k))
