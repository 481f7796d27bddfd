"""SpeedBalancer as a Lightning callback: speed-aware batch shares under Lightning's DDPStrategy.

    balance = libmccl.lightning_speed_balancer_callback(global_batch=256)
    loader = DataLoader(dataset, batch_sampler=balance.batch_sampler(len(dataset), shuffle=True))
    Trainer(strategy="ddp", use_distributed_sampler=False, callbacks=[balance]).fit(model, loader)

The two halves of balance.py, placed where Lightning lets a callback reach:
- the comm hook (the gradient weighted by samples) goes on the DDP model Lightning wrapped, when
  the fit starts (Lightning registers a ``ddp_comm_hook`` of its own only on CUDA);
- the shares: a callback cannot change the batch Lightning hands to ``training_step``, so the
  callback's batch sampler draws each rank's slice of every global batch (rank r takes samples
  [lo_r, lo_r + b_r) of global batch k, lo_r the shares of the ranks before it; every rank
  draws the same order), and ``on_train_batch_start`` runs the balancer's step (the clock, the
  speed exchange when due) and tells the hook how many samples the batch holds.

Lightning fetches one batch ahead (and a DataLoader with workers more), so a batch's share is
the plan when the sampler drew it: a new plan reaches the batches 2 steps after the exchange
that made it (one later than in a plain loop). Every rank draws its k-th batch under the same
plan (plans change at the same step everywhere and every rank's loader runs the same way), so
the shares of every global batch sum to it and the update stays the large-batch one.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator

import torch

from mccl_common.errors import ConfigError

from ..torch.lightning import ddp_model, import_lightning
from .balance import SpeedBalancer

_KEPT = 1024      # plans kept in ``shares_used`` (a long run draws many batches)


class _GlobalOrder(torch.utils.data.Sampler):
    """The order of the whole dataset, the same on every rank: in order, or shuffled from
    ``seed`` + the epoch (Lightning calls ``set_epoch`` on a batch sampler's ``sampler``)."""

    def __init__(self, n_samples: int, shuffle: bool, seed: int) -> None:
        self.n, self.shuffle, self.seed, self.epoch = n_samples, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.n))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())


class BalancedBatchSampler(torch.utils.data.Sampler):
    """This rank's share of each global batch of ``global_batch`` samples, by the plan the
    callback's balancer holds when the batch is drawn; the last, short global batch is dropped."""

    def __init__(self, owner: Any, n_samples: int, shuffle: bool = False, seed: int = 0) -> None:
        if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < owner.global_batch:
            raise ConfigError(f"[balance] the dataset has {n_samples!r} samples, fewer than one global batch of "
                              f"{owner.global_batch}")
        self.owner = owner
        self.sampler = _GlobalOrder(n_samples, shuffle, seed)
        self.sizes: dict[int, int] = {}      # batch index in the epoch -> samples drawn for it

    def __len__(self) -> int:
        return len(self.sampler) // self.owner.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        bal = self.owner.balancer
        if bal is None:
            raise ConfigError("[balance] the balanced batch sampler was iterated outside the Trainer's fit: it "
                              "draws by the shares the callback plans once the fit has started")
        order = list(self.sampler)
        big = self.owner.global_batch
        self.sizes = {}
        for k in range(len(self)):
            shares, rank = bal.shares, bal.planner.rank
            lo = k * big + sum(shares[:rank])
            self.sizes[k] = shares[rank]
            self.owner.shares_used.append((k, shares))
            yield order[lo:lo + shares[rank]]


def lightning_speed_balancer_callback(global_batch: int, *, every: int = 2, alpha: float = 0.3, jump: float = 0.25,
                                      floor: float = 0.25, hysteresis: float = 0.05, warmup: int = 1) -> Any:
    """A Lightning ``Callback`` for ``SpeedBalancer`` (docs/slow-hosts.md): train with
    ``batch_sampler=callback.batch_sampler(len(dataset))``, ``strategy="ddp"`` and
    ``use_distributed_sampler=False``. The arguments are SpeedBalancer's; the running balancer
    is the callback's ``balancer`` attribute once the fit has started."""
    pl = import_lightning("lightning_speed_balancer_callback")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"[balance] global_batch must be a positive int, got {global_batch!r}")

    class SpeedBalancerCallback(pl.Callback):
        def __init__(self) -> None:
            self.global_batch = global_batch
            self.balancer: SpeedBalancer | None = None
            self.shares_used: deque = deque(maxlen=_KEPT)   # (batch index, every rank's shares) per batch
            self._samplers: list[BalancedBatchSampler] = []
            self._sampler: BalancedBatchSampler | None = None   # the one the fit draws from

        def batch_sampler(self, n_samples: int, shuffle: bool = False, seed: int = 0) -> BalancedBatchSampler:
            """The train DataLoader's ``batch_sampler``: ``n_samples`` is the dataset's length."""
            s = BalancedBatchSampler(self, n_samples, shuffle, seed)
            self._samplers.append(s)
            return s

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            model = ddp_model(trainer, "lightning_speed_balancer_callback")
            if getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
                raise ConfigError("[balance] pass Trainer(use_distributed_sampler=False): Lightning would replace "
                                  "the callback's batch sampler, which already draws this rank's share")
            if trainer.accumulate_grad_batches != 1:
                raise ConfigError(f"[balance] accumulate_grad_batches={trainer.accumulate_grad_batches}: the "
                                  "shares split one global batch per optimizer step; raise global_batch instead")
            self.balancer = SpeedBalancer(global_batch, model.process_group, every=every, alpha=alpha, jump=jump,
                                          floor=floor, hysteresis=hysteresis, warmup=warmup)
            model.register_comm_hook(self.balancer.state, self.balancer.hook)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            loaders = trainer.train_dataloader
            loaders = loaders if isinstance(loaders, (list, tuple)) else \
                list(loaders.values()) if isinstance(loaders, dict) else [loaders]
            ours = [getattr(dl, "batch_sampler", None) for dl in loaders]
            if len(ours) != 1 or not any(s is mine for s in ours for mine in self._samplers):
                raise ConfigError("[balance] train with one DataLoader whose batch_sampler is this callback's "
                                  "batch_sampler(len(dataset)): the shares are drawn there, and the comm hook "
                                  "weights each rank's gradient by them")
            self._sampler = ours[0]

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            bal = self.balancer
            bal.batch_size()    # the previous step measured, speeds exchanged when due, the clock started
            drawn = self._sampler.sizes.pop(batch_idx, None)
            if drawn is None:
                raise ConfigError(f"[balance] batch {batch_idx} was not drawn by the callback's batch sampler")
            bal.samples = drawn     # what this batch holds: the hook's weight

    return SpeedBalancerCallback()


__all__ = ["BalancedBatchSampler", "lightning_speed_balancer_callback"]
