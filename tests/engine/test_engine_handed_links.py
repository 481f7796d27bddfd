"""Links on demand over handed-in sockets (transport/handed_links.h, as mccld builds its
engines): built on the collectives' peers only, a send to any other peer asks the owner,
which hands the sockets in on both sides; p2p and all-to-all then work, the sockets stay
reusable by a clean shutdown, and an owner that cannot link fails the op naming the peer.
Ranks are threads."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import PeerLostError

from support.borrowed import K, Mesh, allreduce_check, alltoall_check, send_0_to_3
from support.engine import job_secret, make_options, ptr, run_ranks, run_threads

N = 6   # rank 0's collective peers are 1, 2, 4, 5: 0-3 is linked only on demand


class Owner:
    """Plays mccld: builds each rank's engine on its collective peers' sockets and, when an
    engine asks for a peer, hands that pair's sockets to both ends (off the asking thread)."""

    def __init__(self, mesh: Mesh, refuse: bool = False):
        self.mesh, self.refuse = mesh, refuse
        self.comms: list = []
        self.asked: list[tuple[int, int]] = []
        self._handed: set[frozenset] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def build(self) -> list:
        n = self.mesh.n
        opts = make_options(sockets_per_peer=K, connect_timeout_s=10.0)
        cid = random.getrandbits(63)
        addrs = [f"127.0.0.1:{1000 + r}" for r in range(n)]

        def one(r):
            peers = set(_core.collective_peers(r, n))
            fds = {p: f for p, f in self.mesh.fds(r).items() if p in peers}
            return _core.Communicator(r, n, cid, fds, addrs, opts, secret=job_secret(opts),
                                      want=lambda p, r=r: self._want(r, p))
        self.comms = run_threads(n, one)
        return self.comms

    def _want(self, r: int, p: int) -> None:
        with self._lock:
            self.asked.append((r, p))
            pair = frozenset((r, p))
            if pair in self._handed:
                return
            self._handed.add(pair)
        t = threading.Thread(target=self._hand, args=(r, p))
        self._threads.append(t)
        t.start()

    def _hand(self, r: int, p: int) -> None:
        if self.refuse:
            self.comms[r].refuse_link(p, 1, f"[test] no sockets to peer=127.0.0.1:{1000 + p}: host gone")
            return
        self.comms[r].hand_in(p, self.mesh.fds(r)[p])
        self.comms[p].hand_in(r, self.mesh.fds(p)[r])

    def join(self) -> None:
        for t in self._threads:
            t.join(10)

    def shutdown(self, timeout_s: float) -> list[bool]:
        """Shuts every engine down and drops them (each holds our callback, which holds us)."""
        self.join()
        comms, self.comms = self.comms, []
        return run_threads(len(comms), lambda r: comms[r].shutdown(timeout_s))


@pytest.mark.timeout(90)
def test_a_send_to_a_non_partner_links_it_on_demand_and_the_sockets_stay_reusable():
    with Mesh(N) as mesh:
        owner = Owner(mesh)
        comms = owner.build()
        assert comms[0].stats()["linked_peers"] == 4
        allreduce_check(comms, 1000)
        assert owner.asked == [], "whole-world collectives asked for a link they do not use"

        run_ranks(comms, send_0_to_3)
        assert owner.asked == [(0, 3)], "the receiver must not ask; the sender asks once"
        assert comms[0].stats()["linked_peers"] == 5 and comms[3].stats()["linked_peers"] == 4

        run_ranks(comms, alltoall_check)
        owner.join()
        assert all(c.stats()["linked_peers"] == N - 1 for c in comms)
        del comms
        assert owner.shutdown(5.0) == [True] * N
        again = Owner(mesh)                   # every socket, the handed-in ones too, is reusable
        allreduce_check(again.build(), 8)
        assert again.shutdown(5.0) == [True] * N


@pytest.mark.timeout(60)
def test_an_owner_that_cannot_link_fails_the_send_naming_the_peer():
    with Mesh(N) as mesh:
        owner = Owner(mesh, refuse=True)
        comms = owner.build()
        x = np.zeros(8, dtype=np.uint8)
        with pytest.raises(PeerLostError, match="no sockets to peer=127.0.0.1:1003") as e:
            comms[0].wait(comms[0].send(ptr(x), x.nbytes, 3, 1), 20)
        assert e.value.peer_rank == 3
        del comms
        owner.shutdown(1.0)


@pytest.mark.timeout(30)
def test_hand_in_is_checked():
    with Mesh(N) as mesh:
        owner = Owner(mesh)
        comms = owner.build()
        with pytest.raises(Exception, match="handed in twice"):
            comms[0].hand_in(1, mesh.fds(0)[1])               # a set-up peer
        with pytest.raises(Exception, match="expected 2"):
            comms[0].hand_in(3, mesh.fds(0)[3][:1])
        with pytest.raises(Exception, match="not a peer"):
            comms[0].hand_in(0, mesh.fds(0)[1])
        del comms
        owner.shutdown(2.0)
        plain = Mesh.build(mesh)                             # no `want`: no hand_in
        with pytest.raises(Exception, match="without `ask`"):
            plain[0].hand_in(3, mesh.fds(0)[3])
        run_threads(N, lambda r: plain[r].shutdown(2.0))
