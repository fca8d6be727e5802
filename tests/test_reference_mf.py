"""Rendle et al.'s matrix factorisation as their code trains it (scripts/reference_mf.py):
their step, one example at a time, their epoch of examples, and a run on a small NCF
split that tests the epoch validation chose."""

import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import SCRIPTS_DIR, load_script, the_error_line

reference_mf = load_script("reference_mf")


def _one_user_one_item(user: list[float], item: list[float]) -> tuple[np.ndarray, ...]:
    """Parameters of one user and one item, zero biases."""
    return np.array([user]), np.array([item]), np.zeros(1), np.zeros(1), np.zeros(1)


def _train(parameters, labels: list[float], rate: float = 0.1, l2: float = 0.01) -> float:
    """One epoch of examples of user 0 and item 0 with `labels`."""
    pairs = np.zeros(len(labels), dtype=np.int64)
    return reference_mf.sgd_epoch(*parameters, pairs, pairs, np.array(labels), rate, l2)


def test_a_positive_takes_their_step_from_the_values_before_it():
    # logit 1 x 0.5 + 0 x 2 = 0.5; gradient 1 - sigmoid(0.5) = 0.3775407; rate 0.1, L2 0.01.
    parameters = _one_user_one_item([1.0, 0.0], [0.5, 2.0])
    loss = _train(parameters, [1.0])
    assert loss == pytest.approx(0.4740770, abs=1e-7)  # ln(1 + e^-0.5)
    user, item, user_bias, item_bias, bias = parameters
    np.testing.assert_allclose(user, [[1.0178770, 0.0755081]], atol=1e-7)
    # The item's step uses the user's vector from before this step: 0.5 + 0.1 x
    # (0.3775407 x 1 - 0.01 x 0.5), not x 1.0178770.
    np.testing.assert_allclose(item, [[0.5372541, 1.998]], atol=1e-7)
    for value in (user_bias, item_bias, bias):
        np.testing.assert_allclose(value, [0.0377541], atol=1e-7)


def test_a_negative_with_a_positive_logit_pays_the_logit():
    parameters = _one_user_one_item([1.0, 0.0], [0.5, 2.0])
    assert _train(parameters, [0.0]) == pytest.approx(0.9740770, abs=1e-7)  # ln(1 + e^-0.5) + 0.5


def test_each_example_sees_the_steps_of_those_before_it():
    # Per-example SGD: two examples in one epoch are two epochs of one each, not one
    # step on their summed gradient (what a batch of two would take).
    together = _one_user_one_item([1.0, 0.0], [0.5, 2.0])
    one_by_one = _one_user_one_item([1.0, 0.0], [0.5, 2.0])
    _train(together, [1.0, 0.0])
    _train(one_by_one, [1.0])
    _train(one_by_one, [0.0])
    for ours, theirs in zip(together, one_by_one, strict=True):
        np.testing.assert_array_equal(ours, theirs)
    batched = _one_user_one_item([1.0, 0.0], [0.5, 2.0])
    user, item = batched[0], batched[1]
    # Both examples' gradients at the starting values: 1 - s and -s, s = sigmoid(0.5).
    summed = 1 - 2 / (1 + np.exp(-0.5))
    assert not np.allclose(together[0], user + 0.1 * (summed * item - 2 * 0.01 * user))


def test_an_epoch_holds_each_positive_and_its_negatives_shuffled():
    users, items = np.array([0, 0, 1]), np.array([5, 6, 7])
    epoch = reference_mf.epoch_examples(users, items, 10, 2, np.random.default_rng(3))
    example_users, example_items, labels = epoch
    assert len(example_users) == len(example_items) == len(labels) == 9
    positives = sorted(
        zip(example_users[labels == 1].tolist(), example_items[labels == 1].tolist(), strict=True)
    )
    assert positives == [(0, 5), (0, 6), (1, 7)]
    assert np.bincount(example_users).tolist() == [6, 3]  # 1 + 2 examples per positive
    assert example_items.min() >= 0 and example_items.max() < 10
    assert labels.tolist() != sorted(labels.tolist(), reverse=True)  # not in input order
    again = reference_mf.epoch_examples(users, items, 10, 2, np.random.default_rng(3))
    for ours, theirs in zip(epoch, again, strict=True):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.integration
def test_a_validation_run_tests_the_epoch_validation_chose(tmp_path):
    folder = tmp_path / "ncf"
    folder.mkdir()
    # 12 users, 8 training items each of items 0 to 29, their test item (user + 10)
    # not among them; the fixed test negatives are two of the items each user never had.
    rng = np.random.default_rng(0)
    train, negatives = [], []
    for user in range(12):
        others = np.delete(np.arange(30), user + 10)
        items = rng.choice(others, 8, replace=False)
        train += [f"{user}\t{item}\t5\t{time}\n" for time, item in enumerate(items.tolist())]
        unseen = np.setdiff1d(others, items)[:2].tolist()
        negatives.append(f"({user},{user + 10})\t{unseen[0]}\t{unseen[1]}\n")
    (folder / "ml-1m.train.rating").write_text("".join(train))
    (folder / "ml-1m.test.rating").write_text("".join(f"{u}\t{u + 10}\t5\t99\n" for u in range(12)))
    (folder / "ml-1m.test.negative").write_text("".join(negatives))
    result = subprocess.run(
        [
            sys.executable,
            f"{SCRIPTS_DIR}/reference_mf.py",
            f"--ncf_dir={folder}",
            f"--cache_dir={tmp_path / 'cache'}",
            "--dimensions=4",
            "--epochs=4",
            "--learning_rate=0.05",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    validation = [float(re.search(r"validation HR@10=([\d.]+)", line)[1]) for line in lines[:4]]
    chosen = validation.index(max(validation))
    assert lines[4].startswith(f"selected epoch {chosen}: validation HR@10={max(validation):.4f}; ")
    assert re.search(
        r"test HR@10=[\d.]+ NDCG@10=[\d.]+, full-catalogue HR@10=[\d.]+ NDCG@10=[\d.]+ Recall@10=",
        lines[4],
    )


@pytest.mark.integration
@pytest.mark.parametrize(
    ("folder", "named"),
    [("ncf", "ml-1m.train.rating"), ("ncf-split", "must be a folder named ncf")],
)
def test_a_bad_ncf_dir_is_one_error_line(tmp_path, folder, named):
    # An empty ncf folder: the missing file; another name: the split is read from
    # DATA_DIR/ncf, so the folder itself is refused.
    (tmp_path / folder).mkdir()
    result = subprocess.run(
        [sys.executable, f"{SCRIPTS_DIR}/reference_mf.py", f"--ncf_dir={tmp_path / folder}"],
        capture_output=True,
        text=True,
    )
    assert named in the_error_line(result)  # one line, no traceback
