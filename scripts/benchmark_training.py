"""Training benchmark: this project against the TensorFlow Model Garden NCF, one run.

Suites (each prints a table; both systems run on this machine, in this run):

- ``throughput``: training examples/s at the MLPerf model size (factors 64, layers
  256-256-128-64, batch 65536) on synthetic batches over about as many steps as the
  peer's (first calls included on both sides), ours in fp32 and bf16 with and without
  XLA vs the peer; FLOP/s as the reference counts them and as our graph executes them,
  against matmul ceilings measured in the run; each graph's matrix products timed one
  by one in the run, so that each row's step splits into products and the rest, and
  the most that a step of nothing but our products could reach against the peer.
- ``time_to_target``: wall time from a cold start (preprocessing included) to HR@10
  >= --target on ML-1M (999 evaluation negatives), ours vs the peer; also the time our
  trainer waited for data after the first cycle, as a share of its step time.
- ``convergence``: MLPerf-style runs of the ML-1M defaults over seeds, each stopping at
  HR@10 >= --convergence_target, with compliance logs scored by mlperf_score.py.
- ``paper``: the NCF paper protocol (``ncf-ml-1m`` split, 99 fixed negatives) at
  factors 8, 16, 32 and 64 over seeds, the epoch selected on a validation holdout and
  the test holdout reported once, beside the paper's Table 2 (NeuMF without
  pre-training): mean and standard deviation over the seeds.
- ``pretrained``: the same protocol for the paper's pre-trained NeuMF: a GMF (or MF)
  and an MLP model trained alone, then NeuMF started from both and fine-tuned with SGD,
  each selected on validation, beside Table 2's pre-trained row.

With ``--refit`` the paper and pretrained suites also train each reported configuration
again on all training data, the validation items back in (the paper trained on them),
for the epochs that validation selected, and report that model's test HR once.

    python scripts/benchmark_training.py --suite throughput --suite time_to_target \
        --ratings ../shared/data/ml-1m/ratings.dat --peer ../shared/peer/ncf_official.sh
    python scripts/benchmark_training.py --suite paper --suite pretrained \
        --ncf_dir ../shared/data/ncf --log_dir /tmp/paper

The paper, pretrained and convergence suites train for hours; stopped part way, the
same command with ``--resume`` goes on from the runs that --log_dir holds finished.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from official.utils.misc import machine  # no TensorFlow import
from recommendation.data.constants import TEST_SPLIT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLPERF_MODEL = ["--num_factors=64", "--layers=256,256,128,64", "--mlp_regularization=0,0,0,0"]
# The NCF paper's Table 2, NeuMF without pre-training: (HR@10, NDCG@10) by factors.
PAPER_TABLE2 = {8: (0.688, 0.410), 16: (0.696, 0.420), 32: (0.701, 0.425), 64: (0.705, 0.426)}
# The same table's NeuMF with pre-training (GMF and MLP trained first, alpha 0.5).
PAPER_TABLE2_PRETRAINED = {
    8: (0.684, 0.403),
    16: (0.707, 0.426),
    32: (0.726, 0.445),
    64: (0.730, 0.447),
}
# How the pretrained suite trains each part alone (after the paper protocol's flags).
# ``gmf``: the paper's GMF, as the paper protocol trains NeuMF. ``mf``: GMF's part
# trained as Rendle et al. (2020) train matrix factorisation: a dot product (--model mf),
# plain SGD at 0.008 per example (x the batch: ncf-main's loss is a batch mean), their
# per-example L2 of 0.005 (--row_regularization is half of it: Keras' L2 convention),
# 8 negatives, 64 epochs; the rate, L2 and epochs chosen on validation (docs/benchmarks.md).
MF_BATCH, MF_RATE_PER_EXAMPLE = 8192, 0.008
PART_FLAGS = {
    "gmf": ("--model=gmf",),
    "mlp": ("--model=mlp",),
    "mf": (
        "--model=mf",
        "--optimizer=sgd",
        f"--batch_size={MF_BATCH}",
        f"--learning_rate={MF_RATE_PER_EXAMPLE * MF_BATCH:g}",
        "--row_regularization=0.0025",
        "--num_neg=8",
        "--train_epochs=64",
    ),
}
ML1M_USERS, ML1M_ITEMS = 6040, 3706  # the throughput suite's tables (its --ratings)
# Epochs of ML-1M-sized synthetic batches in our throughput rows by default: 16 x 76
# steps, about the peer's 1,200 synthetic steps, so both averages carry their first
# call's tracing and compilation over as many steps.
THROUGHPUT_EPOCHS = 16


def step_products(
    factors: int, layers: list[int], batch_size: int, table_rows: tuple[int, ...] = ()
) -> list[tuple[str, int, int, int, bool, bool]]:
    """The matrix products of one training step, each ``(name, m, k, n, transpose a,
    transpose b)`` for ``(m x k) @ (k x n)``: every layer's forward product and its two
    backward ones (the input's and the kernel's gradient).

    With `table_rows` (the tables' row counts) and fewer rows than 2 x the batch, NeuMF
    applies the first MLP layer to each table's MLP half once per step
    (`NeuMF._project_tables_first`), so that layer's three products run on each table
    instead of on the batch. The element-wise GMF and the lookups are left out.
    """
    shapes = [(batch_size, a, b) for a, b in zip(layers[:-1], layers[1:], strict=True)]
    if table_rows and sum(table_rows) < 2 * batch_size:
        shapes[:1] = [(rows, layers[0] // 2, layers[1]) for rows in table_rows]
    shapes.append((batch_size, factors + layers[-1], 1))  # the logit's layer
    products = []
    for rows, inputs, outputs in shapes:
        size = f"{rows} x {inputs} -> {outputs}"
        products += [
            (f"{size} forward", rows, inputs, outputs, False, False),
            (f"{size} input gradient", rows, outputs, inputs, False, True),
            (f"{size} kernel gradient", inputs, rows, outputs, True, False),
        ]
    return products


def product_flops(products: list[tuple]) -> int:
    """FLOPs of `products` (`step_products` entries): 2 per multiply-add."""
    return sum(2 * m * k * n for _, m, k, n, _, _ in products)


def model_flops_per_example(factors: int, layers: list[int]) -> int:
    """Forward + backward FLOPs of one example, counted as the reference computes it
    (its "reference FLOPs": a speed figure, the work the reference would do): the
    products of `step_products` for a batch of one and no projected tables."""
    return product_flops(step_products(factors, layers, 1))


def executed_flops_per_example(
    factors: int, layers: list[int], batch_size: int, table_rows: int
) -> float:
    """What our graph computes per example (its "executed FLOPs"): `step_products`
    with the tables' `table_rows` rows, per example of the batch. When the tables are
    fewer than 2 x the batch the first MLP layer costs ``table_rows x layers[0] / 2 x
    layers[1]`` multiply-adds per product and step instead of ``layers[0] x layers[1]``
    per example (how the rows split between the two tables does not change the count).
    """
    return product_flops(step_products(factors, layers, batch_size, (table_rows,))) / batch_size


# FLOP per cycle and core assumed for the widest vector unit the CPU reports, two fused
# multiply-add units of it (Intel's server cores; some AMD cores split a 512-bit
# operation in two, so the measured ceiling beside it is the number to trust).
_FP32_FLOP_PER_CYCLE = (("avx512f", 64), ("avx2", 32), ("avx", 16))
# bf16: AMX tiles (1,024 multiply-adds per cycle), else AVX512-BF16 dot products
# (twice the fp32 rate), else no bf16 arithmetic (converted to fp32).
_BF16_FLOP_PER_CYCLE = (("amx_bf16", 2048), ("avx512_bf16", 128))


def cpu_peak_flops(isa: str, lscpu: str) -> dict[str, tuple[float, str]]:
    """Theoretical fp32 and bf16 peaks: cores x max clock x FLOP/cycle of the ISA.

    Args:
        isa: The CPU's vector flags (`machine.describe_cpu().isa`).
        lscpu: lscpu's output, for the clock (2.5 GHz assumed when it gives none).
    Returns:
        ``{"fp32": (FLOP/s, how), "bf16": (FLOP/s, how)}``.
    """
    found = re.search(r"CPU max MHz:\s*([\d.]+)", lscpu) or re.search(r"CPU MHz:\s*([\d.]+)", lscpu)
    mhz = float(found.group(1)) if found else 2500.0
    clock = f"{mhz:.0f} MHz ({'lscpu' if found else 'assumed: lscpu gives none'})"
    cores = os.cpu_count() or 1
    flags = set(isa.split())
    fp32 = next(((f, n) for f, n in _FP32_FLOP_PER_CYCLE if f in flags), ("sse", 8))
    bf16 = next(((f, n) for f, n in _BF16_FLOP_PER_CYCLE if f in flags), fp32)
    return {
        name: (cores * mhz * 1e6 * per_cycle, f"{cores} cores x {clock} x {per_cycle} ({flag})")
        for name, (flag, per_cycle) in (("fp32", fp32), ("bf16", bf16))
    }


_MATMUL = """
import json, sys, time
import tensorflow as tf
dtype, xla = getattr(tf, sys.argv[1]), sys.argv[2] == "xla"
for m, k, n, transpose_a, transpose_b in json.loads(sys.argv[3]):
    a = tf.cast(tf.random.normal([k, m] if transpose_a else [m, k]), dtype)
    b = tf.cast(tf.random.normal([n, k] if transpose_b else [k, n]), dtype)
    product = lambda a, b: tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    step = tf.function(product, jit_compile=xla)  # the whole product out: nothing to elide
    step(a, b)[0, 0].numpy()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        step(a, b)[0, 0].numpy()
        best = min(best, time.perf_counter() - start)
    print(2 * m * k * n / best, flush=True)
"""
# A large square product: the ceiling that the step's products are read against.
CEILING = ("4096^3", 4096, 4096, 4096, False, False)
# TensorFlow's names of the dtypes the products are timed in, and ours.
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def measured_matmul_flops(dtype: str, products: list[tuple], xla: bool = False) -> list[float]:
    """FLOP/s of each of `products` (`step_products` entries, or `CEILING`) in TensorFlow
    on this CPU, best of 5 each, in one child process: without XLA TensorFlow's own
    kernels (oneDNN), with it XLA's."""
    shapes = [
        [m, k, n, transpose_a, transpose_b] for _, m, k, n, transpose_a, transpose_b in products
    ]
    result = subprocess.run(
        [sys.executable, "-c", _MATMUL, dtype, "xla" if xla else "tf", json.dumps(shapes)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return [float(line) for line in result.stdout.split()[-len(products) :]]


def product_seconds(products: list[tuple], rate: dict[tuple, float]) -> float:
    """Seconds that `products` take one after another at `rate` (FLOP/s by shape)."""
    return sum(product_flops([product]) / rate[product[1:]] for product in products)


def _ours(args: list[str], log_path: str, tree: str = ROOT) -> tuple[float, str]:
    """Runs ncf-main of the checkout `tree`; returns (wall seconds, its output). Exits
    with the end of its log if it fails (bad flags included: ncf-main's checks decide)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        status = subprocess.run(
            [sys.executable, "-m", "recommendation.ncf_main", *args],
            cwd=tree,
            env={**os.environ, "PYTHONPATH": tree},
            stdout=log,
            stderr=subprocess.STDOUT,
        ).returncode
    with open(log_path) as log:
        output = log.read()
    if status:
        tail = "".join(output.splitlines(keepends=True)[-10:])
        sys.exit(f"ncf-main exited with status {status}; the end of {log_path}:\n{tail}")
    return time.perf_counter() - start, output


def _peer(
    peer: str, args: list[str], log_path: str, timeout: float, stop_at_hr: float | None = None
) -> tuple[float, str]:
    """Runs the Model Garden NCF; returns (seconds, log).

    It is killed after `timeout` s, or as soon as its log shows an epoch with HR@10 >=
    `stop_at_hr` (its own early stop watches a metric its Keras path no longer logs).
    """
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            ["bash", peer, "run", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **peer_process(),
        )
        while process.poll() is None and time.perf_counter() - start < timeout:
            time.sleep(1)
            if stop_at_hr is not None and max(peer_hit_rates(log_path), default=0) >= stop_at_hr:
                break
        seconds = time.perf_counter() - start
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
    with open(log_path) as log:
        return seconds, log.read()


def peer_process() -> dict:
    """Where and how every peer command runs (subprocess keywords). Its package is also
    called `official`: away from this checkout, and without PYTHONPATH, which can name
    one of ours (a run from a worktree) and so put our `official` before the peer's.
    The rest of the environment is ours, TF_ENABLE_ONEDNN_OPTS included (set when this
    script imported `official`): the peer's TensorFlow runs the same kernels as ours."""
    return {
        "cwd": tempfile.gettempdir(),
        "env": {name: value for name, value in os.environ.items() if name != "PYTHONPATH"},
    }


def peer_hit_rates(log_path: str) -> list[float]:
    """Per-epoch HR@10 of the peer: its Keras log prints the sum and count of hits."""
    with open(log_path, errors="replace") as log:
        pairs = re.findall(r"val_hr_sum: ([\d.e+-]+) - val_hr_count: ([\d.e+-]+)", log.read())
    return [float(hits) / max(float(count), 1e-9) for hits, count in pairs]


def ml1m_data_dir(ratings: str, work: str, name: str) -> str:
    """A fresh data dir holding a link to `ratings` as ml-1m/ratings.dat (no cache)."""
    data_dir = os.path.join(work, name)
    os.makedirs(os.path.join(data_dir, "ml-1m"))
    os.symlink(os.path.abspath(ratings), os.path.join(data_dir, "ml-1m", "ratings.dat"))
    return data_dir


def _ours_rate(flags: list[str], log_path: str, tree: str = ROOT) -> tuple[float, int]:
    """(examples/s, steps) of a synthetic-data ncf-main run of the checkout `tree`."""
    _, log = _ours(flags, log_path, tree)
    rate = float(re.search(r"throughput: ([\d,]+)", log).group(1).replace(",", ""))
    epochs = re.findall(r"epoch \d+ \[#+\] 100.0% (\d+)/\1 batches", log)
    return rate, sum(int(steps) for steps in epochs)


def _repeated_rate(flags: list[str], log_stem: str, tree: str, repeat: int) -> tuple:
    """`_ours_rate` of one repeat of a throughput row, logged to its own file."""
    return _ours_rate(flags, f"{log_stem}_{repeat}.log", tree)


# Our throughput rows: (name, flags after the MLPerf model's). Each sets XLA and the
# steps per call both ways: the ml-1m preset would otherwise turn XLA on for the rows
# meant to run without it (as it did through the ninth session).
THROUGHPUT_ROWS = (
    ("ours (fp32)", ["--noenable_xla", "--batches_per_step=1"]),
    ("ours (fp32, XLA, 8 steps/call)", ["--enable_xla", "--batches_per_step=8"]),
    ("ours (bf16)", ["--dtype=bf16", "--noenable_xla", "--batches_per_step=1"]),
    ("ours (bf16, XLA, 8 steps/call)", ["--dtype=bf16", "--enable_xla", "--batches_per_step=8"]),
)


def throughput(args, work: str) -> None:
    data_dir = ml1m_data_dir(args.ratings, work, "throughput_data")
    flags = MLPERF_MODEL + [
        "--batch_size=65536",
        "--use_synthetic_data",
        f"--train_epochs={args.throughput_epochs}",
        "--dataset=ml-1m",
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
            _, log = _peer(args.peer, peer_flags, log_path, args.peer_seconds)
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
    print("\n" + machine.cpu_line() + ("; the peer's the same" if args.peer else ""))
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
        f"{', '.join(units) or 'none'}; issue 18: >= 1.5x with them, else >= 0.95x or the "
        "README advises fp32)"
    )
    if len(rows) == 5:
        peer = rows[-1][1]
        print(f"ours fp32 / peer: {fp32 / peer:.2f}x (target >= 3.0x, issue 18)")
        fp32_products = product_seconds(products["ours"], rate["float32", False])
        needed_ms = 1e3 * batch / (3.0 * peer)
        print(
            f"  ours fp32 doing nothing but its products (TensorFlow's kernels, rates above): "
            f"{batch / fp32_products:,.0f} examples/s, {batch / fp32_products / peer:.2f}x the "
            f"peer; 3.0x is a {needed_ms:.1f} ms step, which leaves "
            f"{needed_ms - 1e3 * fp32_products:.1f} ms for everything but the products "
            f"(ours fp32 spends {step_ms['ours (fp32)'] - 1e3 * fp32_products:.1f})"
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


def measured_product_rates(products: list[tuple]) -> dict[tuple, dict[tuple, float]]:
    """``{(dtype, xla): {shape: FLOP/s}}`` for each distinct shape of `products` and,
    with TensorFlow's kernels, `CEILING`, in fp32 and bf16, with and without XLA."""
    shapes = list(dict.fromkeys(product[1:] for product in products))
    rate = {}
    for dtype in DTYPES:
        for xla in (False, True):
            measured = [("", *shape) for shape in shapes] + ([] if xla else [CEILING])
            flops = measured_matmul_flops(dtype, measured, xla)
            rate[dtype, xla] = {
                product[1:]: value for product, value in zip(measured, flops, strict=True)
            }
    return rate


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


def time_to_target(args, work: str) -> None:
    data_dir = ml1m_data_dir(args.ratings, work, "cold_data")
    ours_seconds, log = _ours(
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
    summary = _last_summary(f"{work}/ttt/benchmark.jsonl")
    print("\n" + machine.cpu_line() + ("; the peer's the same" if args.peer else ""))
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
    parts = wall_time_parts(ours_seconds, summary, _records(f"{work}/ttt/benchmark.jsonl"))
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
        peer_seconds, _ = _peer(
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
        print(f"ours / fastest peer wall time: {ratio:.3f} (target <= 0.15, issue 18)")


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
    print(f"{'seed':>4} {'reached':>7} {'epochs':>6} {'HR@10 by epoch':<60} {'wall s':>7}")
    best, reached_after = [], []
    for seed in range(1, args.convergence_seeds + 1):
        name = f"convergence_seed{seed}"
        log_file = os.path.join(logs, f"seed{seed:02d}.log")
        seconds = _run_or_resume(
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
        records = _records(f"{work}/{name}/benchmark.jsonl")
        rates = [record["hr"] for record in records if record.get("kind") == "evaluation"]
        hit = next((i + 1 for i, hr in enumerate(rates) if hr >= args.convergence_target), None)
        best.append(max(rates))
        if hit is not None:
            reached_after.append(hit)
        print(
            f"{seed:>4} {'yes' if hit else 'no':>7} {hit or len(rates):>6} "
            f"{' '.join(f'{hr:.4f}' for hr in rates):<60} {seconds:>7.0f}"
        )
    mean, sd = mean_and_sd(best)
    print(
        f"reached: {len(reached_after)} of {args.convergence_seeds}; epochs to reach: "
        f"{', '.join(map(str, reached_after)) or '-'}; best HR@10 mean {mean:.4f}, sd {sd:.4f}, "
        f"range {min(best):.4f} to {max(best):.4f}"
    )
    print(f"\nscripts/mlperf_score.py {logs}:")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mlperf_score  # a sibling script; here, as it imports TensorFlow

    mlperf_score.main([logs])


PAPER_TOWER_DEPTHS = {"text": 3, "code": 4, "deep": 5}  # entries of --layers


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


def _paper_run(args, work: str, name: str, factors: int, seed: int, *flags: str) -> tuple:
    """One validation-selected run of the paper protocol, the configuration from the
    --paper_* options and `flags` after them (a later flag wins); returns (its summary,
    wall seconds)."""
    layers = paper_layers(factors, args.paper_tower)
    seconds = _run_or_resume(
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
    return _last_summary(f"{work}/{name}/benchmark.jsonl"), seconds


PAPER_HEADER = (
    f"{'factors':>7} {'seed':>5} {'model':>14} {'epoch':>5} {'val HR':>7} {'test HR':>8} "
    f"{'test NDCG':>9} {'paper HR':>9} {'paper NDCG':>11} {'wall s':>7}"
)


def _paper_row(factors, seed, model: str, summary: dict, paper_row: tuple | None, seconds) -> str:
    """One run's line; `paper_row`: Table 2's (HR@10, NDCG@10), None where it has none."""
    paper_hr, paper_ndcg = (f"{value:.3f}" for value in paper_row) if paper_row else ("-", "-")
    return (
        f"{factors:>7} {seed:>5} {model:>14} {summary['best_epoch']:>5} "
        f"{summary['best_hr']:>7.4f} {summary['test_hr']:>8.4f} {summary['test_ndcg']:>9.4f} "
        f"{paper_hr:>9} {paper_ndcg:>11} {seconds:>7.0f}"
    )


def _paper_mean_row(factors, model: str, summaries: list[dict], paper_row: tuple) -> str:
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


def _paper_configuration(args) -> str:
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
            summary, seconds = _paper_run(args, work, name, factors, seed)
            summaries.append(summary)
            print(_paper_row(factors, seed, "neumf", summary, PAPER_TABLE2[factors], seconds))
        print(_paper_mean_row(factors, "neumf", summaries, PAPER_TABLE2[factors]))
        if args.refit:
            print(REFIT_HEADING)
            refits = []
            for seed, selected in zip(args.paper_seed, summaries, strict=True):
                name = f"paper{factors}_seed{seed}"
                refit, seconds = _refit_run(args, work, name, factors, seed, selected)
                refits.append(refit)
                print(_paper_row(factors, seed, "neumf", refit, PAPER_TABLE2[factors], seconds))
            print(_paper_mean_row(factors, "neumf", refits, PAPER_TABLE2[factors]))
    print(_paper_configuration(args))


def pretrained(args, work: str) -> None:
    """The paper's pre-trained NeuMF (its section 3.4.1), each stage selected on
    validation: an MLP model and each --pretrain_gmf_part (`PART_FLAGS`) trained alone,
    then NeuMF started from the MLP and each GMF part (alpha 0.5) and fine-tuned with
    plain SGD, the paper's switch, at each --pretrain_learning_rate; the test holdout
    reported once per run, at its selected epoch, and the GMF part and rate chosen on
    mean validation HR@10 over the seeds."""
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
                name = _part_name(factors, seed, part)
                summary, seconds = _paper_run(args, work, name, factors, seed, *PART_FLAGS[part])
                parts[seed, part] = summary
                print(_paper_row(factors, seed, part, summary, None, seconds))
            for (part, rate), runs in summaries.items():
                name = _pretrained_name(factors, seed, part, rate)
                flags = _fine_tuning_flags(args, work, factors, seed, part, rate)
                summary, seconds = _paper_run(args, work, name, factors, seed, *flags)
                runs.append(summary)
                print(_paper_row(factors, seed, _setting(part, rate), summary, paper_row, seconds))
        chosen = chosen_on_validation(summaries)
        print(_paper_mean_row(factors, _setting(*chosen), summaries[chosen], paper_row))
        if len(summaries) > 1:
            print(
                f"{'':>7} GMF part and SGD rate ({_setting(*chosen)}) chosen on mean "
                "validation HR@10"
            )
        if args.refit:
            _pretrained_refits(args, work, factors, chosen, parts, summaries[chosen])
    print(
        _paper_configuration(args) + f"; NeuMF fine-tuned with SGD (constant rate) for "
        f"{args.pretrain_epochs or args.paper_epochs} epochs, alpha 0.5; the parts: "
        + "; ".join(
            f"{part} {' '.join(PART_FLAGS[part])}" for part in ("mlp", *args.pretrain_gmf_part)
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
            name = _part_name(factors, seed, each)
            refit, seconds = _refit_run(
                args, work, name, factors, seed, parts[seed, each], *PART_FLAGS[each]
            )
            print(_paper_row(factors, seed, each, refit, None, seconds))
        name = _pretrained_name(factors, seed, part, rate)
        flags = _fine_tuning_flags(args, work, factors, seed, part, rate, REFIT_SUFFIX)
        refit, seconds = _refit_run(args, work, name, factors, seed, selected, *flags)
        refits.append(refit)
        print(_paper_row(factors, seed, _setting(*chosen), refit, paper_row, seconds))
    print(_paper_mean_row(factors, _setting(*chosen), refits, paper_row))


def _part_name(factors: int, seed: int, part: str) -> str:
    return f"pretrained{factors}_seed{seed}_{part}"


def _pretrained_name(factors: int, seed: int, part: str, rate: float) -> str:
    return f"pretrained{factors}_seed{seed}_neumf_{part}_sgd{rate:g}"


def _fine_tuning_flags(
    args, work: str, factors: int, seed: int, part: str, rate: float, suffix: str = ""
) -> tuple[str, ...]:
    """NeuMF started from the MLP part and the GMF `part` of `seed` (their runs' names
    + `suffix`) and fine-tuned with plain SGD at `rate`, the paper's switch."""
    return (
        f"--pretrain_gmf_dir={work}/{_part_name(factors, seed, part)}{suffix}",
        f"--pretrain_mlp_dir={work}/{_part_name(factors, seed, 'mlp')}{suffix}",
        "--optimizer=sgd",
        f"--learning_rate={rate}",
        f"--train_epochs={args.pretrain_epochs or args.paper_epochs}",
    )


REFIT_SUFFIX = "_refit"
REFIT_HEADING = (
    f"{'':>7} --refit: each run above trained again on all training data (its validation "
    "items back in) for its selected epochs, test reported once at the end"
)


def _refit_run(
    args, work: str, name: str, factors: int, seed: int, selected: dict, *flags: str
) -> tuple:
    """The run `name` (`flags` after the paper protocol's) trained again as the paper
    trained: on every training interaction, the validation items included, for the
    epochs that validation selected (`selected`, that run's summary), in one cycle so
    that the test holdout is evaluated once, at the end. Returns (a summary: the
    validation run's epoch and HR with this run's test HR and NDCG, its wall seconds)."""
    epochs = selected["best_epoch"] + 1
    refit, seconds = _paper_run(
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


def mean_and_sd(values) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    values = list(values)
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


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


def _run_or_resume(args, work: str, name: str, flags: list[str]) -> float:
    """Runs ncf-main with `flags` as the run `name` (its benchmark log in work/name, its
    output in work/name.log); returns its wall seconds. With --resume, a run that
    finished before with the same flags is reused instead: its seconds are the ones its
    benchmark log measured (training and evaluation, without the process start)."""
    flags = [*flags, f"--benchmark_log_dir={work}/{name}"]
    if args.resume:
        summary = finished_run(f"{work}/{name}/benchmark.jsonl", flags)
        if summary is not None:
            print(f"--resume: {name} finished before with these flags; reused", file=sys.stderr)
            return summary["total_seconds"]
    return _ours(flags, f"{work}/{name}.log")[0]


def finished_run(benchmark_log: str, flags: list[str]) -> dict | None:
    """The summary of the ncf-main run that wrote `benchmark_log`, if it finished after
    every run whose folder a flag names (a pre-trained part: retrained, it makes this
    run stale) and every one of `flags` holds in its run_info record; otherwise None
    (no log, a run that was stopped, a stale run, other flag values)."""
    try:
        records = _records(benchmark_log)
        finished_at = os.path.getmtime(benchmark_log)
    except (OSError, ValueError):  # no log, or a line cut short by a kill
        return None
    for flag in flags:
        other_log = os.path.join(flag.partition("=")[2], "benchmark.jsonl")
        if os.path.isfile(other_log) and os.path.getmtime(other_log) > finished_at:
            return None
    starts = [i for i, record in enumerate(records) if record.get("kind") == "run_info"]
    if not starts:
        return None
    recorded = records[starts[-1]]["flags"]
    summaries = [r for r in records[starts[-1] :] if r.get("kind") == "summary"]
    latest = dict(_flag_setting(recorded, flag) for flag in flags)  # a later flag wins
    if not summaries or not all(
        name in recorded and _value_holds(recorded[name], value) for name, value in latest.items()
    ):
        return None
    return summaries[-1]


def _flag_setting(recorded: dict, flag: str) -> tuple[str, str]:
    """(the flag that the command-line `flag` sets, the value it gives, as text):
    ``--name=value``; ``--name`` gives true; ``--noname``, for a boolean ``name`` that
    `recorded` holds, false."""
    name, has_value, value = flag.removeprefix("--").partition("=")
    if has_value:
        return name, value
    if name not in recorded and name.startswith("no"):
        return name[2:], "false"
    return name, "true"


def _value_holds(held: object, value: str) -> bool:
    """Whether the text `value` gives `held`, a flag's value as absl records it."""
    if isinstance(held, bool):
        return value.lower() in (("true", "1") if held else ("false", "0"))
    if isinstance(held, list):
        return ",".join(map(str, held)) == value
    if isinstance(held, (int, float)):
        try:
            return float(value) == held
        except ValueError:
            return False
    return str(held) == value


def _records(path: str) -> list[dict]:
    with open(path) as log:
        return [json.loads(line) for line in log]


def _last_summary(path: str) -> dict:
    return [record for record in _records(path) if record.get("kind") == "summary"][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--suite",
        action="append",
        required=True,
        choices=["throughput", "time_to_target", "paper", "pretrained", "convergence"],
    )
    parser.add_argument("--ratings", help="ML-1M ratings.dat")
    parser.add_argument("--ncf_dir", help="folder holding ml-1m.train.rating etc.")
    parser.add_argument("--peer", help="path of ../shared/peer/ncf_official.sh")
    parser.add_argument("--peer_data", default="/tmp/peer-data")
    parser.add_argument(
        "--peer_seconds",
        type=float,
        default=240,
        help="how long the peer's throughput run may take",
    )
    parser.add_argument("--target", type=float, default=0.20)
    parser.add_argument(
        "--peer_learning_rate",
        type=float,
        action="append",
        help="learning rate(s) of the peer's time-to-target runs (default 0.001, its tuned "
        "value from the issue); each is a separate cold-start run",
    )
    parser.add_argument(
        "--log_dir",
        help="keep every run's log and model here (default: a "
        "temporary folder, deleted at the end)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="reuse each training run of the paper, pretrained and convergence suites "
        "that --log_dir holds finished with the same flags (a suite stopped part way "
        "goes on from there); a reused run's seconds are its benchmark log's",
    )
    parser.add_argument(
        "--refit",
        action="store_true",
        help="paper and pretrained suites: also train each reported configuration again "
        "on all training data (the validation items back in, as the paper trained) for "
        "the epochs validation selected, and report its test HR once, at the end",
    )
    parser.add_argument(
        "--throughput_epochs",
        type=int,
        default=THROUGHPUT_EPOCHS,
        help="epochs of synthetic ML-1M steps per throughput row (the default: about as "
        "many steps as the peer's)",
    )
    parser.add_argument(
        "--throughput_repeats",
        type=int,
        default=1,
        help="runs of each throughput row (ours, the baseline tree's, the peer's), taken "
        "in turn; each row reports its best, and every run is printed",
    )
    parser.add_argument(
        "--baseline_tree",
        help="another checkout (an older commit): each throughput row is run there too, "
        "right after ours, and the ratio printed",
    )
    parser.add_argument("--convergence_seeds", type=int, default=10)
    parser.add_argument(
        "--convergence_target", type=float, default=0.23, help="HR@10, 999 negatives"
    )
    parser.add_argument("--paper_epochs", type=int, default=12)
    parser.add_argument(
        "--paper_factors",
        type=int,
        action="append",
        choices=sorted(PAPER_TABLE2),
        help="default: 8, 16, 32 and 64",
    )
    parser.add_argument("--paper_learning_rate", type=float, default=0.001)
    parser.add_argument(
        "--pretrain_learning_rate",
        type=float,
        action="append",
        help="SGD learning rate(s) of the pre-trained NeuMF (the pretrained suite; "
        "default: 0.001, the paper code's), each fine-tuned from the same GMF and MLP "
        "models; the one with the best mean validation HR@10 is reported",
    )
    parser.add_argument(
        "--pretrain_epochs",
        type=int,
        help="epochs of the pre-trained NeuMF's fine-tuning (default: --paper_epochs)",
    )
    parser.add_argument(
        "--pretrain_gmf_part",
        action="append",
        choices=["gmf", "mf"],
        help="how the pretrained suite trains NeuMF's GMF part (PART_FLAGS; default: "
        "both, the one with the best mean validation HR@10 of its NeuMF is reported)",
    )
    parser.add_argument("--paper_learning_rate_decay", type=float, default=1.0)
    parser.add_argument("--paper_decay_start_epoch", type=int, default=0)
    parser.add_argument(
        "--paper_tower",
        choices=list(PAPER_TOWER_DEPTHS),
        default="code",
        help="MLP tower: the paper's code (4 layers, 8x factors wide), its text (3 layers, "
        "4x) or one layer deeper than the code (5 layers, 16x)",
    )
    parser.add_argument(
        "--paper_weight_decay", type=float, default=0.0, help="decoupled (AdamW) weight decay"
    )
    parser.add_argument(
        "--paper_sparse_updates",
        action="store_true",
        help="update only the embedding rows in each batch (lazy Adam); the default, "
        "dense Adam over whole tables, is what the paper's Keras code did",
    )
    parser.add_argument(
        "--paper_num_neg", type=int, default=4, help="training negatives per positive"
    )
    parser.add_argument(
        "--paper_embedding_init",
        choices=["glorot_uniform", "normal"],
        default="normal",
        help="normal: N(0, 0.01^2) as in the paper's code",
    )
    parser.add_argument(
        "--paper_seed", type=int, action="append", help="one run per seed (default: 1, 2, 3)"
    )
    parser.add_argument(
        "--paper_batch_size",
        type=int,
        default=1024,
        help="the paper used 256; larger batches keep this CPU run short",
    )
    args = parser.parse_args()
    if args.resume and not args.log_dir:
        parser.error("--resume needs --log_dir, the folder of the runs to go on from")
    args.peer_learning_rate = args.peer_learning_rate or [0.001]
    args.paper_factors = args.paper_factors or sorted(PAPER_TABLE2)
    args.paper_seed = args.paper_seed or [1, 2, 3]
    args.pretrain_learning_rate = args.pretrain_learning_rate or [0.001]
    args.pretrain_gmf_part = args.pretrain_gmf_part or ["gmf", "mf"]
    if args.peer:
        subprocess.run(["bash", args.peer, "setup"], check=True, **peer_process())
        if args.ratings:
            subprocess.run(
                ["bash", args.peer, "prepare", os.path.abspath(args.ratings), args.peer_data],
                check=True,
                **peer_process(),
            )
    with tempfile.TemporaryDirectory() as temp_dir:
        work = args.log_dir or temp_dir
        os.makedirs(work, exist_ok=True)
        for suite in args.suite:
            suites = {
                "throughput": throughput,
                "time_to_target": time_to_target,
                "paper": paper,
                "pretrained": pretrained,
                "convergence": convergence,
            }
            suites[suite](args, work)


if __name__ == "__main__":
    main()
