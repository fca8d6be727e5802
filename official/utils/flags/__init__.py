"""absl flag groups shared by the benchmarks (Model Garden names and meanings)."""

from official.utils.flags.base import define_base
from official.utils.flags.benchmark import define_benchmark
from official.utils.flags.distribution import define_distribution
from official.utils.flags.mlperf import define_mlperf, mlperf_options_from_flags
from official.utils.flags.performance import define_performance, loss_scale_from_flag

__all__ = [
    "define_base",
    "define_benchmark",
    "define_distribution",
    "define_mlperf",
    "define_performance",
    "loss_scale_from_flag",
    "mlperf_options_from_flags",
]
