"""The Metal reduction kernels (metal/reduce.metal), run on the CPU through metal/shim.

Builds metal/tests/kernel_check.cc with the host C++ compiler (directly, not through
CMake: it needs only the reduction sources, so it works wherever a compiler does) and
requires it to report every kernel equal to the CPU reduction path. Apple's Metal
compiler is not available here; metal/README.md lists what that leaves unverified.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
METAL = ROOT / "metal"
CSRC = ROOT / "libmccl" / "csrc"


def _compiler() -> str | None:
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def kernel_check(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    exe = tmp_path_factory.mktemp("metal") / "kernel_check"
    cmd = [cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{METAL}", f"-I{CSRC}",
           str(METAL / "tests" / "kernel_check.cc"),
           # the CPU reduction path: reduce.cc and its reduce_*.cc helpers, dtype and errors
           *(str(f) for f in sorted((CSRC / "reduce").glob("reduce*.cc"))),
           str(CSRC / "core" / "dtype.cc"), str(CSRC / "core" / "errors.cc"), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, f"kernel_check did not compile:\n{build.stderr[-4000:]}"
    return exe


@pytest.mark.timeout(300)
def test_kernels_match_cpu_reduction(kernel_check: Path) -> None:
    run = subprocess.run([str(kernel_check)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"metal kernels differ from the CPU path:\n{run.stderr[-4000:]}"
    m = re.search(r"passed: (\d+) kernels, (\d+) cases", run.stdout)
    assert m, run.stdout
    # 4 dtypes x (sum, min, max, product, finalize_avg) + 3 bitwise int32 kernels.
    assert int(m.group(1)) == 23
    assert int(m.group(2)) > 200


@pytest.mark.timeout(10)
def test_metal_source_stays_plain_msl() -> None:
    # The shim accepts some C++ that Apple's compiler rejects; keep the source to what MSL has.
    src = (METAL / "reduce.metal").read_text()
    includes = re.findall(r"#include\s*[<\"]([^>\"]+)[>\"]", src)
    assert includes == ["metal_stdlib"]
    for forbidden in ("std::", "printf", "malloc", "new ", "double", "long "):
        assert forbidden not in src, f"reduce.metal uses {forbidden!r}, which MSL kernels cannot"
