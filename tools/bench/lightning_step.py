"""``mccl-bench --workload lightning``: Lightning's own model under Lightning's own Trainer.

Every rank trains ``lightning.pytorch.demos.LightningTransformer`` (the demo's default
Transformer: 14.6M parameters, 58.5 MB of float32 gradients) with a ``Trainer`` on
``DDPStrategy(process_group_backend=<the series' backend>)``: one process per emulated host
(``num_nodes`` = world, one device each), as a multi-node Lightning job runs. The process
group the bench worker created is the one Lightning finds and uses. Tokens are random (the
demo's WikiText2 downloads its text; the machines the bench runs on reach no network),
drawn from a fixed seed per rank, so every series sees the same data.

Each rank first times the same model's steps without DDP (the compute alone), then per
variant ``warmup`` + ``steps`` Trainer steps, each timed from Lightning's
``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward with the bucket
all-reduces, optimizer step). Variants: ``ddp`` (the strategy's defaults) and ``shared``
(``gradient_as_bucket_view=True`` and ``libmccl.lightning_callback()``, which installs
``libmccl.ddp_shared_buckets``: no copies through mccld). The output has ddp.run's shape, so ddp.summarize reports it; after
the steps the replicas must be bit-identical, as in ddp.py.

Lightning is not a dependency of MCCL: ``pip install lightning`` where this runs.
"""

from __future__ import annotations

import os
import time

from . import ddp as _ddp

DEFAULTS = {"warmup": 3, "steps": 10, "batch": 16, "seq": 35, "variants": ["ddp"], "vocab": 33278}
VARIANTS = ("ddp", "shared")


def strategy_kwargs(variant: str, backend: str) -> dict:
    """DDPStrategy's arguments for a variant (importable without lightning, for its test)."""
    if variant not in VARIANTS:
        raise ValueError(f"[bench] unknown Lightning variant {variant!r}; known: {', '.join(VARIANTS)}")
    kw: dict = {"process_group_backend": backend}
    if variant == "shared":
        kw["gradient_as_bucket_view"] = True   # and libmccl.lightning_callback() installs the hook
    return kw


def node_env(rank: int) -> dict[str, str]:
    """What Lightning's cluster environment reads to place this process: node ``rank`` of
    ``num_nodes``, its one local process (MASTER_ADDR/PORT, RANK, WORLD_SIZE: the bench's)."""
    return {"NODE_RANK": str(rank), "LOCAL_RANK": "0"}


def _batches(torch, cfg: dict, rank: int, n: int):
    g = torch.Generator().manual_seed(2000 + rank)
    toks = torch.randint(0, cfg["vocab"], (n, cfg["batch"], cfg["seq"] + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks]


def run(torch, dist, cfg: dict, rank: int) -> dict:
    """This rank's compute-alone and Lightning step times (seconds) per variant."""
    import lightning.pytorch as L
    from lightning.pytorch.demos import LightningTransformer
    from lightning.pytorch.strategies import DDPStrategy

    import libmccl

    cfg = {**DEFAULTS, **cfg}
    unknown = set(cfg["variants"]) - set(VARIANTS)
    if unknown:
        raise ValueError(f"[bench] unknown Lightning variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    world, backend = dist.get_world_size(), dist.get_backend()
    n = cfg["warmup"] + cfg["steps"]
    data = _batches(torch, cfg, rank, n)

    torch.manual_seed(0)
    alone = _offline(LightningTransformer)(vocab_size=cfg["vocab"])
    opt = alone.configure_optimizers()
    compute = []
    for i, batch in enumerate(data[:cfg["warmup"] + 3]):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        alone.training_step(batch, i).backward()
        opt.step()
        compute.append(time.perf_counter() - t0)
    grad_bytes = sum(p.numel() * p.element_size() for p in alone.parameters())
    del alone, opt

    os.environ.update(node_env(rank))
    # Lightning's launcher gives a process all the machine's cores (cpu_count // devices) unless
    # OMP_NUM_THREADS says otherwise: keep the worker's budget, the same for every backend.
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    out = {"config": {**cfg, "model": "LightningTransformer"}, "grad_bytes": grad_bytes,
           "compute_s": compute[cfg["warmup"]:]}
    for variant in cfg["variants"]:
        torch.manual_seed(0)
        model = _offline(LightningTransformer)(vocab_size=cfg["vocab"])
        timer = _step_timer(L)
        trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=world, max_steps=n,
                            strategy=DDPStrategy(**strategy_kwargs(variant, backend)),
                            callbacks=[timer] + ([libmccl.lightning_callback()] if variant == "shared" else []),
                            logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                            num_sanity_val_steps=0, limit_val_batches=0)
        dist.barrier()
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
        if len(timer.steps) != n:
            raise RuntimeError(f"[bench] Lightning ran {len(timer.steps)} steps of {n} ({variant})")
        out["step_s" if variant == "ddp" else f"{variant}_s"] = timer.steps[cfg["warmup"]:]
        _ddp._check_replicas(torch, dist, model, cfg, f"lightning {variant}")
        del trainer, model
    return out


def _offline(cls):
    """The demo model as it is, less its prepare_data (which downloads WikiText2)."""
    class Offline(cls):
        def prepare_data(self) -> None:
            pass

    return Offline


def _step_timer(L, cpu: bool = False):
    """A callback timing each training step (wall seconds; with ``cpu``, process CPU seconds too)."""
    class StepTimer(L.Callback):
        def __init__(self):
            self.steps: list[float] = []
            self.cpu: list[float] = []
            self._t0 = self._c0 = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            self._t0 = time.perf_counter()
            if cpu:
                self._c0 = time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self.steps.append(time.perf_counter() - self._t0)
            if cpu:
                self.cpu.append(time.process_time() - self._c0)

    return StepTimer()
