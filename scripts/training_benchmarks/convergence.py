"""The convergence suite: MLPerf-style runs of the ML-1M defaults over seeds, scored by
scripts/mlperf_score.py."""

from __future__ import annotations

import os

from recommendation.training import experiments
from training_benchmarks.harness import mean_and_sd, ml1m_data_dir, read_records
from training_benchmarks.plots import convergence_figure
from training_benchmarks.resume import run_or_resume

# Room for every epoch's "0.1234 " of a run that never reaches the target.
_EPOCHS_WIDTH = 7 * int(experiments.EXPERIMENTS["ml1m_tuned"].values["train_epochs"]) - 1


def convergence(args, work: str) -> None:
    """MLPerf-style convergence of the ML-1M defaults over seeds: each run stops at
    HR@10 >= --convergence_target (999 evaluation negatives) or after its default
    epochs, with a compliance log; the logs are then scored by scripts/mlperf_score.py."""
    data_dir = ml1m_data_dir(args.ratings, work, "convergence_data")
    logs = os.path.join(work, "convergence_logs")
    os.makedirs(logs, exist_ok=True)
    print(
        f"\nconvergence of the ML-1M defaults to HR@10 >= {args.convergence_target} "
        f"(999 evaluation negatives), seeds 1 to {args.convergence_seeds}"
    )
    heading = f"{'HR@10 by epoch':<{_EPOCHS_WIDTH}}"
    print(f"{'seed':>4} {'reached':>7} {'epochs':>6} {heading} {'wall s':>7}")
    best, reached_after = [], []
    for seed in range(1, args.convergence_seeds + 1):
        name = f"convergence_seed{seed}"
        log_file = os.path.join(logs, f"seed{seed:02d}.log")
        seconds = run_or_resume(
            args,
            work,
            name,
            [
                "--dataset=ml-1m",
                f"--data_dir={data_dir}",
                f"--model_dir={work}/{name}",
                "--clean",
                f"--hr_threshold={args.convergence_target}",
                f"--seed={seed}",
                "--output_ml_perf_compliance_logging",
                f"--mlperf_log_file={log_file}",
                "--nomlperf_clear_caches",
            ],
        )
        records = read_records(f"{work}/{name}/benchmark.jsonl")
        rates = [record["hr"] for record in records if record.get("kind") == "evaluation"]
        hit = next((i + 1 for i, hr in enumerate(rates) if hr >= args.convergence_target), None)
        best.append(max(rates))
        if hit is not None:
            reached_after.append(hit)
        print(
            f"{seed:>4} {'yes' if hit else 'no':>7} {hit or len(rates):>6} "
            f"{' '.join(f'{hr:.4f}' for hr in rates):<{_EPOCHS_WIDTH}} {seconds:>7.0f}"
        )
    mean, sd = mean_and_sd(best)
    print(
        f"reached: {len(reached_after)} of {args.convergence_seeds}; epochs to reach: "
        f"{', '.join(map(str, reached_after)) or '-'}; best HR@10 mean {mean:.4f}, sd {sd:.4f}, "
        f"range {min(best):.4f} to {max(best):.4f}"
    )
    print(f"\nscripts/mlperf_score.py {logs}:")
    # A script beside benchmark_training.py (scripts/ is on the path, as it is for this
    # package), imported here as it imports TensorFlow.
    import mlperf_score

    mlperf_score.main([logs])
    convergence_figure(args, work)
