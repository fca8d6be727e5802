"""Rendle et al.'s matrix factorisation, trained as their own code trains it, on the NCF
paper's ML-1M split: what their published HR@10 (RecSys 2020, 0.7294 at 192 dimensions)
is here, beside `ncf-main --model mf` (docs/evaluation.md).

Their `mf_simple.py`: ``b + b_u + b_i + <v_u, v_i>``, the logistic loss, one SGD step per
example (the examples of an epoch shuffled: each positive and `--negatives` items drawn
uniformly from the whole catalogue), L2 on every parameter the example touches; their
``--embedding_dim`` counts the bias column, so the vectors have one column fewer. The
per-example loop is compiled with numba (``pip install -e '.[reference]'``); ncf-main
trains batches of 8,192 examples instead.

With ``--eval_split test`` it trains on every training interaction and evaluates the test
split after the last epoch, as Rendle et al. report it. With ``--eval_split validation``
it trains without each user's latest training interaction, evaluates validation after
every epoch and the test split once with the epoch validation chose, as the baselines
ladder treats every model. Both score with the ladder's code (`SplitProtocol`: the NCF
split's 99 test negatives, sampled and full-catalogue metrics).

    python scripts/reference_mf.py --ncf_dir ../shared/data/ncf --eval_split validation
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import numba
import numpy as np

from official.utils.misc import errors
from recommendation.data import constants, movielens, preprocessing_cache
from recommendation.data.data_preprocessing import DataConfig
from recommendation.evaluation.protocol import SplitProtocol
from recommendation.training.evaluations import metrics_text

USERS_PER_BLOCK = 1024


@dataclasses.dataclass
class RendleMf:
    """``bias + user_biases[u] + item_biases[i] + <user_vectors[u], item_vectors[i]>``."""

    user_vectors: np.ndarray
    item_vectors: np.ndarray
    user_biases: np.ndarray
    item_biases: np.ndarray
    bias: np.ndarray  # of shape (1,): the compiled step updates it in place

    @classmethod
    def drawn(cls, num_users: int, num_items: int, dimensions: int, stddev: float, rng) -> RendleMf:
        """As their code starts it: N(0, stddev^2) vectors of ``dimensions - 1`` columns
        (their --embedding_dim counts the bias), zero biases."""
        return cls(
            rng.normal(0, stddev, (num_users, dimensions - 1)),
            rng.normal(0, stddev, (num_items, dimensions - 1)),
            np.zeros(num_users),
            np.zeros(num_items),
            np.zeros(1),
        )

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The parameters themselves, in `sgd_epoch`'s order."""
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    def copy(self) -> RendleMf:
        return RendleMf(*(array.copy() for array in self.arrays()))

    def score_users(self, users: np.ndarray) -> np.ndarray:
        """`(len(users), num_items)` logits of every item for `users`."""
        return (
            self.bias[0]
            + self.user_biases[users, None]
            + self.item_biases[None, :]
            + self.user_vectors[users] @ self.item_vectors.T
        ).astype(np.float32)


@numba.njit
def sgd_epoch(
    user_vectors, item_vectors, user_biases, item_biases, bias, users, items, labels, rate, l2
):
    """One SGD step per example, in the given order (their `MFModel.fit`); returns the
    mean logistic loss."""
    loss = 0.0
    for n in range(users.shape[0]):
        user, item, label = users[n], items[n], labels[n]
        logit = bias[0] + user_biases[user] + item_biases[item]
        for f in range(user_vectors.shape[1]):
            logit += user_vectors[user, f] * item_vectors[item, f]
        if logit > 0:
            one_plus = 1.0 + np.exp(-logit)
            sigmoid = 1.0 / one_plus
            loss += np.log(one_plus) + (1.0 - label) * logit
        else:
            exp_logit = np.exp(logit)
            sigmoid = exp_logit / (1.0 + exp_logit)
            loss += -label * logit + np.log(1.0 + exp_logit)
        gradient = label - sigmoid
        for f in range(user_vectors.shape[1]):
            user_value, item_value = user_vectors[user, f], item_vectors[item, f]
            user_vectors[user, f] += rate * (gradient * item_value - l2 * user_value)
            item_vectors[item, f] += rate * (gradient * user_value - l2 * item_value)
        user_biases[user] += rate * (gradient - l2 * user_biases[user])
        item_biases[item] += rate * (gradient - l2 * item_biases[item])
        bias[0] += rate * (gradient - l2 * bias[0])
    return loss / users.shape[0]


def epoch_examples(
    users: np.ndarray, items: np.ndarray, num_items: int, negatives: int, rng
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An epoch's examples, shuffled: each positive, then `negatives` items drawn uniformly
    from the catalogue (a training positive may be drawn, as in their code)."""
    width = 1 + negatives
    example_items = np.empty((len(items), width), dtype=np.int64)
    example_items[:, 0] = items
    example_items[:, 1:] = rng.integers(0, num_items, (len(items), negatives))
    labels = np.zeros((len(items), width))
    labels[:, 0] = 1.0
    order = rng.permutation(len(items) * width)
    return np.repeat(users, width)[order], example_items.ravel()[order], labels.ravel()[order]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ncf_dir", required=True, help="the NCF paper's data files")
    parser.add_argument("--cache_dir", help="preprocessed data (default: a temporary one)")
    parser.add_argument("--eval_split", choices=constants.EVAL_SPLITS, default="validation")
    parser.add_argument("--dimensions", type=int, default=192, help="their --embedding_dim")
    parser.add_argument("--learning_rate", type=float, default=0.002)
    parser.add_argument("--regularization", type=float, default=0.005)
    parser.add_argument("--negatives", type=int, default=8)
    parser.add_argument("--stddev", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.dimensions < 2:
        parser.error("--dimensions counts the bias column: it must be 2 or more")

    with (
        tempfile.TemporaryDirectory() as scratch,
        errors.exit_on_user_errors(movielens.DataError),
    ):
        train_and_evaluate(args, args.cache_dir or scratch)


def train_and_evaluate(args: argparse.Namespace, cache_dir: str) -> None:
    """Trains on `args.eval_split`'s training data, prints each epoch and the test line."""
    started = time.perf_counter()
    config = DataConfig(
        dataset="ncf-ml-1m",
        data_dir=movielens.data_dir_of_ncf_split(args.ncf_dir),
        cache_dir=cache_dir,
        eval_split=args.eval_split,
    )
    data = preprocessing_cache.load_or_build(config).data
    validating = args.eval_split == constants.VALIDATION_SPLIT
    validation = (
        SplitProtocol(data, constants.VALIDATION_SPLIT, constants.NCF_EVAL_NEGATIVES, args.seed)
        if validating
        else None
    )
    test = SplitProtocol(data, constants.TEST_SPLIT, constants.NCF_EVAL_NEGATIVES, args.seed)
    rng = np.random.default_rng(args.seed)
    model = RendleMf.drawn(data.num_users, data.num_items, args.dimensions, args.stddev, rng)
    users, items = data.train_users().astype(np.int64), data.train_items.astype(np.int64)
    best, best_hr, best_epoch = model, -1.0, args.epochs - 1
    for epoch in range(args.epochs):
        examples = epoch_examples(users, items, data.num_items, args.negatives, rng)
        loss = sgd_epoch(*model.arrays(), *examples, args.learning_rate, args.regularization)
        line = f"epoch {epoch}: loss={loss:.4f}"
        if validation is not None:
            hr = validation.evaluate(model.score_users, USERS_PER_BLOCK).metrics()["hr"]
            line += f" validation HR@10={hr:.4f}"
            if hr > best_hr:
                best, best_hr, best_epoch = model.copy(), hr, epoch
        print(line, flush=True)
    tested = test.evaluate(best.score_users, USERS_PER_BLOCK).metrics()
    chosen = f"selected epoch {best_epoch}: validation HR@10={best_hr:.4f}; " if validating else ""
    print(
        f"{chosen}test {metrics_text(tested, test.k, constants.BOTH_RANKINGS)}"
        f", {args.epochs} epochs, {time.perf_counter() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
