"""The training suites' figures, drawn with --plot_dir: each function reads what its
suite's runs logged (or the rows it measured), so a suite draws its figure with one call
at its end; without --plot_dir each does nothing and returns None."""

from __future__ import annotations

import os
import statistics

import plots as figures  # scripts/plots.py (scripts/ is on the path, as for this package)

from training_benchmarks.harness import machine_line, read_records, sampled_negatives


def hit_rates(benchmark_log: str) -> dict[int, float]:
    """``{epoch: HR@10}`` of the evaluations an ncf-main benchmark log holds (epochs
    0-based, as its summary's ``best_epoch``; a later record of an epoch wins)."""
    return {
        record["epoch"]: record["hr"]
        for record in read_records(benchmark_log)
        if record.get("kind") == "evaluation"
    }


def convergence_figure(args, work: str) -> str | None:
    """``convergence.png``: HR@10 after each epoch, a line per seed, the target dashed."""
    if not args.plot_dir:
        return None
    series = {}
    for seed in range(1, args.convergence_seeds + 1):
        rates = hit_rates(f"{work}/convergence_seed{seed}/benchmark.jsonl")
        series[f"seed {seed}"] = ([epoch + 1 for epoch in rates], list(rates.values()))
    return figures.line_chart(
        os.path.join(args.plot_dir, "convergence.png"),
        "Convergence of the ML-1M defaults over seeds",
        "epochs trained",
        "HR@10 (999 evaluation negatives)",
        series,
        machine_line(None),
        threshold=(f"target {args.convergence_target}", args.convergence_target),
    )


def paper_figure(args, work: str) -> str | None:
    """``paper_hr_per_epoch.png``: validation HR@10 by epoch, a line per factors (the
    mean over --paper_seed; an epoch's mean over the runs that reached it)."""
    if not args.plot_dir:
        return None
    series = {}
    for factors in args.paper_factors:
        runs = [
            hit_rates(f"{work}/paper{factors}_seed{seed}/benchmark.jsonl")
            for seed in args.paper_seed
        ]
        epochs = sorted({epoch for rates in runs for epoch in rates})
        means = [statistics.fmean(rates[e] for rates in runs if e in rates) for e in epochs]
        label = f"seed {args.paper_seed[0]}" if len(runs) == 1 else f"mean of {len(runs)} seeds"
        series[f"factors {factors} ({label})"] = (epochs, means)
    return figures.line_chart(
        os.path.join(args.plot_dir, "paper_hr_per_epoch.png"),
        "NCF paper protocol (ncf-ml-1m), NeuMF without pre-training",
        "epoch (0-based, as in the table)",
        "validation HR@10 (99 negatives)",
        series,
        machine_line(None),
    )


def throughput_figure(args, rows: list[tuple[str, float, int]]) -> str | None:
    """``throughput.png``: a bar of examples/s per row of the throughput table (its
    ``rows``: name, examples/s, steps). The suite has one batch size, so a row is a
    precision and kernel choice (or the peer)."""
    if not args.plot_dir:
        return None
    best = f"best of {args.throughput_repeats} runs" if args.throughput_repeats > 1 else "one run"
    return figures.bar_chart(
        os.path.join(args.plot_dir, "throughput.png"),
        "Training throughput, MLPerf model size, synthetic batches of 65,536",
        f"training examples/s ({best} per row)",
        {name: examples_per_second for name, examples_per_second, _ in rows},
        machine_line(args.peer),
    )


def baselines_figure(args, report: dict) -> str:
    """``baselines_<dataset>.png``: each model's test HR@10, sampled and over the full
    catalogue (the baselines suite's rows, in its order)."""
    bars = {}
    for name, record in report.items():
        bars[f"{name}, sampled"] = record["hr"]
        bars[f"{name}, full"] = record["full_hr"]
    return figures.bar_chart(
        os.path.join(args.plot_dir, f"baselines_{args.baselines_dataset}.png"),
        f"Test HR@10 on {args.baselines_dataset}, each model selected on validation",
        f"HR@10 (sampled: {sampled_negatives(args.baselines_dataset)} negatives; full: every item)",
        bars,
        machine_line(None),
        value_format="{x:.4f}",
    )
