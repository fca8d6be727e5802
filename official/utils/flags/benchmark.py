"""Benchmark logging flags (rows setting the config fields of the same names)."""

from official.utils.flags.core import FlagSpec

BENCHMARK_FLAGS = (
    FlagSpec(
        "benchmark_log_dir",
        "If set, a JSON-lines benchmark log is written here.",
        short_name="bld",
    ),
    FlagSpec(
        "benchmark_test_id", "Free-form id recorded with the benchmark run.", short_name="bti"
    ),
)
