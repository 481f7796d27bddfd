"""The daemon's local reduction pool: combines the buffers of this host's ranks.

Uses the engine's kernels (``_core.reduce_inplace`` / ``_core.finalize_avg``, the one
place reductions live) when the build exposes them; otherwise numpy, with bfloat16
widened to float32 and rounded back to nearest-even. Large buffers are split across a
few threads (both back ends release the GIL).
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from libmccl.errors import ConfigError

try:
    from libmccl import _core
except ImportError:  # the daemon still serves single-host jobs through numpy
    _core = None

# mccl::DType values (csrc/dtype.h).
F32, F64, F16, BF16, I8, U8, I32, I64, BOOL = range(9)
SUM, AVG, MIN, MAX, PROD, BAND, BOR, BXOR = range(8)
OP_NAMES = ["sum", "avg", "min", "max", "product", "band", "bor", "bxor"]
DTYPE_SIZE = [4, 8, 2, 2, 1, 1, 4, 8, 1]
_NP = {F32: np.float32, F64: np.float64, F16: np.float16, BF16: np.uint16, I8: np.int8,
       U8: np.uint8, I32: np.int32, I64: np.int64, BOOL: np.bool_}
_FLOATS = (F32, F64, F16, BF16)
_CHUNK_BYTES = 4 << 20


def check(dtype: int, op: int) -> None:
    if dtype not in _NP:
        raise ConfigError(f"[daemon] unknown dtype {dtype}; client and daemon releases differ?")
    if op not in range(8):
        raise ConfigError(f"[daemon] unknown reduce op {op}; client and daemon releases differ?")
    if op in (BAND, BOR, BXOR) and dtype in _FLOATS:
        raise ConfigError(f"[daemon] reduce op {OP_NAMES[op]} is not defined on floating-point "
                          f"dtype {dtype}; use an integer or bool tensor")


def _array(addr: int, count: int, dtype: int) -> np.ndarray:
    buf = (ctypes.c_char * (count * DTYPE_SIZE[dtype])).from_address(addr)
    return np.frombuffer(buf, dtype=_NP[dtype], count=count)


def _bf16_to_f32(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(f: np.ndarray, out: np.ndarray) -> None:
    bits = f.view(np.uint32)
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))  # round to nearest even
    res = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        res[nan] = 0x7FC0
    out[:] = res


def _np_reduce(src: np.ndarray, dst: np.ndarray, dtype: int, op: int) -> None:
    if dtype == BF16:
        acc = _bf16_to_f32(dst)
        _np_reduce(_bf16_to_f32(src), acc, F32, op)
        _f32_to_bf16(acc, dst)
        return
    if dtype == BOOL:
        fn = {SUM: np.logical_or, AVG: np.logical_or, MAX: np.logical_or, BOR: np.logical_or,
              MIN: np.logical_and, PROD: np.logical_and, BAND: np.logical_and, BXOR: np.logical_xor}[op]
    else:
        fn = {SUM: np.add, AVG: np.add, MIN: np.minimum, MAX: np.maximum, PROD: np.multiply,
              BAND: np.bitwise_and, BOR: np.bitwise_or, BXOR: np.bitwise_xor}[op]
    fn(dst, src, out=dst)


class ReducePool:
    """``reduce(src, dst, count, dtype, op)``: dst[i] = op(dst[i], src[i]); addresses are ints."""

    def __init__(self, threads: int = 0):
        self._threads = threads or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="mccld-reduce") \
            if self._threads > 1 else None
        self._native = _core is not None and hasattr(_core, "reduce_inplace")
        self._native_avg = _core is not None and hasattr(_core, "finalize_avg")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _one(self, src: int, dst: int, count: int, dtype: int, op: int) -> None:
        if self._native:
            _core.reduce_inplace(src, dst, count, dtype, op)
        else:
            _np_reduce(_array(src, count, dtype), _array(dst, count, dtype), dtype, op)

    def reduce(self, src: int, dst: int, count: int, dtype: int, op: int) -> None:
        esize = DTYPE_SIZE[dtype]
        if self._pool is None or count * esize < 2 * _CHUNK_BYTES:
            self._one(src, dst, count, dtype, op)
            return
        step = max(1, -(-count // self._threads))
        futs = [self._pool.submit(self._one, src + i * esize, dst + i * esize, min(step, count - i), dtype, op)
                for i in range(0, count, step)]
        for f in futs:
            f.result()

    def finalize_avg(self, addr: int, count: int, dtype: int, divisor: int) -> None:
        """Divide by the number of ranks (AVG is reduced as SUM); integers truncate toward zero."""
        if self._native_avg:
            _core.finalize_avg(addr, count, dtype, divisor)
            return
        a = _array(addr, count, dtype)
        if dtype == BF16:
            f = _bf16_to_f32(a) / np.float32(divisor)
            _f32_to_bf16(f.astype(np.float32), a)
        elif dtype in _FLOATS:
            a /= a.dtype.type(divisor)
        elif dtype == BOOL:
            pass  # logical-or of bools: "average" keeps the value, like the engine
        else:
            q = np.abs(a) // divisor  # exact for int64 (no float round trip)
            np.copyto(a, np.where(a < 0, -q, q).astype(a.dtype))
