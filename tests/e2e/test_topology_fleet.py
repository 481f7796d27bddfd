"""Switches on an emulated fleet: two switches of two hosts joined by slow uplinks
(tools.fleet ``switches``). The daemons infer the switches from RTTs (``mcclctl links
--topology``), and a job through them runs its all-reduces switch by switch with exact results.

Run directly (``python tests/e2e/test_topology_fleet.py FN RANK WORLD``) it is the rank program.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from support.fleet import DaemonFleet as _DaemonFleet
from support.fleet import skip_unless_fleet


class DaemonFleet(_DaemonFleet):
    RANK_SCRIPT = Path(__file__).resolve()


STATUS_PORT = 29651
COUNT = 1 << 20  # 4 MB of float32: past MCCL_DAEMON_FAST_BYTES, so pipelined with tickets


@pytest.mark.fleet
@pytest.mark.timeout(150)
def test_daemons_infer_two_switches_and_a_job_reduces_by_switch():
    skip_unless_fleet()
    env = {"MCCL_HIERARCHY_MIN_BYTES": str(64 << 10), "MCCL_HIERARCHY": "tree", "MCCL_STATUS_PORT": str(STATUS_PORT)}
    with DaemonFleet(4, rate="1gbit", extra_env=env, switches=2, uplink_rate="100mbit") as df:
        base = {**df.env(0), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        hosts = [a for h in df.fleet.hosts for a in ("--host", f"{h.addr}:{STATUS_PORT}")]
        deadline = time.monotonic() + 45
        while True:
            res = df.fleet.run(0, [sys.executable, "-m", "mcclctl", "links", "--topology", "--json",
                                   *hosts],
                               timeout=30, env=base)
            view = json.loads(res.stdout) if res.returncode == 0 else {}
            switches = sorted(sorted(v) for v in view.get("switches", {}).values())
            if switches == [["h0", "h1"], ["h2", "h3"]] and all(view["daemons"].values()):
                break
            assert time.monotonic() < deadline, f"never saw two switches: {res.stdout}\n{res.stderr}"
            time.sleep(1.0)
        assert view["source"] == "rtt" and view["rtt"]["far_rtt_s"] > 1.5 * view["rtt"]["near_rtt_s"]
        # Each daemon's own answer (what its jobs use) agrees with the fleet's view.
        assert view["daemons"]["h0"] == view["daemons"]["h1"] != view["daemons"]["h2"] == view["daemons"]["h3"]
        table = df.fleet.run(0, [sys.executable, "-m", "mcclctl", "links", "--topology",
                                 *hosts], timeout=30, env=base)
        assert "switches: 2 (inferred from RTTs)" in table.stdout, table.stdout + table.stderr

        # Ranks 0-3 on hosts 0, 2, 1, 3: the job's ranks interleave the switches.
        out = df.ranks("allreduce", [0, 2, 1, 3], timeout_s=90)
        for r, (code, text) in out.items():
            assert code == 0 and text.endswith("ok"), f"rank {r}:\n{text}\n--- h0 ---\n{df.log(0)[-3000:]}"
        assert "on 2 switches, all-reduces from 65536 bytes run by switch (tree)" in df.log(0)


@pytest.mark.fleet
@pytest.mark.timeout(60)
def test_switches_are_bridges_joined_by_shaped_uplinks():
    skip_unless_fleet()
    from tools.fleet import Fleet, list_links
    from tools.fleet_cli import iperf3_pair
    with Fleet(4, rate="400mbit", switches=[3, 1], uplink_rate="100mbit") as f:
        fid = f.id
        assert [h.switch for h in f.hosts] == [0, 0, 0, 1]
        assert f.topology_text() == f"switch-0: {f.hosts[0].addr} {f.hosts[1].addr} {f.hosts[2].addr}\n" \
                                    f"switch-1: {f.hosts[3].addr}\n"
        bits = lambda doc: doc["end"]["sum_received"]["bits_per_second"]  # noqa: E731
        across, within = bits(iperf3_pair(f, 0, 3, 1.0)), bits(iperf3_pair(f, 0, 1, 1.0))
        assert 50e6 < across < 110e6 and within > 2.5 * across, (across, within)
    assert not [name for name in list_links() if name.startswith(f"mccl{fid}")]


def _allreduce(rank: int, world: int) -> str:
    import numpy as np
    from mccl_common.wire import AVG, F32, SUM
    from support import daemon as t
    comm, _store = t.connect(rank, world, comm_id=0x70b0, timeout_s=60.0)
    for op, ref in ((SUM, sum(range(1, world + 1))), (AVG, sum(range(1, world + 1)) / world)):
        a = np.arange(COUNT, dtype=np.float32) % 7 + (rank + 1)
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, op), 60)
        expect = (np.arange(COUNT, dtype=np.float32) % 7) * (world if op == SUM else 1) + np.float32(ref)
        assert np.array_equal(a, expect), (op, a[:8], expect[:8])
    comm.shutdown(10)
    return "ok"


PROGRAMS = {"allreduce": _allreduce}

if __name__ == "__main__":
    fn, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(PROGRAMS[fn](rank, world), flush=True)
