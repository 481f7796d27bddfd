"""One benchmark run: the ring ceiling, then every series' sweep, on the same hosts.

A series is a backend in one mode: ``mccl`` (the engine in each rank), ``mccl-daemon``
(the same ranks with MCCL_DAEMON=1, through one mccld per host that this run starts and
stops itself, daemons.py) and ``gloo``. With R ranks per host every series runs the same
H*R ranks, so busbw is counted with n = H*R for all of them: in-process mccl and Gloo are
the flat ring of all ranks, the daemon reduces each host's ranks first.

Per (series, op, size) the ranks report wall time per op for each repeat and their CPU
time. A repeat's time is the slowest rank's (an op is done when every rank is done);
the reported time is the median over repeats. CPU seconds per wire GB sums user+sys
time over all ranks (and, through mccld, the daemons) and divides by the bytes all ranks
put on the wire (metrics.py).
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

from mccl_common.errors import ConfigError, MCCLError
from . import ddp
from .ceiling import ring_ceiling
from .daemons import HostDaemons
from .launch import FleetLauncher, LocalLauncher, first_failure, run_group
from .metrics import OPS
from .worker import TEARDOWN_FAILED

log = logging.getLogger(__name__)

BACKENDS = ("mccl", "gloo")
# How mccl runs; Gloo has one way only. daemon-shared: through mccld, the all-reduce buffers
# allocated with libmccl.shared_empty (not copied between the ranks and their daemon).
MODES = ("in-process", "daemon", "daemon-shared", "topology", "topology-ring")
# topology: in-process, with an MCCL_TOPOLOGY naming each emulated host's switch (--switches),
# so all-reduces from MCCL_HIERARCHY_MIN_BYTES run switch by switch (MCCL_HIERARCHY=tree);
# topology-ring: the same as one ring in switch order (MCCL_HIERARCHY=ring); beside in-process (flat).
_VIA_DAEMON = ("daemon", "daemon-shared")
COMPRESSION = ("off", "bf16", "fp16", "int8")   # MCCL_COMPRESSION of the mccl series (--compression)
# An nccl-tests sweep, DDP training steps (ddp.py), or Lightning's Trainer steps (lightning_step.py).
WORKLOADS = ("collectives", "ddp", "lightning")
LATENCY_BYTES = 8                    # the small-op latency: an all_reduce of two float32
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Series:
    name: str                      # the label of its rows and table columns
    backend: str                   # torch.distributed backend
    mode: str | None               # MODES for mccl, None for gloo
    compression: str = "off"       # MCCL_COMPRESSION of an mccl series


@dataclass
class BenchConfig:
    hosts: int = 0                 # 0: loopback; N: emulated hosts (network namespaces)
    ranks: int = 2                 # loopback only: ranks in all; with hosts > 0, hosts * ranks_per_host
    ranks_per_host: int = 1        # ranks sharing one host (and, in daemon mode, one mccld)
    rate: str | None = "1gbit"     # fleet link rate (tc syntax); None: unshaped
    switches: int = 0              # fleet switches (0/1: one bridge); hosts split evenly in order
    uplink_rate: str | None = None  # each switch's uplink to the core (tc syntax); None: unshaped
    uplink_delay: str | None = None  # added per uplink hop (netem), e.g. "200us"
    rank_order: str = "hosts"      # hosts: rank r on host r; interleaved: consecutive ranks on other switches
    backends: list[str] = field(default_factory=lambda: list(BACKENDS))
    modes: list[str] = field(default_factory=lambda: ["in-process"])   # of the mccl backend
    compression: list[str] = field(default_factory=lambda: ["off"])    # MCCL_COMPRESSION per mccl series
    ops: list[str] = field(default_factory=lambda: list(OPS))
    sizes: list[int] = field(default_factory=list)
    warmup: int = 1
    iters: int = 0                 # 0: pick per size so one timed loop lasts about target_s
    repeats: int = 3
    target_s: float = 0.2
    max_iters: int = 200
    ceiling_seconds: float = 3.0
    ceiling_tool: str = "auto"     # auto | iperf3 | probe | none
    latency_iters: int = 300       # individually timed 8-byte all_reduces per series; 0: none
    workload: str = "collectives"
    ddp: dict = field(default_factory=dict)   # overrides of ddp.DEFAULTS (width, depth, batch, warmup, steps)
    timeout_s: float = 1800.0      # per series
    verbose: bool = False
    log_dir: str | None = None     # keep logs here; None: a temporary folder, removed at the end

    @property
    def world(self) -> int:
        return self.hosts * self.ranks_per_host if self.hosts > 0 else self.ranks

    @property
    def n_hosts(self) -> int:
        return self.hosts if self.hosts > 0 else self.ranks // max(1, self.ranks_per_host)

    def series(self) -> list[Series]:
        out = []
        for b in self.backends:
            if b == "mccl":
                out += [Series(("mccl" if m == "in-process" else f"mccl-{m}") + ("" if c == "off" else f"-{c}"), b, m, c)
                        for m in self.modes for c in self.compression]
            else:
                out.append(Series(b, b, None))
        return out

    def validate(self) -> None:
        if self.ranks_per_host < 1 or (not self.hosts and self.ranks % self.ranks_per_host):
            raise ConfigError(f"[bench] --ranks-per-host {self.ranks_per_host} must be at least 1 and divide "
                              f"--ranks {self.ranks} on loopback")
        if self.world < 2:
            raise ConfigError(f"[bench] needs at least 2 ranks, got {self.world}; use --hosts N or --ranks N")
        bad = [b for b in self.backends if b not in BACKENDS]
        if bad:
            raise ConfigError(f"[bench] unknown backend(s) {bad}; choose from {', '.join(BACKENDS)}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ConfigError(f"[bench] unknown or no --mode {bad or ''}; choose from {', '.join(MODES)}")
        bad = [c for c in self.compression if c not in COMPRESSION]
        if bad or not self.compression:
            raise ConfigError(f"[bench] unknown or no --compression {bad or ''}; choose from {', '.join(COMPRESSION)}")
        bad = [o for o in self.ops if o not in OPS]
        if bad:
            raise ConfigError(f"[bench] unknown op(s) {bad}; choose from {', '.join(OPS)}")
        if {"topology", "topology-ring"} & set(self.modes) and (self.hosts < 2 or self.switches < 2):
            raise ConfigError("[bench] --mode topology needs emulated hosts on two or more switches "
                              "(--hosts N --switches S)")
        if self.switches > 1 and not self.hosts:
            raise ConfigError("[bench] --switches needs emulated hosts (--hosts N)")
        if self.rank_order not in ("hosts", "interleaved"):
            raise ConfigError(f"[bench] --rank-order {self.rank_order!r}: use hosts or interleaved")
        if self.repeats < 3:
            raise ConfigError(f"[bench] --repeats {self.repeats}: the median needs at least 3 repeats")
        if self.workload not in WORKLOADS:
            raise ConfigError(f"[bench] unknown --workload {self.workload!r}; choose from {', '.join(WORKLOADS)}")
        if self.workload == "collectives" and not self.sizes:
            raise ConfigError("[bench] no sizes to run; check --min-bytes/--max-bytes")


def host_order(cfg: BenchConfig) -> list[int]:
    """Which host the i-th block of ranks runs on. ``interleaved`` deals the hosts out switch by
    switch (host 0 of switch 0, host 0 of switch 1, ...), so a flat ring in rank order zig-zags
    across the uplinks, as it does where ranks follow a host list that ignores the switches."""
    hosts = cfg.n_hosts
    if cfg.rank_order != "interleaved" or cfg.switches < 2:
        return list(range(hosts))
    sizes = [hosts // cfg.switches + (1 if k < hosts % cfg.switches else 0) for k in range(cfg.switches)]
    starts = [sum(sizes[:k]) for k in range(cfg.switches)]
    return [starts[k] + i for i in range(max(sizes)) for k in range(cfg.switches) if i < sizes[k]]


def git_commit() -> str | None:
    """The checkout's commit as `git describe --always --dirty` names it (None outside git)."""
    try:
        # --dirty: a tree copied elsewhere (a bigger machine) may carry uncommitted or newer
        # files over an old HEAD, and a bare hash would then name the wrong code.
        res = subprocess.run(["git", "-C", _PKG_ROOT, "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=5)
        return res.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


@dataclass
class SeriesRun:
    docs: list[dict]               # one JSON document per rank
    daemon_pids: list[int] = field(default_factory=list)
    # What the bench had to clean after the daemons (nothing, when they freed everything themselves).
    leftovers: list[str] = field(default_factory=list)


def _run_series(launcher, cfg: BenchConfig, series: Series, tmp: str) -> SeriesRun:
    """Run one series' whole sweep."""
    out_dir = os.path.join(tmp, series.name)
    os.makedirs(out_dir)
    plan = {"backend": series.backend, "mode": series.mode, "series": series.name, "workload": cfg.workload,
            "ddp": cfg.ddp, "ops": cfg.ops if cfg.workload == "collectives" else [],
            "sizes": cfg.sizes, "warmup": cfg.warmup, "iters": cfg.iters, "repeats": cfg.repeats,
            "target_s": cfg.target_s, "max_iters": cfg.max_iters, "timeout_s": min(cfg.timeout_s, 600.0),
            "latency_iters": cfg.latency_iters, "latency_bytes": LATENCY_BYTES, "out_dir": out_dir}
    port = launcher.free_port(29500)
    n, per_host = cfg.world, cfg.ranks_per_host
    placement = [host_order(cfg)[r // per_host] for r in range(n)]
    pypath = os.pathsep.join(p for p in (_PKG_ROOT, os.environ.get("PYTHONPATH")) if p)
    envs = [{"RANK": str(r), "LOCAL_RANK": str(r % per_host), "LOCAL_WORLD_SIZE": str(per_host),
             "WORLD_SIZE": str(n), "MASTER_ADDR": launcher.addr(0), "MASTER_PORT": str(port), "PYTHONPATH": pypath,
             "OMP_NUM_THREADS": "1", "MCCL_DAEMON": "0", "MCCL_COMPRESSION": series.compression,
             **launcher.rank_env(placement[r])} for r in range(n)]
    if series.mode in ("topology", "topology-ring"):
        topo = os.path.join(out_dir, "topology.txt")
        with open(topo, "w") as f:
            f.write(launcher.fleet.topology_text())
        for e in envs:
            e["MCCL_TOPOLOGY"] = topo
            e["MCCL_HIERARCHY"] = "ring" if series.mode == "topology-ring" else "tree"
    run, daemons = SeriesRun([]), None
    with contextlib.ExitStack() as stack:
        runner = launcher
        if series.mode in _VIA_DAEMON:
            daemons = HostDaemons(launcher, out_dir).start()
            stack.callback(lambda: run.leftovers.extend(daemons.stop()))
            runner = daemons    # the ranks attach to their host's daemon (MCCL_DAEMON=1)
            plan["daemon_pids"] = {str(h * per_host): p.pid for h, p in enumerate(daemons.procs)}
            run.daemon_pids = [p.pid for p in daemons.procs]
        argv = [sys.executable, "-m", "tools.bench.worker", json.dumps(plan)]
        done = run_group(runner, [argv] * n, envs, tmp, cfg.timeout_s, f"{series.name}-rank",
                         stream_first=cfg.verbose, soft_codes=(TEARDOWN_FAILED,), hosts=placement)
    why = first_failure(done, soft_codes=(TEARDOWN_FAILED,))
    if why:
        said = f"; mccld on host 0 logged: {daemons.tail(0)}" if daemons is not None else ""
        raise MCCLError(f"[bench] {series.name} failed: {why}{said}")
    for r in range(n):
        with open(os.path.join(out_dir, f"{series.name}-rank{r}.json")) as f:
            run.docs.append(json.load(f))
    wanted = series.mode in _VIA_DAEMON
    if any(d.get("via_daemon") != wanted for d in run.docs):
        raise MCCLError(f"[bench] {series.name}: some ranks ran {'without' if wanted else 'through'} mccld, so "
                        "their numbers are not this series'; likely cause: the backend ignores MCCL_DAEMON")
    return run


def aggregate(series: str, docs: list[dict], ceiling: dict | None) -> list[dict]:
    n = len(docs)
    rows = []
    for k, first in enumerate(docs[0]["results"]):
        per_rank = [d["results"][k] for d in docs]
        if any((p["op"], p["bytes"]) != (first["op"], first["bytes"]) for p in per_rank):
            raise MCCLError(f"[bench] ranks of {series} disagree on measurement {k}; results are unusable")
        repeats = len(first["times_s"])
        times = [max(p["times_s"][i] for p in per_rank) for i in range(repeats)]
        t = statistics.median(times)
        size, spec = first["bytes"], OPS[first["op"]]
        algbw = size / t
        busbw = algbw * spec.bus_factor(n)
        wire = spec.wire_factor(n) * size * n * first["iters"] * repeats
        cpu = sum(p["cpu_s"] for p in per_rank)
        rows.append({
            "series": series, "backend": docs[0].get("backend", series), "mode": docs[0].get("mode"),
            "op": first["op"], "bytes": size, "count": first["count"],
            "iters": first["iters"], "repeats": repeats, "time_us": t * 1e6,
            "time_us_repeats": [x * 1e6 for x in times],
            "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9, "busbw_Gbps": busbw * 8 / 1e9,
            "busbw_pct_ceiling": 100 * busbw * 8 / ceiling["mean_bps"] if ceiling else None,
            "cpu_s": cpu, "wire_bytes": wire, "cpu_s_per_wire_gb": cpu / (wire / 1e9) if wire else None,
        })
    return rows


def latency(docs: list[dict]) -> dict | None:
    """The small-op latency: op i took as long as its slowest rank; median and p90 over ops."""
    if not docs[0].get("latency"):
        return None
    per_op = [max(ts) for ts in zip(*(d["latency"]["times_s"] for d in docs))]
    ranked = sorted(per_op)
    return {"bytes": docs[0]["latency"]["bytes"], "iters": len(per_op),
            "median_us": statistics.median(per_op) * 1e6, "p90_us": ranked[int(0.9 * (len(ranked) - 1))] * 1e6}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


# (numerator series, denominator series, key prefix) of every comparison the report shows.
_PAIRS = (("mccl", "gloo", "mccl_over_gloo"), ("mccl-topology", "mccl", "topology_over_flat"),
          ("mccl-topology-ring", "mccl", "switch_ring_over_flat"), ("mccl-daemon", "mccl", "daemon_over_in_process"),
          ("mccl-daemon", "gloo", "daemon_over_gloo"), ("mccl-daemon-shared", "mccl", "shared_over_in_process"),
          ("mccl-bf16", "mccl", "bf16_over_off"), ("mccl-fp16", "mccl", "fp16_over_off"),
          ("mccl-int8", "mccl", "int8_over_off"))


def compare(rows: list[dict], ceiling: dict | None) -> list[dict]:
    """Each pair of _PAIRS relative to each other, per (op, size) both measured."""
    by = {(r.get("series", r["backend"]), r["op"], r["bytes"]): r for r in rows}
    iperf_cpu = ceiling.get("cpu_s_per_gb") if ceiling else None
    out = []
    for op, size in dict.fromkeys((r["op"], r["bytes"]) for r in rows):
        c: dict = {}
        for num, den, key in _PAIRS:
            a, b = by.get((num, op, size)), by.get((den, op, size))
            if a is None or b is None:
                continue
            c[f"busbw_{key}"] = a["busbw_GBps"] / b["busbw_GBps"]
            c[f"time_{key}"] = a["time_us"] / b["time_us"]
            c[f"cpu_{key}"] = _ratio(a["cpu_s_per_wire_gb"], b["cpu_s_per_wire_gb"])
        if "busbw_mccl_over_gloo" in c:
            c["latency_gloo_over_mccl"] = 1 / c.pop("time_mccl_over_gloo")
        for name in ("mccl", "mccl-daemon", "mccl-daemon-shared", "mccl-topology", "mccl-topology-ring"):
            if (name, op, size) in by:
                c[f"cpu_{name.replace('-', '_')}_over_ceiling_tool"] = _ratio(
                    by[(name, op, size)]["cpu_s_per_wire_gb"], iperf_cpu)
        if any(k.startswith("busbw_") for k in c):
            out.append({"op": op, "bytes": size, **c})
    return out


def _assemble(meta: dict, ceilings: list[dict], series: dict, docs_by_series: dict, complete: bool) -> dict:
    # The higher of the ceiling runs is the reference: a backend's share of it is never
    # flattered by a ceiling that happened to be measured while the machine was busy.
    ceiling = (dict(max(ceilings, key=lambda c: c["mean_bps"]), runs_mean_bps=[c["mean_bps"] for c in ceilings])
               if ceilings else None)
    rows: list[dict] = []
    lat, steps = {}, {}
    for name, docs in docs_by_series.items():
        rows += aggregate(name, docs, ceiling)
        lat[name] = latency(docs)
        steps[name] = ddp.summarize(docs, ceiling)
    lat = {k: v for k, v in lat.items() if v}
    if "mccl" in lat and "mccl-daemon" in lat:
        lat["daemon_over_in_process"] = lat["mccl-daemon"]["median_us"] / lat["mccl"]["median_us"]
    steps = {k: v for k, v in steps.items() if v}
    for name, v in steps.items():
        if name != "gloo" and "gloo" in steps and v["step_ms"] and steps["gloo"]["step_ms"]:
            v["step_over_gloo"] = v["step_ms"] / steps["gloo"]["step_ms"]
        if name != "gloo" and "gloo" in steps and "fingerprint" in v:
            v["params_match_gloo"] = ddp.params_close(v, steps["gloo"])
        if name == "mccl-daemon" and "mccl" in steps and v["step_ms"] and steps["mccl"]["step_ms"]:
            v["step_over_in_process"] = v["step_ms"] / steps["mccl"]["step_ms"]
    meta = dict(meta, complete=complete, seconds=time.time() - meta["t0"], loadavg_end=os.getloadavg())
    del meta["t0"]
    out = {"meta": meta, "ceiling": ceiling, "backends": dict(series), "results": rows, "latency": lat,
           "comparison": compare(rows, ceiling)}
    if steps:
        out["ddp"] = steps
    return out


def run_bench(cfg: BenchConfig, checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Run the ceiling and every series; ``checkpoint`` gets the partial result after each
    step (meta.complete is False), so a run cut short still leaves what it measured."""
    cfg.validate()
    meta = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "t0": time.time(), "mode": "fleet" if cfg.hosts else "loopback", "world": cfg.world,
            "hosts": cfg.n_hosts, "ranks_per_host": cfg.ranks_per_host,
            "rate": cfg.rate if cfg.hosts else None, "switches": cfg.switches or None,
            "uplink_rate": cfg.uplink_rate, "uplink_delay": cfg.uplink_delay, "machine": platform.node(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "commit": git_commit(), "loadavg_start": os.getloadavg(),
            "config": asdict(cfg)}
    series: dict[str, dict] = {}
    ceilings: list[dict] = []
    docs_by_series: dict[str, list[dict]] = {}

    def progress() -> None:
        if checkpoint is not None:
            checkpoint(_assemble(meta, ceilings, series, docs_by_series, complete=False))

    launcher = (FleetLauncher(cfg.hosts, cfg.rate, switches=cfg.switches or None, uplink_rate=cfg.uplink_rate,
                              uplink_delay=cfg.uplink_delay)
                if cfg.hosts else LocalLauncher(cfg.n_hosts))
    try:
        with contextlib.ExitStack() as stack:
            if cfg.log_dir:
                os.makedirs(cfg.log_dir, exist_ok=True)
                tmp = tempfile.mkdtemp(prefix="run-", dir=cfg.log_dir)
            else:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="mccl-bench-"))
            measure = cfg.ceiling_tool != "none"
            if measure and launcher.n < 2:
                log.warning("[bench] one host only: no ring ceiling to measure (use --ranks-per-host 1 "
                            "or more hosts for a %% of ceiling)")
                measure = False
            if measure:
                ceilings.append(ring_ceiling(launcher, cfg.ceiling_seconds, tmp, cfg.ceiling_tool))
                log.info("ring ceiling (%s): %.3f Gbit/s per host", ceilings[-1]["tool"], ceilings[-1]["mean_bps"] / 1e9)
                progress()
            for s in cfg.series():
                t0 = time.time()
                try:
                    run = _run_series(launcher, cfg, s, tmp)
                except MCCLError as e:
                    log.error("%s", e)
                    series[s.name] = {"ok": False, "backend": s.backend, "mode": s.mode, "error": str(e),
                                      "seconds": time.time() - t0}
                    progress()
                    continue
                docs = run.docs
                # Measurements done and checked, but shutdown failed: keep the numbers, flag it.
                teardown = [f"rank {d['rank']}: {d['teardown_error']}" for d in docs if d.get("teardown_error")]
                if teardown:
                    log.warning("[bench] %s: shutdown failed after all measurements: %s", s.name, teardown[0])
                docs_by_series[s.name] = docs
                series[s.name] = {"ok": True, "backend": s.backend, "mode": s.mode, "error": None,
                                  "teardown_errors": teardown, "cleaned_after": run.leftovers,
                                  "pids": {"ranks": [d["pid"] for d in docs], "daemons": run.daemon_pids},
                                  "seconds": time.time() - t0,
                                  "init_s": max(d["init_s"] for d in docs), "torch": docs[0]["torch"],
                                  "engine": docs[0].get("engine")}
                progress()
            if measure:
                # Measured again after the backends: on a shared machine the ceiling drifts.
                ceilings.append(ring_ceiling(launcher, cfg.ceiling_seconds, tmp, cfg.ceiling_tool))
    finally:
        launcher.close()
    return _assemble(meta, ceilings, series, docs_by_series, complete=True)
