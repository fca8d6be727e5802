"""The CPU line every benchmark table starts with, and a process's peak RSS."""

from __future__ import annotations

import os
import subprocess
import sys

from official.utils.misc import machine

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
    info = machine.describe_cpu(str(path))
    assert info.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert info.isa == "sse4_2 avx avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 avx_vnni"
    assert str(info) == f"{info.model}; ISA: {info.isa}"


def test_a_machine_without_cpuinfo_is_named_by_its_platform(tmp_path):
    info = machine.describe_cpu(str(tmp_path / "missing"))
    assert info.model and info.isa == "unknown"


def test_the_peak_rss_of_a_live_process_and_of_a_gone_one():
    assert machine.peak_rss_bytes(os.getpid()) > 1 << 20
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert machine.peak_rss_bytes(child.pid) is None
