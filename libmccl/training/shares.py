"""How a global batch is split over ranks of unequal speed: pure arithmetic, no torch.

Synchronous data parallelism runs at its slowest rank's pace. Giving each rank a share of the
global batch proportional to its measured samples/s makes every rank finish its compute at about
the same time, so the step costs what the fleet's summed speed allows instead of
``world x slowest``. ``plan_shares`` turns speeds into integral shares; ``SharePlanner`` keeps one
rank's smoothed speed and decides when the plan is stale. Both are deterministic: every rank
computes the same plan from the same gathered speeds, so no share ever crosses the network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mccl_common.errors import ConfigError


def floor_share(global_batch: int, world: int, floor: float) -> int:
    """The fewest samples a rank gets: ``floor`` x the equal share, at least 1 (an empty batch would
    make a rank's mean loss NaN and its gradient undefined)."""
    return max(1, math.ceil(floor * global_batch / world - 1e-9))


def plan_shares(global_batch: int, speeds: list[float | None], floor: float = 0.25) -> list[int]:
    """Integral shares of ``global_batch``, one per rank, proportional to ``speeds`` (samples/s).

    A speed of None or <= 0 means "not measured yet" (a host that just joined): that rank is
    planned at the mean of the measured speeds, or all ranks equally when none is measured.
    No rank gets fewer than ``floor_share`` samples, so a rank that looks stalled still computes
    and is measured again (a floor of 0 would starve it for good). The shares sum to
    ``global_batch`` exactly; rounding gives the leftover samples to the largest remainders,
    ties to the lower rank, so the plan is the same on every rank.
    """
    n = len(speeds)
    if n < 1:
        raise ConfigError("[balance] no ranks to plan shares for")
    if not 0.0 <= floor <= 1.0:
        raise ConfigError(f"[balance] share floor {floor} must be in [0, 1] (a fraction of the equal share)")
    if global_batch < n:
        raise ConfigError(f"[balance] global batch {global_batch} is smaller than the world ({n} ranks): every "
                          "rank needs at least one sample; raise the global batch")
    measured = [float(s) for s in speeds if s is not None and math.isfinite(float(s)) and float(s) > 0]
    fill = sum(measured) / len(measured) if measured else 1.0
    sp = [float(s) if s is not None and math.isfinite(float(s)) and float(s) > 0 else fill for s in speeds]
    lo = floor_share(global_batch, n, floor)
    if lo * n > global_batch:
        lo = global_batch // n
    # Water-filling: ranks whose proportional share falls under the floor are pinned to it and the
    # rest split what is left in proportion to their speeds, until no free rank falls under it.
    pinned: set[int] = set()
    while True:
        free = [r for r in range(n) if r not in pinned]
        left = global_batch - lo * len(pinned)
        total = sum(sp[r] for r in free)
        ideal = {r: left * sp[r] / total for r in free}
        under = [r for r in free if ideal[r] < lo]
        if not under or len(under) == len(free):
            if under:       # cannot happen with lo * n <= global_batch, but never loop forever
                pinned.update(under)
                free, ideal = [], {}
            break
        pinned.update(under)
    shares = [lo] * n
    for r in free:
        shares[r] = max(lo, int(math.floor(ideal[r])))
    rest = global_batch - sum(shares)
    order = sorted(free or range(n), key=lambda r: (-(ideal.get(r, 0.0) - math.floor(ideal.get(r, 0.0))), r))
    i = 0
    while rest > 0:
        shares[order[i % len(order)]] += 1
        rest -= 1
        i += 1
    return shares


@dataclass
class SharePlanner:
    """One rank's view: its smoothed speed, the current plan, and when to exchange speeds again.

    Speed is an EMA of samples/s (``alpha``). A step change (a Mac whose artist came back drops to
    background priority; a host throttles) would take several steps to show through the EMA, so
    two measurements in a row off the EMA by more than ``jump`` (same direction) replace it:
    noise of one step does not move the plan, a real change does at once. Speeds are exchanged
    every ``every`` steps (the caller's small all-gather) and the plan is adopted when it moves
    some share by more than ``hysteresis`` x the equal share (no churn from noise).
    """

    global_batch: int
    world: int
    rank: int
    every: int = 2
    alpha: float = 0.3
    jump: float = 0.25
    floor: float = 0.25
    hysteresis: float = 0.05
    warmup: int = 1                     # first measurements ignored: allocation, DDP's bucket rebuild
    speed: float | None = None
    shares: list[int] = field(default_factory=list)
    steps: int = 0                      # measurements seen on this world
    replans: int = 0
    _pending: list[float] = field(default_factory=list)
    _force: bool = True

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError(f"[balance] every={self.every}: speeds must be exchanged at least every step (>= 1)")
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"[balance] alpha={self.alpha} must be in (0, 1]")
        self.new_world(self.world, self.rank)

    def new_world(self, world: int, rank: int) -> None:
        """Hosts left or joined: keep this rank's own speed (its host did not change), start from
        equal shares and exchange at the next chance, so the new world is planned from measurements."""
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"[balance] rank {rank} is not in a world of {world}")
        self.world, self.rank = world, rank
        self.shares = plan_shares(self.global_batch, [None] * world, self.floor)
        self.steps = 0
        self._pending = []
        self._force = True

    @property
    def share(self) -> int:
        return self.shares[self.rank]

    def observe(self, samples: int, seconds: float) -> None:
        """One step's compute on this rank: ``samples`` in ``seconds``."""
        self.steps += 1
        if self.steps <= self.warmup or samples <= 0 or not seconds > 0:
            return
        s = samples / seconds
        if self.speed is None:
            self.speed = s
            return
        off = s / self.speed - 1.0
        if abs(off) > self.jump:
            self._pending.append(s)
            if len(self._pending) >= 2 and all((p > self.speed) == (s > self.speed) for p in self._pending[-2:]):
                self.speed = sum(self._pending[-2:]) / 2
                self._pending = []
            return
        self._pending = []
        self.speed = self.alpha * s + (1 - self.alpha) * self.speed

    def due(self) -> bool:
        """Whether this step starts with an exchange of speeds. Every rank must answer alike (the
        exchange is a collective), so it depends only on the count of steps on this world: every
        ``every`` steps, and at the first measured step of a new world. A local jump only replaces
        the speed; the next exchange carries it."""
        if self.steps <= self.warmup:
            return False
        return self._force or self.steps % self.every == 0

    def adopt(self, speeds: list[float | None]) -> bool:
        """The gathered speeds (one per rank, None for unmeasured): re-plan; True when the plan changed."""
        if len(speeds) != self.world:
            raise ConfigError(f"[balance] got {len(speeds)} speeds for a world of {self.world}")
        self._force = False
        new = plan_shares(self.global_batch, speeds, self.floor)
        moved = max(abs(a - b) for a, b in zip(new, self.shares))
        if moved > self.hysteresis * self.global_batch / self.world or (moved and self.replans == 0):
            self.shares = new
            self.replans += 1
            return True
        return False


def plan_inner_steps(sync_every: int, speeds: list[float | None], cap: int | None = None,
                     least: int = 1) -> list[int]:
    """DiLoCo's inner steps per rank for the next round, against a time budget.

    The budget is what the median rank needs for ``sync_every`` (H) steps: T = H / median speed
    (speeds in inner steps/s). Rank r plans H_r = floor(T x speed_r), clamped to [least, cap]
    (cap defaults to 2H), so a rank twice as slow as the median makes half the steps in the
    same time instead of holding the round. Floored, not rounded: the round lasts as long as its
    longest plan, and a slow host's rounded-up half step costs every rank a whole fast step (on
    8 hosts with two at half speed, plans rounded up made rounds 1.27x the uniform fleet's).
    A speed of None or <= 0 (not measured yet) plans H; no speed measured plans H everywhere.
    Pure arithmetic on the gathered speeds: every rank computes the same plan.
    """
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ConfigError(f"[balance] sync_every={sync_every!r}: H must be an integer >= 1")
    cap = 2 * sync_every if cap is None else cap
    if not 1 <= least <= sync_every <= cap:
        raise ConfigError(f"[balance] inner-step bounds least={least}, H={sync_every}, cap={cap}: need "
                          "1 <= least <= H <= cap")
    if not speeds:
        raise ConfigError("[balance] no ranks to plan inner steps for")
    ok = [float(s) for s in speeds if s is not None and math.isfinite(float(s)) and float(s) > 0]
    if not ok:
        return [sync_every] * len(speeds)
    ok.sort()
    mid = len(ok) // 2
    median = ok[mid] if len(ok) % 2 else (ok[mid - 1] + ok[mid]) / 2
    budget = sync_every / median
    plan = []
    for s in speeds:
        if s is None or not math.isfinite(float(s)) or float(s) <= 0:
            plan.append(sync_every)
        else:
            # The 1e-9 keeps the median rank's own H from flooring to H - 1 on a rounding error.
            plan.append(min(cap, max(least, int(math.floor(budget * float(s) + 1e-9)))))
    return plan
