"""Fixtures every test folder shares, and the after-test leak check.

The tests are grouped by layer: ``engine/`` (the C++ engine, ranks as threads),
``torch/`` (the backend and its devices), ``daemon/`` (mccld and its client, one host),
``cli/`` (mcclctl), ``e2e/`` (emulated fleets, the tools, campaigns, soak, fuzzing) and
``project/`` (the repository's own checks). Their shared helpers are the ``support``
package. After every test an autouse check (``_no_leaks``, support/leak_check.py) fails
it if it left threads, fds, child processes or shared-memory segments.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import pytest

# numpy's OpenBLAS shuts its thread pool down before every fork (pthread_atfork) and starts it
# again at the next large BLAS call, so after a test that forked ranks the next test's
# np.linalg.norm started a thread the leak check blamed on it (CI, 7 Dec). One BLAS thread:
# the tests' arrays are small and these machines have 2 cores. Set before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # ``support`` for every folder

from support.jobkey import install_session_job_key  # noqa: E402

# Every rank a test starts (threads, forked and spawned processes, torchrun) holds this
# job key, as a fleet's would: the engine's links and the store's values are keyed by it.
install_session_job_key()

from support.daemon import daemon, mccld_proc, raw  # noqa: E402,F401 - fixtures for every folder
from support.pipelined import jittery_daemon  # noqa: E402,F401
from support.rdzv import rdzv_handlers  # noqa: E402,F401
from support.ranks import run_ranks  # noqa: E402 - needs the path above


@pytest.fixture
def ranks() -> Callable[..., list[Any]]:
    return run_ranks


# -- the leak check after every test (support/leak_check.py) ---------------------------------------
def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "leaks_ok(reason): skip the after-test leak check (a test that "
                                       "deliberately leaves something running for later tests)")


@pytest.fixture(scope="session")
def _leak_warm_up() -> None:
    from support import leak_check
    leak_check.warm_up()


@pytest.fixture(autouse=True)
def _no_leaks(request, _leak_warm_up):
    """Function-scoped, so module- and session-scoped fixtures are set up before the
    baseline is taken and torn down after the check: what they hold is not the test's."""
    from support import leak_check
    if request.node.get_closest_marker("leaks_ok"):
        yield
        return
    before = leak_check.snapshot()
    yield
    left = leak_check.leftovers(before)
    if left:
        pytest.fail(f"the test left behind: {left}", pytrace=False)
