"""absl flag groups shared by the benchmarks (Model Garden names and meanings), as
tables of `core.FlagSpec` rows whose defaults each program's config dataclass holds."""

from official.utils.flags.base import BASE_FLAGS
from official.utils.flags.benchmark import BENCHMARK_FLAGS
from official.utils.flags.distribution import DISTRIBUTION_FLAGS
from official.utils.flags.mlperf import define_mlperf, mlperf_options_from_flags
from official.utils.flags.performance import PERFORMANCE_FLAGS, THREAD_FLAGS

__all__ = [
    "BASE_FLAGS",
    "BENCHMARK_FLAGS",
    "DISTRIBUTION_FLAGS",
    "PERFORMANCE_FLAGS",
    "THREAD_FLAGS",
    "define_mlperf",
    "mlperf_options_from_flags",
]
