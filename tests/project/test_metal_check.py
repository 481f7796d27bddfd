"""scripts/metal_check.py, the macOS workflow's Metal step, as far as it runs off a Mac: what it
records without MPS, and its check of the built .metallib against metal/reduce.metal."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "metal_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("metal_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kernels_in_source() -> set[str]:
    """The host names metal/reduce.metal instantiates, read from its macros."""
    src = (ROOT / "metal" / "reduce.metal").read_text()
    body = src[src.index("#define MCCL_ARITHMETIC_KERNELS"):]
    per_dtype = re.findall(r'"(mccl_\w+_)" tname', body)
    dtypes = re.findall(r'^MCCL_ARITHMETIC_KERNELS\("(\w+)"', body, re.M)
    single = re.findall(r'^MCCL_INSTANTIATE_REDUCE\("(mccl_\w+)"', body, re.M)
    return {p + d for p in per_dtype for d in dtypes} | set(single)


def test_the_kernel_list_is_the_sources():
    assert set(_module().KERNELS) == _kernels_in_source()
    assert len(_module().KERNELS) == 23      # tests/engine/test_metal_kernels.py counts the same


def test_metallib_check_names_a_missing_kernel(tmp_path, monkeypatch):
    from libmccl.devices import metal_ops

    mod = _module()
    monkeypatch.setattr(metal_ops, "bridge_path", lambda: str(tmp_path / "libmccl_metal.dylib"))
    name, ok, detail = mod._metallib_check()
    assert not ok and "was not built" in detail
    blob = b"MTLB" + b"".join(b"NAME" + k.encode() + b"\0" for k in mod.KERNELS)
    (tmp_path / "mccl_reduce.metallib").write_bytes(blob)
    assert mod._metallib_check()[1]
    (tmp_path / "mccl_reduce.metallib").write_bytes(blob.replace(b"mccl_reduce_bxor_int32", b"x"))
    name, ok, detail = mod._metallib_check()
    assert not ok and detail == "missing: ['mccl_reduce_bxor_int32']"


@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform == "darwin", reason="records what a machine without the bridge records")
def test_without_mps_or_bridge_it_fails_and_records_why(tmp_path):
    out, summary = tmp_path / "m.json", tmp_path / "summary.md"
    res = subprocess.run([sys.executable, str(SCRIPT), "--no-mps-ok", "--json", str(out), "--summary", str(summary)],
                         capture_output=True, text=True, timeout=100)
    # --no-mps-ok excuses the missing GPU, not a missing bridge or .metallib.
    assert res.returncode == 1, res.stdout + res.stderr
    rec = json.loads(out.read_text())
    assert rec["mps_available"] is False and rec["mps_detail"] == "torch reports MPS unavailable"
    assert [ok for _, ok, _ in rec["no_gpu_checks"]] == [False, False] and rec["ranks"] == {}
    assert "SKIP the rank checks" in res.stdout
    text = summary.read_text()
    assert "MPS usable: **no**" in text and text.count("| FAIL |") == 2
