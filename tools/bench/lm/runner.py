"""The lm workload's harness: corpus, link-rate calibration, hosts, one training run per variant.

The link rate. A studio step of a 1B-parameter model (STUDIO below) computes for about
``compute_s`` and its fp32 ring all-reduce needs ``comm_s`` on 10 GbE; their ratio R is what
makes DDP communication-bound there. This machine cannot run that model, so the emulated fleet
keeps the ratio instead: ``rate="auto"`` first times this model's step with every emulated host
computing at once on the machine's cores and no communication (calibrate), then shapes the links
so that one fp32 ring all-reduce of its gradients, 2 (N-1)/N x gradient bytes per host at the
same 93.6 % of line rate as 10 GbE's 1.17 GB/s, takes R x that compute time.

Every variant then trains the same model from the same weights on the same data order for the
same number of steps on those hosts, one after the other; ``aggregate`` turns the ranks' curves
into one curve per variant (a point's wall time is its slowest rank's; the bytes on the wire
are summed over the hosts' interfaces).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

from mccl_common.errors import ConfigError, MCCLError

from ...cpucap import Cap, CpuCaps
from ..daemons import HostDaemons
from ..launch import FleetLauncher, LocalLauncher, first_failure, run_group
from ..sweep import git_commit
from . import data as lmdata
from .model import ModelConfig
from .variants import DEFAULT, Variant, resolve

log = logging.getLogger(__name__)
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# 10 GbE's ring all-reduce carries 1.17 GB/s of payload (the table): 93.6 % of line rate.
WIRE_EFFICIENCY = 1.17e9 * 8 / 10e9
# The studio's step that the emulation keeps the proportions of: a 1B-parameter model on an M4 Max
# (40-core GPU, about 17 TFLOPS fp32 peak; ~8 TFLOPS reached by a PyTorch MPS training step is
# the assumption), 4 sequences of 1024 tokens per host per step, so 6 x 1e9 x 4096 = 2.5e13 FLOP:
# ~3.1 s of forward+backward+optimizer. Its 4 GB of fp32 gradients make a ring all-reduce of
# 2 x 4 GB on 10 GbE at 1.17 GB/s: 6.8 s (any N). R = 6.8 / 3.1 = 2.2.
STUDIO = {"model_params": 1e9, "tokens_per_host_step": 4096, "achieved_flops": 8e12,
          "grad_bytes": 4e9, "link_bps": 10e9}
STUDIO["compute_s"] = 6 * STUDIO["model_params"] * STUDIO["tokens_per_host_step"] / STUDIO["achieved_flops"]
STUDIO["comm_s"] = 2 * STUDIO["grad_bytes"] / (STUDIO["link_bps"] * WIRE_EFFICIENCY / 8)
STUDIO["ratio"] = STUDIO["comm_s"] / STUDIO["compute_s"]


@dataclass
class LMConfig:
    hosts: int = 0                  # emulated hosts (network namespaces, root); 0: loopback
    ranks: int = 2                  # loopback only: ranks in all
    rate: str | None = "auto"       # "auto" (from calibration and comm_ratio), a tc rate, or None (unshaped)
    comm_ratio: float = round(STUDIO["ratio"], 2)   # fp32 all-reduce time / compute time, for rate="auto"
    variants: list[str] = field(default_factory=lambda: list(DEFAULT))
    model: ModelConfig = field(default_factory=ModelConfig)
    batch: int = 8                  # sequences per rank per step
    steps: int = 150
    eval_every: int = 15
    val_windows: int = 64           # fixed validation windows of `context` bytes (split over the ranks)
    lr: float = 2e-3
    warmup_steps: int = 15
    seed: int = 1234                # data order; the weights come from model.seed
    bucket_mb: float | None = None  # DDP's bucket_cap_mb (None: DDP's own 25)
    calibrate_steps: int = 8
    reference: str | None = None    # the fp32 DDP curve others are measured against (default gloo, else off)
    # "Reached the reference's final loss" allows this relative margin: fp32 sums in another order
    # (mccl's ring against Gloo's) end 1e-5 apart, which is no slower training.
    loss_tolerance: float = 1e-3
    timeout_s: float = 1800.0       # per variant
    op_timeout_s: float = 300.0     # the process group's timeout in each rank
    log_dir: str | None = None
    verbose: bool = False
    # Slow hosts (the compute stand-in, train.SlowHost): host -> (factor, from step). Factor 2 = half speed.
    slow: dict[int, tuple[float, int]] = field(default_factory=dict)
    # Hosts whose CPU is capped or demoted to idle priority (a cgroup each, tools/cpucap.py).
    cpu_caps: dict[int, Cap] = field(default_factory=dict)
    # (host, step): that host's user comes back after step; the others re-form in place (train.Leave).
    leave: tuple[int, int] | None = None

    @property
    def world(self) -> int:
        return self.hosts if self.hosts > 0 else self.ranks

    def validate(self) -> list[Variant]:
        if self.world < 2:
            raise ConfigError(f"[bench] the lm workload needs at least 2 ranks, got {self.world}")
        if self.steps < 1 or self.eval_every < 1 or self.batch < 1 or self.val_windows < self.world:
            raise ConfigError("[bench] --steps, --eval-every and --batch must be at least 1 and --val-windows at "
                              "least the number of ranks")
        if self.hosts == 0 and self.rate not in (None, "auto", "none"):
            raise ConfigError("[bench] --rate shapes emulated hosts only; use --hosts N (root) or leave --rate out")
        if not 0 <= self.loss_tolerance < 0.1:
            raise ConfigError(f"[bench] --loss-tolerance {self.loss_tolerance} must be in [0, 0.1)")
        for h, (factor, at) in self.slow.items():
            if not 0 <= h < self.world or factor < 1.0 or at < 0:
                raise ConfigError(f"[bench] --slow {h}:{factor}@{at}: the host must be in 0..{self.world - 1}, the "
                                  "factor at least 1 (2 = half speed) and the step at least 0")
        for h, cap in self.cpu_caps.items():
            if not 0 <= h < self.world or (cap.cores is not None and cap.cores <= 0) or cap.at < 0:
                raise ConfigError(f"[bench] --cpu-cap/--background host {h}: the host must be in 0..{self.world - 1}, "
                                  "the cores above 0 and the step at least 0")
        if self.leave is not None:
            h, at = self.leave
            if not 0 <= h < self.world or not 0 < at < self.steps or self.world < 3:
                raise ConfigError(f"[bench] --leave {h}@{at}: the host must be in 0..{self.world - 1}, the step in "
                                  f"1..{self.steps - 1}, and at least 2 hosts must stay (got {self.world} hosts)")
        if self.comm_ratio <= 0:
            raise ConfigError(f"[bench] --comm-ratio {self.comm_ratio} must be positive")
        variants = resolve(self.variants)
        if self.leave is not None:
            for v in variants:
                why = "its rounds are planned for a fixed world" if (v.diloco or {}).get("adaptive") else None
                if why:
                    raise ConfigError(f"[bench] --leave with variant {v.name}: {why}; run it without --leave")
        ref = self.reference_name([v.name for v in variants])
        if ref is not None and ref not in self.variants:
            raise ConfigError(f"[bench] --reference {ref} is not one of --variants {','.join(self.variants)}")
        return variants

    def reference_name(self, names: list[str]) -> str | None:
        if self.reference:
            return self.reference
        return next((n for n in ("gloo", "off") if n in names), None)

    def plan(self) -> dict:
        """What every rank of every variant shares."""
        return {"model": self.model.to_dict(), "batch": self.batch, "steps": self.steps, "eval_every": self.eval_every,
                "val_windows": self.val_windows, "lr": self.lr, "warmup_steps": self.warmup_steps,
                "seed": self.seed, "bucket_mb": self.bucket_mb, "op_timeout_s": self.op_timeout_s,
                "leave": None if self.leave is None else list(self.leave)}


def caps_from(cpu_cap: dict[int, tuple[float, int]], background: dict[int, int]) -> dict[int, Cap]:
    """--cpu-cap and --background, one Cap per host (a host given both takes both from one step)."""
    caps: dict[int, Cap] = {}
    for h in sorted({*cpu_cap, *background}):
        steps = {at for at in (cpu_cap.get(h, (0, None))[1], background.get(h)) if at is not None}
        if len(steps) > 1:
            raise ConfigError(f"[bench] host {h}: --cpu-cap and --background must start at the same step "
                              f"(got {sorted(steps)})")
        caps[h] = Cap(cores=cpu_cap[h][0] if h in cpu_cap else None, idle=h in background, at=steps.pop())
    return caps


def fp32_ring_bytes(grad_bytes: int, n: int) -> float:
    """What one rank sends in one fp32 ring all-reduce of ``grad_bytes``."""
    return 2 * (n - 1) / n * grad_bytes


def rate_for(grad_bytes: int, n: int, compute_s: float, ratio: float) -> int:
    """Link rate (bit/s, rounded to a kbit) at which one fp32 ring all-reduce takes ``ratio`` x ``compute_s``."""
    bps = fp32_ring_bytes(grad_bytes, n) * 8 / (WIRE_EFFICIENCY * ratio * compute_s)
    return max(1000, int(round(bps / 1000)) * 1000)


def _envs(launcher, n: int, port: int, variant: Variant) -> list[dict]:
    pypath = os.pathsep.join(p for p in (_PKG_ROOT, os.environ.get("PYTHONPATH")) if p)
    return [{"RANK": str(r), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": str(n),
             "MASTER_ADDR": launcher.addr(0), "MASTER_PORT": str(port), "PYTHONPATH": pypath,
             "OMP_NUM_THREADS": "1", "MCCL_DAEMON": "0", **launcher.rank_env(r), **variant.env} for r in range(n)]


def _run_ranks(launcher, cfg: LMConfig, plan: dict, variant: Variant, tmp: str, what: str) -> list[dict]:
    out_dir = os.path.join(tmp, what)
    os.makedirs(out_dir, exist_ok=True)
    plan = {**plan, "variant": variant.to_dict(), "out_dir": out_dir}
    argv = [sys.executable, "-m", "tools.bench.lm.train", json.dumps(plan)]
    n = launcher.n
    daemons = None
    with contextlib.ExitStack() as stack:
        runner = launcher
        if variant.daemon:
            daemons = HostDaemons(launcher, out_dir, extra_env=variant.env).start()
            stack.callback(daemons.stop)
            runner = daemons    # its ranks attach to their host's mccld (MCCL_DAEMON=1)
        done = run_group(runner, [argv] * n, _envs(launcher, n, launcher.free_port(29500), variant), tmp,
                         cfg.timeout_s, what, stream_first=cfg.verbose)
    why = first_failure(done)
    paths = [os.path.join(out_dir, f"{variant.name}-rank{r}.json") for r in range(n)]
    if why and variant.backend == "gloo" and all(os.path.exists(p) for p in paths) and all(
            d.returncode <= 0 for d in done):
        # The baseline's own teardown (destroy_process_group, interpreter exit) aborted after
        # every rank had written its results (once in ~25 CI runs: "terminate called without an
        # active exception" inside torch's Gloo): the measurement stands, and the report says so.
        # mccl's teardown gets no such pass: a crash there is ours and fails the variant.
        log.warning("[bench] lm %s: every rank wrote its results, then %s; keeping the results", what, why)
        teardown = why
    elif why:
        said = f"; mccld on host 0 logged: {daemons.tail(0)}" if daemons is not None else ""
        raise MCCLError(f"[bench] lm {what} failed: {why}{said}")
    else:
        teardown = None
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append({**json.load(f), "teardown_failure": teardown})
    if not plan.get("calibrate") and any(d["via_daemon"] != variant.daemon for d in docs):
        raise MCCLError(f"[bench] lm {variant.name}: some ranks ran {'without' if variant.daemon else 'through'} "
                        "mccld, so the curve is not this variant's; likely cause: the backend ignores MCCL_DAEMON")
    return docs


def calibrate(cfg: LMConfig, corpus: dict, tmp: str) -> dict:
    """This model's compute per step with every host computing at once on this machine, no communication."""
    plan = {**cfg.plan(), "corpus": corpus, "calibrate": True, "steps": cfg.calibrate_steps}
    docs = _run_ranks(LocalLauncher(cfg.world), cfg, plan, Variant("calibrate", "none"), tmp, "calibrate")
    skip = min(2, cfg.calibrate_steps - 1)   # the first steps allocate and warm caches
    per_step = [t for d in docs for t in d["calibrate"]["compute_s"][skip:]]
    return {"compute_s": statistics.median(per_step), "compute_s_all": [d["calibrate"]["compute_s"] for d in docs],
            "grad_bytes": docs[0]["calibrate"]["grad_bytes"], "concurrent_hosts": cfg.world,
            "cpus": os.cpu_count()}


def aggregate(variant: Variant, docs: list[dict], n: int) -> dict:
    """One curve from the ranks': val loss (the same on every rank), the slowest rank's wall time,
    the hosts' bytes sent summed. A host that left (--leave) counts until it left: its curve
    stops there, and its bytes are added to every later point."""
    gone = [d for d in docs if "left_after_step" in d]
    docs = [d for d in docs if "left_after_step" not in d]
    first = docs[0]
    if any(len(d["curve"]) != len(first["curve"]) for d in docs):
        raise MCCLError(f"[bench] lm {variant.name}: ranks report curves of different lengths")
    curve = []
    for k, p in enumerate(first["curve"]):
        tx = [d["curve"][k]["tx_bytes"] for d in docs]
        for g in gone:
            left = len(g["curve"]) > k and g["curve"][k]["step"] == p["step"]
            tx.append(g["curve"][k]["tx_bytes"] if left else g["tx_bytes_at_leave"])
        curve.append({"step": p["step"], "samples": p["samples"], "wall_s": max(d["curve"][k]["wall_s"] for d in docs),
                      "val_loss": p["val_loss"], "train_loss": p["train_loss"],
                      "wire_bytes": None if None in tx else sum(tx)})
    steps = [max(ts) for ts in zip(*(d["step_s"] for d in docs))]
    last = curve[-1]
    fp32 = fp32_ring_bytes(first["grad_bytes"], n) * n / first["samples_per_step"]
    wire = last["wire_bytes"] / last["samples"] if last["wire_bytes"] is not None and last["samples"] else None
    return {"variant": variant.to_dict(), "ok": True, "curve": curve, "final_val_loss": last["val_loss"],
            "wall_s": last["wall_s"], "samples": last["samples"], "samples_per_s": last["samples"] / last["wall_s"],
            "step_ms_median": statistics.median(steps) * 1e3, "step_ms_all": [s * 1e3 for s in steps],
            "wire_bytes_per_sample": wire, "fp32_ring_bytes_per_sample": fp32,
            "wire_over_fp32_ring": wire / fp32 if wire is not None else None,
            "grad_bytes": first["grad_bytes"], "replicas": first["replicas"],
            "shares": first.get("shares"), "replans": first.get("replans"),
            "speeds": [d.get("speed") for d in docs], "slow": [d.get("slow") for d in docs],
            "diloco": first.get("diloco"), **_rounds(first, docs),
            "init_s": max(d["init_s"] for d in docs),
            "left": [{"rank": g["rank"], "after_step": g["left_after_step"]} for g in gone],
            # set when the baseline's teardown failed after its results were written (_run_ranks)
            "teardown_failure": first.get("teardown_failure")}


def _rounds(first: dict, docs: list[dict]) -> dict:
    """A DiLoCo variant's outer rounds: each one's training time (rank 0's clock between syncs; every
    rank leaves a sync at once) and the inner steps each rank made in all."""
    ends = first.get("round_ends") or []
    if not ends:
        return {}
    spans = [b - a for a, b in zip([0.0] + ends[:-1], ends)]
    return {"round_ms_all": [s * 1e3 for s in spans], "round_ms_median": statistics.median(spans) * 1e3,
            "inner_steps": [(d.get("diloco") or {}).get("inner_steps") for d in docs]}


def check_wire(res: dict) -> str | None:
    """Why a compressed variant's measured bytes say it was not compressed, if they do: its wire
    bytes per sample must stay within 1.5x of its expected share of the fp32 ring's (headers and
    the scales of int8 blocks fit well within that; fp32 itself measures about 1.05x)."""
    factor, ratio = res["variant"]["wire_factor"], res.get("wire_over_fp32_ring")
    if factor >= 1 or ratio is None or ratio <= 1.5 * factor:
        return None
    return (f"[bench] lm {res['variant']['name']}: it put {ratio:.2f}x the fp32 ring's bytes on the wire, where "
            f"{res['variant']['env']} should send about {factor:.2f}x: the installed mccl did not compress; "
            "its curve is not this variant's")


def time_to_loss(curve: list[dict], target: float) -> float | None:
    """Wall time at which the validation loss first reaches ``target`` (linear between evaluations)."""
    prev = None
    for p in curve:
        if p["val_loss"] <= target:
            if prev is None or prev["val_loss"] == p["val_loss"]:
                return p["wall_s"]
            f = (prev["val_loss"] - target) / (prev["val_loss"] - p["val_loss"])
            return prev["wall_s"] + f * (p["wall_s"] - prev["wall_s"])
        prev = p
    return None


def summarize(results: dict[str, dict], reference: str | None, tolerance: float = 1e-3) -> dict:
    """Each variant against the reference: time to reach its final loss (within ``tolerance``,
    relative), loss at equal samples."""
    ref = results.get(reference) if reference else None
    if not ref or not ref.get("ok"):
        return {"reference": None}
    target = ref["final_val_loss"]
    # Every time, the reference's own included, is to the same loss: the reference is 1.00x.
    t_ref = time_to_loss(ref["curve"], target * (1 + tolerance))
    rows = {}
    for name, r in results.items():
        if not r.get("ok"):
            continue
        t = time_to_loss(r["curve"], target * (1 + tolerance))
        same = [p for p in r["curve"] if p["samples"] == ref["samples"]]
        rows[name] = {"time_to_ref_loss_s": t, "time_to_ref_loss_over_ref": t / t_ref if t and t_ref else None,
                      "val_loss_at_ref_samples_pct": (100 * (same[0]["val_loss"] / target - 1)) if same else None,
                      "wall_over_ref": r["wall_s"] / ref["wall_s"]}
    return {"reference": reference, "target_loss": target, "tolerance": tolerance, "variants": rows}


def run_lm(cfg: LMConfig, checkpoint=None) -> dict:
    variants = cfg.validate()
    meta = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "commit": git_commit(), "loadavg_start": os.getloadavg(), "hosts": cfg.world,
            "mode": "fleet" if cfg.hosts else "loopback", "config": _config_dict(cfg), "studio": STUDIO}
    t_start = time.time()
    results: dict[str, dict] = {}
    out = {"meta": meta, "calibration": None, "results": results}

    def save() -> None:
        if checkpoint is not None:
            checkpoint(out)

    with contextlib.ExitStack() as stack:
        if cfg.log_dir:
            os.makedirs(cfg.log_dir, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix="lm-", dir=cfg.log_dir)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="mccl-bench-lm-"))
        corpus = lmdata.build(os.path.join(tmp, "corpus")).to_dict()
        meta["corpus"] = {k: v for k, v in corpus.items() if not k.endswith("_path")}
        plan = {**cfg.plan(), "corpus": corpus}
        # With a balanced variant in the run, every variant takes its ranks' slices of one global
        # batch per step (data.global_sampler): the curves then differ by the update alone.
        plan["global_data"] = any(v.balanced for v in variants)
        meta["global_data"] = plan["global_data"]
        rate = None if cfg.rate in (None, "none") else cfg.rate
        if cfg.rate == "auto" or cfg.slow:   # a slow host's stand-in needs the per-sample compute
            cal = calibrate(cfg, corpus, tmp)
            out["calibration"] = cal
            if cfg.slow:
                per_sample = cal["compute_s"] / cfg.batch
                plan["sample_compute_s"] = per_sample
                plan["slow"] = {str(h): [f, at] for h, (f, at) in cfg.slow.items()}
                # What perfect balance reaches: the hosts' solo speeds summed (a slow host at 1/factor).
                cal["solo_sum_samples_per_s"] = sum(
                    1.0 / (per_sample * cfg.slow.get(h, (1.0, 0))[0]) for h in range(cfg.world))
                cal["uniform_samples_per_s"] = cfg.world / per_sample
            if cfg.hosts and cfg.rate == "auto":
                bps = rate_for(cal["grad_bytes"], cfg.world, cal["compute_s"], cfg.comm_ratio)
                rate = f"{bps // 1000}kbit"
                cal["rate_bps"] = bps
                cal["fp32_allreduce_s_at_rate"] = fp32_ring_bytes(cal["grad_bytes"], cfg.world) * 8 / (
                    bps * WIRE_EFFICIENCY)
            log.info("[bench] lm calibration: %.3f s of compute per step (%d hosts at once on %d cores), %d "
                     "gradient bytes; link rate %s", cal["compute_s"], cfg.world, os.cpu_count(), cal["grad_bytes"],
                     rate or "unshaped (loopback)")
            save()
        meta["rate"] = rate if cfg.hosts else None
        launcher = FleetLauncher(cfg.hosts, rate) if cfg.hosts else LocalLauncher(cfg.world)
        stack.callback(launcher.close)
        if cfg.cpu_caps:
            caps = CpuCaps(cfg.cpu_caps, tmp)
            stack.callback(caps.close)
            launcher.cpu = caps     # every process started on a capped host goes into its group
            caps.start()
            plan["cpu_cap_markers"] = {str(h): [caps.marker(h), c.at] for h, c in cfg.cpu_caps.items() if c.at > 0}
            meta["cpu_caps"] = {str(h): c.to_dict() for h, c in cfg.cpu_caps.items()}
        plan["wire_iface"] = "eth0" if cfg.hosts else None
        for v in variants:
            t0 = time.time()
            try:
                caps = launcher.cpu
                if caps is not None:
                    caps.reset()
                    held0 = caps.throttled_s()
                docs = _run_ranks(launcher, cfg, plan, v, tmp, v.name)
                res = aggregate(v, docs, cfg.world)
                if caps is not None:   # what the quotas held back: proof the caps bit
                    res["cpu_throttled_s"] = {str(h): round(t - held0[h], 3) for h, t in caps.throttled_s().items()}
                why = check_wire(res)
                if why:
                    raise MCCLError(why)
                if not res["replicas"]["identical"]:
                    raise MCCLError(f"[bench] lm {v.name}: the replicas' parameters differ after training "
                                    f"(sums {res['replicas']['min']!r} .. {res['replicas']['max']!r}); the "
                                    "backend's all-reduce results differ between ranks")
            except MCCLError as e:
                log.error("%s", e)
                res = {"variant": v.to_dict(), "ok": False, "error": str(e)}
            res["seconds"] = time.time() - t0
            results[v.name] = res
            save()
    meta.update(seconds=time.time() - t_start, loadavg_end=os.getloadavg())
    out["summary"] = summarize(results, cfg.reference_name(list(results)), cfg.loss_tolerance)
    return out


def _config_dict(cfg: LMConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["model"] = cfg.model.to_dict()
    return d
