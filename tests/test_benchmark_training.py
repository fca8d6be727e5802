"""scripts/benchmark_training.py: the model sizes its suites run and count.

The suites themselves train for minutes to hours and are run by hand (their results
are in docs/benchmarks.md); these checks pin the towers and the FLOP count they report.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "benchmark_training.py")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("benchmark_training", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "factors, tower, layers",
    [
        (8, "text", "32,16,8"),  # the paper's text: "layers 32 -> 16 -> 8"
        (8, "code", "64,32,16,8"),  # the paper's code: NeuMF default [64,32,16,8]
        (8, "deep", "128,64,32,16,8"),
        (64, "text", "256,128,64"),
        (64, "code", "512,256,128,64"),
        (64, "deep", "1024,512,256,128,64"),
    ],
)
def test_paper_towers_end_in_the_predictive_factors(script, factors, tower, layers):
    assert script.paper_layers(factors, tower) == layers


def test_model_flops_count_the_mlperf_model_by_hand(script):
    # MLP 256->256->128->64: 65,536 + 32,768 + 8,192 multiply-adds; the final layer
    # reads 64 GMF + 64 MLP values; x2 FLOPs per multiply-add, x3 forward + backward.
    assert script.model_flops_per_example(64, [256, 256, 128, 64]) == 6 * (106_496 + 128)
