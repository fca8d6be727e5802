"""The CPU line every benchmark table starts with."""

from __future__ import annotations

from official.utils.misc import cpu_info

_TWO_PROCESSORS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 avx_vnni ht

processor\t: 1
model name\t: something else
flags\t\t: fpu
"""


def test_the_first_processor_is_named_with_its_vector_flags_only(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(_TWO_PROCESSORS)
    info = cpu_info.describe(str(path))
    assert info.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert info.isa == "sse4_2 avx avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 avx_vnni"
    assert str(info) == f"{info.model}; ISA: {info.isa}"


def test_a_machine_without_cpuinfo_is_named_by_its_platform(tmp_path):
    info = cpu_info.describe(str(tmp_path / "missing"))
    assert info.model and info.isa == "unknown"
