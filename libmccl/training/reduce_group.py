"""Which process group carries DiLoCo's outer-gradient all-reduce, and whether it compresses.

The seam with the backend is one attribute: a torch.distributed backend that can compress its
all-reduces exposes ``compression`` (a string: "off", "bf16", "fp16", "int8"), the mode its
all-reduces use. The mccl backend reports what its engine settings say (MCCL_COMPRESSION, or
``libmccl.Options(compression=...)`` for one group); a backend without the attribute (gloo,
nccl) cannot compress. DiLoCo never converts the payload itself: asking for a compression the
group does not apply is an error, never a silent fp32 all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mccl_common.errors import ConfigError

MODES = ("off", "bf16", "fp16", "int8")


def resolve_group(group: Any) -> Any:
    """The group to use now: ``None`` means the default group as it is at this moment, so a
    DiLoCo made before an in-place re-form (ElasticState keep_workers) follows the new world."""
    if group is not None:
        return group
    if not dist.is_initialized():
        raise ConfigError("[diloco] no process group: call torch.distributed.init_process_group first, "
                          "or pass group=")
    return dist.group.WORLD


def backend_of(group: Any, device: torch.device) -> Any:
    """The backend object that runs ``group``'s collectives on ``device``'s type; a clear error
    when the group has none for it (the model is on a device the group cannot reduce)."""
    pg = group if group is not None else dist.group.WORLD
    types = getattr(pg, "_device_types", None)
    if types is not None and device.type not in {torch.device(t).type for t in types}:
        raise ConfigError(f"[diloco] the model's parameters are on {device.type}, but the process group "
                          f"(backend {dist.get_backend(pg)}) has no backend for that device (it has "
                          f"{', '.join(sorted({torch.device(t).type for t in types}))}); move the model, or create "
                          "the group with a backend for that device")
    if hasattr(pg, "compression"):
        return pg       # a backend registered as the group itself (mccl's groups are)
    try:
        return pg._get_backend(torch.device(device.type))
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"[diloco] the model's parameters are on {device.type}, but the process group "
                          f"(backend {dist.get_backend(pg)}) has no backend for that device: {exc}. Move the "
                          "model, or create the group with a backend for that device") from None


def group_compression(group: Any, device: torch.device) -> str | None:
    """The compression ``group``'s all-reduces apply on ``device``; None when its backend
    cannot compress at all."""
    backend = backend_of(group, device)
    mode = getattr(backend, "compression", None)
    return None if mode is None else str(mode)


def check_compression(requested: str | None, group: Any, device: torch.device) -> None:
    """Refuse a group that would not send what ``requested`` says.

    ``None``: whatever the group is configured to do. ``"off"``: the group must send full
    precision. A mode: the group must apply exactly that mode."""
    if requested is None:
        return
    pg = resolve_group(group)
    have = group_compression(pg, device)
    name = dist.get_backend(pg)
    if requested == "off":
        if have not in (None, "off"):
            raise ConfigError(f"[diloco] compression='off' but the process group's {name} backend compresses "
                              f"its all-reduces ({have}); create the group without compression "
                              "(MCCL_COMPRESSION=off) or pass compression=None to accept it")
        return
    if have is None:
        raise ConfigError(f"[diloco] compression={requested!r}: the process group's {name} backend cannot "
                          "compress all-reduces, and DiLoCo does not send fp32 in its place; use an mccl "
                          f"group created with libmccl.Options(compression={requested!r}), or compression=None")
    if have == "off":
        raise ConfigError(f"[diloco] compression={requested!r} but the process group's {name} backend sends its "
                          "all-reduces uncompressed (its compression setting is off), and DiLoCo does not send "
                          f"fp32 in place of {requested}; create the group with pg_options=libmccl.Options("
                          f"compression={requested!r}) (or MCCL_COMPRESSION={requested}), or pass compression=None")
    if have != requested:
        raise ConfigError(f"[diloco] compression={requested!r} but the process group's {name} backend "
                          f"compresses with {have!r}; create a group for the outer gradients with "
                          f"pg_options=libmccl.Options(compression={requested!r}) (dist.new_group(backend='mccl', "
                          "pg_options=...)) and pass it as group=, or set MCCL_COMPRESSION to match")


def check_mode(compression: str | None) -> str | None:
    if compression is not None and compression not in MODES:
        raise ConfigError(f"[diloco] compression={compression!r} is not one of {', '.join(MODES)} (or None: "
                          "whatever the group does)")
    return compression
