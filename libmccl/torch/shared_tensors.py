"""``libmccl.shared_empty``: CPU tensors whose all-reduces through mccld are not copied.

With ``MCCL_DAEMON=1`` every all-reduce of an ordinary tensor is copied into the rank's
shared-memory segment and its result copied back: two passes over the data on the cores the
links need. A tensor made here lives in a buffer mccld maps as well (daemon/buffers.py), so
an all-reduce of it, or of any slice of it, runs in place. Allocate a few large ones (a flat
gradient or parameter buffer) rather than many small ones: a rank may hold 64 at a time.

In-process (no daemon) the engine reads every tensor where it is already, so this returns
an ordinary tensor there: the same script runs in both modes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mccl_common.errors import ConfigError


def shared_empty(*size: Any, dtype: torch.dtype = torch.float32, group: Any = None) -> torch.Tensor:
    """An uninitialised CPU tensor of ``size`` that ``group`` (default: the world) all-reduces
    without copies through mccld. Its memory stays valid after the group is destroyed."""
    from torch import distributed as dist

    from .backend import ProcessGroupMCCL

    shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise ConfigError(f"[mccl] shared_empty{shape}: sizes must be non-negative ints")
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, ProcessGroupMCCL):
        raise ConfigError(f"[mccl] shared_empty needs an mccl process group, got {type(pg).__name__}; "
                          "call init_process_group('mccl') first, or pass group=")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = pg.shared_buffer(nbytes) if nbytes else None
    if buf is None:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf.view(), dtype=dtype, count=math.prod(shape)).view(shape)
