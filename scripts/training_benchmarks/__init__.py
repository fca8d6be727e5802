"""The suites of scripts/benchmark_training.py, a module each, over a shared harness."""
