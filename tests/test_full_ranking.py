"""Full-catalogue ranking metrics: hand-computed ranks, ties, exclusions, blocks, the
NeuMF scores they rank, and an ncf-main run that reports and selects on them."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import tensorflow as tf

from official.core.model_dir import ModelDirError
from recommendation.data import constants, preprocessing_cache
from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.evaluation import full_ranking
from recommendation.evaluation.full_ranking import FullRanking
from recommendation.model import hyperparams, network
from recommendation.training import cycles, reporting
from tests.conftest import tiny_ncf_config


def _ranks(scores, held_out, excluded) -> list[int]:
    excluded = np.array(excluded, dtype=np.int32).reshape(-1, 2)
    return (
        full_ranking.held_out_ranks(
            tf.constant(scores, tf.float32), tf.constant(held_out, tf.int32), tf.constant(excluded)
        )
        .numpy()
        .tolist()
    )


def test_the_held_out_item_loses_ties_and_excluded_items_never_count():
    scores = [[3, 5, 5, 1, 5], [3, 5, 5, 1, 5], [1, 2, 3, 4, 0], [0, 0, 0, 0, 0]]
    # Row 0: items 1 and 2 tie with item 4 (held out): rank 2; row 1: item 1 excluded.
    # Row 2: item 4 scores lowest of 5: rank 4, 3 with item 0 and item 3 excluded.
    assert _ranks(scores, [4, 4, 4, 2], [[1, 1], [2, 0], [2, 3]]) == [2, 1, 2, 4]
    # A held-out item scored NaN ranks last.
    assert _ranks([[0, float("nan"), 1]], [1], []) == [3]


def _data(validation: bool) -> PreprocessedData:
    """4 users, 6 items; user 1 also has its test item (4) among its training items."""
    return PreprocessedData(
        user_ids=np.arange(4),
        item_ids=np.arange(6),
        train_offsets=np.array([0, 2, 5, 6, 8]),
        train_items=np.array([0, 1, 2, 3, 4, 5, 1, 2], dtype=np.int32),
        eval_items=np.array([5, 4, 0, 3], dtype=np.int32),
        validation_items=np.array([2, 0, 1, 4], dtype=np.int32) if validation else None,
    )


def _excluded(ranking: FullRanking) -> list[list[int]]:
    offsets = ranking.excluded_offsets
    return [
        sorted(ranking.excluded_items[offsets[u] : offsets[u + 1]].tolist())
        for u in range(ranking.num_users)
    ]


def test_every_other_interaction_of_the_user_is_excluded():
    test = FullRanking.of(_data(validation=False))
    assert test.held_out.tolist() == [5, 4, 0, 3]
    assert _excluded(test) == [[0, 1], [2, 3], [5], [1, 2]]  # never the held-out item
    validated = _data(validation=True)
    # Ranking the validation item excludes the test item, and the reverse.
    assert _excluded(FullRanking.of(validated, constants.VALIDATION_SPLIT)) == [
        [0, 1, 5],
        [2, 3, 4],
        [0, 5],
        [1, 2, 3],
    ]
    assert _excluded(FullRanking.of(validated)) == [[0, 1, 2], [0, 2, 3], [1, 5], [1, 2, 4]]
    with pytest.raises(ValueError, match="the data holds no validation items"):
        FullRanking.of(_data(validation=False), constants.VALIDATION_SPLIT)


def _item_scores(table: np.ndarray):
    return lambda users: table[users]


def test_metrics_of_hand_computed_ranks():
    ranking = FullRanking.of(_data(validation=False))
    table = np.array(
        [
            [9, 9, 1, 2, 3, 8],  # item 5 first: 0 and 1 are excluded -> rank 0
            [0, 1, 9, 9, 5, 6],  # item 4: 5 beats it, 2 and 3 excluded -> rank 1
            [1, 2, 3, 4, 5, 0],  # item 0: 1, 2, 3, 4 beat it (5 excluded) -> rank 4
            [1, 9, 9, 0, 0, 0],  # item 3: 0, 4, 5 (tie) beat it -> rank 3
        ],
        dtype=np.float32,
    )
    ranked = ranking.rank(_item_scores(table), users_per_block=3, k=2)
    assert ranked.ranks.tolist() == [0, 1, 4, 3]
    metrics = ranked.metrics()
    assert metrics["hr"] == metrics["recall"] == 0.5
    assert metrics["ndcg"] == pytest.approx((1 + 1 / math.log2(3)) / 4, abs=1e-12)
    assert ranking.rank(_item_scores(table), 4, k=4).metrics()["hr"] == 0.75


def test_a_model_scoring_every_item_alike_hits_no_user():
    rng = np.random.default_rng(0)
    users, items = 30, 40
    counts = rng.integers(1, 10, users)
    data = PreprocessedData(
        user_ids=np.arange(users),
        item_ids=np.arange(items),
        train_offsets=np.concatenate([[0], np.cumsum(counts)]),
        train_items=np.concatenate([rng.choice(items - 1, c, replace=False) for c in counts]),
        eval_items=np.full(users, items - 1, dtype=np.int32),
    )
    ranking = FullRanking.of(data)
    ranked = ranking.rank(lambda block: np.full((len(block), items), 0.5), 7, k=10)
    # Every candidate ties with the held-out item and beats it: all but one's own.
    assert ranked.ranks.tolist() == (items - 1 - counts).tolist()
    assert ranked.metrics()["hr"] == 0.0 and ranked.metrics()["ndcg"] == 0.0


def test_blocks_of_users_give_the_ranks_of_one_block_and_of_a_plain_count():
    rng = np.random.default_rng(1)
    data = _data(validation=True)
    table = rng.integers(0, 3, (4, 6)).astype(np.float32)  # many ties
    ranking = FullRanking.of(data)
    expected = []
    excluded = _excluded(ranking)
    for user in range(4):
        held = data.eval_items[user]
        beats = [
            i
            for i in range(6)
            if i != held and i not in excluded[user] and table[user, i] >= table[user, held]
        ]
        expected.append(len(beats))
    for block in (1, 3, 4, 100):
        assert ranking.rank(_item_scores(table), block, k=2).ranks.tolist() == expected


@pytest.mark.parametrize("kind", ["neumf", "gmf", "mlp", "mf"])
def test_a_models_scores_of_every_item_are_its_scores_of_each_pair(kind):
    params = hyperparams.ModelParams(
        num_users=7,
        num_items=11,
        mf_dim=4,
        layers=(8, 6, 4),
        mlp_regularization=(0, 0, 0),
        model_kind=kind,
    )
    tf.keras.utils.set_random_seed(3)
    model = network.build_model(params)
    for weight in model.weights:  # biases too: none may be left out
        weight.assign(tf.random.normal(weight.shape, seed=1))
    scores = full_ranking.ModelScores(model)
    users = np.arange(7, dtype=np.int32)
    every = scores.for_evaluation()(users).numpy()
    pairs = {
        "user_id": tf.constant(np.repeat(users, 11)),
        "item_id": tf.constant(np.tile(np.arange(11, dtype=np.int32), 7)),
    }
    each = model(pairs, training=False).numpy().reshape(7, 11)
    np.testing.assert_allclose(every, each, rtol=1e-5, atol=1e-6)
    # The block keeps a (users, items, widest layer) float32 tensor within 256 MiB.
    assert scores.users_per_block(7) == 7
    assert full_ranking.users_per_block(26_744, 128, 138_493) == 19
    assert full_ranking.users_per_block(26_744, 1, 138_493) == 2_509
    assert full_ranking.users_per_block(10**9, 256, 5) == 1


def _run_config(root, ranking: str, **overrides):
    config = tiny_ncf_config(
        root, benchmark_log_dir=str(root / "bench"), train_epochs=2, eval_ranking=ranking
    )
    data = dataclasses.replace(config.data, eval_split=constants.VALIDATION_SPLIT)
    return dataclasses.replace(config, data=data, **overrides)


def _evaluations(root) -> list[dict]:
    with open(root / "bench" / "benchmark.jsonl") as log:
        return [r for r in map(json.loads, log) if r["kind"] == "evaluation"]


def _full_test_metrics(config, runner) -> dict:
    data = preprocessing_cache.load_or_build(config.data).data
    scores = full_ranking.ModelScores(runner.state.model)
    return FullRanking.of(data).rank(scores.for_evaluation(), 5, k=10).metrics()


def test_a_run_reports_and_tests_the_full_ranking_beside_the_sampled_one(tmp_path):
    config = _run_config(tmp_path, constants.BOTH_RANKINGS)
    result = cycles.run(config)
    summary = result.summary
    records = _evaluations(tmp_path)
    assert [r["epoch"] for r in records] == [0, 1]
    for record in records:
        assert record["full_hr"] == record["full_recall"] and 0 < record["full_hr"] < 1
        assert record["full_hr"] < record["hr"]  # 99 negatives are easier than every item
    # Selected on the sampled HR; the full metrics are the selected epoch's.
    best = max(records, key=lambda r: r["hr"])
    assert (summary["best_hr"], summary["best_full_hr"]) == (best["hr"], best["full_hr"])
    # The test's full metrics are those of the restored (selected) weights.
    recomputed = _full_test_metrics(config, result.runner)
    assert summary["test_full_hr"] == recomputed["hr"]
    assert summary["test_full_ndcg"] == recomputed["ndcg"]
    line = reporting.summary_line(summary, 10)
    assert (
        f"; test HR@10={summary['test_hr']:.4f} NDCG@10={summary['test_ndcg']:.4f}, "
        f"full-catalogue HR@10={summary['test_full_hr']:.4f} "
        f"NDCG@10={summary['test_full_ndcg']:.4f} Recall@10={summary['test_full_recall']:.4f}"
    ) in line
    # Its epochs were ranked both ways: a resume must rank them alike.
    resumed = dataclasses.replace(config, train_epochs=3, eval_ranking=constants.FULL_RANKING)
    with pytest.raises(ModelDirError, match="holds a run evaluated with --eval_ranking both"):
        cycles.run(resumed)


def test_a_run_ranking_the_whole_catalogue_only_selects_on_it(tmp_path):
    summary = cycles.run(_run_config(tmp_path, constants.FULL_RANKING)).summary
    records = _evaluations(tmp_path)
    assert all(r["hr"] == r["full_hr"] for r in records)
    best = max(records, key=lambda r: r["full_hr"])
    assert summary["best_epoch"] == best["epoch"] and summary["best_hr"] == best["full_hr"]
    line = reporting.summary_line(summary, 10)
    assert "validation full-catalogue HR@10=" in line and "; test full-catalogue" in line
