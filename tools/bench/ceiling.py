"""The ring ceiling: what the network gives when every host sends to its right neighbour.

A ring collective keeps every host sending to one neighbour and receiving from the other
at once, so its bus bandwidth can at best match this measurement (made with iperf3, or
the built-in probe where iperf3 is missing). Also reports the CPU seconds the transfer
tool spent per GB moved (sender + receiver), the reference for the backends' CPU cost.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

from mccl_common.errors import MCCLError
from ..fleet import wait_for_output
from .launch import first_failure, run_group

log = logging.getLogger(__name__)

BASE_PORT = 5301


def _json_of(done) -> dict:
    with open(done.log_path, errors="replace") as f:
        text = f.read()
    start = text.find("{")
    if start < 0:
        raise MCCLError(f"[bench] no JSON in the bandwidth tool's output: {text.strip()[-300:]}")
    return json.loads(text[start:text.rfind("}") + 1])


def iperf3_ring(launcher, seconds: float, log_dir: str) -> dict:
    n = launcher.n
    ports = [launcher.free_port(BASE_PORT + i) for i in range(n)]
    servers = []
    try:
        for i in range(n):
            p = launcher.popen(i, ["iperf3", "-s", "-p", str(ports[i]), "--forceflush"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            servers.append(p)
            wait_for_output(p, b"listening", f"iperf3 server on host {i}")
        argvs = [["iperf3", "-c", launcher.addr((i + 1) % n), "-p", str(ports[(i + 1) % n]),
                  "-t", f"{seconds:g}", "-O", "1", "-J"] for i in range(n)]
        # -O 1: TCP slow start is not part of what the link can carry.
        done = run_group(launcher, argvs, [{}] * n, log_dir, seconds + 31, "iperf3")
    finally:
        for p in servers:
            p.kill()
            p.wait(timeout=10)
    why = first_failure(done)
    if why:
        raise MCCLError(f"[bench] iperf3 ring failed: {why}")
    per_host, cpu_s, nbytes = [0.0] * n, 0.0, 0
    for i, d in enumerate(done):
        j = _json_of(d)
        if "error" in j:
            raise MCCLError(f"[bench] iperf3 from host {i} failed: {j['error']}")
        end = j["end"]
        # The receiver's side is what arrived; host i's client lands on host i+1.
        per_host[(i + 1) % n] = end["sum_received"]["bits_per_second"]
        nbytes += end["sum_received"]["bytes"]
        util = end["cpu_utilization_percent"]
        cpu_s += (util["host_total"] + util["remote_total"]) / 100.0 * end["sum_sent"]["seconds"]
    return _summary("iperf3", seconds, per_host, cpu_s, nbytes)


def probe_ring(launcher, seconds: float, log_dir: str) -> dict:
    n = launcher.n
    ports = [launcher.free_port(BASE_PORT + i) for i in range(n)]
    argvs = [[sys.executable, "-m", "tools.bench.probe", launcher.addr(i), str(ports[i]),
              launcher.addr((i + 1) % n), str(ports[(i + 1) % n]), f"{seconds:g}"] for i in range(n)]
    done = run_group(launcher, argvs, [{}] * n, log_dir, seconds + 60, "probe")
    why = first_failure(done)
    if why:
        raise MCCLError(f"[bench] TCP ring probe failed: {why}")
    per_host, cpu_s, nbytes = [], 0.0, 0
    for d in done:
        j = _json_of(d)
        per_host.append(8 * j["bytes"] / j["seconds"] if j["seconds"] > 0 else 0.0)
        cpu_s += j["cpu_s"]
        nbytes += j["bytes"]
    return _summary("tcp-probe", seconds, per_host, cpu_s, nbytes)


def _summary(tool: str, seconds: float, per_host: list[float], cpu_s: float, nbytes: int) -> dict:
    return {"tool": tool, "seconds": seconds, "per_host_bps": per_host,
            "mean_bps": sum(per_host) / len(per_host), "min_bps": min(per_host),
            "cpu_s": cpu_s, "bytes": nbytes, "cpu_s_per_gb": cpu_s / (nbytes / 1e9) if nbytes else None}


def ring_ceiling(launcher, seconds: float, log_dir: str, tool: str = "auto") -> dict:
    """Measure the ring ceiling with iperf3, or the built-in probe if iperf3 is missing."""
    if launcher.n < 2:
        raise MCCLError("[bench] a ring ceiling needs at least 2 hosts")
    if tool == "iperf3" or (tool == "auto" and shutil.which("iperf3")):
        return iperf3_ring(launcher, seconds, log_dir)
    if tool == "auto":
        log.warning("[bench] iperf3 not found; measuring the ring ceiling with the built-in TCP probe")
    return probe_ring(launcher, seconds, log_dir)
