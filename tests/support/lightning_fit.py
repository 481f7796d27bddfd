"""A real ``lightning.pytorch.Trainer`` in a forked rank (CPU, one process per rank as a
multi-node job places them) around a process group the test made, and an unchanged
LightningModule over a plain net: what the Lightning callbacks' tests train."""

from __future__ import annotations

import os
from typing import Any, Callable


def module(net: Any, lr: float, inner: str = "sgd", on_step: Callable | None = None) -> Any:
    """A LightningModule training ``net`` on (x, y) batches with MSE, its optimizer from
    configure_optimizers (``sgd`` or ``adamw``); ``on_step(batch)`` runs in each training step
    (a test's stand-in for a slow host)."""
    import lightning.pytorch as pl
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):  # noqa: ANN001,ANN201
            x, y = batch
            if on_step is not None:
                on_step(batch)
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):  # noqa: ANN201
            if inner == "adamw":
                return torch.optim.AdamW(self.parameters(), lr=lr)
            return torch.optim.SGD(self.parameters(), lr=lr)

    return Tiny()


def fit(rank: int, world: int, model: Any, loader: Any, callbacks: list, max_steps: int, backend: str,
        ckpt_path: str | None = None, max_epochs: int | None = None) -> Any:
    """Trainer.fit on DDP over the group already initialised; returns the trainer. ``max_steps``
    -1 with ``max_epochs``: the fit ends at an epoch's end (where Lightning resumes exactly)."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    # Node ``rank`` of ``world``, its one local process (MASTER_ADDR/PORT, RANK, WORLD_SIZE: the
    # harness's); one thread, as the harness gives every rank (Lightning would take all cores).
    os.environ.update({"NODE_RANK": str(rank), "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"})
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=world, max_steps=max_steps, max_epochs=max_epochs,
                         strategy=DDPStrategy(process_group_backend=backend), callbacks=callbacks,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                         limit_val_batches=0)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    return trainer
