"""Daemon data sockets (mccld/net/datalinks.py): authenticated like the control links, agreed
per job over the control link, handed to the engine, and reused by the next job when the
engine ended them clean.

The first tests drive two pools in this process with the engine directly; the last ones
run two real daemons on loopback (two host ids, one runtime dir each) with spawned
MCCL_DAEMON ranks, one per "host".
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.engine import job_secret
from support.ranks import collect, free_port, reap, run_ranks, spawn_ranks
from libmccl import _core
from mccl_common.errors import AuthError, PeerLostError

from mccld import PROTO_VERSION

from mccld.net import auth
from mccld.daemon import Daemon
from support.daemon import loopback_hosts
from support.datalinks import K, Host


F32, SUM = 0, 0


def run_job(hosts: list[Host], job: str, abort: bool = False) -> list[dict[int, list[str]]]:
    """Lease sockets for a job with one rank per host on every side, run an all-reduce on
    them, shut down (or abort) and give them back. Returns ids[rank][peer rank]: the
    socket ids each side got, in the agreed order."""
    n = len(hosts)
    ids: list = [None] * n
    comm_id = random.getrandbits(63)
    all_done = threading.Barrier(n)

    def side(rank: int) -> bool:
        me = hosts[rank]
        peers = [(p, h.links.host_id, h.links.address) for p, h in enumerate(hosts) if p != rank]
        leased = me.data.lease(job, peers, time.monotonic() + 20, lambda: None)
        ids[rank] = {p: [s.id for s in socks] for p, socks in leased.items()}
        opts = _core.Options()
        opts.sockets_per_peer, opts.timeout_s, opts.connect_timeout_s = K, 20.0, 10.0
        opts.wire_security = _core.WireSecurity.aead
        comm = _core.Communicator(rank, n, comm_id, {p: [s.sock.fileno() for s in socks] for p, socks in leased.items()},
                                  [f"{h.links.host_id}:1" for h in hosts], opts, secret=job_secret())
        a = np.full(1 << 18, rank + 1, dtype=np.float32)
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 20)
        assert (a == n * (n + 1) // 2).all()
        all_done.wait(20)      # an abort must not overtake a peer's last all-reduce frames
        if abort and rank == 0:
            comm.abort("test")
        clean = comm.shutdown(5.0)
        me.data.give_back(job, clean)
        return clean

    results: list = [None] * n
    errors: list = []

    def body(r: int) -> None:
        try:
            results[r] = side(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    assert results == [not abort] * n
    return ids


@pytest.mark.timeout(60)
def test_jobs_reuse_pooled_sockets_and_an_abort_discards_them():
    with Host("a") as a, Host("b") as b:
        first = run_job([a, b], "j1")
        assert first[0][1] == first[1][0] and len(first[0][1]) == K   # both sides agree on ids and order
        assert a.peer("b")["dialled"] == K and b.peer("a")["accepted"] == K   # "a" < "b": a proposes and dials
        second = run_job([b, a], "j2")                            # host ranks swapped: a still proposes
        assert second[0][1] == second[1][0] and sorted(second[0][1]) == sorted(first[0][1])
        assert a.peer("b")["dialled"] == K, "job 2 dialled new data sockets instead of reusing the pool"
        assert a.peer("b")["uses"] == 2 * K and b.peer("a")["uses"] == 2 * K
        run_job([a, b], "j3", abort=True)
        for host, peer in ((a, "b"), (b, "a")):
            st = host.peer(peer)
            assert st["discarded"] == K and st["idle"] == st["leased"] == 0, st
        fourth = run_job([a, b], "j4")                            # fresh sockets after the abort
        assert not set(fourth[0][1]) & set(first[0][1])
        assert a.peer("b")["dialled"] == 2 * K


@pytest.mark.timeout(60)
def test_three_hosts_lease_every_pair_and_reuse_it():
    with Host("a") as a, Host("b") as b, Host("c") as c:
        first = run_job([c, a, b], "j1")
        second = run_job([b, c, a], "j2")
        for ids in (first, second):
            for r in range(3):
                for p in range(3):
                    if p != r:
                        assert ids[r][p] == ids[p][r] and len(ids[r][p]) == K
        assert sorted(second[0][1]) == sorted(first[2][0])         # b-c: the same sockets in job 2
        assert a.peer("b")["dialled"] == a.peer("c")["dialled"] == b.peer("c")["dialled"] == K
        assert [p["dialled"] for p in c.data.status()] == [0, 0]         # the highest id only accepts


@pytest.mark.timeout(60)
def test_a_socket_the_peer_dropped_while_idle_is_replaced():
    with Host("a") as a, Host("b") as b:
        first = run_job([a, b], "j1")
        # b loses one pooled socket (as after a failed release on its side): a notices the
        # EOF when it leases, or b answers "missing"; either way job 2 gets a fresh one.
        with b.data._cv:
            b.data._discard(b.data._socks[first[1][0][0]], "test")
        second = run_job([a, b], "j2")
        assert first[0][1][0] not in second[0][1] and first[0][1][1] in second[0][1]
        assert a.peer("b")["dialled"] == K + 1
        # The periodic sweep drops such a socket without waiting for the next job.
        with b.data._cv:
            b.data._discard(b.data._socks[second[1][0][1]], "test")
        deadline = time.monotonic() + 5
        while a.data.sweep() == 0:
            assert time.monotonic() < deadline, "an idle socket closed by the peer was never swept"
            time.sleep(0.05)
        assert a.peer("b")["idle"] == K - 1 and a.peer("b")["discarded"] == 2


def forged_data_hello(addr: str, sock_id: str) -> dict:
    """What a host without the key can do: follow the protocol and guess the MAC."""
    host, _, port = addr.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        auth.send_plain(s, {"type": "hello", "proto": PROTO_VERSION, "fleet": "f", "host_id": "evil",
                            "listen": "127.0.0.1:9", "nonce": "00" * auth.NONCE_BYTES, "purpose": f"data:{sock_id}"})
        auth.recv_plain(s, addr)                                   # the challenge
        auth.send_plain(s, {"type": "auth", "mac": "11" * auth.MAC_BYTES})
        return auth.recv_plain(s, addr)


@pytest.mark.timeout(60)
def test_a_peer_without_the_fleet_key_gets_no_data_socket(caplog):
    caplog.set_level(logging.DEBUG, logger="mccld.net.links")
    with Host("a") as a, Host("b", key=b"x" * 32) as intruder:
        for i in range(3):
            # A daemon holding another key proves first and is refused (it learns no MAC of ours)...
            with pytest.raises(AuthError, match="failed fleet-key authentication"):
                intruder.links.dial_data(a.links.address, f"evil.{i}")
            # ...and so is a hand-made client answering our challenge with a guess.
            assert forged_data_hello(a.links.address, f"forged.{i}") == {"type": "refused", "reason": "bad fleet key"}
        time.sleep(0.3)
        assert a.data.status() == []                 # nothing adopted, nothing counted
        assert a.links.peers() == []
    ours = [r for r in caplog.records if r.name == "mccld.net.links" and "peer=127.0.0.1:" in r.getMessage()
            and ("refused peer=" in r.getMessage() or "handshake with" in r.getMessage())]
    refused = [r.levelname for r in ours if "refused peer=" in r.getMessage()]
    dropped = [r.levelname for r in ours if "handshake with" in r.getMessage()]
    # Six refusals from one address: WARNING once, then DEBUG; none ends as a dropped handshake.
    assert refused == ["WARNING"] + ["DEBUG"] * 5, [r.getMessage() for r in ours]
    assert dropped == [], [r.getMessage() for r in ours]


# -- two real daemons on loopback -------------------------------------------------------------
def _env(metrics_port: int) -> dict[str, str]:
    # Metrics on a port of their own: tests read the exporter of each.
    return {"MCCL_METRICS_PORT": str(metrics_port), "MCCL_METRICS_ADDR": "127.0.0.1", "MCCL_SOCKETS_PER_PEER": str(K)}


@pytest.fixture
def two_daemons(request):
    """Two daemons on loopback; ``indirect`` parametrisation adds settings to both."""
    extra = getattr(request, "param", {})
    with loopback_hosts(2, "dl", each=lambda i: _env(free_port()) | extra, engine_env=extra) as running_dirs:
        yield running_dirs


def rank_jobs(rank: int, world: int, dirs: list[str], comm_ids: list[int], die_in: int | None) -> str:
    os.environ["MCCL_RUNTIME_DIR"] = dirs[rank]   # rank r attaches to "host" r's daemon
    import datetime
    import torch.distributed as dist
    from libmccl.daemon.client import DaemonCommunicator
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    for comm_id in comm_ids:
        comm = DaemonCommunicator(rank, world, comm_id, dist.PrefixStore(f"job{comm_id}", store), None, None, 30.0)
        a = np.full(1 << 16, rank + 1, dtype=np.float32)
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 20)
        assert (a == 3).all()
        # Idle a while between ops: the daemons' mailbox receives (mccld/jobs/p2p.py) stay
        # posted meanwhile and must neither fail the job nor make the sockets unclean.
        time.sleep(1.5)
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 20)
        assert (a == 6).all()
        if die_in == comm_id:
            if rank == 1:
                os._exit(17)     # a client killed mid-job
            try:
                for _ in range(50):
                    comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 20)
                    time.sleep(0.1)
            except PeerLostError as e:
                comm.shutdown(5)
                return f"peer lost: {e}"
            return "no error"
        comm.shutdown(10)
    return "ok"


def _data_links(d: Daemon) -> list[dict]:
    return d.status_provider()["data_links"]


def _jobs_closed(daemons: list[Daemon], within_s: float = 20.0) -> None:
    """A rank's shutdown returns once it left the job; its daemon closes the job (closing
    barrier, engine shutdown, sockets back to the pool) on the job's thread after that, so
    a status read right after the ranks return can still see the sockets leased."""
    deadline = time.monotonic() + within_s
    while any(d.status_provider()["jobs"] for d in daemons):
        assert time.monotonic() < deadline, [d.status_provider()["jobs"] for d in daemons]
        time.sleep(0.05)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("two_daemons", [{"MCCL_WIRE_SECURITY": "off"}, {}], ids=["off", "keyed"], indirect=True)
def test_two_jobs_between_two_daemons_reuse_the_same_data_sockets(two_daemons, request):
    """Keyed (the default) too: each job's engine proves the job's secret on the pooled
    sockets and derives fresh keys, and the sockets, released at the protected BYEs, still
    serve the second job."""
    daemons, dirs = two_daemons
    want = "off" if request.node.callspec.id == "off" else "aead"
    assert [d.engine_cfg.wire_security for d in daemons] == [want] * 2
    # One job after the other, not back to back in one process: a job leased while the last
    # one is still closing finds its sockets busy and dials new ones (correct, but not what
    # this test counts).
    for comm_id in (0x1a1, 0x1a2):
        assert run_ranks(rank_jobs, 2, dirs, [comm_id], None, timeout_s=100) == ["ok", "ok"]
        _jobs_closed(daemons)
    low = min(range(2), key=lambda i: daemons[i].host_id)      # the proposer dials
    st = [_data_links(d) for d in daemons]
    assert [len(s) for s in st] == [1, 1], st
    mine, theirs = st[low][0], st[1 - low][0]
    assert mine["dialled"] == K and theirs["accepted"] == K, st       # dialled once, for job 1
    assert mine["ids"] == theirs["ids"] and len(mine["ids"]) == K
    assert mine["uses"] == theirs["uses"] == 2 * K, st                # each socket served both jobs
    assert mine["idle"] == theirs["idle"] == K and mine["discarded"] == theirs["discarded"] == 0
    # The exporter reads the same pool at each scrape.
    peer = daemons[1 - low].host_id
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemons[low].cfg.metrics_port}/metrics", timeout=10).read()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}
    assert samples[("mccl_data_sockets", (("peer_host", peer), ("state", "idle")))] == K
    assert samples[("mccl_data_sockets_opened_total", (("direction", "dialled"), ("peer_host", peer)))] == K
    assert samples[("mccl_data_sockets_discarded_total", (("peer_host", peer),))] == 0


@pytest.mark.timeout(180)
def test_client_killed_mid_job_discards_that_jobs_sockets_and_the_next_job_works(two_daemons):
    daemons, dirs = two_daemons
    procs, results, _ = spawn_ranks(rank_jobs, 2, dirs, [0x2b1], 0x2b1)
    try:
        out = collect(procs, results, 100, expect=1)   # rank 1 exits without reporting
    finally:
        reap(procs)
    assert out[0][0] == "ok" and out[0][1].startswith("peer lost: "), out
    assert "rank 1" in out[0][1], out
    deadline = time.monotonic() + 20
    while any(s["discarded"] < K for d in daemons for s in _data_links(d)):
        assert time.monotonic() < deadline, [_data_links(d) for d in daemons]
        time.sleep(0.2)
    assert run_ranks(rank_jobs, 2, dirs, [0x2b2], None, timeout_s=100) == ["ok", "ok"]
    _jobs_closed(daemons)
    low = min(range(2), key=lambda i: daemons[i].host_id)
    st = _data_links(daemons[low])[0]
    assert st["dialled"] == 2 * K and st["discarded"] == K and st["idle"] == K, st


IDLE_TIMEOUT_S = 1.0


def rank_idle_job(rank: int, world: int, dirs: list[str], comm_id: int, p2p_only: bool) -> float:
    """A job idle for twice its timeout, twice, between exchanges; returns when (time.time())
    its client finished shutting down."""
    os.environ["MCCL_RUNTIME_DIR"] = dirs[rank]
    import datetime
    import torch.distributed as dist
    from libmccl.daemon.client import DaemonCommunicator
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    comm = DaemonCommunicator(rank, world, comm_id, dist.PrefixStore(f"job{comm_id}", store), None, None,
                              IDLE_TIMEOUT_S)
    other = 1 - rank
    for round_ in range(2):
        time.sleep(2 * IDLE_TIMEOUT_S)      # no op at all, past the job timeout
        if p2p_only:
            mine, got = np.full(16, rank * 10 + round_, np.int32), np.zeros(16, np.int32)
            r = comm.recv(got.ctypes.data, got.nbytes, other, 5)
            comm.wait(comm.send(mine.ctypes.data, mine.nbytes, other, 5), 10)
            comm.wait(r, 10)
            assert (got == other * 10 + round_).all(), got
        else:
            a = np.full(64, rank + 1, np.float32)
            comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 10)
            assert (a == 3).all()
    comm.shutdown(10)
    return time.time()


def _pooled(daemons: list[Daemon]) -> bool:
    return all(s["idle"] == K and s["leased"] == 0 for d in daemons for s in _data_links(d))


@pytest.mark.timeout(180)
def test_idle_jobs_outlive_their_timeout_close_at_once_and_leave_the_sockets_clean(two_daemons):
    daemons, dirs = two_daemons
    for i, p2p_only in enumerate((False, True, True)):
        # Each daemon closes the job (closing headers, barrier, engine release) once its
        # rank left; then the job's data sockets are back in the pool, idle. Watched from
        # a thread, so the ranks' exit does not count.
        pooled_at: list[float] = []
        stop = threading.Event()

        def watch() -> None:
            leased = False
            while not stop.is_set() and not pooled_at:
                pooled = _pooled(daemons)
                if leased and pooled:
                    pooled_at.append(time.time())
                leased = leased or not pooled
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            run_ranks(rank_idle_job, 2, dirs, 0x3c0 + i, p2p_only, timeout_s=100)
            watcher.join(10)
        finally:
            stop.set()
        # Closed on the ranks' leave, by events rather than a < 1 s bound: every close was clean
        # (below: nothing discarded; a mailbox wait that ran out, 2 s, ends unclean), and the
        # sockets were back within the watcher's 10 s (a hang's bound, which a closing barrier
        # waiting out its 30 s would miss).
        assert pooled_at, f"job {i}: data sockets not back in the pool: {[_data_links(d) for d in daemons]}"
    for d in daemons:
        st = _data_links(d)[0]
        # dialled once, each socket reused by all three jobs: every close was clean
        assert st["uses"] == 3 * K and st["discarded"] == 0 and st["dialled"] + st["accepted"] == K, st
