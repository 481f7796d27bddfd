"""MCCL: a torch.distributed backend ("mccl") on a C++ ring engine over TCP.

Registration happens three ways, all idempotent:
- torch calls ``_autoload`` (entry point group ``torch.backends``) at the end of
  ``import torch``, so an unchanged script can call ``init_process_group("mccl")``;
- ``import libmccl`` registers when torch is already imported (or torch's own
  autoload is switched off, in which case nobody else would);
- ``libmccl.register()`` registers explicitly and raises on failure.

Importing libmccl alone does not import torch otherwise: the daemon and the CLI use
the engine and the settings without it.
"""

from __future__ import annotations

import logging
import os
import sys

from .torch.options import Options  # noqa: E402,F401 - public: init_process_group(pg_options=Options(...))

_log = logging.getLogger(__name__)

BACKEND_NAME = "mccl"
DEVICES = ("cpu", "mps", "cuda")  # cuda: staged through pinned memory, ordered by tickets (device_order)
_registered = False


def register() -> None:
    """Register the ``mccl`` backend with torch.distributed; raises if that is impossible."""
    global _registered
    if _registered:
        return
    from .torch import compat  # imports torch.distributed

    if not compat.is_backend_registered(BACKEND_NAME):
        compat.register_backend(BACKEND_NAME, _create_group, list(DEVICES))
    _registered = True


def _create_group(dist_opts, backend_options=None):  # noqa: ANN001 - torch's creator signature
    """torch's creator hook. The backend (and the engine) load only when a group is
    created, so registering at every `import torch` costs about a millisecond."""
    from .torch.backend import create

    return create(dist_opts, backend_options)


def shared_empty(*size, dtype=None, group=None):  # noqa: ANN001,ANN201 - torch types, imported lazily
    """A CPU tensor whose all-reduces through mccld (``MCCL_DAEMON=1``) are not copied; an
    ordinary tensor in-process. See ``libmccl.torch.shared_tensors``."""
    import torch

    from .torch.shared_tensors import shared_empty as make

    return make(*size, dtype=dtype if dtype is not None else torch.float32, group=group)


def ddp_shared_buckets(state, bucket):  # noqa: ANN001,ANN201 - torch types, imported lazily
    """DDP comm hook that reduces gradient buckets in memory mccld maps (no copies through
    ``MCCL_DAEMON=1``): ``model.register_comm_hook(None, libmccl.ddp_shared_buckets)``.
    See ``libmccl.torch.ddp_buckets``."""
    from .torch.ddp_buckets import ddp_shared_buckets as hook

    return hook(state, bucket)


def lightning_callback():  # noqa: ANN201 - a lightning Callback, imported lazily
    """The Lightning spelling of ``ddp_shared_buckets``: ``Trainer(strategy=DDPStrategy(
    gradient_as_bucket_view=True), callbacks=[libmccl.lightning_callback()])``."""
    from .torch.ddp_buckets import lightning_callback as make

    return make()


def CompressionState(codec: str = "int8", process_group=None, error_feedback: bool = True,  # noqa: ANN001,ANN201,N802
                     min_bytes=None):
    """State of ``compressed_allreduce_hook``: ``model.register_comm_hook(libmccl.CompressionState("int8"),
    libmccl.compressed_allreduce_hook)``. See ``libmccl.torch.compression``."""
    from .torch.compression import CompressionState as State

    return State(codec, process_group, error_feedback, min_bytes)


def compressed_allreduce_hook(state, bucket):  # noqa: ANN001,ANN201 - torch types, imported lazily
    """DDP comm hook averaging each bucket compressed (MCCL_COMPRESSION's engine path, for one model)."""
    from .torch.compression import compressed_allreduce_hook as hook

    return hook(state, bucket)


def lightning_compression_callback(codec: str = "int8", error_feedback: bool = True,  # noqa: ANN201
                                   min_bytes=None):  # noqa: ANN001
    """``Trainer(strategy="ddp", callbacks=[libmccl.lightning_compression_callback("int8")])``."""
    from .torch.compression import lightning_compression_callback as make

    return make(codec, error_feedback, min_bytes)


def lightning_diloco_callback(sync_every: int, outer_optimizer=None, **kwargs):  # noqa: ANN001,ANN003,ANN201
    """``Trainer(strategy="ddp", callbacks=[libmccl.lightning_diloco_callback(sync_every=32)])``: DiLoCo
    around an unchanged LightningModule (libmccl/training/lightning_diloco.py, docs/diloco.md)."""
    from .training.lightning_diloco import lightning_diloco_callback as make

    return make(sync_every, outer_optimizer, **kwargs)


def lightning_speed_balancer_callback(global_batch: int, **kwargs):  # noqa: ANN003,ANN201
    """Speed-aware batch shares under Lightning (libmccl/training/lightning_balance.py,
    docs/slow-hosts.md): ``cb = libmccl.lightning_speed_balancer_callback(256)``,
    ``DataLoader(ds, batch_sampler=cb.batch_sampler(len(ds)))``, ``Trainer(strategy="ddp",
    use_distributed_sampler=False, callbacks=[cb])``."""
    from .training.lightning_balance import lightning_speed_balancer_callback as make

    return make(global_batch, **kwargs)


def torchft_process_group(timeout=None):  # noqa: ANN001,ANN201 - a torchft ProcessGroup, imported lazily
    """torchft on mccl: ``torchft.Manager(pg=libmccl.torchft_process_group(), ...)``, then torchft's
    LocalSGD/DiLoCo unchanged (libmccl/torch/torchft_pg.py, docs/diloco.md). Needs torchft installed."""
    from .torch.torchft_pg import torchft_process_group as make

    return make() if timeout is None else make(timeout)


def __getattr__(name: str):  # noqa: ANN202 - torch types, imported lazily
    """``libmccl.DiLoCo`` (libmccl/training/diloco.py) imports torch only when asked for."""
    if name == "DiLoCo":
        from .training import DiLoCo

        return DiLoCo
    raise AttributeError(f"module 'libmccl' has no attribute {name!r}")


def _autoload() -> None:
    """torch's entry point hook: must be cheap and must never raise (it runs inside ``import torch``)."""
    try:
        register()
    except Exception as exc:  # noqa: BLE001 - a failure here would break `import torch` for everyone
        _log.warning("[libmccl] could not register the 'mccl' torch.distributed backend: %s; "
                     "init_process_group('mccl') will fail until this is fixed", exc)


def _rdzv_handler_creator():  # noqa: ANN202 - returns torch's RendezvousHandlerCreator
    """torchrun's entry point (group ``torchrun.handlers``), called with no arguments while torch
    imports its rendezvous registry. It returns a creator that imports the handler only when
    torchrun asks for ``--rdzv-backend mccl``: importing it here would re-enter that registry."""
    def create(params):  # noqa: ANN001,ANN202
        from .elastic.rdzv import create_handler

        return create_handler(params)

    return create


if "torch" in sys.modules or os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1":
    _autoload()
