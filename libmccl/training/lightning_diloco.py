"""DiLoCo as a Lightning callback: an unchanged LightningModule trains with DiLoCo.

    trainer = Trainer(strategy="ddp", callbacks=[libmccl.lightning_diloco_callback(sync_every=32)])

The inner optimizer is the one the module's ``configure_optimizers`` returns; the outer one is
built over the module's parameters when the fit starts (SGD lr 0.7, momentum 0.9, Nesterov by
default, as docs/diloco.md), so it sees the parameters where the strategy put them.

DiLoCo replaces DDP's per-step gradient all-reduce, so the callback turns it off on the model
Lightning's DDPStrategy wrapped (``require_backward_grad_sync = False``: what ``no_sync()`` sets,
for the whole fit; Lightning's own ``no_sync`` blocks for gradient accumulation restore that
value). DDPStrategy is kept for what else it does: it creates or finds the process group,
starts every rank from rank 0's parameters, and logs from rank 0. A strategy that shards or
wraps otherwise (FSDP, DeepSpeed) is refused: DiLoCo needs each rank's whole model.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from mccl_common.errors import ConfigError

from ..torch.lightning import import_lightning
from .diloco import DiLoCo


def default_outer(params: Any) -> torch.optim.Optimizer:
    """The published outer optimizer (Douillard et al. 2023)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def lightning_diloco_callback(sync_every: int, outer_optimizer: Callable[[Any], Any] | torch.optim.Optimizer
                              | None = None, *, fragments: int | Sequence[torch.nn.Module] = 1, delay: int = 0,
                              alpha: float = 0.0, compression: str | None = None, adaptive: bool = False) -> Any:
    """A Lightning ``Callback`` running ``libmccl.DiLoCo`` around the Trainer's inner steps.

    ``outer_optimizer``: None (the default SGD), a function of the parameters returning the
    optimizer (``lambda ps: torch.optim.SGD(ps, lr=0.5)``), or an optimizer already built over
    the module's parameters. The other arguments are DiLoCo's (docs/diloco.md). The running
    ``DiLoCo`` is the callback's ``diloco`` attribute; its state is saved in Lightning's
    checkpoints and restored when a fit resumes from one.
    """
    pl = import_lightning("lightning_diloco_callback")
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ConfigError(f"[diloco] sync_every={sync_every!r}: H must be an integer >= 1 (inner steps "
                          "between two syncs)")
    if adaptive:
        # A Trainer ends every rank at max_steps (or the loader's end); adaptive ranks make different
        # numbers of steps per round, so the fast ones would end rounds early and the others wait at
        # a sync no one else reaches, until the group's timeout.
        raise ConfigError("[diloco] adaptive=True is not available under Lightning: the Trainer stops every rank "
                          "at the same step count, and adaptive ranks make different numbers of steps per round, "
                          "so the ranks would end at different rounds and the last sync would wait out the group's "
                          "timeout; use libmccl.DiLoCo(..., adaptive=True) in a loop counted in rounds "
                          "(docs/diloco.md), or adaptive=False here")
    if outer_optimizer is not None and not callable(outer_optimizer) and \
            not isinstance(outer_optimizer, torch.optim.Optimizer):
        raise ConfigError(f"[diloco] outer_optimizer must be None, an optimizer or a function of the parameters "
                          f"returning one, got {type(outer_optimizer).__name__}")

    class DiLoCoCallback(pl.Callback):
        def __init__(self) -> None:
            self.diloco: DiLoCo | None = None
            self._entered = False
            self._restore: dict | None = None

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            strategy = trainer.strategy
            model = strategy.model
            if isinstance(model, DistributedDataParallel):
                # DiLoCo's sync replaces DDP's gradient all-reduce; no_sync() sets exactly this.
                model.require_backward_grad_sync = False
            elif not isinstance(strategy, pl.strategies.SingleDeviceStrategy):
                raise ConfigError(f"[diloco] lightning_diloco_callback needs Trainer(strategy='ddp') (its "
                                  f"gradient all-reduce is turned off) or a single-device strategy over a "
                                  f"process group you initialised; {type(strategy).__name__} shards or wraps "
                                  "the model, and DiLoCo needs each rank's whole model")
            optimizers = trainer.optimizers
            if len(optimizers) != 1:
                raise ConfigError(f"[diloco] configure_optimizers returned {len(optimizers)} optimizers: DiLoCo "
                                  "needs exactly one inner optimizer")
            inner = optimizers[0]
            if isinstance(outer_optimizer, torch.optim.Optimizer):
                outer = outer_optimizer
            else:
                make = outer_optimizer if outer_optimizer is not None else default_outer
                outer = make([p for p in pl_module.parameters() if p.requires_grad])
            self.diloco = DiLoCo(pl_module, inner, outer, sync_every, fragments=fragments, delay=delay,
                                 alpha=alpha, compression=compression, adaptive=adaptive)
            if self._restore is not None:
                self.diloco.load_state_dict(self._restore)
                self._restore = None
            self.diloco.__enter__()
            self._entered = True

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            if self._entered:
                self._entered = False
                self.diloco.__exit__(None, None, None)   # what is in flight is applied

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            if self._entered:
                self._entered = False
                self.diloco.__exit__(type(exception), exception, exception.__traceback__)

        def state_dict(self) -> dict:
            return {"diloco": self.diloco.state_dict()} if self.diloco is not None else {}

        def load_state_dict(self, state_dict: dict) -> None:
            # Lightning restores callbacks before the strategy's setup, so before on_fit_start
            # has a DiLoCo to load into: kept until then.
            state = state_dict.get("diloco")
            if state is None:
                return
            if self.diloco is not None:
                self.diloco.load_state_dict(state)
            else:
                self._restore = state

    return DiLoCoCallback()


__all__ = ["lightning_diloco_callback"]
