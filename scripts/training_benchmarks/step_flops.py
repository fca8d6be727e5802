"""What one training step computes, counted in FLOPs as the reference counts them and
as our graph executes them, and the rates this CPU runs the step's matrix products at
(measured in the run) beside its theoretical peaks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from training_benchmarks.harness import ROOT


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
