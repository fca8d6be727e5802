"""The time-to-target suite: wall time from a cold start to HR@10 >= --target on ML-1M,
ours against the peer, and where our wall time went."""

from __future__ import annotations

import os

from training_benchmarks.harness import (
    MLPERF_MODEL,
    last_summary,
    machine_line,
    ml1m_data_dir,
    peer_hit_rates,
    read_records,
    run_ours,
    run_peer,
)


def time_to_target(args, work: str) -> None:
    """Wall time from a cold start to HR@10 >= --target: ours, then the peer at each
    --peer_learning_rate (its preprocessing cache removed first)."""
    data_dir = ml1m_data_dir(args.ratings, work, "cold_data")
    ours_seconds, log = run_ours(
        [
            "--dataset=ml-1m",
            f"--data_dir={data_dir}",
            f"--model_dir={work}/ttt",
            "--clean",
            "--train_epochs=20",
            f"--hr_threshold={args.target}",
            "--seed=1",
            f"--benchmark_log_dir={work}/ttt",
        ],
        f"{work}/ttt.log",
    )
    summary = last_summary(f"{work}/ttt/benchmark.jsonl")
    print("\n" + machine_line(args.peer))
    print(
        f"time to HR@10 >= {args.target} on ML-1M from a cold start (preprocessing "
        "included; 999 evaluation negatives)"
    )
    print(f"{'system':<40} {'wall s':>8} {'epochs':>7} {'best HR@10':>11}")
    print(
        f"{'ours (ML-1M defaults)':<40} {ours_seconds:>8.1f} {summary['epochs']:>7} "
        f"{summary['best_hr']:>11.4f}"
    )
    print(
        f"trainer wait for data after the first cycle: {summary['wait_seconds']:.2f} s = "
        f"{summary['wait_seconds'] / summary['train_seconds']:.2%} of training step time "
        f"(first cycle: {summary['first_wait_seconds']:.1f} s)"
    )
    parts = wall_time_parts(ours_seconds, summary, read_records(f"{work}/ttt/benchmark.jsonl"))
    print(
        "ours, where the wall time went: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items())
    )
    if not args.peer:
        return
    fastest = None
    for learning_rate in args.peer_learning_rate:
        peer_flags = [
            "--dataset=ml-1m",
            f"--data_dir={args.peer_data}",
            "--clean",
            f"--model_dir={work}/peer_ttt_{learning_rate}",
            "--num_gpus=0",
            "--distribution_strategy=off",
            "--download_if_missing=false",
            "--train_epochs=20",
            f"--hr_threshold={args.target}",
            "--batch_size=16384",
            "--eval_batch_size=160000",
            f"--learning_rate={learning_rate}",
            *MLPERF_MODEL,
        ]
        peer_cache = os.path.join(args.peer_data, "ml-1m", "raw_data_cache_py3.pickle")
        if os.path.exists(peer_cache):  # a cold start for the peer too
            os.remove(peer_cache)
        log_path = f"{work}/peer_ttt_{learning_rate}.log"
        peer_seconds, _ = run_peer(
            args.peer, peer_flags, log_path, args.peer_seconds * 10, stop_at_hr=args.target
        )
        hits = peer_hit_rates(log_path)
        reached = max(hits, default=0.0) >= args.target
        label = f"Model Garden NCF (batch 16384, lr {learning_rate})"
        print(
            f"{label:<40} {peer_seconds:>8.1f} {len(hits):>7} "
            f"{max(hits, default=float('nan')):>11.4f}{'' if reached else '  (not reached)'}"
        )
        if reached and (fastest is None or peer_seconds < fastest):
            fastest = peer_seconds
    if fastest is None:
        print("the peer did not reach the target: no ratio")
    else:
        ratio = ours_seconds / fastest
        print(f"ours / fastest peer wall time: {ratio:.3f}")


def wall_time_parts(wall_seconds: float, summary: dict, records: list[dict]) -> dict[str, float]:
    """A run's wall time split into what its benchmark log measured: training and
    evaluation (summed over epochs), waiting for the producer, the run's own start-up
    and bookkeeping (preprocessing, producer start, model building, checkpoints: the
    rest of `total_seconds`, compilation inside the first calls excepted), and what
    came before `run` (the interpreter and the TensorFlow import)."""
    epochs = [record for record in records if record.get("kind") == "evaluation"]
    train = sum(record["train_seconds"] for record in epochs)
    evaluation = sum(record["eval_seconds"] for record in epochs)
    wait = summary["first_wait_seconds"] + summary["wait_seconds"]
    return {
        "process start and imports": wall_seconds - summary["total_seconds"],
        "run start-up and bookkeeping": summary["total_seconds"] - train - evaluation - wait,
        "waiting for data": wait,
        "training (first calls compile)": train,
        "evaluation": evaluation,
    }
