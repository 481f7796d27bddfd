"""Compressed gradient all-reduce for DDP, explicitly (the engine does the work:
libmccl/csrc/algorithms/compressed.cc, docs/compression.md).

Two ways in:
- an unchanged script under ``MCCL_COMPRESSION=int8`` (or ``bf16``): every group's float
  all-reduces of at least ``MCCL_COMPRESSION_MIN_BYTES`` are compressed, DDP's buckets included,
  with error feedback kept by the engine per bucket buffer;
- this hook, for one model only, the rest of the job exact::

      model.register_comm_hook(libmccl.CompressionState("int8"), libmccl.compressed_allreduce_hook)

  The state builds (collectively, so every rank must construct it, at the same point) a
  group over the DDP group's ranks whose engine compresses (``libmccl.Options(compression=...)``);
  the hook averages each bucket over it.

Error feedback stays in the engine, per communicator and keyed by the bucket's buffer
(address and size), not here: DDP's Reducer keeps each bucket in one persistent tensor, so the
engine sees the same buffer each step without any help, the unchanged-script path needs no
hook at all, and the residual lives beside the code that produces it (no torch tensors, no
copy out and back per step). A rebuilt bucket is a new buffer, so it starts afresh.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
from typing import Any

import torch
import torch.distributed as dist

from mccl_common.errors import ConfigError

from .options import Options

CODECS = ("bf16", "fp16", "int8")


class CompressionState:
    """The comm hook's state: a compressing group over ``process_group``'s ranks (the world
    when None). ``error_feedback`` and ``min_bytes`` override MCCL_COMPRESSION_ERROR_FEEDBACK
    and MCCL_COMPRESSION_MIN_BYTES for it."""

    def __init__(self, codec: str = "int8", process_group: Any = None, error_feedback: bool = True,
                 min_bytes: int | None = None) -> None:
        if codec not in CODECS:
            raise ConfigError(f"[mccl] CompressionState({codec!r}): use one of {', '.join(CODECS)}")
        base = process_group if process_group is not None else dist.group.WORLD
        if dist.get_backend(base) != "mccl":
            raise ConfigError(f"[mccl] CompressionState: the DDP group's backend is {dist.get_backend(base)!r}, "
                              "not mccl; compression runs in mccl's engine")
        overrides: dict = {"compression": codec, "compression_error_feedback": error_feedback}
        if min_bytes is not None:
            overrides["compression_min_bytes"] = min_bytes
        self.codec = codec
        self.error_feedback = error_feedback
        ranks = dist.get_process_group_ranks(base)
        self.group = dist.new_group(ranks=ranks, backend="mccl", pg_options=Options(**overrides))
        self.size = len(ranks)


def compressed_allreduce_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket averaged over ``state.group`` compressed (AVG: the engine sums the
    decoded contributions in float32 and divides once, before the result is encoded)."""
    if not isinstance(state, CompressionState):
        raise ConfigError("[mccl] compressed_allreduce_hook needs a libmccl.CompressionState as its state, "
                          f"got {type(state).__name__}")
    buf = bucket.buffer()
    work = dist.all_reduce(buf, op=dist.ReduceOp.AVG, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def lightning_compression_callback(codec: str = "int8", error_feedback: bool = True,
                                   min_bytes: int | None = None) -> Any:
    """A Lightning ``Callback`` installing ``compressed_allreduce_hook`` on the DDP model
    Lightning wraps: ``Trainer(strategy="ddp", callbacks=[libmccl.lightning_compression_callback("int8")])``.
    Its ``state`` is the hook's CompressionState once the fit has started."""
    from .lightning import ddp_model, import_lightning

    pl = import_lightning("lightning_compression_callback")
    if codec not in CODECS:   # at construction, not at the fit's start on every rank
        raise ConfigError(f"[mccl] lightning_compression_callback({codec!r}): use one of {', '.join(CODECS)}")

    class Compression(pl.Callback):
        def __init__(self) -> None:
            self.state: CompressionState | None = None

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            model = ddp_model(trainer, "lightning_compression_callback")
            self.state = CompressionState(codec, model.process_group, error_feedback=error_feedback,
                                          min_bytes=min_bytes)
            model.register_comm_hook(self.state, compressed_allreduce_hook)

    return Compression()
