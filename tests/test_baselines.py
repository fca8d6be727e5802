"""The baselines (hand-computed models), their search, the evaluation protocol they
share with ncf-main, the paired comparison, and the baselines suite on small data."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp
from conftest import SCRIPTS_DIR, tiny_ncf_config, write_movielens

from recommendation.baselines import models, search
from recommendation.data import constants
from recommendation.evaluation import paired
from recommendation.evaluation.full_ranking import ModelScores
from recommendation.evaluation.protocol import SplitProtocol
from recommendation.training import cycles

# 3 users x 4 items: user 0 has items 0, 1; user 1 items 0, 1, 2; user 2 items 2, 3.
_X = sp.csr_matrix(np.array([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 1, 1]], dtype=np.float32))


def test_item_pop_scores_each_item_by_its_training_count():
    scores = models.ItemPop().fit(_X).scores(np.array([0, 2]))
    assert scores.tolist() == [[2, 2, 2, 1], [2, 2, 2, 1]]


def test_item_knn_scores_by_shrunk_cosine_of_the_kept_neighbours():
    # Co-counts: items 0-1: 2 users, 0-2, 1-2 and 2-3: 1; counts 2, 2, 2, 1. With shrink
    # 1: sim(0, 1) = 2 / (2 + 1), sim(0, 2) = sim(1, 2) = 1 / 3, sim(2, 3) = 1 / (1.414 + 1).
    knn = models.ItemKNN(neighbours=1, shrink=1.0).fit(_X)
    # Each item j keeps its most similar item i (column j): 0 <- 1, 1 <- 0, 2 <- 3, 3 <- 2.
    expected = np.zeros((4, 4))
    expected[1, 0] = expected[0, 1] = 2 / 3
    expected[3, 2] = expected[2, 3] = 1 / (np.sqrt(2.0) + 1)
    np.testing.assert_allclose(knn.similarity, expected, rtol=1e-6)
    # User 0 (items 0, 1) scores item 0 by sim(1, 0), item 1 by sim(0, 1), 2 and 3 by 0.
    np.testing.assert_allclose(knn.scores(np.array([0])), [[2 / 3, 2 / 3, 0, 0]], rtol=1e-6)
    # Every neighbour kept: item 2 gets sim(0, 2) + sim(1, 2) from user 0.
    every = models.ItemKNN(neighbours=4, shrink=1.0).fit(_X)
    np.testing.assert_allclose(every.scores(np.array([0]))[0, 2], 2 / 3, rtol=1e-6)


def test_ease_solves_each_items_ridge_regression_without_itself():
    rng = np.random.default_rng(0)
    x = (rng.random((30, 6)) < 0.4).astype(np.float32)
    l2 = 2.5
    weights = models.Ease(l2).fit(sp.csr_matrix(x)).weights
    for j in range(6):
        others = [i for i in range(6) if i != j]
        a = x[:, others]
        column = np.linalg.solve(a.T @ a + l2 * np.eye(5), a.T @ x[:, j])
        np.testing.assert_allclose(weights[others, j], column, rtol=1e-4, atol=1e-6)
        assert weights[j, j] == 0


def _two_groups(users: int = 40, items: int = 20) -> sp.csr_matrix:
    """Users 0..19 like items 0..9, the others items 10..19; each has 6 of them."""
    rng = np.random.default_rng(1)
    rows = np.zeros((users, items), dtype=np.float32)
    for user in range(users):
        group = 0 if user < users // 2 else items // 2
        rows[user, group + rng.choice(items // 2, 6, replace=False)] = 1
    return sp.csr_matrix(rows)


def test_ials_ranks_the_unseen_items_of_the_users_group_first():
    x = _two_groups()
    scores = (
        models.Ials(factors=2, l2=0.1, alpha=5.0, iterations=15, seed=3)
        .fit(x)
        .scores(np.arange(40))
    )
    for user in range(40):
        own = range(0, 10) if user < 20 else range(10, 20)
        unseen_own = [i for i in own if not x[user, i]]
        other = [i for i in range(20) if i not in own]
        assert scores[user, unseen_own].min() > scores[user, other].max()
    again = models.Ials(2, 0.1, 5.0, 15, seed=3).fit(x).scores(np.arange(40))
    np.testing.assert_array_equal(scores, again)


def test_ials_weighs_an_observed_pair_by_one_plus_alpha():
    """Hu et al.'s confidence: the fitted item factors solve the last half-step's
    weighted ridge regression with weight 1 + alpha on observed pairs, 1 elsewhere."""
    x, l2, alpha = _two_groups(), 0.5, 3.0
    model = models.Ials(factors=3, l2=l2, alpha=alpha, iterations=60, seed=2).fit(x).model
    users = model.user_factors
    for item in range(x.shape[1]):
        liked = x[:, item].toarray().ravel()
        weights = np.where(liked > 0, 1 + alpha, 1.0)
        solved = np.linalg.solve(
            (users.T * weights) @ users + l2 * np.eye(3), (users.T * weights) @ liked
        )
        np.testing.assert_allclose(model.item_factors[item], solved, atol=1e-5)


def test_the_search_draws_the_budget_reproducibly_within_each_space():
    for name in ("itemknn", "ease", "ials"):
        baseline = search.BASELINES[name]
        drawn = search.configurations(baseline, 35, seed=1)
        assert drawn == search.configurations(baseline, 35, seed=1)
        assert drawn != search.configurations(baseline, 35, seed=2)
        assert len(drawn) == 35  # continuous spaces: no repeats
    knn = search.configurations(search.BASELINES["itemknn"], 35, 1)
    assert all(5 <= c["neighbours"] <= 1000 and 0 <= c["shrink"] <= 1000 for c in knn)
    assert all(1 <= c["l2"] <= 1e7 for c in search.configurations(search.BASELINES["ease"], 35, 1))
    assert search.configurations(search.BASELINES["itempop"], 35, 1) == [{}]
    first, second = (search.Trial({"l2": v}, {"hr": 0.5}, 0.0) for v in (1.0, 2.0))
    assert search.chosen([first, second]).config == {"l2": 1.0}  # the first on ties


def test_paired_comparison_of_hand_made_hits():
    a = np.array([1, 1, 1, 0, 1, 0] * 20, dtype=float)
    b = np.array([0, 0, 1, 0, 1, 1] * 20, dtype=float)
    comparison = paired.compare(a, b, resamples=2000, seed=4)
    # A alone hits 2 users in 6, B alone 1: difference 1/6; McNemar on 40 vs 20.
    assert comparison.difference == pytest.approx(1 / 6)
    assert (comparison.only_a, comparison.only_b) == (40, 20)
    assert comparison.p_value == pytest.approx(0.013, abs=0.0005)  # binomtest(40, 60)
    assert comparison.low < 1 / 6 < comparison.high and comparison.low > 0
    assert comparison == paired.compare(a, b, resamples=2000, seed=4)
    assert paired.compare(a, a) == paired.PairedComparison(0.0, 0.0, 0.0, 0, 0, 1.0)
    with pytest.raises(ValueError, match="paired hits need the same users"):
        paired.compare(a, b[:-1])


def test_the_protocol_scores_neumf_exactly_as_ncf_main_did(tmp_path):
    """A finished validation run's selected model, scored on test by the protocol the
    baselines use, gives the run's own test metrics, sampled and full."""
    config = tiny_ncf_config(tmp_path, train_epochs=2, eval_ranking=constants.BOTH_RANKINGS)
    data = dataclasses.replace(config.data, eval_split=constants.VALIDATION_SPLIT)
    config = dataclasses.replace(config, data=data)
    summary = cycles.run(config).summary
    runner, data = cycles.restore_selected(config)
    scores = ModelScores(runner.state.model)
    protocol = SplitProtocol(data, constants.TEST_SPLIT, config.num_eval_negatives, config.seed)
    metrics = protocol.evaluate(scores.for_evaluation(), 16).metrics()
    assert metrics["hr"] == pytest.approx(summary["test_hr"], abs=1e-12)
    assert metrics["ndcg"] == pytest.approx(summary["test_ndcg"], abs=1e-6)
    for name in ("full_hr", "full_ndcg", "full_recall"):
        assert metrics[name] == pytest.approx(summary[f"test_{name}"], abs=1e-12)


def _ratings(users: int = 60, items: int = 50) -> list[tuple[int, int, int]]:
    """Two groups of users, each rating 24 of its group's 25 items (timestamps in order)."""
    rng = np.random.default_rng(2)
    rows = []
    for user in range(1, users + 1):
        group = 1 if user <= users // 2 else 1 + items // 2
        chosen = group + rng.choice(items // 2, 24, replace=False)
        rows += [(user, int(item), 1000 + t) for t, item in enumerate(chosen)]
    return rows


@pytest.mark.integration
def test_the_baselines_suite_tunes_tests_and_compares_each_baseline(tmp_path):
    write_movielens(str(tmp_path / "data" / "ml-1m" / "ratings.dat"), _ratings(), "dat")
    result = subprocess.run(
        [
            sys.executable,
            f"{SCRIPTS_DIR}/benchmark_training.py",
            "--suite=baselines",
            "--baselines_dataset=ml-1m",
            f"--data_dir={tmp_path / 'data'}",
            f"--log_dir={tmp_path / 'work'}",
            "--baseline_budget=2",
            "--baseline_seed=1",
            "--baseline_seed=2",
            "--bootstrap_resamples=200",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    # The table's rows: a model, then its number of seeds.
    rows = {words[0]: words for words in map(str.split, lines) if words[1:2] in (["1"], ["2"])}
    for name in ("itempop", "itemknn", "ease", "ials"):
        seeds = "2" if name == "ials" else "1"
        assert rows[name][1] == seeds, lines
        test_hr, full_hr = float(rows[name][3]), float(rows[name][5])
        assert 0 <= full_hr <= test_hr <= 1
    # Items of the user's own group beat the other group's: every model but ItemPop
    # hits nearly every user over the whole catalogue.
    assert float(rows["ease"][5]) > 0.9 and float(rows["itempop"][5]) < 0.5
    compared = [line.split() for line in lines if line.split()[1:2] in (["sampled"], ["full"])]
    assert len(compared) == 6  # the best on validation against the three others, both ways
    # MF, NeuMF and the published numbers are the NCF split's: the legend names none here.
    assert not [line for line in lines if "NeuMF" in line or "published:" in line], lines
    assert (tmp_path / "work" / "baselines.json").is_file()
