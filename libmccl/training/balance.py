"""Speed-aware batch shares for DDP: a slow host does not pace the fleet.

One object gives a DDP script both halves::

    from libmccl.training import SpeedBalancer
    balancer = SpeedBalancer(global_batch=256)                # after init_process_group
    model = DistributedDataParallel(net)
    model.register_comm_hook(balancer.state, balancer.hook)
    for step in range(steps):
        b = balancer.batch_size()          # this rank's share of the global batch for this step
        x, y = next_batch(b)               # exactly b samples
        loss_fn(model(x), y).backward()    # a mean over this rank's b samples, as usual
        opt.step()

``batch_size()`` starts the step's clock; the hook's last call in a step marks the end of this
rank's backward (DDP launches its last bucket when backward is done), so the speed measured is
this rank's own compute, not its wait for the others. Every ``every`` steps the ranks exchange
their smoothed speeds in one all-gather of ``world`` float64 and re-plan (shares.SharePlanner).

The hook all-reduces ``(b_r / B) x g_r`` with SUM, where ``g_r`` is the mean gradient over the
rank's ``b_r`` samples and ``B`` the global batch: sum_r (b_r/B) g_r = (1/B) sum over all B samples,
the gradient one process would compute on the whole batch, whatever the shares. DDP's own
average (sum / world) would weight a slow rank's few samples as much as a fast rank's many.

Hosts leaving or joining: after a re-form (a new default group) call ``balancer.new_world()``:
this rank keeps its measured speed, the world starts from equal shares and the next step
exchanges speeds. (ElasticState restarts the workers of a job with a comm hook instead of
re-forming in place; the restarted script builds a new balancer, which plans the new world.)
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from mccl_common.errors import ConfigError

from .shares import SharePlanner

log = logging.getLogger(__name__)


class _HookState:
    """What DDP hands the hook: the balancer's current weight and a clock."""

    def __init__(self, balancer: "SpeedBalancer") -> None:
        self.balancer = balancer
        self.last_call: float | None = None
        self.calls = 0

    # What an in-place re-form (libmccl.elastic.reform) asks of a DDP comm hook's state: a
    # balancer over the default group follows it into the new world and re-plans there.
    @property
    def follows_default_group(self) -> bool:
        return self.balancer.group is None

    def new_world(self) -> None:
        self.balancer.new_world(None)


class SpeedBalancer:
    def __init__(self, global_batch: int, group=None, *, every: int = 2, alpha: float = 0.3, jump: float = 0.25,
                 floor: float = 0.25, hysteresis: float = 0.05, warmup: int = 1) -> None:
        if not dist.is_initialized():
            raise ConfigError("[balance] call dist.init_process_group before SpeedBalancer: the shares are planned "
                              "over the process group")
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ConfigError(f"[balance] global_batch must be a positive int, got {global_batch!r}")
        self.group = group
        self.planner = SharePlanner(global_batch, dist.get_world_size(group), dist.get_rank(group), every=every,
                                    alpha=alpha, jump=jump, floor=floor, hysteresis=hysteresis, warmup=warmup)
        self.state = _HookState(self)
        self.samples = 0                 # this step's samples on this rank (batch_size() sets it)
        self._started: float | None = None
        self.history: list[dict] = []    # one entry per re-plan: step, speeds, shares

    @property
    def global_batch(self) -> int:
        return self.planner.global_batch

    @property
    def shares(self) -> list[int]:
        return list(self.planner.shares)

    @property
    def speed(self) -> float | None:
        return self.planner.speed

    def new_world(self, group=None) -> None:
        """The group re-formed (hosts left or joined): plan the new world from this rank's speed."""
        self.group = group
        self.planner.new_world(dist.get_world_size(group), dist.get_rank(group))
        self._started = None

    def batch_size(self) -> int:
        """This rank's share for the step that starts now. Collective every ``every`` steps (all ranks
        must call it once per step, in the same order as their other collectives)."""
        if self._started is not None:
            end = self.state.last_call if self.state.calls else None
            secs = (end - self._started) if end is not None and end > self._started else None
            self.planner.observe(self.samples, secs or 0.0)
        if self.planner.due():
            self._exchange()
        self.samples = self.planner.share
        self.state.calls = 0
        self.state.last_call = None
        self._started = time.perf_counter()
        return self.samples

    def _exchange(self) -> None:
        world = self.planner.world
        mine = torch.tensor([self.planner.speed or 0.0], dtype=torch.float64)
        got = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(got, mine, group=self.group)
        speeds = [float(t[0]) if float(t[0]) > 0 else None for t in got]
        if self.planner.adopt(speeds):
            self.history.append({"step": self.planner.steps, "speeds": speeds, "shares": self.shares})
            if self.planner.rank == 0:
                log.info("[balance] step %d: speeds %s samples/s -> shares %s", self.planner.steps,
                         [None if s is None else round(s, 1) for s in speeds], self.shares)
        self._report()

    def _report(self) -> None:
        """Speed and share to this host's mccld (``mcclctl jobs``, the exporter) when the group runs
        through one; a group without a daemon client has nothing to report to."""
        pg = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        report = getattr(getattr(pg, "communicator", None), "report_balance", None)
        if report is None:
            try:
                backend = pg._get_backend(torch.device("cpu"))
            except (RuntimeError, AttributeError):
                return
            report = getattr(getattr(backend, "communicator", None), "report_balance", None)
        if report is not None:
            report(self.planner.speed or 0.0, self.planner.share)

    def weight(self) -> float:
        """This rank's factor on its mean gradient: its samples over the global batch."""
        return self.samples / self.planner.global_batch

    @staticmethod
    def hook(state, bucket):   # no annotations: DDP compares them with dist.GradBucket, strings fail
        """DDP comm hook: all-reduce SUM of (b_r / B) x this bucket, the exact large-batch gradient."""
        bal = state.balancer
        state.calls += 1
        state.last_call = time.perf_counter()
        buf = bucket.buffer()
        if bal.samples <= 0:
            raise ConfigError("[balance] the comm hook ran before balancer.batch_size() this step: call it at the "
                              "start of every step so the gradient is weighted by this rank's samples")
        buf.mul_(bal.weight())
        fut = dist.all_reduce(buf, group=bal.group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
