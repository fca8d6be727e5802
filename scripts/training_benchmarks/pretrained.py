"""The pretrained suite: the paper's pre-trained NeuMF (GMF or MF and MLP trained alone,
then NeuMF from both, fine-tuned with SGD), each stage selected on validation."""

from __future__ import annotations

import statistics

from recommendation.training import experiments
from training_benchmarks.paper import (
    PAPER_HEADER,
    REFIT_HEADING,
    REFIT_SUFFIX,
    paper_configuration,
    paper_mean_row,
    paper_run,
    paper_run_row,
    paper_setting,
    refit_run,
)

# The NCF paper's Table 2, NeuMF with pre-training (GMF and MLP trained first, alpha 0.5):
# (HR@10, NDCG@10) by factors.
PAPER_TABLE2_PRETRAINED = {
    8: (0.684, 0.403),
    16: (0.707, 0.426),
    32: (0.726, 0.445),
    64: (0.730, 0.447),
}


def pretrained(args, work: str) -> None:
    """The paper's pre-trained NeuMF (its section 3.4.1), each stage selected on
    validation: an MLP model and each --pretrain_gmf_part (its experiment,
    `experiments.PAPER_PART_VALUES`) trained alone, then NeuMF started from the MLP and
    each GMF part (alpha 0.5) and fine-tuned with plain SGD, the paper's switch, at each
    --pretrain_learning_rate; the test holdout reported once per run, at its selected
    epoch, and the GMF part and rate chosen on mean validation HR@10 over the seeds."""
    print(
        "\nNCF paper protocol, pre-trained NeuMF (GMF or MF and MLP alone, then NeuMF from "
        "both, SGD); each run's epoch selected on validation, test reported once"
    )
    print(PAPER_HEADER)
    settings = [
        (part, rate) for part in args.pretrain_gmf_part for rate in args.pretrain_learning_rate
    ]
    for factors in args.paper_factors:
        paper_row = PAPER_TABLE2_PRETRAINED[factors]
        summaries = {setting: [] for setting in settings}
        parts = {}  # (seed, part): the part's validation-selected run
        for seed in args.paper_seed:
            for part in ("mlp", *args.pretrain_gmf_part):
                name = part_name(factors, seed, part)
                summary, seconds = paper_run(args, work, name, factors, seed, part=part)
                parts[seed, part] = summary
                print(paper_run_row(factors, seed, part, summary, None, seconds))
            for (part, rate), runs in summaries.items():
                name = pretrained_name(factors, seed, part, rate)
                flags = fine_tuning_flags(args, work, factors, seed, part, rate)
                summary, seconds = paper_run(args, work, name, factors, seed, *flags)
                runs.append(summary)
                print(
                    paper_run_row(factors, seed, _setting(part, rate), summary, paper_row, seconds)
                )
        chosen = chosen_on_validation(summaries)
        print(paper_mean_row(factors, _setting(*chosen), summaries[chosen], paper_row))
        if len(summaries) > 1:
            print(
                f"{'':>7} GMF part and SGD rate ({_setting(*chosen)}) chosen on mean "
                "validation HR@10"
            )
        if args.refit:
            _pretrained_refits(args, work, factors, chosen, parts, summaries[chosen])
    print(
        paper_configuration(args) + f"; NeuMF fine-tuned with SGD (constant rate) for "
        f"{args.pretrain_epochs or paper_setting(args, 'paper_epochs')} epochs, alpha 0.5; "
        "the parts: "
        + "; ".join(
            f"{part} {' '.join(experiments.as_arguments(experiments.PAPER_PART_VALUES[part]))}"
            for part in ("mlp", *args.pretrain_gmf_part)
        )
    )


def _pretrained_refits(
    args, work: str, factors: int, chosen: tuple, parts: dict, selected_runs: list[dict]
) -> None:
    """--refit for the pretrained suite: per seed, the MLP part and the `chosen` GMF
    part (`parts[seed, part]`, their validation runs) trained again on all training
    data, then the NeuMF from those (`selected_runs`, the validation runs of `chosen`
    per seed); prints their rows and the mean."""
    print(REFIT_HEADING)
    part, rate = chosen
    paper_row = PAPER_TABLE2_PRETRAINED[factors]
    refits = []
    for seed, selected in zip(args.paper_seed, selected_runs, strict=True):
        for each in ("mlp", part):
            name = part_name(factors, seed, each)
            refit, seconds = refit_run(
                args, work, name, factors, seed, parts[seed, each], part=each
            )
            print(paper_run_row(factors, seed, each, refit, None, seconds))
        name = pretrained_name(factors, seed, part, rate)
        flags = fine_tuning_flags(args, work, factors, seed, part, rate, REFIT_SUFFIX)
        refit, seconds = refit_run(args, work, name, factors, seed, selected, *flags)
        refits.append(refit)
        print(paper_run_row(factors, seed, _setting(*chosen), refit, paper_row, seconds))
    print(paper_mean_row(factors, _setting(*chosen), refits, paper_row))


def part_name(factors: int, seed: int, part: str) -> str:
    return f"pretrained{factors}_seed{seed}_{part}"


def pretrained_name(factors: int, seed: int, part: str, rate: float) -> str:
    return f"pretrained{factors}_seed{seed}_neumf_{part}_sgd{rate:g}"


def fine_tuning_flags(
    args, work: str, factors: int, seed: int, part: str, rate: float, suffix: str = ""
) -> tuple[str, ...]:
    """NeuMF started from the MLP part and the GMF `part` of `seed` (their runs' names
    + `suffix`) and fine-tuned with plain SGD at `rate`, the paper's switch."""
    return (
        f"--pretrain_gmf_dir={work}/{part_name(factors, seed, part)}{suffix}",
        f"--pretrain_mlp_dir={work}/{part_name(factors, seed, 'mlp')}{suffix}",
        "--optimizer=sgd",
        f"--learning_rate={rate}",
        f"--train_epochs={args.pretrain_epochs or paper_setting(args, 'paper_epochs')}",
    )


def _setting(part: str, rate: float) -> str:
    """A pre-trained NeuMF's row label: its GMF part and fine-tuning rate."""
    return f"{part}, sgd {rate:g}"


def chosen_on_validation(runs_by_setting: dict) -> object:
    """The setting whose runs have the best mean validation HR@10 (their summaries'
    ``best_hr``, the selected epoch's); their test HR plays no part. The first on ties."""
    return max(
        runs_by_setting,
        key=lambda setting: statistics.fmean(run["best_hr"] for run in runs_by_setting[setting]),
    )
