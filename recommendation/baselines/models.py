"""The baselines NeuMF is measured against, each fitted on the binary user x item
matrix of training interactions and scoring every item for a block of users.

- `ItemPop`: items by their training count, the same list for every user.
- `ItemKNN`: item-based nearest neighbours, cosine similarity with a shrink term, each
  item's `neighbours` most similar items kept (Dacrema et al.'s ItemKNN CF).
- `Ease`: Steck's EASE^R, the closed-form item-item model ``B = I - P / diag(P)``,
  ``P = (X'X + l2 I)^-1``, its diagonal zero.
- `Ials`: implicit ALS (Hu, Koren and Volinsky 2008), solved by the `implicit`
  library's conjugate-gradient ALS: confidence 1 + alpha on observed pairs.

Rendle et al.'s matrix factorisation (SGD with L2 on each example's rows) is ncf-main
``--model mf``, trained by the same runner as NeuMF.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import threadpoolctl

from recommendation.data.data_preprocessing import PreprocessedData


def training_matrix(data: PreprocessedData) -> sp.csr_matrix:
    """`(num_users, num_items)` float32 CSR, 1 for each training interaction."""
    ones = np.ones(len(data.train_items), dtype=np.float32)
    return sp.csr_matrix(
        (ones, data.train_items, data.train_offsets), shape=(data.num_users, data.num_items)
    )


class ItemPop:
    """Scores each item by how many users trained on it."""

    def __init__(self) -> None:
        self.counts: np.ndarray | None = None

    def fit(self, train: sp.csr_matrix) -> ItemPop:
        self.counts = np.asarray(train.sum(axis=0), dtype=np.float32)
        return self

    def scores(self, users: np.ndarray) -> np.ndarray:
        return np.broadcast_to(self.counts, (len(users), self.counts.shape[1]))


class ItemKNN:
    """``score(u, j) = sum over u's items i of sim(i, j)``, with ``sim(i, j) = |U_i ∩
    U_j| / (sqrt(|U_i| |U_j|) + shrink)`` kept for j's `neighbours` most similar i.

    Args:
        neighbours: Most similar items kept per item.
        shrink: Added to the cosine's denominator: pairs seen by few users count less.
    """

    def __init__(self, neighbours: int, shrink: float) -> None:
        self.neighbours = neighbours
        self.shrink = shrink

    def fit(self, train: sp.csr_matrix) -> ItemKNN:
        co_counts = (train.T @ train).toarray()
        norms = np.sqrt(np.diag(co_counts))
        similarity = co_counts / (np.outer(norms, norms) + self.shrink + 1e-9)
        np.fill_diagonal(similarity, 0.0)
        num_items = similarity.shape[0]
        if self.neighbours < num_items:
            dropped = np.argpartition(-similarity, self.neighbours, axis=0)[self.neighbours :]
            np.put_along_axis(similarity, dropped, 0.0, axis=0)
        self.train, self.similarity = train, similarity.astype(np.float32)
        return self

    def scores(self, users: np.ndarray) -> np.ndarray:
        return np.asarray(self.train[users] @ self.similarity)


class Ease:
    """Steck (WWW 2019): the item-item weights minimising ``|X - XB|^2 + l2 |B|^2``
    with ``diag(B) = 0``, in closed form.

    Args:
        l2: The L2 weight.
    """

    def __init__(self, l2: float) -> None:
        self.l2 = l2

    def fit(self, train: sp.csr_matrix) -> Ease:
        gram = (train.T @ train).toarray().astype(np.float64)
        gram[np.diag_indices_from(gram)] += self.l2
        inverse = np.linalg.inv(gram)
        weights = -inverse / np.diag(inverse)
        np.fill_diagonal(weights, 0.0)
        self.train, self.weights = train, weights.astype(np.float32)
        return self

    def scores(self, users: np.ndarray) -> np.ndarray:
        return np.asarray(self.train[users] @ self.weights)


class Ials:
    """Implicit ALS by the `implicit` library (CPU, conjugate gradient).

    Args:
        factors: Embedding width.
        l2: Regularisation of both sides' factors.
        alpha: An observed pair's confidence is 1 + alpha x its value (Hu et al.'s
            linear scaling; an unobserved pair's is 1).
        iterations: ALS sweeps.
        seed: The factors' initialisation.
    """

    def __init__(self, factors: int, l2: float, alpha: float, iterations: int, seed: int) -> None:
        from implicit.cpu.als import AlternatingLeastSquares  # imported when used: slow

        self.alpha = alpha
        with _one_blas_thread():  # else implicit warns that BLAS threads oversubscribe
            # implicit takes the matrix's values (times its alpha, here 1) as the
            # confidences themselves, not as 1 + alpha x value: `fit` gives it those.
            self.model = AlternatingLeastSquares(
                factors=factors,
                regularization=l2,
                alpha=1.0,
                iterations=iterations,
                random_state=seed,
            )

    def fit(self, train: sp.csr_matrix) -> Ials:
        confidences = train.copy()
        confidences.data = 1 + self.alpha * confidences.data
        with _one_blas_thread():
            self.model.fit(confidences, show_progress=False)
        return self

    def scores(self, users: np.ndarray) -> np.ndarray:
        return self.model.user_factors[users] @ self.model.item_factors.T


def _one_blas_thread() -> threadpoolctl.threadpool_limits:
    """implicit parallelises over users itself: BLAS threads under it oversubscribe."""
    return threadpoolctl.threadpool_limits(1, "blas")
