"""The CPU line every benchmark table starts with, and a process's peak RSS."""

from __future__ import annotations

import ast
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

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


@pytest.mark.integration
def test_the_peak_rss_of_a_live_process_and_of_a_gone_one():
    assert machine.peak_rss_bytes(os.getpid()) > 1 << 20
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert machine.peak_rss_bytes(child.pid) is None


def test_the_peak_rss_starts_again_from_the_current_size():
    block = np.ones(100 * 2**20 // 8)  # 100 MiB, touched
    before = machine.peak_rss_bytes(os.getpid())
    del block
    machine.reset_peak_rss()
    assert before - machine.peak_rss_bytes(os.getpid()) >= 80 * 2**20


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imports_tensorflow(path: str) -> bool:
    """Whether the module at `path` has an import statement of TensorFlow or Keras (one
    in the code a module hands to a child process, a string, is not)."""
    with open(path) as source:
        tree = ast.parse(source.read())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module)
    return any(name and name.split(".")[0] in ("tensorflow", "keras") for name in names)


# The scripts and their modules that import TensorFlow themselves: the ones whose
# import order matters (the others load it through `official` or `recommendation`).
_SCRIPTS = sorted(
    os.path.relpath(os.path.join(folder, name), os.path.join(_ROOT, "scripts"))[
        : -len(".py")
    ].replace(os.sep, ".")
    for folder, _, names in os.walk(os.path.join(_ROOT, "scripts"))
    for name in names
    if name.endswith(".py") and _imports_tensorflow(os.path.join(folder, name))
)
_X86 = platform.machine().lower() in ("x86_64", "amd64")


def _last_word_without_onednn_setting(code: str) -> tuple[str, str]:
    """The last word `code` prints, run by a fresh python in the checkout without
    TF_ENABLE_ONEDNN_OPTS, and the end of its stderr."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=_ROOT,
        env={k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"},
        check=True,
    )
    return result.stdout.split()[-1], result.stderr[-2000:]


@pytest.mark.integration
@pytest.mark.skipif(not _X86, reason="oneDNN is turned on for x86-64 CPUs only")
@pytest.mark.parametrize("package", ["recommendation", "official"])
def test_tensorflow_loaded_after_the_packages_runs_onednn(package):
    # TensorFlow decides when it loads; on a CPU without AVX512-VNNI, AVX512-BF16,
    # AVX-VNNI or AMX its own default is off: `official` sets TF_ENABLE_ONEDNN_OPTS=1
    # before it loads.
    code = (
        f"import {package}; "
        "from official.utils.misc import machine; print(machine.tensorflow_runs_onednn())"
    )
    printed, stderr = _last_word_without_onednn_setting(code)
    assert printed == "True", stderr


# Run first in a fresh interpreter: prints TF_ENABLE_ONEDNN_OPTS as it is when anything
# first imports TensorFlow (what TensorFlow reads as it loads), then exits.
_AT_TENSORFLOWS_IMPORT = """
import os, sys

class AtTensorFlowsImport:
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow":
            print("TF_ENABLE_ONEDNN_OPTS=" + os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset"))
            sys.stdout.flush()
            os._exit(0)

sys.meta_path.insert(0, AtTensorFlowsImport())
sys.path.insert(0, "scripts")
import {module}
print("TensorFlow never imported")
"""


@pytest.mark.integration
@pytest.mark.skipif(not _X86, reason="oneDNN is turned on for x86-64 CPUs only")
@pytest.mark.parametrize("module", _SCRIPTS)
def test_every_script_sets_onednn_on_before_tensorflow_loads(module):
    # A script importing TensorFlow before `official` would run its matmuls on the
    # slower Eigen kernels (what TensorFlow does with the setting in place: the test
    # above).
    printed, stderr = _last_word_without_onednn_setting(
        _AT_TENSORFLOWS_IMPORT.format(module=module)
    )
    assert printed == "TF_ENABLE_ONEDNN_OPTS=1", stderr


@pytest.mark.integration
def test_the_cpu_line_says_whether_onednn_runs_and_a_users_setting_wins(monkeypatch):
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    line = machine.cpu_line()
    assert line.startswith(f"cpu: {machine.describe_cpu()}; {os.cpu_count()} cores; ")
    assert line.endswith("TensorFlow's oneDNN kernels off (TF_ENABLE_ONEDNN_OPTS=0)")
