"""The daemon's local reduction pool: combines the buffers of this host's ranks.

The arithmetic is the engine's (``_core.reduce_inplace`` / ``_core.finalize_avg``), the
one place reductions live; this file only checks codes and splits large buffers across
a few threads (the kernels release the GIL).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from mccl_common.errors import ConfigError

try:
    from libmccl import _core
except ImportError:  # reported when a pool is created: single-host jobs need it too
    _core = None

from mccl_common.wire import DTYPE_SIZE, bad_reduce

_CHUNK_BYTES = 4 << 20


def check(dtype: int, op: int) -> None:
    why = bad_reduce(dtype, op)
    if why is not None:
        raise ConfigError(f"[daemon] {why}; client and daemon releases differ, or use an integer or bool "
                          "tensor for bitwise ops")


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
