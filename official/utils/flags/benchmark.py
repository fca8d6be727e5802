"""Benchmark logging flags."""

from absl import flags


def define_benchmark(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines --benchmark_log_dir and --benchmark_test_id."""
    flags.DEFINE_string(
        "benchmark_log_dir",
        None,
        "If set, a JSON-lines benchmark log is written here.",
        short_name="bld",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "benchmark_test_id",
        None,
        "Free-form id recorded with the benchmark run.",
        short_name="bti",
        flag_values=flag_values,
    )
