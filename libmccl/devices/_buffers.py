"""Tensors -> engine buffers: validation, dtype/op codes, staging and copy-back.

The engine sees only (pointer, bytes, dtype code). Everything torch-specific about
turning a user's tensor into such a buffer lives here: refusing what cannot be sent
(with a message naming the op and the argument), making non-contiguous or MPS
tensors contiguous CPU buffers, and recording the copy-back that must run when the
operation completes.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Sequence

import torch

from mccl_common.errors import ConfigError

from .. import DEVICES
from . import device_tensors
from ..torch import compat

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


def _unified() -> Any:
    # The staging helpers for mps tensors, imported only when one shows up: collectives other
    # than all_reduce, and all_reduce where the Metal bridge is off (metal_tensors).
    from . import unified

    return unified


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + nbytes(b) and b0 < a0 + nbytes(a)


class Staging:
    """Contiguous CPU buffers for one operation, plus what to do when it completes.

    ``keep`` holds every buffer whose address was handed to the engine. On
    completion, ``unpack`` steps (slices of a flat receive buffer into per-tensor
    buffers) run first, then the copy-backs into the caller's tensors
    (non-contiguous, MPS), which may read what the unpacking wrote.

    Tensors on a device stream (CUDA; device_tensors) are staged through host blocks of
    a ``StagedOp`` instead (``device``): their copies in and out are queued on the stream
    by the op's tickets, never run here. Pass every tensor of the op to the constructor,
    so that scratch buffers are staging blocks too when a device is involved.
    """

    def __init__(self, name: str = "", tensors: Sequence[Any] = (), blocks: Any = None) -> None:
        """``blocks``: where device staging blocks come from first (segment_staging.py)."""
        self.keep: list[Any] = []
        self._unpack: list[Callable[[], None]] = []
        self._copy_back: list[Callable[[], None]] = []
        self.device: Any = None  # the StagedOp, if a tensor is on a device stream
        self.stream: Any = None
        self.device_tensors: list[torch.Tensor] = []
        self._name = name
        self._blocks = blocks
        for t in _flat(tensors):
            if device_tensors.stages(t):
                self._stage(t)

    def _stage(self, t: torch.Tensor) -> None:
        if self.device is None:
            self.device, self.stream = device_tensors.staged(t, self._name, self._blocks)
            self.keep.append(self.device)
        elif device_tensors.ops_for(t)[0] is not self.device.ops:
            self._refuse(f"[mccl] {self._name}: tensors on {self.device_tensors[0].device} and {t.device} in one "
                         "call; mccl runs one device per process, move them to one device")
        self.device_tensors.append(t)

    def _refuse(self, message: str) -> None:
        if self.device is not None:
            self.device.abandon()  # never launched: its blocks and words go back at once
        raise ConfigError(message)

    def _hold(self, buf: Any) -> Any:
        self.keep.append(buf)
        return buf

    def _on_device(self, t: torch.Tensor) -> bool:
        if not device_tensors.stages(t):
            return False
        if not any(t is d for d in self.device_tensors):
            self._stage(t)  # a tensor the constructor was not shown (its scratch may be pageable: slower)
        return True

    def _host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer: a staging block when a device is involved (copies into pageable
        memory would be synchronous), else ordinary memory."""
        if self.device is None:
            return torch.empty(numel, dtype=dtype)
        n = numel * torch.empty(0, dtype=dtype).element_size()
        if n == 0:
            return torch.empty(numel, dtype=dtype)
        addr = self.device.block(n)
        return torch.frombuffer((ctypes.c_char * n).from_address(addr), dtype=torch.uint8).view(dtype)

    def _device_contiguous(self, t: torch.Tensor, what: str) -> None:
        if not t.is_contiguous():
            self._refuse(f"[mccl] {self.device.what}: the {t.device} {what} is not contiguous; device "
                         "tensors are written in place, pass tensor.contiguous() and copy the result back")

    def input(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer the engine only reads."""
        if self._on_device(t):
            src = self._hold(t if t.is_contiguous() else t.contiguous())  # queued on t's stream, before O1
            buf = self._host(t.numel(), t.dtype).view(t.shape)
            self.device.copy_in(buf.data_ptr(), src.data_ptr(), nbytes(t))
            return self._hold(buf)
        if t.device.type == "mps":
            return self._hold(_unified().staging_copy_to_cpu(t).contiguous())
        return self._hold(t if t.is_contiguous() else t.contiguous())

    def input_into(self, t: torch.Tensor, dst: torch.Tensor) -> None:
        """``t``'s elements into ``dst``, a host buffer of this op whose rows are contiguous
        (packing several inputs into one send buffer): of ``t``'s dtype, or flat bytes."""
        if not self._on_device(t):
            src = self.input(t)
            if dst.dtype == t.dtype:
                dst.copy_(src.reshape(dst.shape))
            else:  # a flat byte slice of a packed buffer
                dst.copy_(as_bytes(src))
            return
        src = self._hold(t if t.is_contiguous() else t.contiguous())
        rows = dst if dst.dim() == 2 else dst.reshape(1, -1)
        row_bytes = rows.shape[1] * rows.element_size()
        for i in range(rows.shape[0]):
            self.device.copy_in(rows[i].data_ptr(), src.data_ptr() + i * row_bytes, row_bytes)

    def inout(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer the engine reads and overwrites in place."""
        if self._on_device(t):
            self._device_contiguous(t, "tensor")
        buf = self.input(t)
        if buf is not t:
            self.copy_back(t, buf)
        return buf

    def output(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer the engine only writes."""
        if t.device.type == "cpu" and t.is_contiguous() and not self._on_device(t):
            return self._hold(t)
        buf = self._hold(self._host(t.numel(), t.dtype).view(t.shape))
        self.copy_back(t, buf)
        return buf

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._hold(self._host(numel, dtype))

    def packed(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inputs concatenated into one flat byte buffer (dtypes may differ)."""
        if self.device is None:
            flat = [as_bytes(self.input(p)) for p in parts]
            return self._hold(torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8))
        buf = self.scratch(sum(nbytes(p) for p in parts), torch.uint8)
        offset = 0
        for p in parts:
            self.input_into(p, buf[offset:offset + nbytes(p)])
            offset += nbytes(p)
        return buf

    def copy_back(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._on_device(dst):
            # After the engine and the unpacking: queued behind the wait for done (O2).
            self._device_contiguous(dst, "output")
            self.device.copy_out(dst.data_ptr(), src.data_ptr(), nbytes(dst))
        elif dst.device.type == "mps":
            self._copy_back.append(lambda: _unified().copy_back(dst, src.view(dst.shape)))
        else:
            self._copy_back.append(lambda: dst.copy_(src.view(dst.shape)))

    def unpack(self, dst: torch.Tensor, src_bytes: torch.Tensor) -> None:
        """On completion, copy a slice of a flat byte buffer into contiguous ``dst``."""
        self._unpack.append(lambda: as_bytes(dst).copy_(src_bytes))

    def post(self) -> Callable[[], None] | None:
        steps = self._unpack + self._copy_back
        if self.device is not None:
            steps.append(lambda: self.device.settle(None))  # last: the device copies the result
        if not steps:
            return None

        def run() -> None:
            # Like c10d, write parameters as plain memory: a copy into a leaf that
            # requires grad must not be recorded (or refused) by autograd.
            with torch.no_grad():
                for step in steps:
                    step()
        return run


def _flat(xs: Any) -> list[Any]:
    if isinstance(xs, torch.Tensor):
        return [xs]
    if isinstance(xs, (list, tuple)):
        return [t for x in xs for t in _flat(x)]
    return []


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage."""
    flat = t.reshape(-1)
    if flat.dtype in _COMPLEX_AS_REAL:
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8)
