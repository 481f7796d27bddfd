"""The daemon's local reduction pool: combines the buffers of this host's ranks.

The arithmetic is the engine's (``_core.reduce_inplace`` / ``_core.finalize_avg``), the
one place reductions live; this file only checks codes and splits large buffers across
a few threads (the kernels release the GIL).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from libmccl.errors import ConfigError

try:
    from libmccl import _core
except ImportError:  # reported when a pool is created: single-host jobs need it too
    _core = None

# mccl::DType values (csrc/dtype.h).
F32, F64, F16, BF16, I8, U8, I32, I64, BOOL = range(9)
SUM, AVG, MIN, MAX, PROD, BAND, BOR, BXOR = range(8)
OP_NAMES = ["sum", "avg", "min", "max", "product", "band", "bor", "bxor"]
DTYPE_SIZE = [4, 8, 2, 2, 1, 1, 4, 8, 1]
_FLOATS = (F32, F64, F16, BF16)
_CHUNK_BYTES = 4 << 20


def check(dtype: int, op: int) -> None:
    if not 0 <= dtype < len(DTYPE_SIZE):
        raise ConfigError(f"[daemon] unknown dtype {dtype}; client and daemon releases differ?")
    if op not in range(8):
        raise ConfigError(f"[daemon] unknown reduce op {op}; client and daemon releases differ?")
    if op in (BAND, BOR, BXOR) and dtype in _FLOATS:
        raise ConfigError(f"[daemon] reduce op {OP_NAMES[op]} is not defined on floating-point "
                          f"dtype {dtype}; use an integer or bool tensor")


class ReducePool:
    """``reduce(src, dst, count, dtype, op)``: dst[i] = op(dst[i], src[i]); addresses are ints."""

    def __init__(self, threads: int = 0):
        if _core is None or not hasattr(_core, "reduce_inplace") or not hasattr(_core, "finalize_avg"):
            raise ConfigError("[daemon] the engine extension libmccl._core (with reduce_inplace and "
                              "finalize_avg) is not built; mccld reduces with its kernels: run `make build`")
        self._threads = threads or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="mccld-reduce") \
            if self._threads > 1 else None

    @property
    def threads(self) -> int:
        """How many threads reductions may use (pipelined ops size their stages by it)."""
        return self._threads

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def reduce(self, src: int, dst: int, count: int, dtype: int, op: int) -> None:
        esize = DTYPE_SIZE[dtype]
        if self._pool is None or count * esize < 2 * _CHUNK_BYTES:
            _core.reduce_inplace(src, dst, count, dtype, op)
            return
        step = max(1, -(-count // self._threads))
        futs = [self._pool.submit(_core.reduce_inplace, src + i * esize, dst + i * esize, min(step, count - i),
                                  dtype, op)
                for i in range(0, count, step)]
        for f in futs:
            f.result()

    def finalize_avg(self, addr: int, count: int, dtype: int, divisor: int) -> None:
        """Divide by the number of ranks (AVG is reduced as SUM); integers truncate toward zero."""
        _core.finalize_avg(addr, count, dtype, divisor)
