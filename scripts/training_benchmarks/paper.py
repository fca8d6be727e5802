"""The paper suite: the NCF paper's protocol, each run's epoch selected on validation
and its test holdout reported once, beside the paper's Table 2; and --refit, which
trains a selected run again on all training data."""

from __future__ import annotations

import os
import sys

from recommendation.data.constants import TEST_SPLIT
from training_benchmarks.harness import last_summary, mean_and_sd
from training_benchmarks.resume import run_or_resume

# The NCF paper's Table 2, NeuMF without pre-training: (HR@10, NDCG@10) by factors.
PAPER_TABLE2 = {8: (0.688, 0.410), 16: (0.696, 0.420), 32: (0.701, 0.425), 64: (0.705, 0.426)}
PAPER_TOWER_DEPTHS = {"text": 3, "code": 4, "deep": 5}  # entries of --layers
REFIT_SUFFIX = "_refit"
REFIT_HEADING = (
    f"{'':>7} --refit: each run above trained again on all training data (its validation "
    "items back in) for its selected epochs, test reported once at the end"
)


def paper_layers(factors: int, tower: str) -> str:
    """The MLP tower of the paper's NeuMF for `factors` predictive factors.

    ``code``: the paper's code (NeuMF default ``[64,32,16,8]`` at 8): four layers,
    the first 8x factors wide. ``text``: the paper's text ("factors 8: layers 32 -> 16
    -> 8, embedding 16"): three layers, the first 4x factors wide. ``deep``: the code's
    tower with one more halving layer in front (the paper's Table 3 goes to four hidden
    layers): five layers, the first 16x factors wide.
    """
    depth = PAPER_TOWER_DEPTHS[tower]
    return ",".join(str(factors * 2 ** (depth - 1 - i)) for i in range(depth))


def paper_run(args, work: str, name: str, factors: int, seed: int, *flags: str) -> tuple:
    """One validation-selected run of the paper protocol, the configuration from the
    --paper_* options and `flags` after them (a later flag wins); returns (its summary,
    wall seconds)."""
    layers = paper_layers(factors, args.paper_tower)
    seconds = run_or_resume(
        args,
        work,
        name,
        [
            "--dataset=ncf-ml-1m",
            f"--data_dir={os.path.dirname(args.ncf_dir)}",
            f"--cache_dir={work}/ncf_cache",
            f"--model_dir={work}/{name}",
            "--clean",
            "--eval_split=validation",
            f"--num_factors={factors}",
            f"--layers={layers}",
            "--mlp_regularization=" + ",".join("0" * len(layers.split(","))),
            f"--train_epochs={args.paper_epochs}",
            f"--batch_size={args.paper_batch_size}",
            f"--learning_rate={args.paper_learning_rate}",
            f"--learning_rate_decay={args.paper_learning_rate_decay}",
            f"--decay_start_epoch={args.paper_decay_start_epoch}",
            f"--embedding_init={args.paper_embedding_init}",
            f"--num_neg={args.paper_num_neg}",
            f"--weight_decay={args.paper_weight_decay}",
            f"--sparse_embedding_updates={args.paper_sparse_updates}",
            "--batches_per_step=32",
            "--enable_xla",
            f"--seed={seed}",
            *flags,
        ],
    )
    return last_summary(f"{work}/{name}/benchmark.jsonl"), seconds


PAPER_HEADER = (
    f"{'factors':>7} {'seed':>5} {'model':>14} {'epoch':>5} {'val HR':>7} {'test HR':>8} "
    f"{'test NDCG':>9} {'paper HR':>9} {'paper NDCG':>11} {'wall s':>7}"
)


def paper_run_row(
    factors, seed, model: str, summary: dict, paper_row: tuple | None, seconds
) -> str:
    """One run's line; `paper_row`: Table 2's (HR@10, NDCG@10), None where it has none."""
    paper_hr, paper_ndcg = (f"{value:.3f}" for value in paper_row) if paper_row else ("-", "-")
    return (
        f"{factors:>7} {seed:>5} {model:>14} {summary['best_epoch']:>5} "
        f"{summary['best_hr']:>7.4f} {summary['test_hr']:>8.4f} {summary['test_ndcg']:>9.4f} "
        f"{paper_hr:>9} {paper_ndcg:>11} {seconds:>7.0f}"
    )


def paper_mean_row(factors, model: str, summaries: list[dict], paper_row: tuple) -> str:
    """Mean and sample sd of test HR@10 / NDCG@10 over seeds, beside the paper's."""
    (mean_hr, sd_hr), (mean_ndcg, sd_ndcg) = (
        mean_and_sd(summary[key] for summary in summaries) for key in ("test_hr", "test_ndcg")
    )
    side = "below" if mean_hr < paper_row[0] else "at or above"
    return (
        f"{factors:>7} {'mean':>5} {model:>14} {'':>5} {'':>7} {mean_hr:>8.4f} "
        f"{mean_ndcg:>9.4f} {paper_row[0]:>9.3f} {paper_row[1]:>11.3f}   sd {sd_hr:.4f} / "
        f"{sd_ndcg:.4f}; test HR {mean_hr - paper_row[0]:+.4f}: {side} the paper"
    )


def paper_configuration(args) -> str:
    """The --paper_* configuration the runs share: the line under each table."""
    return (
        f"tower {args.paper_tower}, {args.paper_embedding_init} embeddings, "
        f"{args.paper_num_neg} negatives, batch {args.paper_batch_size}, "
        f"weight decay {args.paper_weight_decay}, "
        f"{'sparse (lazy Adam)' if args.paper_sparse_updates else 'dense'} embedding updates, "
        f"Adam lr {args.paper_learning_rate} x {args.paper_learning_rate_decay} per epoch from "
        f"epoch {args.paper_decay_start_epoch}, {args.paper_epochs} epochs; sd over seeds (n - 1)"
    )


def paper(args, work: str) -> None:
    """The paper protocol with selection on validation only: each run trains with each
    user's second-to-last training interaction held out, picks its epoch on it, and
    reports the test holdout once, at that epoch (``--eval_split validation``)."""
    print(
        "\nNCF paper protocol (ncf-ml-1m split, 99 fixed test negatives), NeuMF without "
        "pre-training; epoch selected on validation, test reported once"
    )
    print(PAPER_HEADER)
    for factors in args.paper_factors:
        summaries = []
        for seed in args.paper_seed:
            name = f"paper{factors}_seed{seed}"
            summary, seconds = paper_run(args, work, name, factors, seed)
            summaries.append(summary)
            print(paper_run_row(factors, seed, "neumf", summary, PAPER_TABLE2[factors], seconds))
        print(paper_mean_row(factors, "neumf", summaries, PAPER_TABLE2[factors]))
        if args.refit:
            print(REFIT_HEADING)
            refits = []
            for seed, selected in zip(args.paper_seed, summaries, strict=True):
                name = f"paper{factors}_seed{seed}"
                refit, seconds = refit_run(args, work, name, factors, seed, selected)
                refits.append(refit)
                print(paper_run_row(factors, seed, "neumf", refit, PAPER_TABLE2[factors], seconds))
            print(paper_mean_row(factors, "neumf", refits, PAPER_TABLE2[factors]))
    print(paper_configuration(args))


def refit_run(
    args, work: str, name: str, factors: int, seed: int, selected: dict, *flags: str
) -> tuple:
    """The run `name` (`flags` after the paper protocol's) trained again as the paper
    trained: on every training interaction, the validation items included, for the
    epochs that validation selected (`selected`, that run's summary), in one cycle so
    that the test holdout is evaluated once, at the end. Returns (a summary: the
    validation run's epoch and HR with this run's test HR and NDCG, its wall seconds)."""
    epochs = selected["best_epoch"] + 1
    refit, seconds = paper_run(
        args,
        work,
        name + REFIT_SUFFIX,
        factors,
        seed,
        *flags,
        f"--eval_split={TEST_SPLIT}",
        f"--train_epochs={epochs}",
        f"--epochs_between_evals={epochs}",
    )
    if refit["epochs"] != epochs or refit["eval_split"] != TEST_SPLIT:
        sys.exit(f"{work}/{name}{REFIT_SUFFIX} did not train {epochs} epochs on the test split")
    return {**selected, "test_hr": refit["best_hr"], "test_ndcg": refit["best_ndcg"]}, seconds
