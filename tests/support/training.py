"""The small training run the training and fault tests share: a model, its batches, the
steps, and the single-process reference DDP must match."""

from __future__ import annotations

STEPS = 5
LOCAL_BATCH = 8


def make_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def make_batches(world: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return [(torch.randn(world * LOCAL_BATCH, 16, generator=g), torch.randn(world * LOCAL_BATCH, 4, generator=g))
            for _ in range(STEPS)]


def train(model, batches, rank: int, world: int):
    """SGD steps; each rank uses its slice of every global batch (all of it if world is 1)."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        lo, hi = rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH
        if world > 1:
            x, y = x[lo:hi], y[lo:hi]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def reference(world: int):
    return [p.detach().clone() for p in train(make_model(), make_batches(world), 0, 1).parameters()]
