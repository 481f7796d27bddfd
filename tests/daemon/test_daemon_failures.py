"""Failure behaviour of the daemon path: a client dies, the daemon dies, a daemon
restarts after a crash. Every test reaps what it started and checks no segment stays."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from support.ranks import collect, reap, spawn_ranks
from mccl_common.errors import AbortedError, DaemonUnavailableError, MCCLError, PeerLostError

from mccl_common import shm
from mccld.attach import local_request
from mccl_common.daemon_settings import load_config
from mccld.daemon import Daemon
from support.daemon import connect, daemon_env, our_segments
from support.daemon import segments_left
F32, SUM = 0, 0


def rank_one_dies(rank: int, world: int) -> str:
    comm, _store = connect(rank, world, comm_id=0xdead01, timeout_s=30)
    a = np.ones(1024, dtype=np.float32)
    comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 20)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 25)
    except PeerLostError as e:
        assert "rank 1" in str(e) and "died" in str(e), e
        took = time.monotonic() - started
        # Later ops fail at once with the same error.
        with pytest.raises(PeerLostError):
            comm.wait(comm.barrier(), 5)
        comm.shutdown(5)
        return f"PeerLostError after {took:.2f}s"
    raise AssertionError("the collective succeeded although rank 1 died")


@pytest.mark.timeout(90)
def test_client_killed_frees_its_segment_and_fails_the_others(daemon):  # noqa: F811
    d, env = daemon
    procs, results, _ = spawn_ranks(rank_one_dies, 2, env=env)
    try:
        out = collect(procs, results, 60, expect=1)
    finally:
        reap(procs)
    status, value = out[0]
    # Noticed by the pid check: its PeerLostError says rank 1 died (rank_one_dies checks it);
    # the op's 30 s timeout would have raised CollectiveTimeout. A < 5 s bound stood here.
    assert status == "ok" and value.startswith("PeerLostError after"), value
    assert segments_left(0xdead01) == []
    assert d.status_provider()["jobs"] == [] or all(j["state"] != "ready" for j in d.status_provider()["jobs"])


def rank_daemon_dies(rank: int, world: int, marker: str, expect: str) -> str:
    comm, _store = connect(rank, world, comm_id=0xdead02, timeout_s=60)
    a = np.ones(8, dtype=np.float32)
    comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 20)
    if rank == 0:
        op = comm.allreduce(a.ctypes.data, a.size, F32, SUM)  # rank 1 never joins it: stays pending
        Path(marker).write_text("pending")
        started = time.monotonic()
        try:
            comm.wait(op, 50)
        except MCCLError as e:
            assert type(e).__name__ == expect, e
            assert "went away" in str(e) or "mccld is stopping" in str(e), e
            return f"pending op failed after {time.monotonic() - started:.2f}s"
        raise AssertionError("pending op succeeded although the daemon was killed")
    deadline = time.monotonic() + 30
    while Path(marker).read_text() != "killed" and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises((DaemonUnavailableError, AbortedError)):
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 10)
    return "later op failed"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig,expect", [(signal.SIGKILL, "DaemonUnavailableError"),
                                        (signal.SIGTERM, "AbortedError")])
def test_daemon_killed_fails_pending_and_later_ops(tmp_path, sig, expect):
    rdir = tmp_path / "rt"
    env = daemon_env(rdir)
    marker = tmp_path / "marker"
    marker.write_text("")
    proc = subprocess.Popen([sys.executable, "-m", "mccld"], env={**os.environ, **env},
                            stderr=subprocess.DEVNULL)
    procs = []
    try:
        deadline = time.monotonic() + 30
        while not (rdir / "token").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "mccld did not start"
            time.sleep(0.1)
        procs, results, _ = spawn_ranks(rank_daemon_dies, 2, str(marker), expect, env=env)
        deadline = time.monotonic() + 60
        while marker.read_text() != "pending":
            assert time.monotonic() < deadline, "rank 0 never got its op pending"
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(proc.pid, sig)
        proc.wait(10)
        marker.write_text("killed")
        out = collect(procs, results, 60)
    finally:
        reap(procs)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert out[0][0] == "ok" and out[1] == ("ok", "later op failed"), out
    assert float(out[0][1].split()[-1][:-1]) < 5.0, out[0]
    assert segments_left(0xdead02) == []   # clients unlink their own segments on failure


def _named_segment(name: str) -> str:
    import _posixshmem
    os.close(_posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    return name


@pytest.mark.timeout(60)
def test_start_sweeps_segments_of_dead_processes():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    # Named segments are what a client older than sealed memfds (or one on macOS, between
    # creating and handing over) leaves in /dev/shm: the start-up sweep still clears them.
    stale = _named_segment(shm.segment_name("0badc0de", 3, dead.pid, 1))
    live = _named_segment(shm.segment_name("0badc0de", 4, os.getpid(), 1))
    rdir = Path(tempfile.mkdtemp(prefix="mccl-dtest-"))
    d = None
    try:
        d = Daemon(load_config(env=daemon_env(rdir))).start()
        names = our_segments()
        assert stale not in names, "a dead process's segment survived the start-up sweep"
        assert live in names, "the sweep removed a live process's segment"
        assert local_request(rdir, {"type": "status"})["ok"]
    finally:
        if d is not None:
            d.stop()
        for name in (stale, live):
            shm.unlink(name)
        for p in rdir.iterdir():
            p.unlink()
        rdir.rmdir()


@pytest.mark.timeout(60)
def test_second_daemon_on_same_runtime_dir_is_refused(daemon):  # noqa: F811
    from mccl_common.errors import ConfigError
    _d, env = daemon
    with pytest.raises(ConfigError, match="another mccld already serves"):
        Daemon(load_config(env=env)).start()


def rank_aborts(rank: int, world: int) -> str:
    comm, store = connect(rank, world, comm_id=0xdead04, timeout_s=30)
    a = np.ones(16, dtype=np.float32)
    comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 20)
    if rank == 1:
        store.wait(["pending"])
        comm.abort("user pressed ctrl-c")
        with pytest.raises(AbortedError):   # later ops on the aborted communicator fail at once
            comm.wait(comm.barrier(), 5)
        return "aborted"
    op = comm.allreduce(a.ctypes.data, a.size, F32, SUM)
    store.set("pending", "1")
    with pytest.raises(AbortedError, match="rank 1 aborted the communicator: user pressed ctrl-c"):
        comm.wait(op, 20)
    comm.shutdown(5)
    return "saw abort"


@pytest.mark.timeout(90)
def test_abort_by_one_rank_fails_the_others_with_aborted(daemon):  # noqa: F811
    from support.ranks import run_ranks
    _d, env = daemon
    assert run_ranks(rank_aborts, 2, env=env, timeout_s=60) == ["saw abort", "aborted"]
    assert segments_left(0xdead04) == []


def rank_mismatch(rank: int, world: int) -> str:
    from mccl_common.errors import CollectiveMismatch
    comm, _store = connect(rank, world, comm_id=0xdead05, timeout_s=30)
    a = np.ones(10 + 10 * rank, dtype=np.float32)           # rank 1 sends twice as many elements
    with pytest.raises(CollectiveMismatch, match="every rank must issue the same collectives"):
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 20)
    assert (a == 1).all()                                    # no partial result written back
    with pytest.raises(CollectiveMismatch):                  # the communicator stays failed
        comm.wait(comm.barrier(), 5)
    comm.shutdown(5)
    return "mismatch"


@pytest.mark.timeout(90)
def test_mismatched_collectives_fail_every_rank(daemon):  # noqa: F811
    from support.ranks import run_ranks
    _d, env = daemon
    assert run_ranks(rank_mismatch, 2, env=env, timeout_s=60) == ["mismatch", "mismatch"]


@pytest.mark.timeout(90)
def test_daemon_dying_during_join_is_reported_at_once(mccld_proc, monkeypatch):
    """Rank 0 of a 2-rank job waits in join (rank 1 never comes); the daemon is killed."""
    import threading
    import torch.distributed as dist
    from support.ranks import free_port
    from libmccl.daemon.client import DaemonCommunicator
    proc, rdir, host_id = mccld_proc
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
    store.set("mccld/member/1", '{"host_id": "%s", "link_addr": "127.0.0.1:1"}' % host_id)
    # 3 s: time for the client to get past hello into join on a loaded box (at 1 s a
    # run beside another suite was still in hello); join waits 60 s for rank 1.
    threading.Timer(3.0, lambda: os.kill(proc.pid, signal.SIGKILL)).start()
    monkeypatch.setenv("MCCL_RUNTIME_DIR", str(rdir))
    started = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match="went away during join"):
        DaemonCommunicator(0, 2, 0xdead06, store, None, None, timeout_s=60)
    assert time.monotonic() - started < 10
