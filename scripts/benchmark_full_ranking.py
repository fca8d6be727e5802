"""Full-catalogue evaluation benchmark: seconds and peak RSS of ranking every user's
held-out item against every item (``ncf-main --eval_ranking full``), at ML-1M and
ml-20m shapes.

Each row is a model (random weights: the cost does not depend on them) over a dataset
shape: ML-1M (the real ratings with --ratings, else generated) and ml-20m (the
synthetic ml-20m shape of `synthetic_data`: 138,493 users, 26,744 items, 20,000,263
ratings), preprocessed as ncf-main does. A row runs in a process of its own, so its
peak RSS is its own:

- ``exclusions s``: building the held-out items and each user's excluded items;
- ``ranked users``: the users ranked (all, or the first --users for ml-20m: the cost is
  linear in users, so ``all users s`` extrapolates) and their seconds;
- the baseline, in the same process on the same first users: the network's scoring of
  looked-up row pairs (`NeuMF.score`) on every (user, item) pair, every layer per pair
  as the network reads (the first MLP layer too, where ours applies it once per user
  and once per item), and the ratio of the two;
- ``score GFLOP/s``: the multiply-adds the scores need (x2), over the ranking's seconds;
- ``peak RSS MB``: the process's high-water mark from the exclusions to the end of our
  ranking (data, model and TensorFlow included; the data's generation before it and the
  baseline after it are not).

    python scripts/benchmark_full_ranking.py --ratings ../shared/data/ml-1m/ratings.dat
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from official.utils.misc import machine  # before TensorFlow: official sets its environment

# isort: split
import numpy as np
import tensorflow as tf
from training_benchmarks.harness import ml1m_data_dir

from recommendation.data import data_preprocessing, preprocessing_cache, synthetic_data
from recommendation.data.data_preprocessing import DataConfig, PreprocessedData
from recommendation.evaluation.full_ranking import FullRanking, ModelScores, users_per_block
from recommendation.model import hyperparams, network

# (--model, factors, layers): the MLPerf NeuMF and Rendle's MF at 64 dimensions.
MODELS = {
    "neumf": ("neumf", 64, (256, 256, 128, 64)),
    "mf": ("mf", 64, (256, 256, 128, 64)),
}


def ml1m_data(ratings: str) -> PreprocessedData:
    """ML-1M as ncf-main preprocesses it (a cache in a temporary folder)."""
    with tempfile.TemporaryDirectory() as work:
        config = DataConfig(dataset="ml-1m", data_dir=ml1m_data_dir(ratings, work, "data"))
        return preprocessing_cache.load_or_build(config).data


def score_flops(model_name: str, num_users: int, num_items: int) -> float:
    """FLOPs of every score: each user's and each item's first-layer half once, each
    pair's layers above it and the GMF product and logit."""
    kind, factors, layers = MODELS[model_name]
    pairs = num_users * num_items
    if kind == "mf":
        return 2.0 * pairs * factors
    half = layers[0] // 2
    sides = 2.0 * (num_users + num_items) * half * layers[1]
    above = sum(a * b for a, b in zip(layers[1:], layers[2:], strict=False)) + factors + layers[-1]
    return sides + 2.0 * pairs * (above + factors)


def run_row(model_name: str, shape: str, users: int, ratings: str | None) -> dict:
    """One row, in this process."""
    if shape == "ml-1m" and ratings:
        data = ml1m_data(ratings)
    else:
        data = data_preprocessing.preprocess(
            synthetic_data.generate(synthetic_data.SHAPES[shape], 0)
        )
    machine.reset_peak_rss()  # the data's generation is not the evaluation's
    start = time.perf_counter()
    ranking = FullRanking.of(data)
    exclusions = time.perf_counter() - start
    kind, factors, layers = MODELS[model_name]
    params = hyperparams.ModelParams(
        num_users=data.num_users,
        num_items=data.num_items,
        mf_dim=factors,
        layers=layers,
        mlp_regularization=(0.0,) * len(layers),
        model_kind=kind,
    )
    tf.keras.utils.set_random_seed(1)
    model = network.build_model(params)
    scores = ModelScores(model)
    ranked_users = min(users, data.num_users)
    subset = ranking.first(ranked_users)
    block = scores.users_per_block(ranked_users)
    subset.rank(scores.for_evaluation(), block, 10)  # traced and warm
    ranked = subset.rank(scores.for_evaluation(), block, 10)
    seconds = ranked.seconds
    peak_rss = machine.peak_rss_bytes(os.getpid())  # before the baseline's own
    # The baseline: every layer on every pair of the same first users.
    call = tf.function(
        lambda users, items: model.score(model.user_embedding(users), model.item_embedding(items)),
        reduce_retracing=True,
    )
    # Its blocks hold a (pairs, widest layer) tensor within the same bound as ours.
    pair_block = users_per_block(data.num_items, max((*layers, factors)), ranked_users)
    pair_users = min(ranked_users, 16 * pair_block)
    every_item = np.arange(data.num_items, dtype=np.int32)

    def score_pairs(block_users: np.ndarray):
        users = tf.constant(np.repeat(block_users, data.num_items))
        items = tf.constant(np.tile(every_item, len(block_users)))
        return tf.reshape(call(users, items)[:, 0], [len(block_users), data.num_items])

    pair_subset = ranking.first(pair_users)
    pair_subset.rank(score_pairs, pair_block, 10)
    pairs_ranked = pair_subset.rank(score_pairs, pair_block, 10)
    per_user = seconds / ranked_users
    pair_per_user = pairs_ranked.seconds / pair_users
    if not np.array_equal(pairs_ranked.ranks, ranked.ranks[:pair_users]):
        differing = int(np.sum(pairs_ranked.ranks != ranked.ranks[:pair_users]))
        print(f"note: {differing} of {pair_users} ranks differ by rounding", file=sys.stderr)
    return {
        "model": model_name,
        "shape": shape,
        "users": data.num_users,
        "items": data.num_items,
        "exclusions_s": exclusions,
        "ranked_users": ranked_users,
        "block": block,
        "ranked_s": seconds,
        "all_users_s": per_user * data.num_users,
        "pairs_all_users_s": pair_per_user * data.num_users,
        "speedup": pair_per_user / per_user,
        "gflops": score_flops(model_name, ranked_users, data.num_items) / seconds / 1e9,
        "peak_rss_mb": peak_rss / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ratings", help="ML-1M ratings.dat (default: generated ML-1M shape)")
    parser.add_argument("--users", type=int, default=2048, help="ml-20m users ranked")
    parser.add_argument("--model", action="append", choices=list(MODELS))
    parser.add_argument("--shape", action="append", choices=list(synthetic_data.SHAPES))
    parser.add_argument("--row", nargs=2, help=argparse.SUPPRESS)  # model, shape: one row
    args = parser.parse_args()
    if args.row:
        users = args.users if args.row[1] == "ml-20m" else 10**9
        print(json.dumps(run_row(*args.row, users, args.ratings)))
        return
    print(machine.cpu_line())
    print(
        f"{'model':>6} {'shape':>7} {'exclusions s':>12} {'ranked users':>12} {'block':>5} "
        f"{'ranked s':>9} {'all users s':>11} {'per-pair call s':>15} {'speedup':>7} "
        f"{'GFLOP/s':>7} {'peak RSS MB':>11}"
    )
    for shape in args.shape or list(synthetic_data.SHAPES):
        for model_name in args.model or list(MODELS):
            command = [sys.executable, __file__, "--row", model_name, shape]
            command += [f"--users={args.users}"] + (
                [f"--ratings={args.ratings}"] * bool(args.ratings)
            )
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode:
                sys.exit(result.stderr[-3000:])
            row = json.loads(result.stdout.splitlines()[-1])
            print(
                f"{row['model']:>6} {row['shape']:>7} {row['exclusions_s']:>12.1f} "
                f"{row['ranked_users']:>12,} {row['block']:>5} {row['ranked_s']:>9.1f} "
                f"{row['all_users_s']:>11.1f} {row['pairs_all_users_s']:>15.1f} "
                f"{row['speedup']:>6.1f}x {row['gflops']:>7.1f} {row['peak_rss_mb']:>11,.0f}",
                flush=True,
            )
    print(
        "all users s: the ranked users' seconds x users / ranked users; per-pair call s: "
        "the same for every layer on every (user, item) pair (the baseline, on the first "
        "users only); speedup: its seconds per user over ours; GFLOP/s: the scores' "
        "multiply-adds x 2 over the ranked seconds"
    )


if __name__ == "__main__":
    main()
