"""One OpenSSL in a process that runs MCCL (issue 34): the engine's libcrypto, Python's hashlib
and the AES-GCM of the control links (mccl_common/aead.py) are the same library, so a
security team patches one. A copy is found the way it would be patched: a mapped file that
carries an OpenSSL version banner (a shared libcrypto, or a copy linked into another module)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")]

_PROBE = textwrap.dedent(r"""
    import json, re, sys

    BANNER = re.compile(rb"OpenSSL \d+\.\d+\.\d+[a-z]?(?:-[\w.]+)? +\d{1,2} \w{3} \d{4}")

    def builds():
        found = {}
        for line in open("/proc/self/maps"):
            parts = line.split()
            if len(parts) < 6 or not parts[5].startswith("/") or parts[5] in found:
                continue
            try:
                with open(parts[5], "rb") as fh:
                    m = BANNER.search(fh.read())
            except OSError:
                continue
            if m:
                found[parts[5]] = m.group().decode()
        return found

    import hashlib, hmac, secrets, ssl
    hmac.new(b"k", b"m", hashlib.sha256).digest()
    python_only = builds()

    import libmccl, libmccl._core, libmccl.torch, mccl_common, mcclctl, mccld, mccld.daemon, mccld.net.auth
    from mccl_common import aead, libcrypto
    tx, rx = aead.Box(bytes(32)), aead.Box(bytes(32))
    assert rx.open(tx.seal(b"m", b"a")[1], b"a") == b"m"
    print(json.dumps({"python": python_only, "all": builds(), "aead_lib": libcrypto.lib().library,
                      "cryptography": sorted(m for m in sys.modules if m.split(".")[0] == "cryptography")}))
""")


def test_the_engine_python_and_the_control_links_share_one_openssl():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["cryptography"] == [], got
    assert len(got["python"]) == 1, got
    if "libcrypto" not in next(iter(got["python"])):
        pytest.skip(f"this Python links its own OpenSSL into {next(iter(got['python']))}: the engine cannot share it")
    assert got["all"] == got["python"], (
        f"importing MCCL added OpenSSL copies beside Python's own {got['python']}: {got['all']}")
