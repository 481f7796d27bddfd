"""One benchmark run: the ring ceiling, then every backend's sweep, on the same hosts.

Per (backend, op, size) the ranks report wall time per op for each repeat and their CPU
time. A repeat's time is the slowest rank's (an op is done when every rank is done);
the reported time is the median over repeats. CPU seconds per wire GB sums user+sys
time over all ranks and divides by the bytes all ranks put on the wire (metrics.py).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from ..errors import ConfigError, MCCLError
from .ceiling import ring_ceiling
from .launch import FleetLauncher, LocalLauncher, first_failure, run_group
from .metrics import OPS
from .worker import TEARDOWN_FAILED

log = logging.getLogger(__name__)

BACKENDS = ("mccl", "gloo")
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class BenchConfig:
    hosts: int = 0                 # 0: loopback; N: one rank per emulated host
    ranks: int = 2                 # loopback only; with hosts > 0 there is one rank per host
    rate: str | None = "1gbit"     # fleet link rate (tc syntax); None: unshaped
    backends: list[str] = field(default_factory=lambda: list(BACKENDS))
    ops: list[str] = field(default_factory=lambda: list(OPS))
    sizes: list[int] = field(default_factory=list)
    warmup: int = 1
    iters: int = 0                 # 0: pick per size so one timed loop lasts about target_s
    repeats: int = 3
    target_s: float = 0.2
    max_iters: int = 200
    ceiling_seconds: float = 3.0
    ceiling_tool: str = "auto"     # auto | iperf3 | probe | none
    timeout_s: float = 1800.0      # per backend sweep
    verbose: bool = False
    log_dir: str | None = None     # keep logs here; None: a temporary folder, removed at the end

    @property
    def world(self) -> int:
        return self.hosts if self.hosts > 0 else self.ranks

    def validate(self) -> None:
        if self.world < 2:
            raise ConfigError(f"[bench] needs at least 2 ranks, got {self.world}; use --hosts N or --ranks N")
        bad = [b for b in self.backends if b not in BACKENDS]
        if bad:
            raise ConfigError(f"[bench] unknown backend(s) {bad}; choose from {', '.join(BACKENDS)}")
        bad = [o for o in self.ops if o not in OPS]
        if bad:
            raise ConfigError(f"[bench] unknown op(s) {bad}; choose from {', '.join(OPS)}")
        if self.repeats < 3:
            raise ConfigError(f"[bench] --repeats {self.repeats}: the median needs at least 3 repeats")
        if not self.sizes:
            raise ConfigError("[bench] no sizes to run; check --min-bytes/--max-bytes")


def _git_commit() -> str | None:
    try:
        res = subprocess.run(["git", "-C", _PKG_ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        return res.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _run_backend(launcher, cfg: BenchConfig, backend: str, tmp: str) -> list[dict]:
    """Run one backend's whole sweep; returns the per-rank JSON documents."""
    out_dir = os.path.join(tmp, backend)
    os.makedirs(out_dir)
    plan = {"backend": backend, "ops": cfg.ops, "sizes": cfg.sizes, "warmup": cfg.warmup, "iters": cfg.iters,
            "repeats": cfg.repeats, "target_s": cfg.target_s, "max_iters": cfg.max_iters,
            "timeout_s": min(cfg.timeout_s, 600.0), "out_dir": out_dir}
    port = launcher.free_port(29500)
    n = cfg.world
    pypath = os.pathsep.join(p for p in (_PKG_ROOT, os.environ.get("PYTHONPATH")) if p)
    envs = [{"RANK": str(r), "LOCAL_RANK": "0" if launcher.kind == "fleet" else str(r), "WORLD_SIZE": str(n),
             "MASTER_ADDR": launcher.addr(0), "MASTER_PORT": str(port), "PYTHONPATH": pypath,
             "OMP_NUM_THREADS": "1", **launcher.rank_env(r)} for r in range(n)]
    argv = [sys.executable, "-m", "libmccl.bench.worker", json.dumps(plan)]
    done = run_group(launcher, [argv] * n, envs, tmp, cfg.timeout_s, f"{backend}-rank", stream_first=cfg.verbose,
                     soft_codes=(TEARDOWN_FAILED,))
    why = first_failure(done, soft_codes=(TEARDOWN_FAILED,))
    if why:
        raise MCCLError(f"[bench] backend {backend} failed: {why}")
    docs = []
    for r in range(n):
        with open(os.path.join(out_dir, f"{backend}-rank{r}.json")) as f:
            docs.append(json.load(f))
    return docs


def aggregate(backend: str, docs: list[dict], ceiling: dict | None) -> list[dict]:
    n = len(docs)
    rows = []
    for k, first in enumerate(docs[0]["results"]):
        per_rank = [d["results"][k] for d in docs]
        if any((p["op"], p["bytes"]) != (first["op"], first["bytes"]) for p in per_rank):
            raise MCCLError(f"[bench] ranks of {backend} disagree on measurement {k}; results are unusable")
        repeats = len(first["times_s"])
        times = [max(p["times_s"][i] for p in per_rank) for i in range(repeats)]
        t = statistics.median(times)
        size, spec = first["bytes"], OPS[first["op"]]
        algbw = size / t
        busbw = algbw * spec.bus_factor(n)
        wire = spec.wire_factor(n) * size * n * first["iters"] * repeats
        cpu = sum(p["cpu_s"] for p in per_rank)
        rows.append({
            "backend": backend, "op": first["op"], "bytes": size, "count": first["count"],
            "iters": first["iters"], "repeats": repeats, "time_us": t * 1e6,
            "time_us_repeats": [x * 1e6 for x in times],
            "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9, "busbw_Gbps": busbw * 8 / 1e9,
            "busbw_pct_ceiling": 100 * busbw * 8 / ceiling["mean_bps"] if ceiling else None,
            "cpu_s": cpu, "wire_bytes": wire, "cpu_s_per_wire_gb": cpu / (wire / 1e9) if wire else None,
        })
    return rows


def compare(rows: list[dict], ceiling: dict | None) -> list[dict]:
    """MCCL relative to Gloo, per (op, size) both measured."""
    by = {(r["backend"], r["op"], r["bytes"]): r for r in rows}
    out = []
    for r in rows:
        if r["backend"] != "mccl" or ("gloo", r["op"], r["bytes"]) not in by:
            continue
        g = by[("gloo", r["op"], r["bytes"])]
        cpu_ratio = (r["cpu_s_per_wire_gb"] / g["cpu_s_per_wire_gb"]
                     if r["cpu_s_per_wire_gb"] and g["cpu_s_per_wire_gb"] else None)
        iperf_cpu = ceiling.get("cpu_s_per_gb") if ceiling else None
        out.append({"op": r["op"], "bytes": r["bytes"],
                    "busbw_mccl_over_gloo": r["busbw_GBps"] / g["busbw_GBps"],
                    "latency_gloo_over_mccl": g["time_us"] / r["time_us"],
                    "cpu_mccl_over_gloo": cpu_ratio,
                    "cpu_mccl_over_ceiling_tool": (r["cpu_s_per_wire_gb"] / iperf_cpu
                                                   if iperf_cpu and r["cpu_s_per_wire_gb"] else None)})
    return out


def _assemble(meta: dict, ceilings: list[dict], backends: dict, docs_by_backend: dict, complete: bool) -> dict:
    # The higher of the ceiling runs is the reference: a backend's share of it is never
    # flattered by a ceiling that happened to be measured while the machine was busy.
    ceiling = (dict(max(ceilings, key=lambda c: c["mean_bps"]), runs_mean_bps=[c["mean_bps"] for c in ceilings])
               if ceilings else None)
    rows: list[dict] = []
    for b, docs in docs_by_backend.items():
        rows += aggregate(b, docs, ceiling)
    meta = dict(meta, complete=complete, seconds=time.time() - meta["t0"], loadavg_end=os.getloadavg())
    del meta["t0"]
    return {"meta": meta, "ceiling": ceiling, "backends": dict(backends), "results": rows,
            "comparison": compare(rows, ceiling)}


def run_bench(cfg: BenchConfig, checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Run the ceiling and every backend; ``checkpoint`` gets the partial result after each
    step (meta.complete is False), so a run cut short still leaves what it measured."""
    cfg.validate()
    meta = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "t0": time.time(), "mode": "fleet" if cfg.hosts else "loopback", "world": cfg.world,
            "rate": cfg.rate if cfg.hosts else None, "machine": platform.node(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "commit": _git_commit(), "loadavg_start": os.getloadavg(),
            "config": asdict(cfg)}
    backends: dict[str, dict] = {}
    ceilings: list[dict] = []
    docs_by_backend: dict[str, list[dict]] = {}

    def progress() -> None:
        if checkpoint is not None:
            checkpoint(_assemble(meta, ceilings, backends, docs_by_backend, complete=False))

    launcher = FleetLauncher(cfg.hosts, cfg.rate) if cfg.hosts else LocalLauncher(cfg.ranks)
    try:
        with contextlib.ExitStack() as stack:
            if cfg.log_dir:
                os.makedirs(cfg.log_dir, exist_ok=True)
                tmp = tempfile.mkdtemp(prefix="run-", dir=cfg.log_dir)
            else:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="mccl-bench-"))
            measure = cfg.ceiling_tool != "none"
            if measure:
                ceilings.append(ring_ceiling(launcher, cfg.ceiling_seconds, tmp, cfg.ceiling_tool))
                log.info("ring ceiling (%s): %.3f Gbit/s per host", ceilings[-1]["tool"], ceilings[-1]["mean_bps"] / 1e9)
                progress()
            for b in cfg.backends:
                t0 = time.time()
                try:
                    docs = _run_backend(launcher, cfg, b, tmp)
                except MCCLError as e:
                    log.error("%s", e)
                    backends[b] = {"ok": False, "error": str(e), "seconds": time.time() - t0}
                    progress()
                    continue
                # Measurements done and checked, but shutdown failed: keep the numbers, flag it.
                teardown = [f"rank {d['rank']}: {d['teardown_error']}" for d in docs if d.get("teardown_error")]
                if teardown:
                    log.warning("[bench] %s: shutdown failed after all measurements: %s", b, teardown[0])
                docs_by_backend[b] = docs
                backends[b] = {"ok": True, "error": None, "teardown_errors": teardown,
                               "seconds": time.time() - t0,
                               "init_s": max(d["init_s"] for d in docs), "torch": docs[0]["torch"],
                               "engine": docs[0].get("engine")}
                progress()
            if measure:
                # Measured again after the backends: on a shared machine the ceiling drifts.
                ceilings.append(ring_ceiling(launcher, cfg.ceiling_seconds, tmp, cfg.ceiling_tool))
    finally:
        launcher.close()
    return _assemble(meta, ceilings, backends, docs_by_backend, complete=True)
