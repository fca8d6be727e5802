"""The paper suite: the NCF paper's protocol, each run's epoch selected on validation
and its test holdout reported once, beside the paper's Table 2; and --refit, which
trains a selected run again on all training data."""

from __future__ import annotations

import sys

from recommendation.data.constants import TEST_SPLIT
from recommendation.training import experiments
from training_benchmarks.harness import last_summary, mean_and_sd
from training_benchmarks.plots import paper_figure
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
    return ",".join(map(str, experiments.paper_layers(factors, PAPER_TOWER_DEPTHS[tower])))


# The --paper_* options and the ncf-main flags they set. An option left unset (None)
# keeps the experiment's value (`experiments.PAPER_PROTOCOL`).
PAPER_OPTIONS = {
    "paper_epochs": "train_epochs",
    "paper_learning_rate": "learning_rate",
    "paper_learning_rate_decay": "learning_rate_decay",
    "paper_decay_start_epoch": "decay_start_epoch",
    "paper_weight_decay": "weight_decay",
    "paper_sparse_updates": "sparse_embedding_updates",
    "paper_num_neg": "num_neg",
    "paper_embedding_init": "embedding_init",
    "paper_batch_size": "batch_size",
}


def paper_setting(args, option: str) -> object:
    """The value the runs use for the --paper_* `option`: the one given, or the
    experiment's."""
    value = getattr(args, option)
    return experiments.PAPER_PROTOCOL[PAPER_OPTIONS[option]] if value is None else value


def paper_arguments(args, factors: int, part: str) -> list[str]:
    """The ncf-main arguments of the paper protocol's `part` at `factors`: its
    experiment, then the --paper_* options given, but where the part has a value of its
    own (the MF recipe's batch, rate, negatives and epochs)."""
    overrides = {
        flag: getattr(args, option)
        for option, flag in PAPER_OPTIONS.items()
        if getattr(args, option) is not None
    }
    if args.paper_tower != "code":
        depth = PAPER_TOWER_DEPTHS[args.paper_tower]
        overrides.update(experiments.paper_model_values(factors, depth))
    own = experiments.PAPER_PART_VALUES[part]
    return [
        f"--config={experiments.paper_experiment_name(part, factors)}",
        *experiments.as_arguments({k: v for k, v in overrides.items() if k not in own}),
    ]


def paper_run(
    args, work: str, name: str, factors: int, seed: int, *flags: str, part: str = "neumf"
) -> tuple:
    """One validation-selected run of the paper protocol's `part` (`paper_flags`);
    returns (its summary, wall seconds)."""
    run_flags = paper_flags(args, work, name, factors, seed, *flags, part=part)
    seconds = run_or_resume(args, work, name, run_flags)
    return last_summary(f"{work}/{name}/benchmark.jsonl"), seconds


def paper_flags(
    args, work: str, name: str, factors: int, seed: int, *flags: str, part: str = "neumf"
) -> list[str]:
    """The ncf-main flags of the paper protocol's `part` (`paper_arguments`) as the run
    `name` in `work`, `flags` after them (a later flag wins)."""
    return [
        *paper_arguments(args, factors, part),
        f"--data_dir={args.ncf_data_dir}",
        f"--cache_dir={work}/ncf_cache",
        f"--model_dir={work}/{name}",
        "--clean",
        f"--seed={seed}",
        *flags,
    ]


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

    def setting(option: str) -> object:
        return paper_setting(args, option)

    return (
        f"experiments ncf_paper_<model>_<factors>; tower {args.paper_tower}, "
        f"{setting('paper_embedding_init')} embeddings, {setting('paper_num_neg')} "
        f"negatives, batch {setting('paper_batch_size')}, weight decay "
        f"{setting('paper_weight_decay')}, "
        f"{'sparse (lazy Adam)' if args.paper_sparse_updates else 'dense'} embedding updates, "
        f"Adam lr {setting('paper_learning_rate')} x {setting('paper_learning_rate_decay')} "
        f"per epoch from epoch {setting('paper_decay_start_epoch')}, "
        f"{setting('paper_epochs')} epochs; sd over seeds (n - 1)"
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
    paper_figure(args, work)


def refit_run(
    args,
    work: str,
    name: str,
    factors: int,
    seed: int,
    selected: dict,
    *flags: str,
    part: str = "neumf",
) -> tuple:
    """The run `name` (`paper_run` of `part`, `flags` after) trained again as the paper
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
        part=part,
    )
    if refit["epochs"] != epochs or refit["eval_split"] != TEST_SPLIT:
        sys.exit(f"{work}/{name}{REFIT_SUFFIX} did not train {epochs} epochs on the test split")
    return {**selected, "test_hr": refit["best_hr"], "test_ndcg": refit["best_ndcg"]}, seconds
