"""init_process_group with a TCPStore or a file:// method and no MASTER_ADDR, between
emulated hosts (network namespaces, tools/fleet.py): each rank must pick an address its
peers can dial, and a rank left on loopback must make every rank fail at once instead of
waiting out the timeout. Needs root; skipped otherwise."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mccl_common.errors import ConfigError

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0  # the process group's timeout: what a hang would cost, well past "fails fast"

RANK = r'''
import datetime, json, os, sys, time
for k in ("MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(k, None)
import torch, torch.distributed as dist
from mccl_common.errors import MCCLError

mode, rank, world, where, timeout_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
timeout = datetime.timedelta(seconds=timeout_s)
res = {}
if mode == "tcp":
    host, port = where.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world, rank == 0, timeout=timeout)
    kw = {"store": store}
else:
    kw = {"init_method": "file://" + where}
started = time.monotonic()
try:
    dist.init_process_group("mccl", rank=rank, world_size=world, timeout=timeout, **kw)
    t = torch.full((1 << 16,), float(rank + 1))
    dist.all_reduce(t)
    res["ok"] = bool(torch.equal(t, torch.full_like(t, world * (world + 1) / 2)))
    res["peers"] = [dist.group.WORLD.communicator.peer_address(r) for r in range(world)]
    dist.barrier()
    dist.destroy_process_group()
except MCCLError as e:
    res.update(cls=type(e).__name__, msg=str(e))
res["elapsed"] = time.monotonic() - started
print("RESULT " + json.dumps(res), flush=True)
'''


@pytest.fixture
def fleet2():
    from tools import fleet as fleet_mod

    try:
        fleet_mod.check_prerequisites()
    except ConfigError as e:
        pytest.skip(str(e))
    with fleet_mod.Fleet(2, rate=None) as f:
        yield f


def run_ranks(f, tmp: Path, mode: str, env: list[dict] | None = None, timeout_s: float = TIMEOUT_S) -> list[dict]:
    """Rank r on host r. The fleet's hosts have no default route and share the machine's host
    name (not an address inside their namespace), so with "tcp" only the route to the store's
    host can find the address."""
    if mode == "file":
        # file:// gives no host to route to: a default route, as real hosts have, is what is left.
        for h in f.hosts:
            subprocess.run(["ip", "-n", h.ns, "route", "replace", "default", "dev", h.ifname], check=True, timeout=20)
    script = tmp / "rank.py"
    script.write_text(RANK)
    where = f"{f.hosts[0].addr}:{random.randint(20000, 40000)}" if mode == "tcp" else str(tmp / "store")
    world = len(f.hosts)
    procs = [f.popen(r, [sys.executable, str(script), mode, str(r), str(world), where, str(timeout_s)], cwd=ROOT,
                     env={"MCCL_BIND_ADDR": "", "MCCL_SOCKET_IFNAME": "", **((env or [{}] * world)[r])},
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    results = []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout_s + 60)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert p.returncode == 0 and lines, f"rank {r} (rc={p.returncode}):\n{out[-2000:]}\n{err[-3000:]}"
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


@pytest.mark.parametrize("mode", ["tcp", "file"])
def test_ranks_on_two_hosts_find_each_other_without_master_addr(fleet2, tmp_path: Path, mode: str) -> None:
    results = run_ranks(fleet2, tmp_path, mode)
    for r, res in enumerate(results):
        assert res.get("ok") is True, f"rank {r}: {res}"
        assert [a.rsplit(":", 1)[0] for a in res["peers"]] == [h.addr for h in fleet2.hosts], res


@pytest.mark.parametrize("mode", ["tcp", "file"])
@pytest.mark.parametrize("on_loopback", [0, 1])
def test_a_rank_on_loopback_fails_every_rank_fast(fleet2, tmp_path: Path, mode: str, on_loopback: int) -> None:
    env = [{}, {}]
    env[on_loopback] = {"MCCL_BIND_ADDR": "127.0.0.1"}
    started = time.monotonic()
    results = run_ranks(fleet2, tmp_path, mode, env)
    # Interpreter start and torch import take seconds on a loaded box; the hang took TIMEOUT_S.
    assert time.monotonic() - started < TIMEOUT_S / 2
    real = fleet2.hosts[1 - on_loopback].addr
    for r, res in enumerate(results):
        assert res.get("cls") == "ConfigError", f"rank {r}: {res}"
        assert res["elapsed"] < 15, f"rank {r} took {res['elapsed']:.1f}s: {res}"
        msg = res["msg"]
        assert f"rank {on_loopback} listens on loopback 127.0.0.1:" in msg, msg
        assert f"rank {1 - on_loopback} publishes {real}:" in msg, msg
        assert "MCCL_SOCKET_IFNAME" in msg and "MCCL_BIND_ADDR" in msg, msg


def _daemon_fleet(loopback_hosts: tuple[int, ...] = ()):
    """Two hosts with one mccld each that picks its own interface, except on
    ``loopback_hosts``, where it is told to listen on 127.0.0.1."""
    from support.fleet import DaemonFleet, skip_unless_fleet

    skip_unless_fleet()

    class AutoAddressDaemons(DaemonFleet):
        def env(self, i: int) -> dict[str, str]:
            env = super().env(i)
            del env["MCCL_IFACE"]
            if i in loopback_hosts:
                env["MCCL_LISTEN_ADDR"] = "127.0.0.1"
            return env

    return AutoAddressDaemons(2)


def test_daemon_mode_without_master_addr(tmp_path: Path) -> None:
    with _daemon_fleet() as df:
        results = run_ranks(df.fleet, tmp_path, "tcp", [{**df.env(h), "MCCL_DAEMON": "1"} for h in range(2)])
        for r, res in enumerate(results):
            assert res.get("ok") is True, f"rank {r}: {res}\n--- h{r} ---\n{df.log(r)[-2000:]}"
            assert [a.rsplit(":", 1)[0] for a in res["peers"]] == [h.addr for h in df.fleet.hosts], res


def test_daemon_mode_a_daemon_on_loopback_fails_every_rank_fast(tmp_path: Path) -> None:
    with _daemon_fleet(loopback_hosts=(1,)) as df:
        results = run_ranks(df.fleet, tmp_path, "tcp", [{**df.env(h), "MCCL_DAEMON": "1"} for h in range(2)])
        for r, res in enumerate(results):
            assert res.get("cls") == "ConfigError", f"rank {r}: {res}"
            assert res["elapsed"] < 15, f"rank {r} took {res['elapsed']:.1f}s: {res}"
            assert "rank 1's mccld listens on loopback 127.0.0.1:" in res["msg"], res
            assert f"rank 0's mccld publishes {df.fleet.hosts[0].addr}:" in res["msg"], res
            assert "MCCL_IFACE" in res["msg"] and "MCCL_LISTEN_ADDR" in res["msg"], res
