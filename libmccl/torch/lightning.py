"""Lightning for the callbacks (compression.py, ddp_buckets.py, training/lightning_*.py):
imported only when a callback is made, so libmccl imports without it, and a missing install
says what to run instead of a bare ModuleNotFoundError."""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from mccl_common.errors import ConfigError

TESTED = "2.6.6"


def import_lightning(what: str) -> Any:
    """``lightning.pytorch`` (or the older ``pytorch_lightning``); ImportError naming the fix."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl   # the older package name
        except ImportError as exc:
            raise ImportError(f"[mccl] {what} is a Lightning callback and Lightning is not installed: "
                              f"pip install lightning (MCCL's tests run lightning=={TESTED})") from exc
    return pl


def ddp_model(trainer: Any, what: str) -> DistributedDataParallel:
    """The DistributedDataParallel Lightning wrapped the module in, or a ConfigError naming the
    strategy to use (a comm hook needs DDP; any other strategy would silently skip it)."""
    model = trainer.strategy.model
    if not isinstance(model, DistributedDataParallel):
        raise ConfigError(f"[mccl] {what} needs Trainer(strategy='ddp') (or a DDPStrategy): the strategy is "
                          f"{type(trainer.strategy).__name__}, whose model is a {type(model).__name__}, not a "
                          "DistributedDataParallel to install the comm hook on")
    return model
