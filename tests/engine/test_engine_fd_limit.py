"""The open-file limit: the engine (building a communicator) and mccld (at start) raise the
soft limit to what they need, up to the hard limit, or fail with a ConfigError naming
`ulimit -n`. Each case runs in a subprocess under a low limit set with resource.setrlimit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, {tests!r})
    from libmccl import _core
    from mccl_common.fd_limit import open_file_count
    from support.engine import ranks
    def limit(soft, hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
""").format(tests=str(ROOT / "tests"))


def run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_engine_raises_a_low_soft_limit_up_to_the_hard_one():
    p = run("""
        n = open_file_count()
        limit(n + 12, 4096)  # room for the listeners, not for the links of 4 ranks
        with ranks(4) as cs:
            pass
        print("SOFT", resource.getrlimit(resource.RLIMIT_NOFILE)[0], n)
    """)
    assert p.returncode == 0, p.stderr
    soft, opened = (int(x) for x in p.stdout.split("SOFT")[1].split())
    assert soft > opened + 12


def test_engine_fails_with_a_config_error_naming_ulimit_when_the_hard_limit_is_too_low():
    p = run("""
        from mccl_common.errors import ConfigError
        from support.engine import job_secret, make_options
        opts = make_options()
        secret = job_secret(opts)
        lst = [_core.Listener("127.0.0.1", 0) for _ in range(8)]
        n = open_file_count()
        limit(n + 2, n + 2)  # no room for rank 0's links
        try:
            _core.Communicator(0, 8, 1, lst[0], [x.address for x in lst], opts, None, secret=secret)
        except ConfigError as e:
            print("CONFIG", e)
    """)
    assert "CONFIG" in p.stdout, (p.stdout, p.stderr)
    msg = p.stdout.split("CONFIG", 1)[1]
    assert "ulimit -n" in msg and "open-file limit is" in msg and "hard limit" in msg


def test_mccld_helper_raises_or_names_ulimit():
    p = run("""
        from mccl_common.errors import ConfigError
        from mccl_common.fd_limit import ensure_open_files
        n = open_file_count()
        limit(n + 4, 4096)
        print("RAISED", ensure_open_files(1400, 8192, "[daemon] mccld"))
        limit(n + 4, n + 100)
        try:
            ensure_open_files(1400, 8192, "[daemon] mccld")
        except ConfigError as e:
            print("CONFIG", e)
    """)
    assert p.returncode == 0, p.stderr
    assert int(p.stdout.split("RAISED")[1].split()[0]) == 4096
    assert "[daemon] mccld needs to open 1400 more files" in p.stdout and "ulimit -n" in p.stdout
