"""`torchrun --rdzv-backend mccl` for real: two "hosts" on loopback, each a torchrun of its own
(own MCCL_HOST_ID), running tests/support/rdzv_worker.py. No MASTER_ADDR anywhere: the anchor
named by --rdzv-endpoint is all they share. Each torchrun runs under a hard timeout in its own
session, so a hang fails the test and nothing outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.ports import free_port as _free_port

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "rdzv_worker.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
HARD_S = 60.0  # per torchrun: far past every bound asserted below


class Host:
    """One torchrun, standing for one host of the job."""

    def __init__(self, name: str, port: int, nnodes: str, *args: str, conf: str = "", restarts: int = 0,
                 env: dict[str, str] | None = None) -> None:
        cmd = [*TORCHRUN, "--rdzv-backend", "mccl", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t",
               "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", str(restarts),
               "--monitor-interval", "0.1"]
        if conf:
            cmd += ["--rdzv-conf", conf]
        full_env = {**os.environ, "MCCL_HOST_ID": name, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        for k in ("MASTER_ADDR", "MASTER_PORT", "MCCL_DAEMON"):
            full_env.pop(k, None)
        self.name = name
        self.started = time.monotonic()
        self.proc = subprocess.Popen([*cmd, str(WORKER), *args], env=full_env, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.ended: float | None = None
        # A reader thread, so that waiting for a line can time out; it ends at torchrun's EOF.
        self._reader = threading.Thread(target=self._read, name=f"torchrun-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def results(self) -> list[dict]:
        return [json.loads(line.split("RESULT ", 1)[1]) for line in list(self.lines) if line.startswith("RESULT ")]

    def wait_result(self, n: int = 1, timeout_s: float = HARD_S) -> dict:
        """The n-th RESULT line (the worker's stdout comes through torchrun's)."""
        deadline = time.monotonic() + timeout_s
        while len(self.results()) < n:
            if self.proc.poll() is not None and not self._reader.is_alive() and len(self.results()) < n:
                pytest.fail(f"{self.name} exited (rc={self.proc.returncode}) before RESULT {n}:\n{self.text()}")
            assert time.monotonic() < deadline, f"{self.name}: no RESULT {n} within {timeout_s}s:\n{self.text()}"
            time.sleep(0.05)
        return self.results()[n - 1]

    def finish(self, timeout_s: float = HARD_S) -> int:
        try:
            self.proc.wait(timeout=max(0.1, self.started + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.close()
            pytest.fail(f"{self.name} still running after {timeout_s}s:\n{self.text()}")
        self.ended = time.monotonic()
        self._reader.join(10)
        return self.proc.returncode

    def kill(self, worker_pids: list[int] = ()) -> None:
        """SIGKILL torchrun and its workers together (torchrun starts workers in sessions of
        their own): the host is gone, nothing says goodbye."""
        for pid in worker_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill([r["pid"] for r in self.results()])
        self.proc.wait(timeout=10)
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def text(self) -> str:
        return "\n".join(self.lines[-60:])


@pytest.fixture
def hosts():
    made: list[Host] = []

    def make(*args, **kw) -> Host:
        made.append(Host(*args, **kw))
        return made[-1]

    yield make
    for h in made:
        h.close()


def test_two_hosts_meet_at_the_anchor_and_all_reduce(hosts):
    port = _free_port()
    a = hosts("hA", port, "2")
    b = hosts("hB", port, "2")
    rcs = {h.name: h.finish() for h in (a, b)}
    assert rcs == {"hA": 0, "hB": 0}, a.text() + "\n---\n" + b.text()
    res = [h.results()[0] for h in (a, b)]
    assert sorted(r["rank"] for r in res) == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 and r["master"] == "127.0.0.1" for r in res), res
    print(f"two hosts: both done in {max(h.ended for h in (a, b)) - a.started:.1f}s")


def test_an_unreachable_anchor_fails_within_the_store_timeout(hosts):
    port = _free_port()  # nothing listens there, and is_host=0 forbids serving it
    h = hosts("hA", port, "2", conf="is_host=0", env={"MCCL_RDZV_STORE_TIMEOUT": "2"})
    rc = h.finish(timeout_s=30)
    took = h.ended - h.started
    assert rc != 0
    assert f"[rendezvous] cannot reach the anchor's rendezvous store, peer=127.0.0.1:{port}, within 2s" in h.text()
    assert "RendezvousUnreachable" in h.text()
    assert took < 15, f"{took:.1f}s"
    print(f"unreachable anchor: torchrun exited {rc} after {took:.1f}s")


def test_a_killed_host_ends_the_job_on_the_other(hosts):
    """--nnodes 2, no restarts: the survivor's collective fails, its torchrun exits non-zero.
    The survivor serves the anchor's store, so before exiting it waits out the close timeout
    for the dead host to count itself out: 1 s here, to keep the test short."""
    port = _free_port()
    a = hosts("hA", port, "2", "--loop", conf="is_host=1", env={"MCCL_RDZV_CLOSE_TIMEOUT": "1"})
    b = hosts("hB", port, "2", "--loop", conf="is_host=0")
    a.wait_result()
    b.wait_result()
    b.kill([r["pid"] for r in b.results()])
    killed = time.monotonic()
    rc = a.finish(timeout_s=HARD_S)
    took = a.ended - killed
    assert rc != 0, a.text()
    assert "PeerLostError" in a.text(), a.text()
    assert took < 20, f"{took:.1f}s"
    print(f"killed host: the other torchrun exited {rc} {took:.1f}s after the kill")


def test_the_survivor_reforms_alone_when_min_nodes_allows(hosts):
    """--nnodes 1:2 with a restart to spare: the survivor drops the silent host (its keep-alives
    stop) and runs the next round as a world of one."""
    port = _free_port()
    fast = {"MCCL_RDZV_HEARTBEAT": "0.5", "MCCL_RDZV_HEARTBEAT_MISSES": "4", "MCCL_RDZV_LAST_CALL": "1"}
    a = hosts("hA", port, "1:2", "--loop", conf="is_host=1", restarts=1, env=fast)
    b = hosts("hB", port, "1:2", "--loop", conf="is_host=0", restarts=1, env=fast)
    # Both usually make the first round; if A completed one alone first, B's arrival triggers
    # the next round, of two (a membership change, which spends no restart).
    for h in (a, b):
        while not any(r["world"] == 2 for r in h.results()):
            h.wait_result(len(h.results()) + 1)
    b.kill([r["pid"] for r in b.results()])
    killed = time.monotonic()
    a.wait_result(len(a.results()) + 1)
    reformed = time.monotonic() - killed
    last = a.results()[-1]
    assert (last["world"], last["rank"], last["sum"]) == (1, 0, 1.0), a.results()
    assert a.finish() == 0, a.text()
    assert reformed < 20, f"{reformed:.1f}s"
    print(f"re-formed as a world of one {reformed:.1f}s after the kill")
