"""The throughput suite: training examples/s at the MLPerf model size, ours in fp32 and
bf16 with and without XLA against the peer, read against the step's products."""

from __future__ import annotations

import functools
import re
import subprocess
import sys

from official.utils.misc import machine  # no TensorFlow import
from recommendation.training import experiments
from training_benchmarks.harness import (
    MLPERF_MODEL,
    ROOT,
    machine_line,
    ml1m_data_dir,
    run_ours,
    run_peer,
)
from training_benchmarks.plots import throughput_figure
from training_benchmarks.step_flops import (
    CEILING,
    DTYPES,
    cpu_peak_flops,
    executed_flops_per_example,
    measured_product_rates,
    model_flops_per_example,
    product_flops,
    product_seconds,
    step_products,
)

ML1M_USERS, ML1M_ITEMS = 6040, 3706  # the throughput suite's tables (its --ratings)
# Epochs of ML-1M-sized synthetic batches in our throughput rows by default: 16 x 76
# steps, about the peer's 1,200 synthetic steps, so both averages carry their first
# call's tracing and compilation over as many steps.
THROUGHPUT_EPOCHS = 16


def _ours_rate(flags: list[str], log_path: str, tree: str = ROOT) -> tuple[float, int]:
    """(examples/s, steps) of a synthetic-data ncf-main run of the checkout `tree`."""
    _, log = run_ours(flags, log_path, tree)
    rate = float(re.search(r"throughput: ([\d,]+)", log).group(1).replace(",", ""))
    epochs = re.findall(r"epoch \d+ \[#+\] 100.0% (\d+)/\1 batches", log)
    return rate, sum(int(steps) for steps in epochs)


def _repeated_rate(flags: list[str], log_stem: str, tree: str, repeat: int) -> tuple:
    """`_ours_rate` of one repeat of a throughput row, logged to its own file."""
    return _ours_rate(flags, f"{log_stem}_{repeat}.log", tree)


# Our throughput rows: (name, flags after the throughput experiment's). Each sets XLA
# and the steps per call both ways: a --baseline_tree without experiments applies the
# ml-1m preset, which would turn XLA on for the rows meant to run without it.
THROUGHPUT_ROWS = (
    ("ours (fp32)", ["--noenable_xla", "--batches_per_step=1"]),
    ("ours (fp32, XLA, 8 steps/call)", ["--enable_xla", "--batches_per_step=8"]),
    ("ours (bf16)", ["--dtype=bf16", "--noenable_xla", "--batches_per_step=1"]),
    ("ours (bf16, XLA, 8 steps/call)", ["--dtype=bf16", "--enable_xla", "--batches_per_step=8"]),
)


def throughput(args, work: str) -> None:
    """Each of `THROUGHPUT_ROWS` (and the baseline tree's, and the peer) on synthetic
    batches, then the table against the step's products timed in this run."""
    data_dir = ml1m_data_dir(args.ratings, work, "throughput_data")
    # The experiment's values spelled out, which a --baseline_tree of any age takes.
    flags = experiments.as_arguments(experiments.EXPERIMENTS["throughput"].values) + [
        f"--train_epochs={args.throughput_epochs}",
        f"--data_dir={data_dir}",
        f"--model_dir={work}/ours",
        "--clean",
    ]
    trees = {"ours": ROOT, **({"baseline": args.baseline_tree} if args.baseline_tree else {})}
    rows, baseline, each_run = [], [], {}
    for row, (name, extra) in enumerate(THROUGHPUT_ROWS):
        runs = {
            side: functools.partial(_repeated_rate, flags + extra, f"{work}/{side}{row}", tree)
            for side, tree in trees.items()
        }
        results = alternated_runs(runs, args.throughput_repeats)
        rows.append((name, *max(results["ours"])))
        each_run[name] = [rate for rate, _ in results["ours"]]
        if args.baseline_tree:
            baseline.append(max(rate for rate, _ in results["baseline"]))
    if args.peer:
        peer_flags = [
            "--dataset=ml-1m",
            f"--data_dir={args.peer_data}",
            "--clean",
            f"--model_dir={work}/peer",
            "--num_gpus=0",
            "--distribution_strategy=off",
            "--download_if_missing=false",
            "--train_epochs=1",
            "--use_synthetic_data",
            "--batch_size=65536",
            "--eval_batch_size=160000",
            *MLPERF_MODEL,
        ]

        def peer_run(repeat: int) -> tuple[float, int]:
            log_path = f"{work}/peer_{repeat}.log"
            _, log = run_peer(args.peer, peer_flags, log_path, args.peer_seconds)
            windows = re.findall(r"([\d.]+) examples/second between steps \d+ and (\d+)", log)
            if not windows:
                sys.exit(f"the peer logged no examples/second; see {log_path}")
            return sum(float(value) for value, _ in windows) / len(windows), int(windows[-1][1])

        name = "Model Garden NCF (TF 2.15, Keras fit)"
        results = alternated_runs({"peer": peer_run}, args.throughput_repeats)["peer"]
        rows.append((name, *max(results)))
        each_run[name] = [rate for rate, _ in results]
    cpu = machine.describe_cpu()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    peaks = cpu_peak_flops(cpu.isa, lscpu)
    layers, batch = [256, 256, 128, 64], 65536
    products = {
        "ours": step_products(64, layers, batch, (ML1M_USERS, ML1M_ITEMS)),
        "peer": step_products(64, layers, batch),  # the reference's graph
    }
    rate = measured_product_rates([*products["ours"], *products["peer"]])
    ceiling = {dtype: rate[dtype, False][CEILING[1:]] for dtype in DTYPES}
    reference = model_flops_per_example(64, layers)
    executed = executed_flops_per_example(64, layers, batch, ML1M_USERS + ML1M_ITEMS)
    print("\n" + machine_line(args.peer))
    print(
        f"throughput, MLPerf model size, batch {batch:,}, synthetic batches; reference "
        f"{reference:,} FLOP/example (the reference's graph), ours executes "
        f"{executed:,.0f} (first MLP layer on the ML-1M tables, {ML1M_USERS + ML1M_ITEMS:,} "
        "rows, once per step)"
    )
    for dtype, name in DTYPES.items():
        print(
            f"  {name}: measured ceiling {ceiling[dtype] / 1e9:,.0f} GFLOP/s (4096^3 matmul, "
            f"TensorFlow, this run); theoretical {peaks[name][0] / 1e9:,.0f} GFLOP/s = "
            f"{peaks[name][1]}"
        )
    print_products(products, rate)
    print(
        f"{'system':<40} {'steps':>6} {'examples/s':>12} {'ref GFLOP/s':>11} "
        f"{'exec GFLOP/s':>12} {'exec/ceiling':>12} {'step ms':>8} {'products':>8} {'other':>6}"
    )
    step_ms = {}
    for name, examples_per_second, steps in rows:
        ours = name.startswith("ours")
        done = examples_per_second * (executed if ours else reference)
        kernels = ("bfloat16" if "bf16" in name else "float32", "XLA" in name)
        step_ms[name] = 1e3 * batch / examples_per_second
        in_products = 1e3 * product_seconds(products["ours" if ours else "peer"], rate[kernels])
        print(
            f"{name:<40} {steps:>6,} {examples_per_second:>12,.0f} "
            f"{examples_per_second * reference / 1e9:>11.1f} {done / 1e9:>12.1f} "
            f"{done / ceiling[kernels[0]]:>12.1%} {step_ms[name]:>8.1f} {in_products:>8.1f} "
            f"{step_ms[name] - in_products:>6.1f}"
        )
    print(
        "  step ms: the row's mean step (first calls included); products: its graph's "
        "products at the rates above, one after another (the peer's too are timed with this "
        "TensorFlow's kernels, not its 2.15's); other: the rest"
    )
    rates = {name: examples_per_second for name, examples_per_second, _ in rows}
    fp32 = max(rate for name, rate in rates.items() if "fp32" in name)
    bf16 = max(rate for name, rate in rates.items() if "bf16" in name)
    units = [flag for flag in machine.BF16_CPU_FLAGS if flag in cpu.isa.split()]
    print(
        f"ours bf16 / fp32, the faster of each: {bf16 / fp32:.2f}x (bf16 matrix instructions: "
        f"{', '.join(units) or 'none'})"
    )
    if len(rows) == 5:
        peer = rows[-1][1]
        print(f"ours fp32 / peer, examples/s: {fp32 / peer:.2f}x")
        fp32_products = product_seconds(products["ours"], rate["float32", False])
        print(
            f"  ours fp32 doing nothing but its products (TensorFlow's kernels, rates above): "
            f"{batch / fp32_products:,.0f} examples/s, {batch / fp32_products / peer:.2f}x the "
            f"peer; ours fp32 spends {step_ms['ours (fp32)'] - 1e3 * fp32_products:.1f} ms "
            f"of its step on everything but the products"
        )
    if args.throughput_repeats > 1:
        print(f"each row is the best of {args.throughput_repeats} runs; every run, examples/s:")
        for name, runs in each_run.items():
            print(f"  {name:<38} " + " ".join(f"{rate:>9,.0f}" for rate in runs))
    if baseline:
        print(f"against {args.baseline_tree} (the same flags, each run right after ours):")
        for (name, new_rate, _), old in zip(rows, baseline, strict=False):
            print(
                f"  {name:<38} {old:>12,.0f} -> {new_rate:>12,.0f} examples/s: "
                f"{new_rate / old:.2f}x"
            )
    throughput_figure(args, rows)


def print_products(products: dict[str, list[tuple]], rate: dict) -> None:
    """The products of each side's step with their rates, and each step's sum in ms."""
    print("the step's matrix products, each timed alone (best of 5, this run), GFLOP/s:")
    print(
        f"  {'product':<36} {'step of':>9} {'fp32 TF':>8} {'fp32 XLA':>9} {'bf16 TF':>8} "
        f"{'bf16 XLA':>9}"
    )
    kernels = [(dtype, xla) for dtype in DTYPES for xla in (False, True)]
    names = {product[0]: product for product in [*products["ours"], *products["peer"]]}
    for name, product in names.items():
        sides = [side for side, listed in products.items() if product in listed]
        step_of = "both" if len(sides) == 2 else sides[0]
        values = " ".join(f"{rate[k][product[1:]] / 1e9:>8.0f}" for k in kernels)
        print(f"  {name:<36} {step_of:>9} {values}")
    for side, listed in products.items():
        values = " ".join(f"{1e3 * product_seconds(listed, rate[k]):>8.1f}" for k in kernels)
        label = f"sum, {side} ({product_flops(listed) / 1e9:.1f} GFLOP a step), ms"
        print(f"  {label:<46} {values}")


def alternated_runs(runs: dict, repeats: int) -> dict[str, list]:
    """``{name: [result of each repeat]}``, calling each of `runs` (``repeat -> result``)
    in turn, `repeats` times (a, b, a, b): a spell in which this shared machine runs
    slower falls on both sides, and the best of each side is the one it spared."""
    results = {name: [] for name in runs}
    for repeat in range(repeats):
        for name, run in runs.items():
            results[name].append(run(repeat))
    return results
