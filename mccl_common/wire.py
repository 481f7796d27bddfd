"""The dtype and reduce-op codes every component puts on the wire, in one place.

The numbers are the engine's (``mccl::DType`` / ``mccl::ReduceOp`` in
libmccl/csrc/core/dtype.h, exported as ``_core.DType`` / ``_core.ReduceOp``): the daemon client
sends them, mccld checks and reduces with them, the torch glue maps torch's dtypes onto
them. tests/project/test_layers.py compares these tables with the engine's enums, so a new dtype
added to the engine and not here fails CI instead of drifting.
"""

from __future__ import annotations

# mccl::DType order: append, never renumber.
DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool")
DTYPE_SIZE = (4, 8, 2, 2, 1, 1, 4, 8, 1)
F32, F64, F16, BF16, I8, U8, I32, I64, BOOL = range(len(DTYPE_NAMES))
FLOAT_DTYPES = frozenset((F32, F64, F16, BF16))

# mccl::ReduceOp order.
OP_NAMES = ("sum", "avg", "min", "max", "product", "band", "bor", "bxor")
SUM, AVG, MIN, MAX, PROD, BAND, BOR, BXOR = range(len(OP_NAMES))
BITWISE_OPS = frozenset((BAND, BOR, BXOR))

MAX_TAG = (1 << 32) - 1        # the engine's point-to-point tag range, kept through mccld


def bad_reduce(dtype: int, op: int) -> str | None:
    """Why (dtype, op) cannot be reduced, or None if it can."""
    if not (isinstance(dtype, int) and 0 <= dtype < len(DTYPE_NAMES)):
        return f"unknown dtype code {dtype!r} (0..{len(DTYPE_NAMES) - 1}: {', '.join(DTYPE_NAMES)})"
    if not (isinstance(op, int) and 0 <= op < len(OP_NAMES)):
        return f"unknown reduce op code {op!r} (0..{len(OP_NAMES) - 1}: {', '.join(OP_NAMES)})"
    if op in BITWISE_OPS and dtype in FLOAT_DTYPES:
        return f"reduce op {OP_NAMES[op]} is not defined on floating-point dtype {DTYPE_NAMES[dtype]}"
    return None
