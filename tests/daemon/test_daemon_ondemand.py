"""Data sockets between daemons on demand (mccld/net/ondemand.py): a job leases only the hosts
its engine's whole-world algorithms use at set-up, and any other host when its engine
first sends there. Pools of several "hosts" run in this process (one LinkManager and
DataLinks each, on loopback) with one engine per host, as mccld builds them."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import CollectiveTimeout, MCCLError, PeerLostError
from mccld.daemon import Daemon
from mccld.net.ondemand import _MAX_EARLY, setup_hosts
from support.borrowed import alltoall_check, send_0_to_3
from support.daemon import loopback_hosts
from support.datalinks import K, Host
from support.engine import job_secret, ptr, thread_count
from support.ranks import run_ranks
from tools.bench.daemon_sockets import run_job as bench_job

F32, SUM = 0, 0


class Engine:
    """What ondemand.py calls on a job's engine, recorded (a job whose hosts are fake)."""

    def __init__(self):
        self.calls: list = []

    def hand_in(self, peer, fds):
        self.calls.append(("hand_in", peer, len(fds)))

    def refuse_link(self, peer, kind, message):
        self.calls.append(("refuse", peer, message))


def run_job(hosts: list[Host], job: str, body, timeout_s: float = 20.0, budget_s: float = 10.0) -> list:
    """One engine rank per host on set-up leases only, the rest on demand (mccld's way):
    [(body's result or its error, clean)] by rank."""
    return bench_job(hosts, job, body, job_secret(), K, timeout_s=timeout_s, budget_s=budget_s)


def hosts_of(n: int, tag: str):
    # Host ids sort as ranks do, so the lower rank of a pair proposes.
    return [Host(f"{tag}{i}") for i in range(n)]


def whole_world(rank, comm):
    a = np.full(1000, rank + 1, dtype=np.float32)
    comm.wait(comm.allreduce(ptr(a), a.size, F32, SUM), 20)
    out = np.zeros(comm.size * 4, dtype=np.int32)
    comm.wait(comm.allgather(ptr(np.full(4, rank, np.int32)), ptr(out), 16), 20)
    comm.wait(comm.broadcast(ptr(a), a.nbytes, 0), 20)
    comm.wait(comm.barrier(), 20)
    return float(a[0])


@pytest.mark.timeout(120)
def test_whole_world_ops_lease_only_setup_hosts_then_p2p_and_alltoall_lease_the_rest():
    n = 6
    hosts = hosts_of(n, "od")
    for h in hosts:
        h.__enter__()
    try:
        setup = [setup_hosts(r, n) for r in range(n)]
        assert 3 not in setup[0]                     # 0 and 3 are linked only on demand
        seen: list = []

        def job1(rank, comm):
            total = whole_world(rank, comm)
            seen.append((rank, hosts[rank].sockets()))
            return total
        out = run_job(hosts, "j1", job1)
        assert [o for o, _ in out] == [n * (n + 1) / 2] * n and all(c for _, c in out), out
        assert sorted(seen) == [(r, K * len(setup[r])) for r in range(n)], "leased more than the set-up hosts"
        assert sum(h.data.on_demand.counts["leased"] for h in hosts) == 0

        phases: dict = {}
        phase = threading.Barrier(n)

        def job2(rank, comm):
            send_0_to_3(rank, comm)                  # any-source receive at 3
            phase.wait(20)
            phases.setdefault("p2p", {})[rank] = hosts[rank].sockets()
            alltoall_check(rank, comm)
            phase.wait(20)
            phases.setdefault("a2a", {})[rank] = hosts[rank].sockets()
            return "ok"
        out = run_job(hosts, "j2", job2)
        assert out == [("ok", True)] * n, out
        want_p2p = {r: K * (len(setup[r]) + (r in (0, 3))) for r in range(n)}
        assert phases["p2p"] == want_p2p, "only the sender's and receiver's hosts lease for their p2p"
        assert phases["a2a"] == {r: K * (n - 1) for r in range(n)}
        # Every socket, leased at set-up or on demand, went back to the pool clean.
        for h in hosts:
            assert all(p["leased"] == 0 and p["discarded"] == 0 for p in h.data.status()), h.data.status()
        # A third job reuses them: nothing new is dialled.
        dialled = [sum(p["dialled"] for p in h.data.status()) for h in hosts]
        assert [o for o, _ in run_job(hosts, "j3", whole_world)] == [n * (n + 1) / 2] * n
        assert [sum(p["dialled"] for p in h.data.status()) for h in hosts] == dialled
    finally:
        for h in hosts:
            h.__exit__(None, None, None)


@pytest.mark.timeout(120)
def test_a_peer_that_stops_answering_or_dies_fails_the_send_naming_it():
    n = 5                                            # collective peers of 0: 1, 2, 4 (not 3)
    hosts = hosts_of(n, "dd")
    for h in hosts:
        h.__enter__()
    try:
        hosts[3].tap = lambda peer, msg: msg.get("lazy") is True   # stuck mid-job

        def send_to_3(rank, comm):
            if rank != 0:
                return None
            started = time.monotonic()
            x = np.zeros(8, dtype=np.uint8)
            try:
                comm.wait(comm.send(ptr(x), x.nbytes, 3, 1), 30)
            except MCCLError as e:
                return e.with_traceback(None), time.monotonic() - started
            return None
        out = run_job(hosts, "stuck", send_to_3, timeout_s=2.0)
        err, took = out[0][0]
        assert isinstance(err, CollectiveTimeout) and err.peer_addr == hosts[3].links.address, err
        assert "rank 3" in str(err) and "never handed in" in str(err) and took < 2.0 + 3.0, (err, took)
        assert hosts[0].peer("dd3")["leased"] == 0      # the half-made lease was closed at the job's end

        hosts[3].tap = None
        gone = threading.Event()

        def host_3_dies(rank, comm):
            if rank == 3:
                hosts[3].links.stop()                    # its daemon is gone: nothing answers a dial
                gone.set()
            elif rank == 0:
                assert gone.wait(20)
                return send_to_3(rank, comm)
            return None
        out = run_job(hosts, "dead", host_3_dies, timeout_s=5.0)
        err, took = out[0][0]
        assert isinstance(err, PeerLostError) and err.peer_rank == 3, err
        assert f"peer={hosts[3].links.address}" in str(err), err
        assert took < 5.0, took
    finally:
        for h in hosts:
            h.__exit__(None, None, None)


@pytest.mark.timeout(60)
def test_hostile_data_messages_get_a_clear_refusal_and_leak_nothing():
    with Host("ha") as a, Host("hb") as b:
        refusals: list = []
        a.tap = lambda peer, msg: msg.get("type") == "data_refused" and not refusals.append(msg["error"])
        engine = Engine()
        b.data.on_demand.attach("jx", engine, 0, [("hb", b.links.address), ("hc", "127.0.0.1:9")], 5.0)

        def send(msg):
            a.links.send(b.links.address, msg)

        def refused(pattern: str) -> str:
            deadline = time.monotonic() + 10
            while not any(pattern in r for r in refusals):
                assert time.monotonic() < deadline, refusals
                time.sleep(0.02)
            return next(r for r in refusals if pattern in r)

        send({"type": "data_want", "job": "jx"})
        assert "host ha is not one of its hosts" in refused("not one of its hosts")
        threads = thread_count()                    # the control link's readers are up by now
        send({"type": "data_lease", "lazy": True, "job": "jx", "round": "0", "ids": ["x", "y"]})
        assert "malformed data_lease from host ha: round" in refused("round")
        send({"type": "data_lease", "lazy": True, "job": "jx", "round": 0, "ids": ["x" * 500, "y"]})
        assert "ids must be 2 socket ids" in refused("ids must be")
        send({"type": "data_lease", "lazy": True, "job": 7, "round": 0, "ids": ["x", "y"]})   # no reply: no job id
        b.data.give_back("jx", clean=True)
        send({"type": "data_want", "job": "jx"})
        assert "job jx ended on host hb" in refused("ended on host hb")
        for i in range(_MAX_EARLY + 20):           # a flood of wants for jobs that never run
            send({"type": "data_want", "job": f"nope{i}"})
        # Every want past the cap is refused: wait for all 20 before counting (ci: counted after
        # the first, the other 19 came in after it).
        deadline = time.monotonic() + 10
        while sum("too many messages wait" in r for r in refusals) < 20:
            assert time.monotonic() < deadline, refusals
            time.sleep(0.02)
        told = len(refusals)
        send({"type": "data_refused", "job": "jx", "kind": 1, "error": "no"})   # a refusal is never answered
        send({"type": "data_refused", "job": "nope0", "kind": "1", "error": "no"})
        # One link carries the messages in order: once the reply to a later want is in, none
        # to the two refusals is still on its way.
        send({"type": "data_want", "job": "jx"})
        refused_again = told + 1
        deadline = time.monotonic() + 10
        while len(refusals) < refused_again:
            assert time.monotonic() < deadline, refusals[told:]
            time.sleep(0.02)
        assert len(refusals) == refused_again and "ended on host hb" in refusals[-1], refusals[told:]
        assert b.data.on_demand.status()["early"] == _MAX_EARLY
        assert engine.calls == [], "a hostile message reached the engine"
        assert b.sockets() == 0 and a.sockets() == 0
        assert thread_count() == threads, "the flood started threads"


# -- real daemons on loopback, one rank process per "host" ---------------------------------------
N_DAEMONS = 5                                        # host 0's set-up hosts: 1, 2, 4 (not 3)


def rank_job(rank: int, world: int, dirs: list[str], comm_id: int, exchanges: bool) -> str:
    os.environ["MCCL_RUNTIME_DIR"] = dirs[rank]   # rank r attaches to "host" r's daemon
    import datetime
    import torch.distributed as dist
    from libmccl.daemon.client import DaemonCommunicator
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    comm = DaemonCommunicator(rank, world, comm_id, dist.PrefixStore(f"job{comm_id}", store), None, None, 30.0)
    a = np.full(4096, rank + 1, dtype=np.float32)
    comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 30)
    assert (a == world * (world + 1) // 2).all()
    if exchanges:
        send = np.arange(world * 4, dtype=np.int32) + 100 * rank
        out = np.zeros(world * 4, dtype=np.int32)
        comm.wait(comm.alltoall(send.ctypes.data, out.ctypes.data, 16), 30)
        want = np.concatenate([np.arange(rank * 4, rank * 4 + 4) + 100 * s for s in range(world)])
        assert (out == want).all(), out
        x, got = np.arange(64, dtype=np.int32), np.zeros(64, dtype=np.int32)
        if rank == 0:
            comm.wait(comm.send(x.ctypes.data, x.nbytes, 3, 9), 30)
            # Any source, through the mailbox, from host 3 (not a set-up host of 0), long after
            # 0's set-up hosts (1, 2, 4) left: their closing must not end 0's mailbox early.
            comm.wait(comm.recv(got.ctypes.data, got.nbytes, -1, 9), 30)
        elif rank == 3:
            comm.wait(comm.recv(got.ctypes.data, got.nbytes, -1, 9), 30)
            time.sleep(1.5)
            comm.wait(comm.send(x.ctypes.data, x.nbytes, 0, 9), 30)
        assert rank not in (0, 3) or (got == x).all(), got
    comm.shutdown(10)
    return "ok"


@pytest.fixture
def daemons():
    with loopback_hosts(N_DAEMONS, "od", each=lambda i: {"MCCL_SOCKETS_PER_PEER": str(K)}) as running_dirs:
        yield running_dirs


def _sockets(d: Daemon) -> int:
    return sum(p["idle"] + p["leased"] for p in d.status_provider()["data_links"])


def _closed(daemons: list[Daemon]) -> None:
    deadline = time.monotonic() + 20
    while any(d.status_provider()["jobs"] for d in daemons):
        assert time.monotonic() < deadline, [d.status_provider()["jobs"] for d in daemons]
        time.sleep(0.05)


@pytest.mark.timeout(240)
def test_through_mccld_an_allreduce_job_leases_setup_hosts_and_p2p_alltoall_the_rest(daemons):
    running, dirs = daemons
    assert run_ranks(rank_job, N_DAEMONS, dirs, 0x0d1, False, timeout_s=150) == ["ok"] * N_DAEMONS
    _closed(running)
    assert [_sockets(d) for d in running] == [K * len(setup_hosts(r, N_DAEMONS)) for r in range(N_DAEMONS)]
    assert run_ranks(rank_job, N_DAEMONS, dirs, 0x0d2, True, timeout_s=150) == ["ok"] * N_DAEMONS
    _closed(running)
    assert [_sockets(d) for d in running] == [K * (N_DAEMONS - 1)] * N_DAEMONS
    for d in running:   # every socket, the ones leased mid-job too, went back to the pool clean
        assert all(p["leased"] == 0 and p["discarded"] == 0 for p in d.status_provider()["data_links"])
    assert sum(d.datalinks.on_demand.counts["leased"] for d in running) == 2 * 3   # pairs 0-3, 1-4, 2-4; both ends


def test_an_engine_built_after_its_job_ended_is_not_kept():
    # A peer that drops its data sockets mid set-up ends the job (detach) while this host is
    # still building the engine; attaching it afterwards kept it, and its progress thread's
    # pipe, for the daemon's lifetime (found by the fuzz run's no-cyclic-GC check).
    import gc
    import weakref
    from types import SimpleNamespace

    from mccld.net.ondemand import OnDemand

    class Engine:
        pass

    od = OnDemand(SimpleNamespace(discard=lambda *a, **k: None), SimpleNamespace(host_id="hosta"))
    hosts = [("hosta", "127.0.0.1:1"), ("hostb", "127.0.0.1:2")]
    gc.disable()
    try:
        live = Engine()
        od.attach("live", live, 0, hosts, 5.0)
        kept = weakref.ref(live)
        del live
        assert kept() is not None, "a running job's engine must be served"
        od.detach("live")
        assert kept() is None

        od.detach("ended")                 # the job failed while its engine was being built
        late = Engine()
        od.attach("ended", late, 0, hosts, 5.0)
        gone = weakref.ref(late)
        del late
        assert gone() is None, "the engine of a job that had ended is still held"
    finally:
        gc.enable()
