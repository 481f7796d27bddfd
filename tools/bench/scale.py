"""The scale benchmark: ``python -m tools.bench scale --hosts 8,64,200 ...`` (root, for the fleet).

For each host count N: an emulated fleet of N hosts (tools/fleet.py) whose links stand for
``--rate`` plus a ``--delay`` switch hop, time-dilated by a factor D where the machine
cannot carry N such links (shaped to rate/D, delay x D; model.py); the iperf3 ring ceiling
at that shaping (what the machine really carries); one engine-only rank per host
(engine_rank.py: no torch) timing each op and size under each ``--algos`` entry (``auto``
and pinned algorithms, one communicator each); and, where N is in ``--gloo-hosts``, torch
Gloo ranks (worker.py) in the same namespaces as the baseline. Every time is reported
converted back to the real network (measured / D), beside the alpha-beta model's
prediction, their ratio, the bus bandwidth, and the flat ring's time.

Sizes the model says would take longer than ``--max-op-seconds`` per op on the dilated
emulation are skipped (and listed), and every N has ``--time-limit`` seconds in all:
the ranks stop starting sizes once it would be overrun.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

from mccl_common.errors import MCCLError
from .launch import FleetLauncher, LocalLauncher, first_failure, run_group
from ..fleet import parse_rate_bits, parse_time_s
from .metrics import OPS, parse_bytes
from .model import Dilation, Model, auto_factor

log = logging.getLogger(__name__)

_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLOO_PORT = 29500


@dataclass
class ScaleConfig:
    hosts: list[int]
    sizes: list[int]
    ops: list[str] = field(default_factory=lambda: ["all_reduce"])
    algos: list[str] = field(default_factory=lambda: ["auto", "ring"])
    rate_bits: float = 10e9
    delay_s: float = 30e-6
    dilation: dict[int, float] = field(default_factory=dict)   # N -> factor; absent: auto
    # What the machine carries, all hosts together, for auto dilation: the 16-core machine's
    # iperf3 ring carried ~17 Gbit/s at 64 hosts; the engine's AEAD costs CPU on top.
    machine_bits: float = 10e9
    loopback: bool = False           # ranks on 127.0.0.1, no fleet, no shaping (tests)
    gloo_hosts: list[int] = field(default_factory=list)
    gloo_sizes: list[int] = field(default_factory=lambda: [256 << 10, 1 << 20, 4 << 20])
    time_limit_s: float = 150.0      # per N, everything included
    time_limits: dict[int, float] = field(default_factory=dict)   # N -> seconds, overriding time_limit_s
    max_op_s: float = 4.0            # skip sizes predicted slower than this per op, dilated
    target_s: float = 0.5
    repeats: int = 3
    warmup: int = 1
    max_iters: int = 100
    ceiling_seconds: float = 2.0
    log_dir: str | None = None


def _realtime(cfg: ScaleConfig, n: int) -> Dilation:
    factor = cfg.dilation.get(n) or (1.0 if cfg.loopback else auto_factor(n, cfg.rate_bits, cfg.machine_bits))
    return Dilation(cfg.rate_bits, cfg.delay_s, factor)


def _burst(d: Dilation) -> str:
    # fleet.py's 256 KB burst, scaled like the rate; not below a GSO packet (64 KB).
    return f"{max(64, round(256 / d.factor))}kb"


def _queue(d: Dilation) -> str:
    # fleet.py's 10 ms of queue, dilated like the delay, so the shaper holds as many bytes as
    # the real link's would: undilated, a 64x slower link queues 64x fewer bytes and drops the
    # bursts a lock-step algorithm sends (Rabenseifner's halving steps) that a real port carries.
    return f"{10 * d.factor:g}ms"


def _aggregate(docs: list[dict], algo: str) -> list[dict]:
    """Per (op, size): each repeat took as long as its slowest rank; the median repeat."""
    rows = []
    per_rank = [d["series"].get(algo, {}).get("results", []) for d in docs]
    common = min(len(r) for r in per_rank) if per_rank else 0
    for k in range(common):
        first = per_rank[0][k]
        if any((r[k]["op"], r[k]["bytes"]) != (first["op"], first["bytes"]) for r in per_rank):
            raise MCCLError(f"[bench] ranks of {algo} disagree on measurement {k}; results are unusable")
        if first.get("skipped") or any(r[k].get("skipped") for r in per_rank):
            rows.append({"op": first["op"], "bytes": first["bytes"], "skipped": first.get("skipped") or "a rank skipped"})
            continue
        reps = min(len(r[k]["times_s"]) for r in per_rank)
        times = [max(r[k]["times_s"][i] for r in per_rank) for i in range(reps)]
        rows.append({"op": first["op"], "bytes": first["bytes"], "iters": first["iters"],
                     "dilated_s": statistics.median(times), "dilated_s_repeats": times})
    return rows


def _read_docs(out_dir: str, n: int, prefix: str = "rank") -> list[dict]:
    docs = []
    for r in range(n):
        try:
            with open(os.path.join(out_dir, f"{prefix}{r}.json")) as f:
                docs.append(json.load(f))
        except (OSError, ValueError):
            return []   # a rank that wrote nothing: no row can claim all ranks
    return docs


class ScalePoint:
    """Everything measured at one host count."""

    def __init__(self, cfg: ScaleConfig, n: int, model: Model):
        self.cfg, self.n, self.model = cfg, n, model
        self.dil = _realtime(cfg, n)
        self.t0 = time.monotonic()
        self.result: dict = {"hosts": n, "dilation": self.dil.factor, "rate_bits": cfg.rate_bits,
                             "delay_s": cfg.delay_s, "loopback": cfg.loopback, "rows": [], "skipped": [],
                             "notes": [], "errors": []}

    def left(self) -> float:
        return self.cfg.time_limits.get(self.n, self.cfg.time_limit_s) - (time.monotonic() - self.t0)

    def run(self, tmp: str) -> dict:
        cfg, d, res = self.cfg, self.dil, self.result
        launcher = self._launcher(res)
        try:
            res["setup_s"] = round(time.monotonic() - self.t0, 1)
            if not cfg.loopback and cfg.ceiling_seconds > 0 and shutil.which("iperf3"):
                from .ceiling import ring_ceiling

                try:
                    res["ceiling"] = ring_ceiling(launcher, cfg.ceiling_seconds, tmp, "iperf3")
                    res["ceiling"]["carried_pct"] = 100 * res["ceiling"]["mean_bps"] / (cfg.rate_bits / d.factor)
                except MCCLError as e:
                    res["errors"].append(f"ceiling: {e}")
            gloo = self.n in cfg.gloo_hosts and not cfg.loopback
            # Gloo's torch ranks start slowly (~1.5 s of CPU each): it gets a third of what is left.
            mccl_s = self.left() - max(20.0, self.n * 0.15) - (self.left() / 3 if gloo else 0)
            self._mccl(launcher, tmp, mccl_s)
            if gloo:
                self._gloo(launcher, tmp, self.left() - max(10.0, self.n * 0.1))
        finally:
            launcher.close()
        res["total_s"] = round(time.monotonic() - self.t0, 1)
        return res

    def _launcher(self, res: dict):  # noqa: ANN202
        if self.cfg.loopback:
            res.update(tc_rate=None, tc_delay=None, delay_emulated=False)
            return LocalLauncher(self.n)
        from ..fleet import netem_supported

        d = self.dil
        emulate = d.tc_delay is not None and netem_supported()
        res.update(tc_rate=d.tc_rate, tc_delay=d.tc_delay if emulate else None, delay_emulated=emulate,
                   tc_burst=_burst(d), tc_queue=_queue(d))
        if d.tc_delay is not None and not emulate:
            res["notes"].append("this kernel has no netem (sch_netem): the hop delay is NOT emulated; alpha is the "
                                 "machine's own latency (the model takes it from an 8-byte ping-pong)")
        # static_arp: 64+ hosts connecting all at once lose their ARP broadcasts (fleet.py).
        return FleetLauncher(self.n, d.tc_rate, delay=d.tc_delay if emulate else None, burst=_burst(d),
                             queue=os.environ.get("MCCL_BENCH_TC_QUEUE") or _queue(d), static_arp=True)

    # ---- the network the measurements stand for ------------------------------------
    def _alpha_beta(self, docs: list[dict], algo: str) -> tuple[float, float, str]:
        """(alpha, beta) of the real network for the model: the engine's own measurement where
        it has one (dilated, so / D), else the emulated link's nominal values."""
        ab = [d["series"][algo]["alpha_beta"] for d in docs if "alpha_beta" in d["series"].get(algo, {})]
        if ab:
            return (self.dil.real(statistics.median(a for a, _ in ab)),
                    self.dil.real(statistics.median(b for _, b in ab)), "engine alpha_beta()")
        pp = docs[0]["series"].get(algo, {}).get("pingpong_alpha_s")
        if pp is not None:
            return self.dil.real(pp), self.dil.beta, "alpha: 8-byte ping-pong rank 0-1 at set-up; beta: nominal rate"
        alpha = self.dil.alpha if self.result.get("delay_emulated") else 0.0
        return alpha, self.dil.beta, "nominal link (rate, delay)"

    def _predict_dilated(self, op: str, nbytes: int) -> float:
        """The slowest algorithm's predicted time for one op on the dilated emulation."""
        alpha = self.dil.alpha if self.result.get("delay_emulated") else 0.0
        worst = 0.0
        for algo in self.cfg.algos:
            a = self.model.choose(op, self.n, nbytes, alpha, self.dil.beta) if algo == "auto" else algo
            try:
                worst = max(worst, self.model.predict(op, a, self.n, nbytes, alpha, self.dil.beta))
            except ValueError:
                pass
        return self.dil.dilated(worst)

    # ---- MCCL, engine-only ranks ---------------------------------------------------
    def _mccl(self, launcher, tmp: str, budget_s: float) -> None:  # noqa: ANN001
        cfg, n, res = self.cfg, self.n, self.result
        sizes = []
        for nbytes in cfg.sizes:
            worst = max(self._predict_dilated(op, nbytes) for op in cfg.ops)
            if cfg.loopback or worst <= cfg.max_op_s:
                sizes.append(nbytes)
            else:
                res["skipped"].append({"bytes": nbytes, "why": f"the model predicts {worst:.1f} s per op dilated "
                                                             f"(> --max-op-seconds {cfg.max_op_s:g})"})
        out_dir = os.path.join(tmp, f"n{n}-mccl")
        os.makedirs(out_dir)
        run_id = secrets.token_hex(8)
        base = {"world": n, "ops": cfg.ops, "sizes": sizes, "algos": cfg.algos, "rdzv_dir": out_dir,
                "run_id": run_id, "comm_ids": {a: secrets.randbits(63) for a in cfg.algos},
                "out_dir": out_dir, "warmup": cfg.warmup, "repeats": cfg.repeats, "target_s": cfg.target_s,
                "max_iters": cfg.max_iters, "timeout_s": max(60.0, 3 * cfg.max_op_s),
                "connect_timeout_s": max(30.0, n * 0.3), "rdzv_timeout_s": max(30.0, n * 0.3),
                "deadline_s": max(budget_s - max(10.0, n * 0.1), 5.0)}
        env = {"PYTHONPATH": os.pathsep.join(p for p in (_PKG_ROOT, os.environ.get("PYTHONPATH")) if p),
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        argvs = [[sys.executable, "-m", "tools.bench.engine_rank",
                  json.dumps({**base, "rank": r, "addr": launcher.addr(r)})] for r in range(n)]
        t0 = time.monotonic()
        try:
            done = run_group(launcher, argvs, [env] * n, tmp, max(budget_s, 10.0), f"n{n}-mccl-rank")
            why = first_failure(done)
            if why:
                res["errors"].append(f"mccl: {why}")
        except MCCLError as e:   # out of time: what the ranks wrote so far still counts
            res["errors"].append(f"mccl: {e}")
        res["mccl_wall_s"] = round(time.monotonic() - t0, 1)
        docs = _read_docs(out_dir, n)
        if not docs:
            res["errors"].append("mccl: not every rank wrote results")
            return
        res["torch_imported"] = any(d.get("torch_imported", True) for d in docs)
        res["shutdown_ok"] = all(s.get("shutdown_ok", False) for d in docs for s in d["series"].values())
        res["init_s"] = {a: max(d["series"].get(a, {}).get("init_s", 0.0) for d in docs) for a in cfg.algos}
        pinned = "MCCL_ALGO" if self.model.chooser == "engine" else None
        for algo in cfg.algos:
            alpha, beta, ab_src = self._alpha_beta(docs, algo)
            res.setdefault("alpha_beta", {})[algo] = {"alpha_s": alpha, "beta_s_per_byte": beta, "source": ab_src}
            for row in _aggregate(docs, algo):
                self._add_row(row, algo, alpha, beta, pinned)
        self._add_ring_columns()

    def _add_row(self, row: dict, algo: str, alpha: float, beta: float, pinned: str | None) -> None:
        n, d = self.n, self.dil
        op, nbytes = row["op"], row["bytes"]
        if algo == "auto":
            used = self.model.choose(op, n, nbytes, alpha, beta)
        elif algo == "ring" or pinned:
            used = algo     # ring is pinned today too: the one-round path is off (MCCL_SMALL_ALLREDUCE_BYTES=0)
        else:
            used = self.model.choose(op, n, nbytes, alpha, beta) + " (pin unsupported by this engine)"
        out = {"backend": "mccl", "algo": algo, "algo_used": used, **row}
        if "dilated_s" in row:
            t = d.real(row["dilated_s"])
            out["time_s"] = t
            out["busbw_Gbps"] = nbytes * OPS[op].bus_factor(n) / t * 8 / 1e9 if t > 0 else None
            if self.cfg.loopback:   # no link the model could stand for
                out.update(model_s=None, ratio=None)
                self.result["rows"].append(out)
                return
            try:
                m = self.model.predict(op, used.split()[0], n, nbytes, alpha, beta)
                # And on the network the run stands for (rate, delay), whether or not its delay was emulated.
                target = self.model.predict(op, used.split()[0], n, nbytes, d.alpha, d.beta)
                out.update(model_s=m, ratio=t / m if m > 0 else None, target_model_s=target)
            except ValueError:
                out.update(model_s=None, ratio=None, target_model_s=None)
        self.result["rows"].append(out)

    def _add_ring_columns(self) -> None:
        ring = {(r["op"], r["bytes"]): r for r in self.result["rows"] if r["algo"] == "ring" and "time_s" in r}
        ab = self.result.get("alpha_beta", {}).get("ring") or next(iter(self.result.get("alpha_beta", {}).values()))
        for r in self.result["rows"]:
            if "time_s" not in r:
                continue
            flat = ring.get((r["op"], r["bytes"]))
            r["ring_time_s"] = flat["time_s"] if flat else None
            r["ring_model_s"] = None if self.cfg.loopback else self.model.predict(r["op"], "ring", self.n, r["bytes"], ab["alpha_s"],
                                                   ab["beta_s_per_byte"])

    # ---- Gloo, torch ranks in the same namespaces -----------------------------------
    def _gloo(self, launcher, tmp: str, budget_s: float) -> None:  # noqa: ANN001
        cfg, n, res = self.cfg, self.n, self.result
        if budget_s < 20:
            res["errors"].append(f"gloo: skipped, {budget_s:.0f}s left")
            return
        out_dir = os.path.join(tmp, f"n{n}-gloo")
        os.makedirs(out_dir)
        sizes = [s for s in cfg.gloo_sizes if self._predict_dilated("all_reduce", s) <= cfg.max_op_s]
        plan = {"backend": "gloo", "mode": None, "series": "gloo", "workload": "collectives", "ops": ["all_reduce"],
                "sizes": sizes, "warmup": 1, "iters": 0, "repeats": cfg.repeats, "target_s": min(cfg.target_s, 0.3),
                "max_iters": 20, "timeout_s": max(60.0, budget_s), "latency_iters": 0, "out_dir": out_dir}
        pypath = os.pathsep.join(p for p in (_PKG_ROOT, os.environ.get("PYTHONPATH")) if p)
        envs = [{"RANK": str(r), "WORLD_SIZE": str(n), "MASTER_ADDR": launcher.addr(0), "MASTER_PORT": str(GLOO_PORT),
                 "PYTHONPATH": pypath, "OMP_NUM_THREADS": "1", **launcher.rank_env(r)} for r in range(n)]
        argv = [sys.executable, "-m", "tools.bench.worker", json.dumps(plan)]
        t0 = time.monotonic()
        try:
            done = run_group(launcher, [argv] * n, envs, tmp, budget_s, f"n{n}-gloo-rank", soft_codes=(3,))
            why = first_failure(done, soft_codes=(3,))
            if why:
                res["errors"].append(f"gloo: {why}")
        except MCCLError as e:
            res["errors"].append(f"gloo: {e}")
        res["gloo_wall_s"] = round(time.monotonic() - t0, 1)
        docs = _read_docs(out_dir, n, prefix="gloo-rank")
        if not docs:
            res["errors"].append("gloo: not every rank wrote results")
            return
        for k, first in enumerate(docs[0]["results"]):
            times = [max(d["results"][k]["times_s"][i] for d in docs) for i in range(len(first["times_s"]))]
            t = self.dil.real(statistics.median(times))
            nbytes = first["bytes"]
            res["rows"].append({"backend": "gloo", "algo": "gloo", "algo_used": "gloo", "op": "all_reduce",
                                "bytes": nbytes, "iters": first["iters"], "dilated_s": statistics.median(times),
                                "dilated_s_repeats": times, "time_s": t,
                                "busbw_Gbps": nbytes * OPS["all_reduce"].bus_factor(n) / t * 8 / 1e9})
        mccl = {r["bytes"]: r for r in res["rows"] if r["algo"] == "auto" and r["op"] == "all_reduce" and "time_s" in r}
        res["gloo_vs_mccl"] = [{"bytes": g["bytes"], "gloo_s": g["time_s"], "mccl_auto_s": mccl[g["bytes"]]["time_s"],
                                "speedup": g["time_s"] / mccl[g["bytes"]]["time_s"]}
                               for g in res["rows"] if g["backend"] == "gloo" and g["bytes"] in mccl]


def run_scale(cfg: ScaleConfig, checkpoint=None) -> dict:  # noqa: ANN001
    from libmccl import _core
    from mccl_common.settings import EngineConfig, load

    small = load(EngineConfig).small_allreduce_bytes
    model = Model(_core, small)
    result = {"meta": {"kind": "scale", "model": model.source, "chooser": model.chooser, "algos": cfg.algos,
                       "ops": cfg.ops, "sizes": cfg.sizes, "rate_bits": cfg.rate_bits, "delay_s": cfg.delay_s,
                       "machine_bits": cfg.machine_bits, "cores": os.cpu_count(), "loopback": cfg.loopback,
                       "time_limit_s": cfg.time_limit_s, "max_op_s": cfg.max_op_s,
                       "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
              "points": []}
    tmp = cfg.log_dir or tempfile.mkdtemp(prefix="mccl-scale-")
    os.makedirs(tmp, exist_ok=True)
    for n in cfg.hosts:
        point = ScalePoint(cfg, n, model)
        where = os.path.join(tmp, f"n{n}")
        os.makedirs(where, exist_ok=True)
        try:
            result["points"].append(point.run(where))
        except MCCLError as e:   # the fleet would not come up: the next N may still fit
            point.result["errors"].append(str(e))
            result["points"].append(point.result)
        if checkpoint:
            checkpoint(result)
    if cfg.log_dir is None:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _per_n(text: str) -> dict[int, float]:
    """'64:32,200:100' -> {64: 32.0, 200: 100.0}; 'auto' or a plain number -> {}."""
    if text == "auto" or ":" not in text:
        return {}
    return {int(k): float(v) for k, v in (p.split(":") for p in _csv(text))}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.bench scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=lambda t: [int(x) for x in _csv(t)], default=[8, 64],
                    help="comma list of host counts (up to 256)")
    ap.add_argument("--loopback", action="store_true", help="ranks on 127.0.0.1, no fleet, no shaping (no root)")
    ap.add_argument("--sizes", type=lambda t: [parse_bytes(x) for x in _csv(t)],
                    default=[parse_bytes(x) for x in "8,256K,1M,4M,16M,64M,256M".split(",")])
    ap.add_argument("--ops", type=_csv, default=["all_reduce"], help=f"comma list of {', '.join(OPS)}")
    ap.add_argument("--algos", type=_csv, default=["auto", "ring"],
                    help="auto (the engine's choice) and algorithms to pin (MCCL_ALGO): ring, rd, rabenseifner")
    ap.add_argument("--rate", default="10gbit", help="the real link rate the run stands for")
    ap.add_argument("--delay", default="30us", help="the real one-way hop latency the run stands for")
    ap.add_argument("--dilation", default="auto",
                    help="'auto' (hosts x rate within --machine-gbit) or N:factor list, e.g. 8:4,64:32,200:100")
    ap.add_argument("--machine-gbit", type=float, default=10.0,
                    help="what the machine carries, all hosts together, for --dilation auto")
    ap.add_argument("--gloo-hosts", type=lambda t: [int(x) for x in _csv(t)], default=[64],
                    help="host counts at which torch Gloo ranks run too (empty: none)")
    ap.add_argument("--gloo-sizes", type=lambda t: [parse_bytes(x) for x in _csv(t)],
                    default=[256 << 10, 1 << 20, 4 << 20])
    ap.add_argument("--time-limit", default="150",
                    help="seconds per host count, everything included: one number, or N:seconds list (8:60,64:170)")
    ap.add_argument("--max-op-seconds", type=float, default=4.0,
                    help="skip sizes the model predicts to take longer per op (dilated)")
    ap.add_argument("--target-seconds", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ceiling-seconds", type=float, default=2.0, help="iperf3 ring ceiling per N; 0 = none")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--out-dir", help="also write scale.json, README.md and plots here")
    ap.add_argument("--log-dir")
    return ap


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    cfg = ScaleConfig(hosts=args.hosts, sizes=args.sizes, ops=args.ops, algos=args.algos,
                      rate_bits=parse_rate_bits(args.rate), delay_s=parse_time_s(args.delay),
                      dilation=_per_n(args.dilation), machine_bits=args.machine_gbit * 1e9,
                      loopback=args.loopback, gloo_hosts=args.gloo_hosts, gloo_sizes=args.gloo_sizes,
                      time_limit_s=150.0 if ":" in args.time_limit else float(args.time_limit),
                      time_limits=_per_n(args.time_limit), max_op_s=args.max_op_seconds, target_s=args.target_seconds,
                      repeats=args.repeats, ceiling_seconds=args.ceiling_seconds, log_dir=args.log_dir)
    from .scale_report import markdown, write_outputs

    def save(result: dict) -> None:
        if args.json_out:
            with open(args.json_out + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(args.json_out + ".tmp", args.json_out)
        if args.out_dir:
            write_outputs(result, args.out_dir, plots=False)

    result = run_scale(cfg, checkpoint=save)
    save(result)
    if args.out_dir:
        write_outputs(result, args.out_dir, plots=True)
    print(markdown(result))
    return 0 if all(not p["errors"] and p.get("torch_imported") is False for p in result["points"]) else 1
