"""One rank of the lm workload: ``python -m tools.bench.lm.train '<json plan>'``.

Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT like any torch.distributed program. With
``calibrate`` it times ``steps`` training steps of the model alone (no process group, no
communication: the compute a step costs on this host while the others do the same), else it
trains the model under DistributedDataParallel for ``steps`` steps (AdamW, linear warm-up then
cosine decay, gradient clipping), evaluating the validation loss every ``eval_every`` steps. A
``diloco`` variant trains the same way without DDP, each rank on its own batch, under
libmccl.DiLoCo; its evaluations are of theta_global (the model the ranks agree on).

The training clock runs only during steps: evaluation (every rank its share of the fixed
validation windows, then one 16-byte all-reduce of float64 sums) is excluded, so the curve's
wall time is what training alone took. On an emulated host (``wire_iface``) each point also
carries the bytes this host's interface sent since training began (/proc/net/dev, which shows
this process's network namespace): what compression actually saves, measured, not computed.

Writes ``<out_dir>/<variant>-rank<r>.json``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import sys
import time

from mccl_common.errors import MCCLError

from . import data as lmdata
from . import model as lmmodel


def tx_bytes(iface: str | None) -> int | None:
    """Bytes ``iface`` has sent, in this process's network namespace; None when not asked."""
    if not iface:
        return None
    with open("/proc/self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                return int(rest.split()[8])
    raise MCCLError(f"[bench] no interface {iface!r} in this network namespace's /proc/net/dev")


def lr_at(step: int, plan: dict) -> float:
    warm, total, peak = plan["warmup_steps"], plan["steps"], plan["lr"]
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _evaluate(torch, dist, model, val, mcfg, plan, rank, world) -> float:
    x, y = lmdata.val_windows(torch, val, mcfg.context, plan["val_windows"], rank, world)
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, len(x), plan["batch"]):
            logits = model(x[i:i + plan["batch"]])
            total[0] += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, lmmodel.VOCAB), y[i:i + plan["batch"]].reshape(-1), reduction="sum"))
            total[1] += y[i:i + plan["batch"]].numel()
    model.train()
    if dist is not None:
        dist.all_reduce(total)   # 16 bytes of float64: below any compression threshold, exact
    return float(total[0] / total[1])


def _calibrate(torch, plan: dict, mcfg, train, rank: int) -> dict:
    model = lmmodel.build(torch, mcfg)
    opt = torch.optim.AdamW(model.parameters(), lr=plan["lr"], weight_decay=0.1)
    it = lmdata.batches(torch, train, mcfg.context, plan["batch"], plan["seed"], rank)
    times = []
    for _ in range(plan["steps"]):
        x, y = next(it)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        lmmodel.loss_fn(torch, model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"compute_s": times, "grad_bytes": grad_bytes}


def run(plan: dict) -> dict:
    import torch

    torch.set_num_threads(1)   # the emulated hosts share the machine's cores: one thread each, every variant
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    mcfg = lmmodel.ModelConfig(**plan["model"])
    train = lmdata.load_split(torch, plan["corpus"]["train_path"])
    val = lmdata.load_split(torch, plan["corpus"]["val_path"])
    out = {"rank": rank, "world": world, "pid": os.getpid(), "variant": plan["variant"]["name"],
           "backend": plan["variant"]["backend"], "torch": torch.__version__}
    if plan.get("calibrate"):
        out["calibrate"] = _calibrate(torch, plan, mcfg, train, rank)
        return out

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if plan["variant"]["backend"] == "mccl":
        import libmccl

        libmccl.register()
    t0 = time.perf_counter()
    dist.init_process_group(plan["variant"]["backend"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=plan["op_timeout_s"]))
    out["init_s"] = time.perf_counter() - t0
    model = lmmodel.build(torch, mcfg)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dcfg = plan["variant"].get("diloco")
    if dcfg:
        # DiLoCo: every rank steps its own batch alone; libmccl.DiLoCo syncs every H inner steps.
        if plan["variant"].get("balanced"):
            raise MCCLError("[bench] a diloco variant cannot also be balanced: the balancer is a DDP comm hook")
        ddp = model
        opt = torch.optim.AdamW(model.parameters(), lr=plan["lr"], weight_decay=0.1)
        diloco = DiLoCoRun(torch, model, opt, dcfg)
    else:
        kwargs = {} if plan.get("bucket_mb") is None else {"bucket_cap_mb": plan["bucket_mb"]}
        ddp = DistributedDataParallel(model, **kwargs)
        opt = torch.optim.AdamW(ddp.parameters(), lr=plan["lr"], weight_decay=0.1)
        diloco = None
    draw = lmdata.sampler(torch, train, mcfg.context, plan["seed"], rank)   # keyed by host: kept across a re-form
    draw_global = lmdata.global_sampler(torch, train, mcfg.context, plan["seed"]) if plan.get("global_data") else None
    balancer = None
    if plan["variant"].get("balanced"):
        from libmccl.training import SpeedBalancer

        balancer = SpeedBalancer(plan["batch"] * world)
        ddp.register_comm_hook(balancer.state, balancer.hook)
    slow = SlowHost.from_plan(plan, rank)
    elastic = Leave.from_plan(plan, rank, ddp, opt, diloco)
    # A CPU cap that starts mid-run (--cpu-cap/--background HOST@STEP): the runner applies it when
    # the host's rank reports the step through a marker file (tools/cpucap.py says why a file).
    cap_marker = (plan.get("cpu_cap_markers") or {}).get(str(rank))
    iface = plan.get("wire_iface")
    samples_per_step = plan["batch"] * world
    curve, step_s, losses, shares = [], [], [], []
    # DiLoCo: the training clock at each completed outer round (every rank leaves a sync together).
    round_ends: list[float] = []
    # An adaptive DiLoCo's ranks make different numbers of inner steps (each its own plan per round),
    # so its run is counted in rounds: every rank stops after the same sync, and the curve's points
    # are at round ends, with the samples every rank actually drew.
    adaptive = bool(dcfg and dcfg.get("adaptive"))
    rounds_wanted = plan["steps"] // dcfg["H"] if adaptive else None
    if adaptive and (rounds_wanted < 1 or plan["eval_every"] % dcfg["H"]):
        raise MCCLError(f"[bench] {plan['variant']['name']}: --steps must be at least H={dcfg['H']} and "
                        f"--eval-every a multiple of it (got {plan['steps']} and {plan['eval_every']}): "
                        "an adaptive DiLoCo is evaluated at round ends")

    samples_so_far = 0      # the global batches drawn so far, counted per step: the world may shrink mid-run

    def samples_drawn(step: int) -> int:
        if not adaptive:
            return samples_so_far
        made = torch.tensor([float(diloco.d.step * plan["batch"])], dtype=torch.float64)
        dist.all_reduce(made)
        return int(made[0])

    def point(step: int, wall: float, tx0: int | None) -> None:
        samples = samples_drawn(step)
        now_rank, now_world = dist.get_rank(), dist.get_world_size()   # after a leave: the new world's
        if diloco is not None:
            with diloco.global_weights():   # DiLoCo's model is theta_global; the local ones drift between syncs
                loss = _evaluate(torch, dist, model, val, mcfg, plan, now_rank, now_world)
        else:
            loss = _evaluate(torch, dist, model, val, mcfg, plan, now_rank, now_world)
        tx = tx_bytes(iface)
        curve.append({"step": step, "samples": samples, "wall_s": wall, "val_loss": loss,
                      "train_loss": statistics.fmean(losses[-plan["eval_every"]:]) if losses else None,
                      "tx_bytes": None if tx is None else tx - tx0})
        if now_rank == 0:
            print(f"[bench] {plan['variant']['name']} step {step}: val loss {loss:.4f} at {wall:.1f} s",
                  file=sys.stderr, flush=True)

    dist.barrier()
    tx0 = tx_bytes(iface)
    point(0, 0.0, tx0)
    wall = 0.0
    if diloco is not None:
        diloco.enter()
    step = 0
    while (diloco.rounds() < rounds_wanted) if adaptive else (step < plan["steps"]):
        for g in opt.param_groups:
            g["lr"] = lr_at(min(step, plan["steps"] - 1), plan)
        if cap_marker and step == cap_marker[1]:
            with open(cap_marker[0], "w"):
                pass
        t = time.perf_counter()
        b = balancer.batch_size() if balancer is not None else plan["batch"]   # exchanges speeds every few steps
        shares.append(balancer.shares if balancer is not None else None)
        if draw_global is not None:
            # the world now (a host may have left): slices of one global batch by the current ranks
            x, y = draw_global(balancer.shares if balancer is not None else [plan["batch"]] * dist.get_world_size(),
                               dist.get_rank())
        else:
            x, y = draw(b)
        opt.zero_grad(set_to_none=True)
        loss = lmmodel.loss_fn(torch, ddp(x), y)
        slow.compute(step, b)        # a slow host's extra compute, before backward: inside what the balancer times
        loss.backward()              # DDP's bucket all-reduces overlap this
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        rounds_before = diloco.rounds() if diloco is not None else 0
        opt.step()                   # DiLoCo: its hook may sync here
        # the global batch: a balancer keeps its B as hosts leave (the others split it), DDP is b x world
        samples_so_far += balancer.global_batch if balancer is not None else plan["batch"] * dist.get_world_size()
        if elastic is not None:
            try:
                elastic.step_done(step)      # a re-form rebuilds DDP in place: `ddp` is still the object to use
            except SystemExit:
                # this host left: ElasticState destroyed its group; the others go on without it
                out.update(left_after_step=step, curve=curve, step_s=step_s, grad_bytes=grad_bytes,
                           samples_per_step=samples_per_step, tx_bytes_at_leave=None if iface is None else
                           tx_bytes(iface) - tx0, via_daemon="libmccl.daemon.client" in sys.modules)
                return out
        dt = time.perf_counter() - t
        step_s.append(dt)
        wall += dt
        step += 1
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise MCCLError(f"[bench] {plan['variant']['name']}: training loss is {losses[-1]} at step {step - 1} "
                            f"on rank {rank}; the gradients are corrupt or the learning rate too high")
        synced = diloco is not None and diloco.rounds() > rounds_before
        if synced:
            round_ends.append(wall)
        last = (diloco.rounds() >= rounds_wanted) if adaptive else step == plan["steps"]
        if last and diloco is not None:
            t = time.perf_counter()
            diloco.exit()            # applies a round still in flight: the final point is after it
            wall += time.perf_counter() - t
        if adaptive:
            if synced and ((diloco.rounds() * dcfg["H"]) % plan["eval_every"] == 0 or last):
                point(diloco.rounds() * dcfg["H"], wall, tx0)
        elif step % plan["eval_every"] == 0 or last:
            point(step, wall, tx0)
    out.update(curve=curve, step_s=step_s, round_ends=round_ends, grad_bytes=grad_bytes, samples_per_step=samples_per_step,
               shares=shares, speed=None if balancer is None else balancer.speed,
               replans=None if balancer is None else balancer.history, slow=slow.to_dict(),
               replicas=_replica_spread(torch, dist, model, diloco),
               diloco=None if diloco is None else diloco.to_dict(),
               # loaded only when the group went through mccld: proof that a daemon variant ran as one
               via_daemon="libmccl.daemon.client" in sys.modules)
    return out


class Leave:
    """``--leave HOST@STEP``: host HOST's user comes back after step STEP. The job runs under
    ElasticState(keep_workers=True), as an elastic script does; the leaving host's rank creates
    its drain file, every rank learns it in step_done's all-reduce, and the others re-form in
    place (libmccl.elastic.reform) and go on: a DiLoCo made with group=None follows the new
    default group at its next sync. ElasticState checkpoints only at the leave (every is
    beyond the run): the state a restart would need, written where a real job writes it."""

    def __init__(self, state, drain_file: str, leaves: bool, at: int) -> None:
        self.state, self.drain_file, self.leaves, self.at = state, drain_file, leaves, at

    @classmethod
    def from_plan(cls, plan: dict, rank: int, model, opt, diloco) -> "Leave | None":
        spec = plan.get("leave")
        if not spec:
            return None
        from libmccl.elastic.state import DRAIN_ENV, ElasticState

        drain_file = os.path.join(plan["out_dir"], f"drain-h{rank}")
        os.environ[DRAIN_ENV] = drain_file
        os.environ["GROUP_RANK"] = str(rank)      # one rank per host: the host index
        replicated = {"diloco": diloco.d} if diloco is not None else None
        state = ElasticState(os.path.join(plan["out_dir"], "ckpt"), model=model, optimizer=opt,
                             every=plan["steps"] + 1, keep_workers=True, replicated=replicated)
        return cls(state, drain_file, rank == int(spec[0]), int(spec[1]))

    def step_done(self, step: int) -> bool:
        """Call after step ``step`` (0-based); True when the world changed; SystemExit on the leaver."""
        if self.leaves and step + 1 == self.at:
            open(self.drain_file, "w").close()
        return self.state.step_done(step)


class SlowHost:
    """The compute stand-in for a slow host (``--slow host:factor[@step]``): from step ``at`` on, each
    step's forward is followed by ``(factor - 1) x samples x per-sample compute`` of sleep, the
    per-sample compute being the calibration's (every host computing at once). Sleeping, not
    spinning: on a shared 2-core machine a spinning host would slow the others too. A host at
    factor 2 takes twice as long per sample, and a balancer that gives it fewer samples makes it
    sleep less, as a slower chip given less work would."""

    def __init__(self, factor: float = 1.0, at: int = 0, per_sample_s: float = 0.0) -> None:
        self.factor, self.at, self.per_sample_s = factor, at, per_sample_s
        self.slept_s = 0.0

    @classmethod
    def from_plan(cls, plan: dict, rank: int) -> "SlowHost":
        spec = (plan.get("slow") or {}).get(str(rank))
        if not spec:
            return cls()
        if not plan.get("sample_compute_s"):
            raise MCCLError("[bench] --slow needs the calibration's per-sample compute (sample_compute_s)")
        return cls(float(spec[0]), int(spec[1]), float(plan["sample_compute_s"]))

    def compute(self, step: int, samples: int) -> None:
        if self.factor > 1.0 and step >= self.at:
            d = (self.factor - 1.0) * samples * self.per_sample_s
            time.sleep(d)
            self.slept_s += d

    def to_dict(self) -> dict:
        return {"factor": self.factor, "at": self.at, "per_sample_s": self.per_sample_s, "slept_s": self.slept_s}


class DiLoCoRun:
    """libmccl.DiLoCo as a variant configures it, the outer optimizer the published one."""

    def __init__(self, torch, model, inner, cfg: dict) -> None:
        import libmccl

        self.torch, self.model = torch, model
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        self.d = libmccl.DiLoCo(model, inner, outer, sync_every=cfg["H"], fragments=cfg["F"], delay=cfg["tau"],
                                alpha=cfg["alpha"], compression=cfg.get("compression"),
                                adaptive=bool(cfg.get("adaptive")))
        self.entered = False

    def rounds(self) -> int:
        """Outer rounds completed (the first fragment's: with F > 1 each fragment counts its own)."""
        return self.d._fragments[0].rounds

    def enter(self) -> None:
        self.d.__enter__()
        self.entered = True

    def exit(self) -> None:
        if self.entered:
            self.entered = False
            self.d.__exit__(None, None, None)

    def global_params(self) -> list:
        # theta_global, what every rank agrees on (tools may read the fragments; the product API
        # exposes them only through state_dict, which would copy them)
        return [g for f in self.d._fragments for g in f.globals]

    def global_weights(self):
        import contextlib

        torch, params = self.torch, [p for f in self.d._fragments for p in f.params]

        @contextlib.contextmanager
        def swapped():
            saved = [p.detach().clone() for p in params]
            with torch.no_grad():
                for p, g in zip(params, self.global_params()):
                    p.copy_(g)
            try:
                yield
            finally:
                with torch.no_grad():
                    for p, s in zip(params, saved):
                        p.copy_(s)
        return swapped()

    def to_dict(self) -> dict:
        return {"syncs": self.d.syncs, "payload_bytes": self.d.payload_bytes, "inner_steps": self.d.step,
                "rounds": [f.rounds for f in self.d._fragments],
                "history": list(self.d.history) if self.d.adaptive else None}   # per sync: steps made, speeds, next plan


def _replica_spread(torch, dist, model, diloco: DiLoCoRun | None = None) -> dict:
    """Min and max over ranks of the parameters' float64 sum: equal when the replicas are bit-identical,
    as they must be after DDP (compressed or not: every rank ends with the same all-reduce result).
    Under DiLoCo, theta_global's: the local parameters differ by design."""
    params = diloco.global_params() if diloco is not None else list(model.parameters())
    total = torch.tensor([sum(float(p.detach().double().sum()) for p in params)], dtype=torch.float64)
    lo, hi = total.clone(), total.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return {"min": float(lo[0]), "max": float(hi[0]), "identical": float(lo[0]) == float(hi[0])}


def main() -> int:
    from ..worker import die_with_parent

    die_with_parent()
    plan = json.loads(sys.argv[1])
    result = run(plan)
    path = os.path.join(plan["out_dir"], f"{plan['variant']['name']}-rank{result['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    if not plan.get("calibrate") and "left_after_step" not in result:   # a host that left has no group
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
