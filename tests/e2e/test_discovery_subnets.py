"""Discovery across routed subnets (tools/fleet_subnets.py): three subnets behind one router,
mDNS confined to each by construction, one mccld per emulated host, MCCL_PEERS naming one seed
in the next subnet. Gossip gives every daemon the whole fleet, `mcclctl status --json` on a host
of subnet 0 lists every host, and a daemon without the fleet key gets into no table."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from support.fleet import KEY, skip_unless_fleet

SIZES = [2, 2, 3]                 # subnet 2's last host is the intruder
INTRUDER = (2, 2)
CONVERGE_S = 60.0                 # generous: 7 daemons start on 2 busy cores


def name(h: tuple[int, int]) -> str:
    return "intruder" if h == INTRUDER else f"s{h[0]}h{h[1]}"


@pytest.fixture
def subnets():
    skip_unless_fleet()
    from tools.fleet_subnets import SubnetFleet
    rundir = Path(tempfile.mkdtemp(prefix="mccl-subnets-"))
    net = SubnetFleet(SIZES)
    daemons: list[subprocess.Popen] = []
    try:
        net.start()
        for h in net.hosts:
            seed = net.hosts[((h[0] + 1) % len(SIZES), 0)]     # one seed, in the next subnet
            env = {"MCCL_IFACE": "eth0", "MCCL_RUNTIME_DIR": str(rundir / name(h)), "MCCL_HOST_ID": name(h),
                   "MCCL_FLEET_KEY": "intruder-key-" + "x" * 24 if h == INTRUDER else KEY,
                   "MCCL_FLEET": "subnets", "MCCL_MDNS_TTL": "6", "MCCL_METRICS_PORT": "0",
                   "MCCL_LAUNCH_PORT": "0", "MCCL_GOSSIP_INTERVAL": "0.5", "MCCL_GOSSIP_TTL": "10",
                   "MCCL_PEERS": f"{seed.addr}" if h != INTRUDER else f"{net.hosts[(0, 0)].addr},{seed.addr}"}
            with open(rundir / f"{name(h)}.log", "w") as log:
                daemons.append(net.popen(h, [sys.executable, "-m", "mccld", "--log-level", "DEBUG"], env=env,
                                         stderr=log))
        yield net, rundir
    finally:
        for p in daemons:
            if p.poll() is None:
                p.terminate()
        for p in daemons:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        net.stop()       # kills anything left by pid before deleting the namespaces
        for p in sorted(rundir.rglob("*"), reverse=True):
            p.unlink() if not p.is_dir() else p.rmdir()
        rundir.rmdir()


def table(rundir: Path, host: str) -> list[dict]:
    from mccld.attach import local_request
    return local_request(rundir / host, {"type": "status"})["status"]["fleet_table"]


@pytest.mark.timeout(150)
def test_every_daemon_learns_every_subnet_and_mcclctl_lists_them_all(subnets):
    net, rundir = subnets
    honest = sorted(name(h) for h in net.hosts if h != INTRUDER)
    deadline = time.monotonic() + CONVERGE_S
    tables: dict[str, list[dict]] = {}
    while time.monotonic() < deadline:
        try:
            tables = {h: table(rundir, h) for h in honest}
        except Exception:  # noqa: BLE001 - a daemon still starting
            tables = {}
        if tables and all(sorted(r["host_id"] for r in t if r["host_id"] != "intruder") == honest
                          for t in tables.values()):
            break
        time.sleep(0.5)
    else:
        logs = "\n".join(f"--- {h}\n{(rundir / f'{h}.log').read_text()[-1500:]}" for h in honest)
        pytest.fail(f"tables did not converge in {CONVERGE_S:.0f} s: "
                    f"{ {h: sorted(r['host_id'] for r in t) for h, t in tables.items()} }\n{logs}")

    # mDNS stays in its subnet (the router does not forward it): subnet 0 hears only subnet 0.
    mdns = {r["host_id"] for r in tables["s0h0"] if r.get("source") == "mdns"}
    assert mdns <= {"s0h0", "s0h1"}, mdns
    # The intruder holds no fleet key: no gossip table anywhere has it (only its own subnet's
    # unauthenticated mDNS shows it, and nobody links with it).
    for h, t in tables.items():
        assert all(r["host_id"] != "intruder" for r in t if r.get("source") == "gossip"), h
    # Nor does it learn the fleet beyond what its subnet's mDNS shows anyone.
    assert {r["host_id"] for r in table(rundir, "intruder")} <= {"s2h0", "s2h1", "intruder"}

    env = {"MCCL_IFACE": "eth0", "MCCL_FLEET_KEY": KEY, "MCCL_FLEET": "subnets"}
    t0 = time.monotonic()
    res = net.run((0, 1), [sys.executable, "-m", "mcclctl", "status", "--json", "--discover-timeout", "1"],
                  timeout=60, env=env)
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr + res.stdout
    daemons = json.loads(res.stdout)["daemons"]
    assert sorted(d["host"] for d in daemons) == honest, (took, daemons)
    assert all(d["error"] is None and d["status"]["host"] == d["host"] for d in daemons), daemons
    addrs = {d["host"]: d["target"].rpartition(":")[0] for d in daemons}
    assert addrs["s2h1"] == net.hosts[(2, 1)].addr      # reached through the router
