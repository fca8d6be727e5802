"""What machine a benchmark ran on, and what its processes used.

The machines benchmarks run on change between runs (AMD without AVX-512 one
time, Intel with AMX another), so every benchmark table names the CPU behind it:
its model name and the vector ISA extensions it has, and whether TensorFlow's processes
run its oneDNN kernels there (`official` turns them on; a user's setting wins).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys

# The ISA flags that change how fast TensorFlow's and NumPy's kernels run.
_VECTOR_FLAGS = {"sse4_2", "avx", "avx2", "fma", "avx_vnni"}
_VECTOR_FAMILIES = ("avx512", "amx")
# The flags of bf16 matrix instructions, by which bf16 products run faster than fp32's.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    model: str
    isa: str  # the vector flags, space-separated, as /proc/cpuinfo spells them

    def __str__(self) -> str:
        return f"{self.model}; ISA: {self.isa}"


def describe_cpu(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    """The first processor's model name and vector flags (the platform's name where
    /proc/cpuinfo is missing)."""
    try:
        with open(cpuinfo_path) as stream:
            text = stream.read()
    except OSError:
        return CpuInfo(model=platform.processor() or platform.machine(), isa="unknown")
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = [
        flag
        for flag in fields.get("flags", "").split()
        if flag in _VECTOR_FLAGS or flag.startswith(_VECTOR_FAMILIES)
    ]
    return CpuInfo(
        model=fields.get("model name", platform.machine()), isa=" ".join(flags) or "none"
    )


def tensorflow_runs_onednn() -> bool:
    """Whether this process's TensorFlow runs oneDNN's kernels, as it decided when it
    loaded. No public API says: this reads TensorFlow 2.21's private
    `_pywrap_util_port.IsMklEnabled` (tests/test_machine.py fails if it moves)."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


def onednn_enabled() -> bool:
    """Whether a TensorFlow process started from here runs oneDNN's kernels: asked of
    a child process (importing `official` first, as every entry point does)."""
    query = "from official.utils.misc import machine; print(machine.tensorflow_runs_onednn())"
    result = subprocess.run(
        [sys.executable, "-c", query], capture_output=True, text=True, check=True
    )
    return result.stdout.split()[-1] == "True"


def cpu_line() -> str:
    """The line every benchmark table starts with: the CPU, its cores, and TensorFlow's
    kernel library on it (oneDNN's matmuls run at twice the rate of the Eigen ones
    TensorFlow falls back to on an AVX2 CPU)."""
    kernels = "on" if onednn_enabled() else "off"
    variable = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset")
    return (
        f"cpu: {describe_cpu()}; {os.cpu_count()} cores; TensorFlow's oneDNN kernels "
        f"{kernels} (TF_ENABLE_ONEDNN_OPTS={variable})"
    )


def peak_rss_bytes(pid: int) -> int | None:
    """A running process's peak resident set (VmHWM) in bytes; None once it is gone."""
    return _status_bytes(pid, "VmHWM")


def resident_bytes(pid: int) -> int | None:
    """A running process's resident set now (VmRSS) in bytes; None once it is gone."""
    return _status_bytes(pid, "VmRSS")


def _status_bytes(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> None:
    """Starts this process's peak resident set (VmHWM) again from its current size
    (Linux's ``/proc/self/clear_refs``), so that a later `peak_rss_bytes` measures one
    piece of work, not what came before it."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
