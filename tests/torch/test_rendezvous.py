"""Store rendezvous (libmccl/rendezvous.py), plus abort; the address choice itself is in
test_listen_addr.py."""

from __future__ import annotations

import datetime
import time

import pytest

from support.ranks import init_pg
from libmccl import rendezvous
from mccl_common.errors import CollectiveTimeout, ConfigError
from mccl_common.settings import EngineConfig


class _FakeListener:
    def __init__(self, host: str) -> None:
        self.address = f"{host}:1"
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _exchange_on_threads(store, cfgs: list[EngineConfig], timeout_s: float) -> list:
    """Each rank's exchange() on its own thread: what it returned or raised, and its listener."""
    import threading

    out: list = [None] * len(cfgs)
    listeners: list = [None] * len(cfgs)

    def rank_fn(rank: int) -> None:
        def factory(host: str) -> _FakeListener:
            listeners[rank] = _FakeListener(host)
            return listeners[rank]
        started = time.monotonic()
        try:
            out[rank] = rendezvous.exchange(store, rank, len(cfgs), factory, cfgs[rank], timeout_s, "g")
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out[rank] = exc
        out[rank] = (out[rank], time.monotonic() - started, listeners[rank])
    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(len(cfgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return out


@pytest.mark.timeout(60)
def test_a_rank_on_loopback_among_real_addresses_fails_every_rank_at_once() -> None:
    import torch.distributed as dist

    cfgs = [EngineConfig(bind_addr="10.0.0.1"), EngineConfig(bind_addr="127.0.0.1"), EngineConfig(bind_addr="10.0.0.3")]
    for rank, (exc, elapsed, listener) in enumerate(_exchange_on_threads(dist.HashStore(), cfgs, 30)):
        assert isinstance(exc, ConfigError), (rank, exc)
        assert elapsed < 5, f"rank {rank} waited {elapsed:.1f}s"
        assert listener.closed
        msg = str(exc)
        assert msg.startswith("[rendezvous] group 'g': rank 1 listens on loopback 127.0.0.1:1 but rank "), msg
        assert f"seen by rank {rank}" in msg and "MCCL_SOCKET_IFNAME" in msg and "MCCL_BIND_ADDR" in msg, msg
        # Each rank names its own address: the one its log's reader can fix.
        assert f"rank {rank} " in msg.split("(")[0], msg


@pytest.mark.timeout(60)
def test_a_rank_that_cannot_listen_stops_its_peers_at_once() -> None:
    import torch.distributed as dist

    cfgs = [EngineConfig(bind_addr="10.0.0.1"), EngineConfig(socket_ifname="mccl-nope0")]
    (exc0, elapsed0, listener0), (exc1, elapsed1, _) = _exchange_on_threads(dist.HashStore(), cfgs, 30)
    assert isinstance(exc1, ConfigError) and "MCCL_SOCKET_IFNAME='mccl-nope0'" in str(exc1)
    assert isinstance(exc0, ConfigError) and "rank 1 could not start listening" in str(exc0), exc0
    assert "MCCL_SOCKET_IFNAME='mccl-nope0'" in str(exc0)
    assert elapsed0 < 5 and elapsed1 < 5 and listener0.closed


@pytest.mark.timeout(30)
def test_missing_rank_times_out_naming_it() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    started = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="rank 2's address") as info:
        rendezvous.exchange(store, 0, 3, _FakeListener, EngineConfig(), 0.5, "g")
    assert time.monotonic() - started < 5
    assert "rank 1's address" in str(info.value) and str(info.value).startswith("[rendezvous]")


@pytest.mark.timeout(30)
def test_incarnations_do_not_collide() -> None:
    """Re-creating a group on the same store gets fresh keys and a fresh comm id."""
    import threading

    import torch.distributed as dist

    store, world = dist.HashStore(), 2
    seen: list[list] = [[], []]

    def rank_fn(rank: int) -> None:
        for _ in range(3):
            rv = rendezvous.exchange(store, rank, world, _FakeListener, EngineConfig(bind_addr=f"10.0.0.{rank}"),
                                     10, "g")
            seen[rank].append((rv.comm_id, rv.peer_addrs))
    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen[0] == seen[1] and len(seen[0]) == 3
    assert len({cid for cid, _ in seen[0]}) == 3, "each incarnation draws its own comm id"
    assert all(addrs == ["10.0.0.0:1", "10.0.0.1:1"] for _, addrs in seen[0])


def _abort_rank(rank: int, world: int) -> str:
    import torch
    import torch.distributed as dist

    from mccl_common.errors import AbortedError, MCCLError

    init_pg(rank, world, timeout_s=60)
    try:
        if rank == 0:
            work = dist.all_reduce(torch.ones(8), async_op=True)  # rank 1 never joins it
            time.sleep(0.3)
            started = time.monotonic()
            dist.group.WORLD.abort()
            with pytest.raises(AbortedError):
                work.wait(datetime.timedelta(seconds=10))
            assert time.monotonic() - started < 5
            with pytest.raises(AbortedError, match="shut down or aborted"):
                dist.all_reduce(torch.ones(8))
            return "aborted"
        time.sleep(1.0)
        try:  # the peer aborted: this must fail fast, not wait out the 60 s timeout
            started = time.monotonic()
            dist.all_reduce(torch.ones(8))
            return "no error"
        except MCCLError as exc:
            assert time.monotonic() - started < 10
            return type(exc).__name__
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_abort_fails_pending_ops_everywhere(ranks) -> None:
    results = ranks(_abort_rank, 2, timeout_s=100)
    assert results[0] == "aborted"
    assert results[1] in ("AbortedError", "PeerLostError"), results


_HOST_SCRIPT = '''
import os, sys, torch, torch.distributed as dist
dist.init_process_group("mccl")
pg = dist.group.WORLD
t = torch.full((1 << 20,), float(dist.get_rank() + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((1 << 20,), float(sum(range(1, dist.get_world_size() + 1)))))
peers = [pg.communicator.peer_address(r) for r in range(dist.get_world_size())]
dist.barrier()
dist.destroy_process_group()
print("PEERS", " ".join(peers))
'''


@pytest.mark.fleet
@pytest.mark.timeout(240)
@pytest.mark.parametrize("ifname", ["", "eth0"])
def test_hosts_in_namespaces_find_each_other(ifname: str) -> None:
    """Three emulated hosts: each advertises the address that routes to MASTER_ADDR
    (or MCCL_SOCKET_IFNAME's), never loopback, and the ring works across them."""
    import subprocess
    import sys

    from tools.fleet import Fleet, check_prerequisites

    try:
        check_prerequisites()
    except ConfigError as exc:
        pytest.skip(str(exc))
    world = 3
    with Fleet(world, rate="2gbit") as fleet:
        master = fleet.hosts[0].addr
        procs = [fleet.popen(i, [sys.executable, "-c", _HOST_SCRIPT],
                             env={"MASTER_ADDR": master, "MASTER_PORT": "29500", "RANK": str(i),
                                  "WORLD_SIZE": str(world), "MCCL_SOCKET_IFNAME": ifname},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(world)]
        outs = [p.communicate(timeout=200) for p in procs]
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"host {i}:\n{err[-3000:]}"
        peers = out.split("PEERS ", 1)[1].split()
        assert [a.rsplit(":", 1)[0] for a in peers] == [h.addr for h in fleet.hosts], peers


@pytest.mark.timeout(60)
def test_a_rank_0_that_cannot_listen_stops_its_peers_at_once() -> None:
    """The others wait for rank 0's address table, which carries rank 0's failure."""
    import torch.distributed as dist

    cfgs = [EngineConfig(socket_ifname="mccl-nope0"), EngineConfig(bind_addr="10.0.0.2"),
            EngineConfig(bind_addr="10.0.0.3")]
    results = _exchange_on_threads(dist.HashStore(), cfgs, 30)
    assert isinstance(results[0][0], ConfigError) and "MCCL_SOCKET_IFNAME='mccl-nope0'" in str(results[0][0])
    for exc, elapsed, listener in results[1:]:
        assert isinstance(exc, ConfigError) and "rank 0 could not start listening" in str(exc), exc
        assert elapsed < 5 and listener.closed


@pytest.mark.timeout(60)
def test_the_store_serves_O_N_reads_not_N_squared() -> None:
    """Rank 0 reads every address once and publishes one table; every other rank reads the
    comm id and the table: about 3N reads in all (every rank reading every address: N^2)."""
    import threading

    import torch.distributed as dist

    class CountingStore(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.reads, self.lock = dist.HashStore(), 0, threading.Lock()

        def _count(self, n: int) -> None:
            with self.lock:
                self.reads += n

        def get(self, key):
            self._count(1)
            return self.inner.get(key)

        def multi_get(self, keys):
            self._count(len(keys))
            return self.inner.multi_get(keys)

        def set(self, key, value):
            self.inner.set(key, value)

        def add(self, key, amount):
            return self.inner.add(key, amount)

        def check(self, keys):
            return self.inner.check(keys)

        def wait(self, keys, timeout=None):
            self.inner.wait(keys, timeout if timeout is not None else datetime.timedelta(seconds=30))

    n = 16
    store = CountingStore()
    results = _exchange_on_threads(store, [EngineConfig(bind_addr=f"10.0.0.{r + 1}") for r in range(n)], 30)
    for r, (rv, _, _) in enumerate(results):
        assert not isinstance(rv, Exception), (r, rv)
        assert rv.peer_addrs == [f"10.0.0.{q + 1}:1" for q in range(n)]
    assert store.reads <= 3 * n, store.reads
