"""ATTACKER tests for the stores a job meets through (issue 24): a client on loopback that
holds no job key reaches the anchor's rendezvous store or the c10d store and writes into it.
What it writes must never be acted on: not unpickled by torch's rendezvous, not dialled as a
rank's address, not taken as MASTER_ADDR/PORT, not accepted under another key's name."""

from __future__ import annotations

import base64
import datetime
import gc
import os
import pickle
import re
import socket

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from libmccl.elastic import rdzv as er
from libmccl import rendezvous
from mccl_common import store_auth
from mccl_common.errors import StoreAuthError
from mccl_common.jobkey import find_job_key, key_id
from mccl_common.launch_protocol import REFORM_ENV
from mccl_common.settings import EngineConfig
from support.ports import free_port

pytestmark = pytest.mark.timeout(60)


class _Payload:
    """What the attacker pickles: unpickling it creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _attacker(port: int) -> dist.TCPStore:
    """A plain TCPStore client: all an attacker needs is the port."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))


@pytest.fixture
def handlers(monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.delenv(REFORM_ENV, raising=False)
    made: list = []

    def make(port: int, run_id: str = "r", min_nodes: int = 1, max_nodes: int = 1, **conf):
        conf.setdefault("join_timeout", "10")
        conf.setdefault("last_call_timeout", "0.5")
        params = RendezvousParameters("mccl", f"127.0.0.1:{port}", run_id, min_nodes, max_nodes, **conf)
        made.append(er.create_handler(params))
        return made[-1]

    yield make
    for h in reversed(made):
        h._stop_heartbeats()
        h.anchor_store = None
    made.clear()
    gc.collect()


@pytest.mark.parametrize("form", ["pickle", "pickle-with-a-made-up-mac"])
def test_a_pickle_written_into_the_rendezvous_state_is_never_unpickled(handlers, tmp_path, form) -> None:
    port = free_port()
    h = handlers(port, run_id="victim", is_host="1")
    marker = tmp_path / "owned"
    evil = pickle.dumps(_Payload(str(marker)))
    blob = (base64.b64encode(evil) if form == "pickle"
            else store_auth.PREFIX + base64.b64encode(os.urandom(store_auth.TAG_BYTES) + evil))
    attacker = _attacker(port)
    attacker.set("mccl/rdzv/victim/state", blob)
    with pytest.raises(StoreAuthError) as info:
        h.next_rendezvous()
    msg = str(info.value)
    assert "'mccl/rdzv/victim/state'" in msg and f"peer=127.0.0.1:{port}" in msg, msg
    assert "without the job's key" in msg, msg
    assert isinstance(info.value, er.RendezvousForged)     # torch's RendezvousStateError too
    assert not marker.exists(), "the attacker's pickle ran in torchrun"
    del attacker


def test_a_forged_master_addr_is_refused(handlers) -> None:
    """A host that reads MASTER_ADDR/PORT from the round store (rank > 0, or one joining a later
    round after the republish) refuses one the attacker wrote over rank 0's."""
    import threading

    port = free_port()
    a = handlers(port, run_id="m", min_nodes=2, max_nodes=2, is_host="1")
    b = handlers(port, run_id="m", min_nodes=2, max_nodes=2, is_host="0")
    infos: list = [None, None]
    ts = [threading.Thread(target=lambda i=i, h=h: infos.__setitem__(i, h.next_rendezvous()))
          for i, h in enumerate((a, b))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert all(infos), infos
    later = next(i for i in infos if i.rank == 1)
    attacker = _attacker(port)
    round_prefix = f"torch.rendezvous.m.{a._state_holder.state.round}/"
    # The round's values live under the run's epoch, which the attacker reads in the state.
    epoch = a._state_holder._backend.epoch
    for name, value in ((RendezvousStoreInfo.MASTER_ADDR_KEY, b"203.0.113.66"),
                        (RendezvousStoreInfo.MASTER_PORT_KEY, b"6666")):
        attacker.set(round_prefix + name, value)
        attacker.set(f"mccl/rdzv/epoch/{epoch.hex()}/{round_prefix}{name}", value)
    with pytest.raises(StoreAuthError, match=rf"'{re.escape(round_prefix)}MASTER_ADDR'.*peer=127\.0\.0\.1:{port}"):
        RendezvousStoreInfo.build(1, later.store, None)
    # rank 0's republish is what a later joiner reads: sealed, it verifies; the forgery did not.
    zero = next(i for i in infos if i.rank == 0)
    er._republish_workers_store(type("I", (), {"store": zero.store, "bootstrap_store_info":
                                               RendezvousStoreInfo("127.0.0.1", 1234)})())
    assert RendezvousStoreInfo.build(1, later.store, None) == RendezvousStoreInfo("127.0.0.1", 1234)
    del attacker, infos, later, zero


def _c10d_store() -> tuple[dist.TCPStore, int]:
    port = free_port()
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10)), port


class _Listener:
    def __init__(self, host: str) -> None:
        self.address = f"{host}:1"

    def close(self) -> None:
        pass


def test_a_forged_comm_id_is_refused_naming_the_key_and_the_store() -> None:
    server, port = _c10d_store()
    attacker = _attacker(port)
    attacker.set("mccl/1/comm_id", b"4242")
    with pytest.raises(StoreAuthError, match=rf"'mccl/1/comm_id'.*peer=127.0.0.1:{port}.*without the job's key"):
        rendezvous.exchange(server, 1, 2, _Listener, EngineConfig(bind_addr="127.0.0.1"), 3.0, "g")
    del attacker, server


def test_a_forged_peer_address_is_refused_and_never_dialled() -> None:
    server, port = _c10d_store()
    key = store_auth.scoped_key(find_job_key(), "c10d", "g")
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(1)
    trap.setblocking(False)
    try:
        # Rank 0 (here the test, holding the job key) published the comm id; the attacker's
        # address table (rank 0 publishes it, rendezvous.py) is there before rank 1 reads it.
        server.set("mccl/1/comm_id", store_auth.seal(key, "mccl/1/comm_id", rendezvous.comm_id_value(77, 2, key_id(find_job_key()))))
        attacker = _attacker(port)
        attacker.set("mccl/1/addr_table", f"127.0.0.1:{trap.getsockname()[1]}\n127.0.0.1:9".encode())
        with pytest.raises(StoreAuthError, match=rf"'mccl/1/addr_table'.*peer=127.0.0.1:{port}"):
            rendezvous.exchange(server, 1, 2, _Listener, EngineConfig(bind_addr="127.0.0.1"), 3.0, "g")
        with pytest.raises(BlockingIOError):
            trap.accept()      # nobody dialled the forged address
    finally:
        trap.close()
    del attacker, server


def test_a_value_copied_to_another_key_or_run_is_refused() -> None:
    server, port = _c10d_store()
    key = store_auth.scoped_key(find_job_key(), "c10d", "g")
    server.set("mccl/1/comm_id", store_auth.seal(key, "mccl/1/comm_id", rendezvous.comm_id_value(77, 2, key_id(find_job_key()))))
    # Rank 1's own sealed address, copied by the attacker into the table's slot.
    attacker = _attacker(port)
    addr_key = store_auth.scoped_key(key, "comm", 77)
    attacker.set("mccl/1/addr_table", store_auth.seal(addr_key, "mccl/1/addr/1", b"127.0.0.1:9\n127.0.0.1:9"))
    with pytest.raises(StoreAuthError, match=r"'mccl/1/addr_table'.*failed its MAC"):
        rendezvous.exchange(server, 1, 2, _Listener, EngineConfig(bind_addr="127.0.0.1"), 3.0, "g")
    # A rendezvous state of one run copied into another run's key.
    store = dist.HashStore()
    first = er.AnchorStoreBackend(store, "run-a", "anchor:1")
    first.set_state(b"state of run a")
    second = er.AnchorStoreBackend(store, "run-b", "anchor:1")
    store.set("mccl/rdzv/run-b/state", store.get("mccl/rdzv/run-a/state"))
    with pytest.raises(StoreAuthError, match=r"'mccl/rdzv/run-b/state'.*failed its MAC.*peer=anchor:1"):
        second.get_state()
    del attacker, server


def test_a_mac_failure_never_shows_the_key_or_the_expected_mac() -> None:
    key = store_auth.scoped_key(b"k" * 32, "rdzv", "r")
    good = store_auth.seal(key, "n", b"v")
    forged = store_auth.PREFIX + base64.b64encode(b"\0" * store_auth.TAG_BYTES + b"v")
    with pytest.raises(StoreAuthError) as info:
        store_auth.open(key, "n", forged, "h:1")
    text = str(info.value)
    tag = base64.b64decode(good[len(store_auth.PREFIX):])[:store_auth.TAG_BYTES]
    for secret in (key, tag):
        assert secret.hex() not in text and base64.b64encode(secret).decode() not in text
    assert store_auth.open(key, "n", good, "h:1") == b"v"
    assert store_auth.open(None, "n", good, "h:1") == b"v"      # MCCL_WIRE_SECURITY=off reads it unchecked
    with pytest.raises(StoreAuthError, match="carries no MAC"):
        store_auth.open(key, "n", store_auth.seal(None, "n", b"v"), "h:1")


def _reachable(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/net"), reason="127.0.0.2 reaches loopback on Linux only")
def test_stores_are_served_on_the_training_address_only() -> None:
    """The anchor's store (served by a torchrun or by a standalone anchor) and the workers'
    store answer on the address they were given, not on the host's other addresses (here
    127.0.0.2 stands for them)."""
    import threading

    port = free_port()
    store, serving = er.open_anchor_store("127.0.0.1", port, serve=True, timeout_s=5)
    assert serving and _reachable("127.0.0.1", port) and not _reachable("127.0.0.2", port)
    del store
    gc.collect()

    port = free_port()
    stop = threading.Event()
    anchor = threading.Thread(target=er.serve_anchor, args=(port, stop, 5.0, "127.0.0.1"), name="anchor")
    anchor.start()
    try:
        deadline = 50
        while not _reachable("127.0.0.1", port) and deadline:
            deadline -= 1
            stop.wait(0.1)
        assert _reachable("127.0.0.1", port) and not _reachable("127.0.0.2", port)
    finally:
        stop.set()
        anchor.join(10)

    workers = er.MCCLRendezvousHandler._create_tcp_store_server(None, "127.0.0.1", 0)
    assert _reachable("127.0.0.1", workers.port) and not _reachable("127.0.0.2", workers.port)
    del workers
    gc.collect()


def test_an_earlier_state_of_the_same_run_written_back_is_refused() -> None:
    """A sealed state is valid for its run forever; one replayed over a newer one would roll
    the rendezvous back (drop hosts, reopen a round): refused by its version."""
    store = dist.HashStore()
    a = er.AnchorStoreBackend(store, "run", "anchor:1")
    _, first_token, ok = a.set_state(b"round 1")
    assert ok
    recorded = store.get("mccl/rdzv/run/state")
    _, token, ok = a.set_state(b"round 2", first_token)
    assert ok and a.get_state() == (b"round 2", token)
    store.set("mccl/rdzv/run/state", recorded)
    with pytest.raises(StoreAuthError, match=r"'mccl/rdzv/run/state'.*version 1, older than version 2.*peer=anchor:1"):
        a.get_state()
    # A host that joins later is vouched for by a host of the run and reads the newest state.
    store.set("mccl/rdzv/run/state", token)
    b = er.AnchorStoreBackend(store, "run", "anchor:1")
    with _vouching(a):
        assert b.get_state()[0] == b"round 2"


class _vouching:
    """A host of the run reading the state now and then, as torch's join loop and keep-alives
    do: it acknowledges the hellos of hosts that join (AnchorStoreBackend)."""

    def __init__(self, backend) -> None:
        import threading
        self._backend, self._stop = backend, threading.Event()
        self._thread = threading.Thread(target=self._run, name="vouching-host")
        self.error: Exception | None = None

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self._backend.get_state()
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                self.error = exc
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def test_a_state_recorded_in_an_earlier_run_is_refused_by_joining_hosts_and_the_runs_own(caplog) -> None:
    """Runs 1 and 2 under the same long-lived key and --rdzv-id: the state's key name and MAC
    key are the same in both. An attacker who recorded run 1's last state (a high version)
    writes it into run 2's store. Neither a host that joins now (nothing seen yet) nor a host
    already in run 2 may take it; a joining host that nobody vouches for begins afresh, so the
    replay cannot stop the run either."""
    first = dist.HashStore()
    run1 = er.AnchorStoreBackend(first, "run", "anchor:1")
    token = None
    for step in range(5):
        _, token, ok = run1.set_state(f"run 1 step {step}".encode(), token)
        assert ok
    recorded = first.get("mccl/rdzv/run/state")

    # A fresh store holding only the replayed state: the first host of run 2 must not take it.
    fresh = dist.HashStore()
    fresh.set("mccl/rdzv/run/state", recorded)
    joiner = er.AnchorStoreBackend(fresh, "run", "anchor:1")
    joiner._vouch_s = 1.0
    with caplog.at_level("WARNING", logger="libmccl.elastic.rdzv"):
        assert joiner.get_state() is None
    assert re.search(r"no host of run 'run' vouched.*peer=anchor:1.*earlier run.*nothing of it was used", caplog.text)
    _, _, ok = joiner.set_state(b"run 2 round 0")
    assert ok and joiner.get_state()[0] == b"run 2 round 0"
    assert joiner.epoch is not None and joiner.epoch != run1.epoch

    # Run 2 under way, the replay written over its state.
    second = dist.HashStore()
    host = er.AnchorStoreBackend(second, "run", "anchor:1")
    _, token2, ok = host.set_state(b"run 2 round 0")
    assert ok and host.get_state()[0] == b"run 2 round 0"
    second.set("mccl/rdzv/run/state", recorded)
    with pytest.raises(StoreAuthError, match=r"another run of 'run'.*peer=anchor:1.*earlier run"):
        host.get_state()
    late = er.AnchorStoreBackend(second, "run", "anchor:1")
    late._vouch_s = 1.0
    assert late.get_state() is None      # nothing of the replay taken
    # And the run's own state written back: a host joining is vouched for and reads it.
    second.set("mccl/rdzv/run/state", token2)
    newcomer = er.AnchorStoreBackend(second, "run", "anchor:1")
    with _vouching(host) as v:
        assert newcomer.get_state()[0] == b"run 2 round 0"
    assert v.error is None, v.error


def test_hosts_left_waiting_by_a_first_host_that_left_begin_the_run_afresh_together() -> None:
    """The host that began the run (drew its epoch) left before it saw the others' hellos, as
    a host whose user came back during start-up does: nobody can vouch for its state. The
    hosts waiting must not stop (they did, with RendezvousForged, in tests/e2e/test_reclaim_fleet.py):
    one empties the key and begins afresh, acknowledging the other, and both hold one epoch."""
    import threading

    store = dist.HashStore()
    first = er.AnchorStoreBackend(store, "run", "anchor:1")
    assert first.set_state(b"round 0 of a host that leaves")[2]
    waiting = [er.AnchorStoreBackend(store, "run", "anchor:1", vouch_s=0.5) for _ in range(2)]
    got: list = [b"unset", b"unset"]

    def join(i: int) -> None:
        got[i] = waiting[i].get_state()

    threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert got == [None, None]              # the abandoned state was used by neither
    b, c = waiting
    _, _, ok = b.set_state(b"round 0 again")
    assert ok
    assert c.get_state()[0] == b"round 0 again"
    assert b.epoch == c.epoch and b.epoch != first.epoch


def _run_exchange(port: int, size: int, factory) -> list:
    """Every rank's exchange() on a thread and store client of its own, as one run of a job does."""
    import threading

    out: list = [None] * size
    clients = [_attacker(port) for _ in range(size)]

    def rank_fn(rank: int) -> None:
        try:
            out[rank] = rendezvous.exchange(clients[rank], rank, size, factory, EngineConfig(bind_addr="127.0.0.1"),
                                            10.0, "g")
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out[rank] = exc
    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.parametrize("mode", ["in-process", "daemon"])
def test_a_value_recorded_in_an_earlier_run_is_refused_by_a_non_zero_rank(mode) -> None:
    """Run 1 and run 2 of a job under the same long-lived key (the fleet key): the store's key
    names repeat. An attacker who watched run 1's store writes its comm id and address table
    into run 2's before rank 1 reads them; rank 0 is slow (or the attacker overwrites the id
    after rank 0 read it back). Rank 1 must not take run 1's comm id or peers."""
    factory = _Listener if mode == "in-process" else None
    first, port1 = _c10d_store()
    run1 = _run_exchange(port1, 2, factory)
    assert all(isinstance(r, rendezvous.Rendezvous) for r in run1), run1
    names = [n for n in ("mccl/1/comm_id", "mccl/1/addr_table", "mccl/1/addr/0", "mccl/1/addr/1")
             if first.check([n])]
    recorded = {n: first.get(n) for n in names}
    assert "mccl/1/comm_id" in recorded

    second, port2 = _c10d_store()
    attacker = _attacker(port2)
    for name, blob in recorded.items():
        if name != "mccl/1/addr/1":   # rank 1 writes its own
            attacker.set(name, blob)
    with pytest.raises(StoreAuthError, match=r"earlier run") as info:
        rendezvous.exchange(second, 1, 2, factory, EngineConfig(bind_addr="127.0.0.1"), 3.0, "g")
    assert f"peer=127.0.0.1:{port2}" in str(info.value)
    del attacker, second, first
    gc.collect()
