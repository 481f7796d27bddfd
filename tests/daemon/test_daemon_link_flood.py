"""A keyless host floods mccld's link port, which carries both the control links and the
data sockets (mccld/net/links.py, datalinks.py), with idle connections (issue 34).

The attacker holds more silent connections than the port's pre-auth caps allow, from the
address the fleet's daemons dial from (one machine, loopback) and from four others, before
the daemons first meet. Before the fix the gate closed every connection past a cap at
accept, the real daemon's too, and a dial was tried once: the job's lease failed with
PeerLostError. The gate must make room by dropping the oldest unauthenticated connection
of the busiest address instead, so the newest (a real daemon's, which authenticates at
once) gets in. Hosts are link managers and data-socket pools in this process, as mccld
wires them; ranks are engine communicators over the leased sockets.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import MCCLError
from support.datalinks import K, Host
from support.engine import job_secret, ptr
from tools.bench.daemon_sockets import run_job

pytestmark = pytest.mark.timeout(120)

SAME_HOST = 40                      # from the daemons' own address (127.0.0.1)
OTHERS = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
PER_OTHER = 12


def flood(port: int) -> list[socket.socket]:
    held = []
    for ip in ["127.0.0.1"] * SAME_HOST + [a for a in OTHERS for _ in range(PER_OTHER)]:
        s = socket.socket()
        s.bind((ip, 0))
        s.settimeout(5.0)
        s.connect(("127.0.0.1", port))
        held.append(s)
    return held


def test_a_job_through_the_daemons_runs_while_their_link_ports_hold_a_flood_of_idle_connections():
    n = 3
    hosts = [Host(f"flood{i}") for i in range(n)]
    held: list[socket.socket] = []
    for h in hosts:
        h.__enter__()
    try:
        for h in hosts:
            held += flood(int(h.links.address.rpartition(":")[2]))
        # Over the caps on every port: the gates saw the flood before the daemons met.
        for h in hosts:
            gate = h.links.gate
            assert gate.unauthenticated() > 0

        def body(rank, comm):
            for step in range(2):
                a = np.full(4096, rank + 1 + step, np.float32)
                comm.wait(comm.allreduce(ptr(a), a.size, int(_core.DType.float32), int(_core.ReduceOp.SUM)), 30)
                assert np.all(a == sum(range(1 + step, n + 1 + step)))
            return float(a[0])

        out = run_job(hosts, "flooded", body, job_secret(), K, timeout_s=20.0, budget_s=10.0)
        errors = [r for r, _ in out if isinstance(r, MCCLError)]
        assert not errors, errors
        assert [r for r, _ in out] == [float(sum(range(2, n + 2)))] * n
        # The flood was met by the gates' caps, not by luck: each dropped some of it.
        assert all(h.links.gate.refused > 0 for h in hosts)
    finally:
        for s in held:
            s.close()
        for h in hosts:
            h.__exit__(None, None, None)
