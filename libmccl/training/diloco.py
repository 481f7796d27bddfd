"""DiLoCo and streaming DiLoCo around an unchanged inner training loop.

    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with libmccl.DiLoCo(model, inner_opt, outer, sync_every=32) as diloco:
        for x, y in batches:
            inner_opt.zero_grad(); loss_fn(model(x), y).backward(); inner_opt.step()

Every rank trains alone; a hook after ``inner_opt.step()`` counts inner steps. Fragment f of the
model (all of it when ``fragments=1``) is sent at the inner steps t >= 1 with
(t - f*H/F) % H == 0: its outer gradient theta_global - theta_local is all-reduced (async), and
``delay`` inner steps later the average over the ranks (weighted by the inner steps each made
since it had the state) is the gradient ``outer_optimizer`` steps theta_global with; the rank
then continues from alpha*theta_local + (1-alpha)*theta_global. F=1, delay=0, alpha=0 is the
published algorithm (Douillard et al. 2023); F>1 with a delay and a mixing factor is streaming
DiLoCo (Douillard et al. 2025). Everything goes through torch.distributed collectives on the
group given (or the default group as it is at each sync), so it runs on mccl in-process,
through mccld, and on gloo. The user page is docs/diloco.md.

With ``adaptive=True`` (F=1) a slow host does not hold the round: each rank measures its inner
steps/s over the round (an EMA), the per-sync table carries it, and every rank computes the same
plan for the next round from the same gathered speeds (shares.plan_inner_steps): H_r =
floor(T x speed_r) within [1, 2H] for the budget T = H / median speed. Rank r syncs when it has
made its own H_r steps since the last sync, and the outer gradients are averaged with weights
H_r / sum(H) (the weighting below, now by unequal steps).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from mccl_common.errors import ConfigError

from . import reduce_group, state_transfer
from .shares import plan_inner_steps

# Columns of the per-sync table every rank contributes (one small all_gather per fragment sync).
# int64 throughout: MPS has no float64, and a weight sent as a fraction is exact on every rank.
# _SPEED: the rank's inner steps/s (EMA, in micro-steps/s: an integer every rank reads alike;
# 0 not measured yet, -1 not adaptive),
# _ROUND: outer rounds completed, _IN_ROUND: inner steps since the previous sync.
_HAS_STATE, _NUM, _DEN, _STEP, _FRAGMENT, _SPEED, _ROUND, _IN_ROUND = range(8)
_SPEED_SCALE = 1_000_000
_SPEED_EMA = 0.5
_HISTORY = 1024     # adaptive syncs kept in DiLoCo.history (a long run makes many)
_STATE_VERSION = 1
# The fragment column of a rank leaving the ``with`` under adaptive=True (__exit__): ranks make
# different numbers of inner steps there, so a loop that ends on a step count ends them at
# different rounds, and the one still training must learn it at its next sync, not wait.
_LEAVING = -2


@dataclass
class _Pending:
    """A fragment's outer-gradient all-reduce in flight: one flat buffer per (device, dtype)."""
    works: list
    buffers: list               # flat tensors, same order as the fragment's buckets
    complete_at: int            # the inner step whose hook waits for it
    total_weight: float         # the sum of every rank's weight: the divisor of the average
    waited: bool = False


@dataclass
class _Fragment:
    index: int
    offset: int                                     # first sync at this inner step (0: at H)
    names: list[str]
    params: list[torch.nn.Parameter]
    globals: list[torch.Tensor]                     # theta_global of each parameter
    buckets: list[list[int]] = field(default_factory=list)  # indices into params, by (device, dtype)
    # One flat buffer per bucket, the same tensor at every sync: a compressing engine keeps its
    # error feedback per buffer address (as for DDP's buckets), so each fragment's residual
    # goes into that fragment's next round, never into another fragment's.
    sendbufs: list[torch.Tensor] = field(default_factory=list)
    last_send: int | None = None                    # the inner step of the previous sync
    rounds: int = 0                                  # completed outer steps
    pending: _Pending | None = None


class DiLoCo:
    """Context manager: see the module docstring and docs/diloco.md.

    Args:
        model: the module whose trainable parameters DiLoCo synchronizes.
        inner_optimizer: the optimizer the loop steps every batch (the hook sits on it).
        outer_optimizer: the optimizer over the same parameters that steps theta_global with the
            averaged outer gradient (typically SGD(lr=0.7, momentum=0.9, nesterov=True)); or one
            per fragment, each over exactly its fragment's parameters.
        sync_every: H, inner steps between two syncs of the same fragment (>= 1).
        fragments: F, the number of fragments (the parameters split in order into F parts of
            about equal size), or a list of submodules of ``model``, one per fragment. H % F == 0.
        delay: tau, inner steps between starting a fragment's all-reduce and using its result
            (0 <= tau < H/F).
        alpha: the share of the local parameters kept at a merge (0 <= alpha <= 1; 0 takes
            theta_global as is, as the published algorithm does).
        compression: None (whatever the group does), "off" (the group must not compress), or a
            mode ("bf16", "fp16", "int8") the group's backend must apply to its all-reduces.
        group: the process group; None: the default group as it is at each sync (it follows an
            in-place re-form).
        join: this process joins a job whose other ranks are already training: entering the
            context waits for their next sync and takes theta_global, the outer optimizer's
            state and the step counters from them.
        adaptive: plan each rank's inner steps per round by its measured speed within the time
            the median rank needs for H steps (H_r in [1, 2H]; with a delay, in [delay+1, 2H]);
            the outer average is weighted by the inner steps each rank made. F=1 only, and
            not with join=True.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], sync_every: int, *,
                 fragments: int | Sequence[torch.nn.Module] = 1, delay: int = 0, alpha: float = 0.0,
                 compression: str | None = None, group: Any = None, join: bool = False,
                 adaptive: bool = False) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"[diloco] model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ConfigError(f"[diloco] sync_every={sync_every!r}: H must be an integer >= 1 (inner steps "
                              "between two syncs)")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise ConfigError(f"[diloco] inner_optimizer must be a torch.optim.Optimizer, got "
                              f"{type(inner_optimizer).__name__}")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.compression = reduce_group.check_mode(compression)
        self.group = group
        self.alpha = float(alpha)
        if not 0.0 <= self.alpha <= 1.0 or math.isnan(self.alpha):
            raise ConfigError(f"[diloco] alpha={alpha!r}: the mixing factor must be within [0, 1]")
        self._fragments = self._split(model, fragments)
        n_frag = len(self._fragments)
        if sync_every % n_frag:
            raise ConfigError(f"[diloco] sync_every={sync_every} is not a multiple of the {n_frag} fragments: "
                              "fragment f syncs at steps f*H/F + k*H, so H/F must be whole")
        span = sync_every // n_frag
        if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < span:
            raise ConfigError(f"[diloco] delay={delay!r}: tau must be an integer with 0 <= tau < H/F = {span}, "
                              "so a fragment's all-reduce is used before the next fragment's starts")
        self.delay = delay
        self.adaptive = bool(adaptive)
        if self.adaptive and (n_frag != 1 or join):
            raise ConfigError(f"[diloco] adaptive=True plans whole-model rounds of unequal length: it needs "
                              f"fragments=1 (got {n_frag}) and join=False (got {join}); a joining rank would "
                              "have no plan of the running round")
        self._plan: list[int] | None = None   # every rank's inner steps in this round (None: H for all)
        self._planned = sync_every            # this rank's
        self._speed: float | None = None      # inner steps/s, EMA over rounds
        self._round_start: float | None = None
        self.history: list[dict] = []         # adaptive: the last syncs (steps made, speeds, next plan)
        for frag in self._fragments:
            frag.offset = frag.index * span
        self._outer = self._outer_map(outer_optimizer, inner_optimizer)
        self._check_devices()
        self.step = 0                       # inner steps since the start of training (all ranks agree)
        self._has_state = not join
        self._since_state = 0 if join else None   # inner steps since this rank took the state (joined)
        self._join = join
        self._hook = None
        # What this rank handed to all-reduce: the benchmark's "bytes per sample" counts these (the
        # payload before any compression the group applies; the schedule tables are not counted).
        self.syncs = 0
        self.payload_bytes = 0

    # ---- construction ----------------------------------------------------------------

    @staticmethod
    def _split(model: torch.nn.Module, fragments: int | Sequence[torch.nn.Module]) -> list[_Fragment]:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("[diloco] the model has no trainable parameters")
        if isinstance(fragments, int) and not isinstance(fragments, bool):
            if not 1 <= fragments <= len(named):
                raise ConfigError(f"[diloco] fragments={fragments}: between 1 and the model's {len(named)} "
                                  "trainable parameters")
            parts: list[list[tuple[str, torch.nn.Parameter]]] = []
            total = sum(p.numel() for _, p in named)
            cur: list = []
            done = 0
            for i, (n, p) in enumerate(named):
                cur.append((n, p))
                done += p.numel()
                left_params, left_parts = len(named) - i - 1, fragments - len(parts) - 1
                # Cut at the next ~1/F of the elements, keeping a parameter for every part to come.
                if left_parts and (done >= total * (len(parts) + 1) / fragments or left_params == left_parts):
                    parts.append(cur)
                    cur = []
            parts.append(cur)
        else:
            mods = list(fragments)
            if not mods or not all(isinstance(m, torch.nn.Module) for m in mods):
                raise ConfigError("[diloco] fragments must be an int or a non-empty list of submodules of model")
            ids = {id(p): n for n, p in named}
            parts, seen = [], set()
            for i, m in enumerate(mods):
                part = []
                for p in m.parameters():
                    if not p.requires_grad:
                        continue
                    if id(p) not in ids:
                        raise ConfigError(f"[diloco] fragment {i} has a parameter that is not one of model's")
                    if id(p) in seen:
                        raise ConfigError(f"[diloco] a parameter ({ids[id(p)]}) is in two fragments")
                    seen.add(id(p))
                    part.append((ids[id(p)], p))
                if not part:
                    raise ConfigError(f"[diloco] fragment {i} has no trainable parameters")
                parts.append(part)
            missing = [n for n, p in named if id(p) not in seen]
            if missing:
                raise ConfigError(f"[diloco] the fragments leave out trainable parameters {missing[:5]}: every "
                                  "parameter must be in one fragment, or it would never be synchronized")
        out = []
        for i, part in enumerate(parts):
            params = [p for _, p in part]
            frag = _Fragment(i, 0, [n for n, _ in part], params, [p.detach().clone() for p in params])
            by_kind: dict = {}
            for j, p in enumerate(params):
                by_kind.setdefault((p.device, p.dtype), []).append(j)
            frag.buckets = list(by_kind.values())
            out.append(frag)
        return out

    def _outer_map(self, outer: Any, inner: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
        """The outer optimizer of each fragment, checked to cover exactly the model's parameters."""
        opts = list(outer) if isinstance(outer, (list, tuple)) else [outer]
        for o in opts:
            if not isinstance(o, torch.optim.Optimizer):
                raise ConfigError(f"[diloco] outer_optimizer must be a torch.optim.Optimizer (or a list, one per "
                                  f"fragment), got {type(o).__name__}")
            if o is inner:
                raise ConfigError("[diloco] outer_optimizer is the inner optimizer: make a second optimizer over "
                                  "the same parameters (e.g. SGD(lr=0.7, momentum=0.9, nesterov=True))")
        if len(opts) > 1 and len(opts) != len(self._fragments):
            raise ConfigError(f"[diloco] {len(opts)} outer optimizers for {len(self._fragments)} fragments: pass "
                              "one, or one per fragment")
        names = {id(p): n for f in self._fragments for n, p in zip(f.names, f.params)}
        mapping = []
        for k, frag in enumerate(self._fragments):
            o = opts[k] if len(opts) > 1 else opts[0]
            covered = {id(p) for g in o.param_groups for p in g["params"]}
            strangers = covered - set(names) if len(opts) == 1 else covered - {id(p) for p in frag.params}
            if strangers:
                raise ConfigError("[diloco] the outer optimizer has parameters that are not "
                                  + ("the model's trainable ones" if len(opts) == 1 else f"fragment {k}'s"))
            left_out = [n for n, p in zip(frag.names, frag.params) if id(p) not in covered]
            if left_out:
                raise ConfigError(f"[diloco] the outer optimizer does not cover {left_out[:5]}: those parameters "
                                  "would be reset to theta_global at every sync and never learn")
            mapping.append(o)
        return mapping

    def _check_devices(self) -> None:
        if not dist.is_initialized() and self.group is None:
            raise ConfigError("[diloco] call torch.distributed.init_process_group first (or pass group=)")
        pg = reduce_group.resolve_group(self.group)
        devices = {p.device for f in self._fragments for p in f.params}
        for dev in devices:
            reduce_group.backend_of(pg, dev)
            reduce_group.check_compression(self.compression, pg, dev)

    # ---- the context -----------------------------------------------------------------

    def __enter__(self) -> "DiLoCo":
        if self._hook is not None:
            raise ConfigError("[diloco] this DiLoCo is already entered")
        if self._join and not self._has_state:
            self._join_running_job()
        self._hook = self.inner_optimizer.register_step_post_hook(self._after_inner_step)
        self._round_start = time.perf_counter()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if exc_type is None:
            # Finish what is in flight now rather than drop it: the rounds sent are applied.
            for frag in self._fragments:
                if frag.pending is not None:
                    self._complete(frag)
            if self.adaptive:
                # Every rank says it leaves, in the sync table's shape: where all leave together
                # (a loop counted in rounds) that is one small all-gather; where one leaves while
                # another trains on, its row meets that rank's next sync and both raise.
                self._check_leaving(self._table(reduce_group.resolve_group(self.group), _LEAVING, (0, 1)))
        else:
            for frag in self._fragments:
                if frag.pending is not None:
                    for w in frag.pending.works:
                        try:
                            w.wait()
                        except Exception:  # noqa: BLE001 - the loop's own exception is the one to see
                            pass
                    frag.pending = None
        return False

    @property
    def fragments(self) -> int:
        return len(self._fragments)

    # ---- the schedule ----------------------------------------------------------------

    def _after_inner_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        self.step += 1
        if self._since_state is not None:
            self._since_state += 1
        for frag in self._fragments:
            if frag.pending is not None and self.step >= frag.pending.complete_at:
                self._complete(frag)
        if self.adaptive:
            frag = self._fragments[0]
            made = self._in_round(frag)
            if made >= self._planned:
                now = time.perf_counter()
                if self._round_start is not None and now > self._round_start:
                    # This rank's own compute: the clock restarted after the previous sync's wait.
                    rate = made / (now - self._round_start)
                    self._speed = rate if self._speed is None else \
                        _SPEED_EMA * rate + (1 - _SPEED_EMA) * self._speed
                self._send(frag)
                if self.delay == 0:
                    self._complete(frag)
                self._round_start = time.perf_counter()
            return
        for frag in self._fragments:
            if self.step >= frag.offset and (self.step - frag.offset) % self.sync_every == 0:
                self._send(frag)
                if self.delay == 0:
                    self._complete(frag)

    def _in_round(self, frag: _Fragment) -> int:
        return self.step - (frag.last_send if frag.last_send is not None else 0)

    def _weight(self, frag: _Fragment) -> tuple[int, int]:
        """This rank's share of the round as a fraction: 1 for a rank that made every inner step
        of it; the share it made for one that joined during it; 0 for one that has no state yet."""
        if not self._has_state:
            return 0, 1
        if self.adaptive:
            # Inner steps made this round over the most any rank plans (2H): the average is
            # weighted by inner steps, and the fraction stays within [0, 1] like the others.
            return self._in_round(frag), 2 * self.sync_every
        if self._since_state is None:
            return 1, 1
        expected = self.step - frag.last_send if frag.last_send is not None else self.step
        return (1, 1) if expected <= 0 else (min(self._since_state, expected), expected)

    def _table(self, pg: Any, frag_index: int, weight: tuple[int, int]) -> torch.Tensor:
        """Every rank's [has state, weight numerator, denominator, step, fragment]: who needs the
        state, the divisor of the average, and a check that every rank is at the same point of
        the schedule."""
        dev = self._fragments[0].params[0].device
        frag = self._fragments[max(frag_index, 0)]
        # -1: this rank does not plan adaptively (the others must not either, or the weights mix).
        speed = (int(round(self._speed * _SPEED_SCALE)) if self._speed else 0) if self.adaptive else -1
        mine = torch.tensor([int(self._has_state), weight[0], weight[1], self.step if self._has_state else -1,
                             frag_index, speed, frag.rounds, self._in_round(frag)], dtype=torch.int64, device=dev)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
        dist.all_gather(rows, mine, group=pg)
        table = torch.stack(rows).cpu()
        if bool((table[:, _DEN] <= 0).any()) or bool((table[:, _NUM] < 0).any()) or \
                bool((table[:, _NUM] > table[:, _DEN]).any()):
            raise ConfigError(f"[diloco] a rank sent a weight outside [0, 1] in the sync table {table.tolist()}")
        return table

    def _send(self, frag: _Fragment, table: torch.Tensor | None = None) -> None:
        pg = reduce_group.resolve_group(self.group)
        self._check_shapes(frag)
        weight = self._weight(frag)
        if table is None:
            table = self._table(pg, frag.index, weight)
            self._check_table(table, frag.index)
            if not bool(table[:, _HAS_STATE].all()):
                state_transfer.exchange(self, pg, table)
            if self.adaptive:
                self._replan(pg, table)
        total = sum(n / d for n, d in table[:, [_NUM, _DEN]].tolist())
        if total <= 0:
            raise ConfigError("[diloco] no rank has made an inner step with the state: nothing to average")
        works, buffers = [], []
        with torch.no_grad():
            for k, bucket in enumerate(frag.buckets):
                parts = [(frag.globals[j] - frag.params[j].detach()).reshape(-1) for j in bucket]
                buf = self._sendbuf(frag, k)
                torch.cat(parts, out=buf)
                if weight[0] != weight[1]:
                    buf.mul_(weight[0] / weight[1])
                works.append(dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=pg, async_op=True))
                buffers.append(buf)
                self.payload_bytes += buf.numel() * buf.element_size()
        self.syncs += 1
        frag.pending = _Pending(works, buffers, self.step + self.delay, total)
        frag.last_send = self.step

    @staticmethod
    def _sendbuf(frag: _Fragment, k: int) -> torch.Tensor:
        if not frag.sendbufs:
            for bucket in frag.buckets:
                first = frag.params[bucket[0]]
                n = sum(frag.params[j].numel() for j in bucket)
                frag.sendbufs.append(torch.empty(n, dtype=first.dtype, device=first.device))
        return frag.sendbufs[k]

    def _replan(self, pg: Any, table: torch.Tensor) -> None:
        """The next round's inner steps of every rank, from the speeds in the table (the same
        table on every rank, so the same plan)."""
        speeds = [s / _SPEED_SCALE if s > 0 else None for s in table[:, _SPEED].tolist()]
        made = [int(x) for x in table[:, _IN_ROUND].tolist()]
        self._plan = plan_inner_steps(self.sync_every, speeds, 2 * self.sync_every, least=self.delay + 1)
        self._planned = self._plan[dist.get_rank(pg)]
        self.history.append({"round": int(table[0, _ROUND]), "steps": made, "speeds": speeds,
                             "plan": list(self._plan)})
        del self.history[:-_HISTORY]

    def _check_leaving(self, table: torch.Tensor) -> None:
        leaving = table[:, _FRAGMENT] == _LEAVING
        if bool(leaving.any()) and not bool(leaving.all()):
            at = ", ".join(f"rank {r} {'left the loop' if gone else 'syncs'} after {int(row[_ROUND])} rounds and "
                           f"{int(row[_IN_ROUND])} inner steps" for r, (gone, row) in
                           enumerate(zip(leaving.tolist(), table.tolist())))
            raise ConfigError(f"[diloco] with adaptive=True the ranks left the loop at different rounds ({at}): "
                              "adaptive ranks make different numbers of inner steps, so end the loop on the "
                              "rounds done (while len(diloco.history) < rounds), not on a step count")

    def _check_table(self, table: torch.Tensor, frag_index: int) -> None:
        if self.adaptive:
            self._check_leaving(table)
        have = table[:, _HAS_STATE] > 0
        if not bool(have.any()):
            raise ConfigError("[diloco] no rank of the group has DiLoCo's state: join=True is for a process "
                              "joining ranks that already train; start a new job with join=False")
        modes = table[:, _SPEED] >= 0
        if bool(modes.any()) != bool(modes.all()):
            which = ", ".join(f"rank {r} adaptive={bool(m)}" for r, m in enumerate(modes.tolist()))
            raise ConfigError(f"[diloco] the ranks disagree on adaptive ({which}): pass the same adaptive= to "
                              "DiLoCo on every rank")
        if self.adaptive:
            rounds = {int(r) for r in table[:, _ROUND].tolist()}
            made = [int(x) for x in table[:, _IN_ROUND].tolist()]
            plan = self._plan if self._plan is not None and len(self._plan) == len(made) else None
            expected = plan if plan is not None else [self.sync_every] * len(made)
            # A group re-formed since the plan was made has no per-rank plan to hold it to.
            if len(rounds) > 1 or (made != expected and (plan is not None or self._plan is None)):
                at = ", ".join(f"rank {r} at round {int(row[_ROUND])} after {int(row[_IN_ROUND])} inner steps "
                               f"(planned {expected[r]})" for r, row in enumerate(table.tolist()))
                raise ConfigError(f"[diloco] the ranks are not at their planned sync ({at}): every rank must "
                                  "use adaptive=True with the same sync_every, and resume from the same "
                                  "checkpoint")
            return
        steps = {int(s) for s in table[have, _STEP].tolist()}
        frags = {int(f) for f in table[have, _FRAGMENT].tolist()}
        if len(steps) > 1 or len(frags) > 1:
            at = ", ".join(f"rank {r} at step {int(row[_STEP])} fragment {int(row[_FRAGMENT])}"
                           for r, row in enumerate(table.tolist()) if row[_HAS_STATE] > 0)
            raise ConfigError(f"[diloco] the ranks are at different points of the schedule ({at}): every rank "
                              "must run the same number of inner steps between syncs (same sync_every, "
                              "fragments, and batches per rank), and resume from the same checkpoint")

    def _check_shapes(self, frag: _Fragment) -> None:
        for n, p, g in zip(frag.names, frag.params, frag.globals):
            if p.shape != g.shape or p.dtype != g.dtype or p.device != g.device:
                raise ConfigError(f"[diloco] parameter {n} changed from {tuple(g.shape)} {g.dtype} on {g.device} "
                                  f"to {tuple(p.shape)} {p.dtype} on {p.device} while DiLoCo held it: make a new "
                                  "DiLoCo after changing the model")

    def _complete(self, frag: _Fragment) -> None:
        """Wait for the fragment's all-reduce, step theta_global with the average and merge."""
        pend = frag.pending
        assert pend is not None
        if not pend.waited:
            for w in pend.works:
                w.wait()
            pend.waited = True
        outer = self._outer[frag.index]
        with torch.no_grad():
            for buf in pend.buffers:
                buf.div_(pend.total_weight)
            # The outer step sees only this fragment's gradients; the loop's own are put back.
            others = [p for g in outer.param_groups for p in g["params"]]
            saved = [(p, p.grad) for p in others]
            for p in others:
                p.grad = None
            local = [p.detach().clone() for p in frag.params] if self.alpha > 0 else None
            for bucket, buf in zip(frag.buckets, pend.buffers):
                off = 0
                for j in bucket:
                    p = frag.params[j]
                    n = p.numel()
                    p.copy_(frag.globals[j])
                    p.grad = buf[off:off + n].view_as(p)
                    off += n
            try:
                outer.step()
            finally:
                for p, g in saved:
                    p.grad = g
            for j, p in enumerate(frag.params):
                frag.globals[j].copy_(p)
                if local is not None:
                    p.lerp_(local[j], self.alpha)
        frag.rounds += 1
        frag.pending = None

    # ---- joining ---------------------------------------------------------------------

    def _join_running_job(self) -> None:
        """Meet the running ranks at their next sync: its table, the state from one of them,
        and that fragment's all-reduce (with weight 0: nothing of this rank is in the round)."""
        pg = reduce_group.resolve_group(self.group)
        table = self._table(pg, -1, (0, 1))
        self._check_table(table, -1)
        state_transfer.exchange(self, pg, table)
        frag_index = int(table[int(torch.nonzero(table[:, _HAS_STATE] > 0)[0]), _FRAGMENT])
        frag = self._fragments[frag_index]
        frag.last_send = None   # set from the state; _send records this step again
        self._send(frag, table)
        if self.delay == 0:
            self._complete(frag)

    def _adopt(self, step: int, last_send: list, rounds: list) -> None:
        """Called by state_transfer on a rank that received the state: continue from theta_global."""
        self.step = step
        with torch.no_grad():
            for frag, ls, r in zip(self._fragments, last_send, rounds):
                frag.last_send, frag.rounds = ls, r
                for p, g in zip(frag.params, frag.globals):
                    p.copy_(g)
        self._has_state = True
        self._since_state = 0

    # ---- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict:
        """theta_global, the outer optimizers' state, the step counters, and any all-reduce
        in flight (waited for, so its result is kept: a checkpoint changes no numbers)."""
        frags = []
        for frag in self._fragments:
            entry: dict = {"global": {n: g.detach().clone() for n, g in zip(frag.names, frag.globals)},
                           "last_send": frag.last_send, "rounds": frag.rounds, "pending": None}
            if frag.pending is not None:
                if not frag.pending.waited:
                    for w in frag.pending.works:
                        w.wait()
                    frag.pending.waited = True
                entry["pending"] = {"buffers": [b.clone() for b in frag.pending.buffers],
                                    "complete_at": frag.pending.complete_at,
                                    "total_weight": frag.pending.total_weight}
            frags.append(entry)
        outers = []
        for o in state_transfer.distinct(self._outer):
            outers.append(o.state_dict())
        return {"version": _STATE_VERSION, "sync_every": self.sync_every, "fragments": len(self._fragments),
                "delay": self.delay, "step": self.step, "has_state": self._has_state,
                "since_state": self._since_state, "fragment_state": frags, "outer": outers,
                "adaptive": {"plan": self._plan, "planned": self._planned, "speed": self._speed}
                if self.adaptive else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned; the model's parameters are the caller's (load them
        too: they are theta_local, which may differ from theta_global between syncs)."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ConfigError(f"[diloco] not a DiLoCo state (version {state.get('version') if isinstance(state, dict) else None}, "
                              f"expected {_STATE_VERSION})")
        for key, mine in (("sync_every", self.sync_every), ("fragments", len(self._fragments)),
                          ("delay", self.delay)):
            if state.get(key) != mine:
                raise ConfigError(f"[diloco] the state was saved with {key}={state.get(key)}, this DiLoCo has "
                                  f"{mine}: the schedule would differ")
        if bool(state.get("adaptive")) != self.adaptive:
            raise ConfigError(f"[diloco] the state was saved with adaptive={bool(state.get('adaptive'))}, this "
                              f"DiLoCo has adaptive={self.adaptive}: the schedule would differ")
        frags = state["fragment_state"]
        for frag, entry in zip(self._fragments, frags):
            glob = entry["global"]
            if sorted(glob) != sorted(frag.names):
                raise ConfigError(f"[diloco] fragment {frag.index} of the state has parameters {sorted(glob)[:5]}, "
                                  f"the model {frag.names[:5]}")
            for n, g in zip(frag.names, frag.globals):
                src = glob[n]
                if tuple(src.shape) != tuple(g.shape):
                    raise ConfigError(f"[diloco] parameter {n}: saved {tuple(src.shape)}, model {tuple(g.shape)}")
        outers = state_transfer.distinct(self._outer)
        if len(state["outer"]) != len(outers):
            raise ConfigError(f"[diloco] the state has {len(state['outer'])} outer optimizers, this DiLoCo "
                              f"{len(outers)}")
        with torch.no_grad():
            for frag, entry in zip(self._fragments, frags):
                for n, g in zip(frag.names, frag.globals):
                    g.copy_(entry["global"][n])
                frag.last_send, frag.rounds = entry["last_send"], entry["rounds"]
                pend = entry["pending"]
                if pend is None:
                    frag.pending = None
                else:
                    sizes = [self._sendbuf(frag, k).numel() for k in range(len(frag.buckets))]
                    if [int(b.numel()) for b in pend["buffers"]] != sizes:
                        raise ConfigError(f"[diloco] fragment {frag.index}'s all-reduce in flight in the state "
                                          f"has buffers of {[int(b.numel()) for b in pend['buffers']]} elements, "
                                          f"this model's {sizes}")
                    bufs = [self._sendbuf(frag, k).copy_(b) for k, b in enumerate(pend["buffers"])]
                    frag.pending = _Pending([], bufs, int(pend["complete_at"]), float(pend["total_weight"]),
                                            waited=True)
        for o, sd in zip(outers, state["outer"]):
            o.load_state_dict(sd)
        self.step = int(state["step"])
        self._has_state = bool(state["has_state"])
        self._since_state = state["since_state"]
        if self.adaptive:
            ad = state["adaptive"]
            self._plan = None if ad["plan"] is None else [int(x) for x in ad["plan"]]
            self._planned = int(ad["planned"])
            self._speed = None if ad["speed"] is None else float(ad["speed"])


__all__ = ["DiLoCo"]
