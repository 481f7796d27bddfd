"""mcclctl against real mccld daemons on a 3-host emulated fleet (network namespaces).

Three daemons find each other over mDNS; a 2-rank training job (MCCL_DAEMON clients,
all-reduce loop) runs on host 1. From host 0, ``mcclctl status`` (mDNS discovery, no
--host) must list all three hosts with host 1 training and the others idle; ``jobs``
must show the job's ranks; ``linktest`` must measure and record a ceiling; ``doctor``
must find the daemon's endpoints, the peers and their clocks; ``prometheus-sd`` must list
all three metrics endpoints.

Run as a script, this file is one rank of that job (started inside host 1's namespace).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 30.0


def _rank_main(rank: int, world: int, port: int, stop_file: str, max_s: float) -> int:
    """One rank: all-reduce in a loop through the local daemon until told to stop."""
    import datetime

    import numpy as np
    import torch.distributed as dist

    from libmccl.daemon.client import DaemonCommunicator
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    comm = DaemonCommunicator(rank, world, 0x0b5, store, None, None, 60.0)
    buf = np.ones(1 << 16, dtype=np.float32)
    deadline = time.monotonic() + max_s
    # The last element carries "I saw the stop file" through the all-reduce itself, so every
    # rank stops after the same collective: a rank that stopped on its own look at the file
    # would leave its peer waiting in the next all-reduce until the job's timeout.
    while True:
        buf[:] = 1.0
        buf[-1] = 2.0 if os.path.exists(stop_file) or time.monotonic() > deadline else 1.0
        comm.wait(comm.allreduce(buf.ctypes.data, buf.size, 0, 0), 30)
        if not (np.all(buf[:-1] == world) and world <= buf[-1] <= 2 * world):
            print(f"rank {rank}: wrong all-reduce result", file=sys.stderr)
            return 1
        if buf[-1] > world:
            break
        time.sleep(0.01)
    comm.shutdown(10)
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])))


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="the fleet needs root and iproute2")


def _mcclctl(fleet, host: int, env: dict, *args: str) -> subprocess.CompletedProcess:
    return fleet.run(host, [PY, "-m", "mcclctl", *args], timeout=STEP_TIMEOUT_S, env=env)


def _wait_for(what: str, fn, timeout_s: float = 45.0):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        ok, last = fn()
        if ok:
            return last
        time.sleep(1.0)
    raise AssertionError(f"{what} not reached within {timeout_s} s; last: {last}")


@needs_root
@pytest.mark.fleet
@pytest.mark.timeout(240)
def test_status_lists_three_hosts_with_their_states():
    from tools.fleet import Fleet

    work = Path(tempfile.mkdtemp(prefix="mccl-ctl-fleet-"))
    key = work / "fleet.key"
    key.write_text("obs-fleet-test-key-" + "k" * 24)
    key.chmod(0o600)
    fleet_name = f"ctl{os.getpid()}"
    base = {"MCCL_KEY_FILE": str(key), "MCCL_FLEET": fleet_name, "MCCL_IFACE": "eth0",
            "PYTHONPATH": str(REPO)}
    logs = []
    try:
        with Fleet(3, rate=None) as fleet:
            for i in range(3):
                env = dict(base, MCCL_HOST_ID=f"host{i}", MCCL_RUNTIME_DIR=str(work / f"rt{i}"),
                           MCCL_CLIENT_CHECK_INTERVAL="0.1")
                log = open(work / f"mccld{i}.log", "w")
                logs.append(log)
                fleet.popen(i, [PY, "-m", "mccld"], env=env, stdout=log, stderr=subprocess.STDOUT)

            def three_idle():
                r = _mcclctl(fleet, 0, base, "status", "--json")
                if r.returncode != 0:
                    return False, r.stdout + r.stderr
                states = {d["host"]: (d["status"] or {}).get("state") for d in json.loads(r.stdout)["daemons"]}
                return states == {"host0": "idle", "host1": "idle", "host2": "idle"}, states
            _wait_for("three idle daemons found over mDNS", three_idle)

            stop_file = work / "stop"
            job_env = dict(base, MCCL_RUNTIME_DIR=str(work / "rt1"), OMP_NUM_THREADS="1")
            port = 29800 + os.getpid() % 100
            ranks = [fleet.popen(1, [PY, __file__, str(r), "2", str(port), str(stop_file), "120"], env=job_env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]

            def host1_training():
                r = _mcclctl(fleet, 0, base, "status", "--json")
                if r.returncode != 0:
                    return False, r.stdout + r.stderr
                states = {d["host"]: (d["status"] or {}).get("state") for d in json.loads(r.stdout)["daemons"]}
                return states == {"host0": "idle", "host1": "training", "host2": "idle"}, states
            _wait_for("host1 training while host0/host2 idle", host1_training, timeout_s=90)

            table = _mcclctl(fleet, 0, base, "status")
            assert table.returncode == 0, table.stderr
            lines = table.stdout.splitlines()
            assert lines[0] == f"fleet {fleet_name}: 3 daemons (from this host's mccld)", table.stdout
            rows = {line.split()[0]: line.split() for line in lines[2:] if line.strip()}
            assert set(rows) == {"host0", "host1", "host2"}, table.stdout
            assert rows["host1"][3] == "training" and rows["host1"][5] == "1/2", table.stdout
            assert rows["host0"][3] == "ready" and rows["host2"][3] == "ready"   # ACTIVITY: no job
            assert rows["host1"][1] == f"{fleet.hosts[1].addr}:29650"

            jobs = _mcclctl(fleet, 2, base, "jobs", "--json", "--host", fleet.hosts[1].addr)
            (entry,) = json.loads(jobs.stdout)
            (job,) = entry["jobs"]
            assert sorted(job["ranks"]) == [0, 1] and job["world"] == 2 and job["collectives"] > 0

            lt = _mcclctl(fleet, 0, base, "linktest", "host0", "host2", "--seconds", "1", "--json")
            assert lt.returncode == 0, lt.stdout + lt.stderr
            result = json.loads(lt.stdout)
            assert result["peer_address"] == f"{fleet.hosts[2].addr}:29650" and result["bits_per_s"] > 1e8
            links = _mcclctl(fleet, 1, base, "links", "--json", "--host", fleet.hosts[0].addr)
            (entry,) = json.loads(links.stdout)
            ceilings = {link["peer"]: link["ceiling_bits_per_s"] for link in entry["links"]}
            assert ceilings.get(result["peer_address"]) == result["bits_per_s"]

            doc = _mcclctl(fleet, 2, base, "doctor", "--json")
            checks = {c["name"]: c for c in json.loads(doc.stdout)}
            for name in ("link port", "status port", "metrics port", "peer host0", "peer host1",
                         "clock host0", "clock host1", "fleet key", "interface"):
                assert checks[name]["status"] == "ok", checks[name]
            assert doc.returncode == 0, doc.stdout

            sd = _mcclctl(fleet, 0, base, "prometheus-sd")
            groups = json.loads(sd.stdout)
            assert sorted(g["labels"]["host"] for g in groups) == ["host0", "host1", "host2"]
            assert sorted(g["targets"][0] for g in groups) == sorted(f"{h.addr}:29652" for h in fleet.hosts)

            stop_file.touch()
            for p in ranks:
                out, _ = p.communicate(timeout=STEP_TIMEOUT_S)
                assert p.returncode == 0, out.decode(errors="replace")[-3000:]
    except BaseException:
        for i in range(len(logs)):
            sys.stderr.write(f"--- mccld{i}.log\n{(work / f'mccld{i}.log').read_text()[-3000:]}\n")
        raise
    finally:
        for log in logs:
            log.close()
        shutil.rmtree(work, ignore_errors=True)
