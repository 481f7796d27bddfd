"""The DiLoCo tests' model, data and reference: DiLoCo and streaming DiLoCo written the plain
way, one blocking ``all_reduce`` per parameter on the group given (Gloo in the tests), with
the schedule libmccl.DiLoCo documents. Its numbers are what libmccl.DiLoCo must reproduce."""

from __future__ import annotations

from typing import Callable


def make_model(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(rank: int, step: int):
    """Rank ``rank``'s batch at inner step ``step`` (1-based): different on every rank."""
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 3, generator=g)


def optimizers(model):
    import torch

    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return inner, outer


def inner_step(model, inner, rank: int, step: int) -> None:
    import torch

    x, y = batch(rank, step)
    inner.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    inner.step()


def reference(model, inner, outer, rank: int, steps: int, sync_every: int, fragments: list[list], delay: int,
              alpha: float, group, reduce: Callable | None = None) -> list:
    """Train ``steps`` inner steps with the streaming DiLoCo schedule; returns theta_global.

    ``fragments`` lists each fragment's parameters. Fragment f starts its sync at the inner
    steps t >= f*H/F with (t - f*H/F) % H == 0 and applies it ``delay`` steps later (at the end
    of the run at the latest)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    span = sync_every // len(fragments)
    glob = [[p.detach().clone() for p in frag] for frag in fragments]
    pending: dict[int, tuple[list, int]] = {}
    all_params = [p for g in outer.param_groups for p in g["params"]]

    def complete(f: int) -> None:
        deltas, _ = pending.pop(f)
        with torch.no_grad():
            local = [p.detach().clone() for p in fragments[f]]
            for p in all_params:
                p.grad = None
            for p, g, d in zip(fragments[f], glob[f], deltas):
                p.copy_(g)
                p.grad = d
            outer.step()
            for p in all_params:
                p.grad = None
            for p, g, loc in zip(fragments[f], glob[f], local):
                g.copy_(p)
                p.lerp_(loc, alpha)

    for t in range(1, steps + 1):
        inner_step(model, inner, rank, t)
        for f in list(pending):
            if pending[f][1] <= t:
                complete(f)
        for f in range(len(fragments)):
            if t >= f * span and (t - f * span) % sync_every == 0:
                deltas = []
                with torch.no_grad():
                    for p, g in zip(fragments[f], glob[f]):
                        d = g - p.detach()
                        dist.all_reduce(d, group=group)
                        deltas.append(d / world)
                pending[f] = (deltas, t + delay)
                if delay == 0:
                    complete(f)
    for f in list(pending):
        complete(f)
    return [g for frag in glob for g in frag]


def simulate(n_ranks: int, steps: int, sync_every: int, split: bool, delay: int, alpha: float,
             members_at: Callable[[int], list[int]]) -> list:
    """The schedule in one process for ranks that come and go without joining: ``members_at(t)``
    are the ranks that make inner step t; a sync averages the ranks present when it is sent and
    merges into those present when it completes. Returns theta_global."""
    import torch

    models = [make_model() for _ in range(n_ranks)]
    opts = [optimizers(m) for m in models]
    frags = [[list(m[0].parameters()), list(m[2].parameters())] if split else [list(m.parameters())]
             for m in models]
    n_frag = len(frags[0])
    span = sync_every // n_frag
    glob = [[p.detach().clone() for p in frags[0][f]] for f in range(n_frag)]
    carrier = make_model()                  # stands for theta_global under the outer optimizer
    cfr = [list(carrier[0].parameters()), list(carrier[2].parameters())] if split else [list(carrier.parameters())]
    outer = torch.optim.SGD(carrier.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    pending: dict[int, tuple[list, int]] = {}

    def complete(f: int, members: list[int]) -> None:
        avg, _ = pending.pop(f)
        with torch.no_grad():
            for p in carrier.parameters():
                p.grad = None
            for p, g, a in zip(cfr[f], glob[f], avg):
                p.copy_(g)
                p.grad = a
            outer.step()
            for g, p in zip(glob[f], cfr[f]):
                g.copy_(p)
            for r in members:
                for p, g in zip(frags[r][f], glob[f]):
                    p.copy_(g + alpha * (p - g))

    members = members_at(1)
    for t in range(1, steps + 1):
        members = members_at(t)
        for r in members:
            inner_step(models[r], opts[r][0], r, t)
        for f in list(pending):
            if pending[f][1] <= t:
                complete(f, members)
        for f in range(n_frag):
            if t >= f * span and (t - f * span) % sync_every == 0:
                with torch.no_grad():
                    avg = [sum(g - frags[r][f][i].detach() for r in members) / len(members)
                           for i, g in enumerate(glob[f])]
                pending[f] = (avg, t + delay)
                if delay == 0:
                    complete(f, members)
    for f in list(pending):
        complete(f, members)
    return [g for frag in glob for g in frag]
