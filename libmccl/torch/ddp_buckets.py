"""``libmccl.ddp_shared_buckets``: a DDP comm hook that reduces each gradient bucket in memory
the local mccld maps, so ``MCCL_DAEMON=1`` does not copy DDP's buckets in and out.

Through mccld an all-reduce of an ordinary tensor is copied into the rank's segment and the
result copied back (daemon/client.py); a tensor in a shared buffer (daemon/buffers.py) is
reduced where it is. DDP's Reducer allocates its buckets itself, so this hook moves them:

- ``gradient_as_bucket_view=True``: the parameters' ``.grad`` tensors are the Reducer's bucket
  views. On a bucket's first reduction the hook copies it into a shared buffer once and points
  the bucket and those views at it (``Tensor.set_``); the Reducer, autograd's accumulation and
  the optimizer then all work in shared memory, and every later step reduces in place with no
  copy. A gradient found elsewhere (``zero_grad(set_to_none=True)`` made autograd allocate a
  fresh one, which the Reducer copied into a view the hook could not reach) is copied into its
  place and pointed there too; a missing one (unused parameter) gets zeros, as the Reducer
  gives it. After DDP rebuilds its buckets (after the first step) the new ones are moved the same way.
- ``gradient_as_bucket_view=False``: the gradients are the user's own tensors, so nothing is
  re-pointed: the bucket is scaled into a shared buffer kept with it (one pass doing the copy
  and the scaling the Reducer would otherwise do while copying the gradients in) and the
  Reducer copies the result out of it: three passes over the bucket instead of four, one of
  them on the autograd thread rather than pipelined beside the network (not measured here).

The average is taken as DDP's own reduction takes it: each gradient scaled by 1/size before
the sum, as a product with 1/size, which DDP uses for every gradient it copies into a bucket.
A gradient already in its bucket view (``gradient_as_bucket_view=True`` with
``zero_grad(set_to_none=False)``) DDP divides instead; the two agree to the bit when the size
is a power of two, and may differ in the last bit otherwise. In-process (no mccld) or when a rank's shared buffers
run out (attach_protocol.MAX_BUFFERS_PER_RANK) a bucket is reduced where it is, as torch's
``allreduce_hook`` does. DDP's join mode (uneven inputs) divides by the ranks still joined;
this hook, like torch's own hooks, by the group's size.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import logging
from typing import Any

import torch
import torch.distributed as dist

from mccl_common.errors import ConfigError

log = logging.getLogger(__name__)

_ATTR = "_mccl_shared"   # on the bucket tensor's Python object: the shared tensor kept with it
_PLACED = "_mccl_placed"  # and where its gradients were after the last gather (data pointers)
_warned = False          # a bucket left in ordinary memory: said once at WARNING, then at DEBUG


def ddp_shared_buckets(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook: ``ddp_model.register_comm_hook(group_or_None, libmccl.ddp_shared_buckets)``.
    ``state`` is the DDP model's process group (None: the world), as for torch's own hooks."""
    pg = state if state is not None else dist.group.WORLD
    buf = bucket.buffer()
    n = pg.size()
    with torch.no_grad():
        if n == 1:
            return _reduce(pg, buf)   # identity; no shared memory needed
        # DDP's own scaling: a gradient it copies into the bucket is multiplied by 1/n on the way
        # (always so without gradient_as_bucket_view, and with it whenever zero_grad set the
        # gradients to None, torch's default); the same product, bit for bit.
        scale = 1.0 / n
        shared = _shared_for(pg, buf)
        if shared is None:
            buf.mul_(scale)
            return _reduce(pg, buf)
        grads = [p.grad for p in bucket.parameters()]
        if _same_memory(buf, shared) or any(g is not None and _same_memory(g, buf) for g in grads):
            # The steady state in one comparison: every gradient where the last step left it (a
            # missing one's place must be zeroed again, so that is never the steady state).
            placed = [0 if g is None else g.data_ptr() for g in grads]
            if 0 in placed or placed != getattr(buf, _PLACED, None):
                _gather_in_place(bucket, buf, shared, grads)
                setattr(buf, _PLACED, [0 if g is None else g.data_ptr() for g in grads])
            shared.mul_(scale)
        else:
            torch.mul(buf, scale, out=shared)
        return _reduce(pg, shared)


def _reduce(pg: Any, t: torch.Tensor) -> torch.futures.Future:
    # The Reducer takes a Future of the tensor, not of the Work's list of outputs.
    return pg.allreduce([t]).get_future().then(lambda fut: fut.value()[0])


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _shared_for(pg: Any, buf: torch.Tensor) -> torch.Tensor | None:
    """The shared tensor this bucket is reduced in (allocated on its first reduction), or None
    where there is none to be had (in-process, a device bucket, the rank's buffers used up)."""
    if buf.device.type != "cpu" or buf.layout != torch.strided or not buf.is_contiguous():
        return None
    shared = getattr(buf, _ATTR, None)
    if shared is False:
        return None   # refused before (the rank's buffers used up): not asked again each step
    if shared is not None and shared.numel() == buf.numel() and shared.dtype == buf.dtype:
        return shared
    alloc = getattr(pg, "shared_buffer", None)
    if alloc is None:
        return None   # not an mccl group
    try:
        mem = alloc(buf.numel() * buf.element_size())
    except ConfigError as e:
        global _warned
        (log.debug if _warned else log.warning)(
            "[mccl] a DDP bucket of %d bytes stays in ordinary memory and is copied through mccld: %s; "
            "raise DDP's bucket_cap_mb for fewer, larger buckets", buf.numel() * buf.element_size(), e)
        _warned = True
        setattr(buf, _ATTR, False)
        return None
    if mem is None:
        return None   # in-process: the engine reads the bucket where it is
    shared = torch.frombuffer(mem.view(), dtype=buf.dtype, count=buf.numel())
    # The Python object of a tensor the Reducer holds is kept while the tensor lives, so the
    # shared memory lives exactly as long as this bucket (a rebuilt bucket gets its own).
    setattr(buf, _ATTR, shared)
    return shared


def _gather_in_place(bucket: Any, buf: torch.Tensor, shared: torch.Tensor, grads: list) -> None:
    """gradient_as_bucket_view: makes ``shared`` hold each gradient at its offset and points the
    bucket, and every gradient that is one of DDP's views, at it."""
    storage, base = shared.untyped_storage(), shared.storage_offset()
    moved = not _same_memory(buf, shared)
    for g, view in zip(grads, bucket.gradients()):
        at = base + view.storage_offset() - buf.storage_offset()
        if g is None:
            # The Reducer zeroed this parameter's place: it took no part locally.
            shared.as_strided((view.numel(),), (1,), at).zero_()
            continue
        # The gradient is DDP's bucket view, laid out as the Reducer laid it (the parameter's
        # strides where they are dense, channels_last say; GradBucket.gradients() are always
        # contiguous): the slot takes that layout, which is how the Reducer reads the result.
        dense = _spans(g) == view.numel()
        slot = shared.as_strided(g.size(), g.stride(), at) if dense else _view_at(shared, view, at)
        if dense and g.data_ptr() == slot.data_ptr() and _same_memory(g, shared):
            continue       # already in place: the steady state
        slot.copy_(g)
        if dense and (_same_memory(g, buf) or not moved):
            # One of DDP's bucket views (the Reducer set .grad to it): from now on it, and the
            # Reducer's view behind it, live in shared memory.
            g.set_(storage, at, g.size(), g.stride())
    if moved:
        buf.set_(storage, base, buf.size(), buf.stride())


def _view_at(shared: torch.Tensor, view: torch.Tensor, at: int) -> torch.Tensor:
    return shared.as_strided(view.size(), view.stride(), at)


def _spans(t: torch.Tensor) -> int:
    """How many elements of memory ``t`` reaches from its first (its numel when it is dense)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(t.size(), t.stride()) if st > 0)


def lightning_callback() -> Any:
    """A Lightning ``Callback`` that installs ``ddp_shared_buckets`` on the DDP model Lightning
    wraps (Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only on CUDA):
    ``Trainer(strategy=DDPStrategy(gradient_as_bucket_view=True), callbacks=[libmccl.lightning_callback()])``."""
    from torch.nn.parallel import DistributedDataParallel

    from .lightning import import_lightning

    pl = import_lightning("lightning_callback")

    class SharedBuckets(pl.Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            model = trainer.strategy.model
            if isinstance(model, DistributedDataParallel):
                model.register_comm_hook(model.process_group, ddp_shared_buckets)

    return SharedBuckets()
