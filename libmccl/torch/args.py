"""The torch glue's argument checks: what a collective's caller passed, refused with a message
naming the op and the argument (a tensor MCCL cannot send, a rank outside the group, a reduction
the engine lacks), and turned into the engine's codes (dtype, element count, reduce op).

Called once per collective by the backend (``reduction`` covers the single-tensor reductions in
one call); the device layer (libmccl.devices.plan) sees only tensors that passed.
"""

from __future__ import annotations

from typing import Any

import torch

from mccl_common.errors import ConfigError

from .. import DEVICES
from . import compat

# Values of mccl::DType (csrc/core/dtype.h): part of the engine ABI, append-only.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int8: 4,
    torch.uint8: 5,
    torch.int32: 6,
    torch.int64: 7,
    torch.bool: 8,
}
# Reductions over complex numbers that are element-wise on (re, im) pairs.
_COMPLEX_AS_REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64}

_R = compat.ReduceOp.RedOpType
# Values of mccl::ReduceOp (csrc/core/dtype.h).
REDUCE_OP_CODES: dict[Any, int] = {
    _R.SUM: 0, _R.AVG: 1, _R.MIN: 2, _R.MAX: 3, _R.PRODUCT: 4, _R.BAND: 5, _R.BOR: 6, _R.BXOR: 7,
}
_COMPLEX_OK = {0, 1}  # SUM, AVG


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_tensor(t: Any, op: str, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"[mccl] {op}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ConfigError(f"[mccl] {op}: {what} has layout {t.layout}; only dense (strided) tensors can be "
                          "sent, convert with .to_dense()")
    if t.device.type not in DEVICES:
        raise ConfigError(f"[mccl] {op}: {what} is on device {t.device}; the mccl backend handles "
                          f"{'/'.join(DEVICES)} tensors (use gloo/nccl for others)")
    return t


def single(tensors: Any, op: str, what: str = "tensors") -> Any:
    """The one entry of a per-device list: MCCL runs one device per process."""
    if isinstance(tensors, torch.Tensor):
        return tensors
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
        n = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise ConfigError(f"[mccl] {op}: expected exactly one entry in {what} (one device per process), got {n}")
    return tensors[0]


def tensor_list(tensors: Any, op: str, what: str, expected_len: int | None = None,
                min_len: int = 0) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)):
        raise ConfigError(f"[mccl] {op}: {what} must be a list of tensors, got {type(tensors).__name__}")
    if len(tensors) < min_len:
        raise ConfigError(f"[mccl] {op}: {what} is empty; pass at least {min_len} tensor(s)")
    if expected_len is not None and len(tensors) != expected_len:
        raise ConfigError(f"[mccl] {op}: {what} has {len(tensors)} tensors, expected {expected_len} "
                          "(one per rank of the group)")
    return [check_tensor(t, op, f"{what}[{i}]") for i, t in enumerate(tensors)]


def check_like(t: torch.Tensor, ref: torch.Tensor, op: str, what: str, ref_what: str, numel: int | None = None) -> None:
    want = ref.numel() if numel is None else numel
    if t.dtype != ref.dtype:
        raise ConfigError(f"[mccl] {op}: {what} has dtype {t.dtype} but {ref_what} has {ref.dtype}; "
                          "they must match")
    if t.numel() != want:
        raise ConfigError(f"[mccl] {op}: {what} has {t.numel()} elements, expected {want} "
                          f"(from {ref_what} {tuple(ref.shape)})")


def check_rank(r: int, size: int, op: str, what: str) -> int:
    r = int(r)
    if not 0 <= r < size:
        raise ConfigError(f"[mccl] {op}: {what}={r} is not a rank of this group (size {size})")
    return r


def root_list(name: str, lists: Any, lists_what: str, what: str, ref: torch.Tensor, ref_what: str, rank: int,
              size: int, root: int) -> list[torch.Tensor]:
    """The per-rank list of a rooted op (scatter's scatter_list, gather's gather_list): on the
    root one tensor like ``ref`` per rank, elsewhere nothing (a list there is refused)."""
    if rank != root:
        if lists and any(len(lst) for lst in lists):
            raise ConfigError(f"[mccl] {name}: rank {rank} passed a {what} but is not the root ({root}); "
                              "only the root may")
        return []
    ts = tensor_list(single(lists, name, lists_what), name, what, size)
    for r, t in enumerate(ts):
        check_like(t, ref, name, f"{what}[{r}]", ref_what)
    return ts


def reduce_codes(t: torch.Tensor, op: Any, name: str) -> tuple[int, int, int]:
    """(dtype code, element count, op code) for a reduction over ``t``."""
    try:
        kind = compat.reduce_op_kind(op)
    except TypeError as exc:
        raise ConfigError(f"[mccl] {name}: {exc}") from None
    code = REDUCE_OP_CODES.get(kind)
    if code is None:
        raise ConfigError(f"[mccl] {name}: reduce op {kind.name} is not supported by mccl "
                          "(supported: SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR); "
                          "for PREMUL_SUM scale the tensor first and use SUM")
    dtype, count = t.dtype, t.numel()
    if dtype in _COMPLEX_AS_REAL:
        if code not in _COMPLEX_OK:
            raise ConfigError(f"[mccl] {name}: {kind.name} is undefined for complex tensors ({dtype}); "
                              "only SUM and AVG are")
        dtype, count = _COMPLEX_AS_REAL[dtype], count * 2
    dcode = DTYPE_CODES.get(dtype)
    if dcode is None:
        raise ConfigError(f"[mccl] {name}: dtype {t.dtype} cannot be reduced by mccl; supported: "
                          + ", ".join(str(d).replace("torch.", "") for d in DTYPE_CODES))
    return dcode, count, code


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + nbytes(b) and b0 < a0 + nbytes(a)


def reduction(tensors: Any, opts: Any, options_cls: Any, name: str) -> tuple[torch.Tensor, Any, int, int, int]:
    """(tensor, options, dtype code, element count, op code) of a reduction over one tensor
    (all-reduce, reduce): the per-device list unwrapped, the options defaulted, both checked."""
    opts = compat.options_or_default(opts, options_cls)
    t = check_tensor(single(tensors, name), name, "tensor")
    dtype, count, op = reduce_codes(t, opts.reduceOp, name)
    return t, opts, dtype, count, op
