"""The baselines suite: ItemPop, ItemKNN, EASE and iALS, each tuned on the validation
split within one budget and tested once, beside Rendle et al.'s matrix factorisation and
the pre-trained NeuMF (ncf-main runs, each selected on validation), every model scored by
the same evaluation code, sampled and full-catalogue; then NeuMF against each, user by
user (paired bootstrap interval and McNemar's test)."""

from __future__ import annotations

import json
import os
import sys
import time

from absl import flags

from recommendation.baselines import search
from recommendation.data import constants, preprocessing_cache
from recommendation.data.data_preprocessing import DataConfig, PreprocessedData
from recommendation.evaluation import paired
from recommendation.evaluation.full_ranking import ModelScores
from recommendation.evaluation.protocol import SplitProtocol, UserResults
from recommendation.training import cycles, ncf_common
from training_benchmarks.harness import machine_line, mean_and_sd, sampled_negatives
from training_benchmarks.paper import paper_flags, paper_run
from training_benchmarks.plots import baselines_figure
from training_benchmarks.pretrained import fine_tuning_flags, part_name, pretrained_name

# Published HR@10 / NDCG@10 on the NCF paper's ML-1M split: Dacrema et al. (TOIS 2021,
# Table 55; NeuMF with the paper's own code) and Rendle et al. (RecSys 2020, dot-product
# MF at 192 dimensions).
PUBLISHED = {
    "itempop": (0.4533, 0.2542),
    "itemknn": (0.6694, 0.3979),
    "ease": (0.7192, 0.4494),
    "ials": (0.7109, 0.4382),
    "mf": (0.7294, 0.4523),
    "neumf": (0.7093, 0.4349),
}
HEADER = (
    f"{'model':>10} {'seeds':>5} {'val HR':>7} {'test HR':>8} {'NDCG':>7} {'full HR':>8} "
    f"{'full NDCG':>9} {'published':>15} {'HR gap':>7} {'fit s':>7}  chosen"
)


def _data(args, work: str, split: str) -> PreprocessedData:
    """The suite's dataset, holding out the validation items or not (`split`)."""
    config = DataConfig(
        dataset=args.baselines_dataset,
        data_dir=args.data_dir or args.ncf_data_dir,
        cache_dir=os.path.join(work, f"baselines_cache_{split}"),
        eval_split=split,
    )
    return preprocessing_cache.load_or_build(config).data


def baselines(args, work: str) -> None:
    ncf_split = args.baselines_dataset.startswith("ncf-")
    negatives = sampled_negatives(args.baselines_dataset)
    print(
        f"\nBaselines on {args.baselines_dataset} ({negatives} sampled negatives; "
        f"full: every item the user has not interacted with), each tuned on validation "
        f"within {args.baseline_budget} configurations, tested once"
    )
    print(machine_line(None))
    validation_data, test_data = (_data(args, work, split) for split in constants.EVAL_SPLITS[::-1])
    seed = args.baseline_search_seed
    validation = SplitProtocol(validation_data, constants.VALIDATION_SPLIT, negatives, seed)
    test = SplitProtocol(test_data, constants.TEST_SPLIT, negatives, seed)
    print(HEADER)
    rows: dict[str, list[UserResults]] = {}
    report: dict[str, dict] = {}
    for name in args.baseline:
        rows[name], report[name] = _baseline_row(
            args, search.BASELINES[name], validation_data, validation, test_data, test
        )
    if ncf_split:
        for name, runs in _learned_runs(args, work).items():
            rows[name], report[name] = _learned_row(name, runs, test_data)
    print(_legend(ncf_split))
    _paired_table(args, rows, report)
    with open(os.path.join(work, "baselines.json"), "w") as out:
        json.dump(report, out, indent=1)
    if args.plot_dir:
        baselines_figure(args, report)  # prints where it wrote the figure


def _legend(ncf_split: bool) -> str:
    """What the table's columns hold; MF, NeuMF and the published numbers are the NCF
    split's only."""
    legend = (
        "test HR, NDCG: sampled (mean over seeds); full: over the whole catalogue; val HR: "
        "sampled validation HR@10 of the chosen configuration; fit s: one fit on this machine"
    )
    if not ncf_split:
        return legend
    return (
        f"{legend} (MF: its ncf-main run; NeuMF: its three, the two parts and the "
        "fine-tuning); published: HR / NDCG@10 of Dacrema et al. Table 55 (NeuMF: the "
        "paper's code) and Rendle et al. 2020 (MF, 192 dimensions)"
    )


def _baseline_row(args, baseline, validation_data, validation, test_data, test):
    """Tunes `baseline` on validation, tests the chosen configuration over the seeds,
    prints its row; returns the per-seed test results and the row's record."""
    started = time.perf_counter()

    def progress(trial: search.Trial) -> None:
        print(
            f"  {baseline.name}: {trial.config} validation HR@10={trial.metrics['hr']:.4f} "
            f"({trial.fit_seconds:.1f} s)",
            file=sys.stderr,
        )

    trials = search.tune(
        baseline,
        validation_data,
        validation,
        args.baseline_budget,
        args.baseline_search_seed,
        progress,
    )
    best = search.chosen(trials)
    seeds = args.baseline_seed if baseline.seeded else args.baseline_seed[:1]
    runs = []
    fits = []
    for seed in seeds:
        results, fit_seconds = search.evaluate(baseline, best.config, seed, test_data, test)
        runs.append(results)
        fits.append(fit_seconds)
    record = _record(runs, best.metrics["hr"], fits, best.config)
    record.update(trials=len(trials), search_seconds=time.perf_counter() - started)
    print(_row(baseline.name, record, args.baselines_dataset.startswith("ncf-")))
    return runs, record


def _record(runs: list[UserResults], validation_hr: float, seconds, chosen) -> dict:
    metrics = [run.metrics() for run in runs]
    record = {"seeds": len(runs), "validation_hr": validation_hr, "chosen": chosen}
    for key in ("hr", "ndcg", "full_hr", "full_ndcg", "full_recall"):
        record[key], record[f"{key}_sd"] = mean_and_sd(m[key] for m in metrics)
    record["seconds"] = mean_and_sd(seconds)[0]
    return record


def _row(name: str, record: dict, ncf_split: bool) -> str:
    published = PUBLISHED.get(name.split(" ")[0]) if ncf_split else None
    known = f"{published[0]:.4f} / {published[1]:.4f}" if published else "-"
    gap = f"{record['hr'] - published[0]:+.4f}" if published else "-"
    return (
        f"{name:>10} {record['seeds']:>5} {record['validation_hr']:>7.4f} {record['hr']:>8.4f} "
        f"{record['ndcg']:>7.4f} {record['full_hr']:>8.4f} {record['full_ndcg']:>9.4f} "
        f"{known:>15} {gap:>7} {record['seconds']:>7.1f}  {record['chosen']}"
    )


def _learned_runs(args, work: str) -> dict[str, list[tuple[list[str], float]]]:
    """Rendle's MF (runs of its own, at each --mf_factors and --baseline_seed, the
    random baselines' seeds) and the pre-trained NeuMF (the pretrained suite's runs in
    `work` at each --paper_seed, when it ran): per model, each seed's ncf-main flags and
    wall seconds."""
    runs: dict[str, list] = {}
    for factors in args.mf_factors:
        name = f"mf {factors}"
        runs[name] = []
        for seed in args.baseline_seed:
            run = f"baselines_mf{factors}_seed{seed}"
            extra = (f"--num_factors={factors}",)
            _, seconds = paper_run(args, work, run, 64, seed, *extra, part="mf")
            runs[name].append((paper_flags(args, work, run, 64, seed, *extra, part="mf"), seconds))
    neumf = []
    for seed in args.paper_seed:
        run = pretrained_name(64, seed, "mf", args.pretrain_learning_rate[0])
        log = os.path.join(work, run, "benchmark.jsonl")
        if not os.path.isfile(log):
            print(
                f"no pre-trained NeuMF run {run} in {work}: add --suite pretrained "
                "(before --suite baselines) for the NeuMF row",
                file=sys.stderr,
            )
            return runs
        tuning = fine_tuning_flags(args, work, 64, seed, "mf", args.pretrain_learning_rate[0])
        # Its training time: the MLP and MF parts' and the fine-tuning's.
        stages = (part_name(64, seed, "mlp"), part_name(64, seed, "mf"), run)
        seconds = sum(_summary(os.path.join(work, stage))["total_seconds"] for stage in stages)
        neumf.append((paper_flags(args, work, run, 64, seed, *tuning), seconds))
    runs["neumf"] = neumf
    return runs


def _learned_row(name: str, runs, test_data: PreprocessedData):
    """Each seed's validation-selected model restored and scored on the test split by
    the suite's protocol; prints the row."""
    results, seconds, validation_hrs = [], [], []
    for run_flags, wall in runs:
        config = _ncf_config(run_flags)
        runner, data = cycles.restore_selected(config)
        if not (data.eval_items == test_data.eval_items).all():
            sys.exit(f"{config.model_dir} holds other test items than the baselines' data")
        protocol = SplitProtocol(data, constants.TEST_SPLIT, 99, config.seed or 0)
        scores = ModelScores(runner.state.model)
        results.append(
            protocol.evaluate(scores.for_evaluation(), scores.users_per_block(data.num_users))
        )
        summary = _summary(config.model_dir)
        validation_hrs.append(summary["best_hr"])
        seconds.append(wall)
    record = _record(
        results, mean_and_sd(validation_hrs)[0], seconds, "ncf-main, selected on validation"
    )
    print(_row(name, record, ncf_split=True))
    return results, record


def _ncf_config(run_flags: list[str]) -> ncf_common.NcfConfig:
    """The config of the ncf-main run that `run_flags` started."""
    flag_values = flags.FlagValues()
    ncf_common.define_ncf_flags(flag_values)
    ncf_common.parse_ncf_flags(["ncf-main", *run_flags], flag_values)
    return ncf_common.ncf_config_from_flags(flag_values)


def _summary(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "benchmark.jsonl")) as log:
        return [r for r in map(json.loads, log) if r.get("kind") == "summary"][-1]


def _paired_table(args, rows: dict[str, list[UserResults]], report: dict) -> None:
    """The reference model (NeuMF when it ran, else the best on validation) against
    every other, on each model's first seed's per-user test hits."""
    if len(rows) < 2:
        return
    reference = (
        "neumf" if "neumf" in rows else max(report, key=lambda n: report[n]["validation_hr"])
    )
    print(
        f"\n{reference} against each model, per user (test, each model's first seed): "
        f"HR@10 difference with its 95% paired bootstrap interval ({args.bootstrap_resamples} "
        "resamples), users hit by one model only, McNemar's exact p"
    )
    print(
        f"{'model':>10} {'ranking':>8} {'difference':>11} {'95% interval':>18} "
        f"{'only ' + reference:>12} {'only other':>10} {'p':>9}"
    )
    for name, results in rows.items():
        if name == reference:
            continue
        for ranking in ("sampled", "full"):
            ours, theirs = (
                (r[0].sampled_hits if ranking == "sampled" else r[0].full.hits)
                for r in (rows[reference], results)
            )
            comparison = paired.compare(ours, theirs, resamples=args.bootstrap_resamples)
            interval = f"[{comparison.low:+.4f}, {comparison.high:+.4f}]"
            print(
                f"{name:>10} {ranking:>8} {comparison.difference:>+11.4f} {interval:>18} "
                f"{comparison.only_a:>12} {comparison.only_b:>10} {comparison.p_value:>9.2g}"
            )
