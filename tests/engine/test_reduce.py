"""The reduction kernels (csrc/reduce/reduce.cc) against torch's own CPU results.

Every kernel computes inout[i] = op(inout[i], in[i]); the reference is the matching
torch elementwise op on the same two tensors. Floats must agree bit for bit (NaN only
as "is NaN"; MIN/MAX only up to the sign of zero, which torch leaves unspecified).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from libmccl import _core
from mccl_common.errors import ConfigError

# Codes of mccl::DType / mccl::ReduceOp (csrc/core/dtype.h).
DTYPES = {
    torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
    torch.int8: 4, torch.uint8: 5, torch.int32: 6, torch.int64: 7, torch.bool: 8,
}
SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR = range(8)
OP_NAMES = {SUM: "SUM", AVG: "AVG", MIN: "MIN", MAX: "MAX", PRODUCT: "PRODUCT",
            BAND: "BAND", BOR: "BOR", BXOR: "BXOR"}
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.uint8, torch.int32, torch.int64)
LENGTHS = (0, 1, 7, 1000003)


def supported(dtype: torch.dtype, op: int) -> bool:
    if op in (BAND, BOR, BXOR):
        return dtype not in FLOATS
    if op == AVG:
        return dtype != torch.bool
    return True


def reference(op: int, inout: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    fn = {SUM: torch.add, AVG: torch.add, MIN: torch.minimum, MAX: torch.maximum,
          PRODUCT: torch.mul, BAND: torch.bitwise_and, BOR: torch.bitwise_or,
          BXOR: torch.bitwise_xor}[op]
    return fn(inout, inp)


def special_values(dtype: torch.dtype) -> list[float]:
    info = torch.finfo(dtype)
    return [0.0, -0.0, 1.0, -1.0, 0.5, 3.0, math.inf, -math.inf, math.nan, info.max, -info.max,
            info.tiny, -info.tiny, info.tiny / 4, info.eps, 1.0 + info.eps]


def random_tensor(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if dtype in INTS:
        info = torch.iinfo(dtype)  # the full range, so SUM and PRODUCT overflow and wrap
        return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * 4
    # Sprinkle values that exercise rounding, overflow, underflow and NaN/inf paths.
    specials = torch.tensor(special_values(dtype), dtype=torch.float64)
    idx = torch.randint(0, n, (n // 16 + 1,), generator=gen) if n else torch.empty(0, dtype=torch.long)
    x[idx] = specials[torch.randint(0, len(specials), (len(idx),), generator=gen)]
    return x.to(dtype)


def assert_same(got: torch.Tensor, want: torch.Tensor, op: int) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype not in FLOATS:
        if got.dtype == torch.bool and got.numel():  # stored bytes must be normalized to 0/1
            assert int(got.view(torch.uint8).max()) <= 1
        bad = (got != want).nonzero()
        assert bad.numel() == 0, f"first mismatch at {bad[0].item()}: got {got[bad[0]]} want {want[bad[0]]}"
        return
    got_nan, want_nan = torch.isnan(got), torch.isnan(want)
    assert torch.equal(got_nan, want_nan), "NaN positions differ"
    g, w = got[~got_nan], want[~want_nan]
    if op in (MIN, MAX):
        bad = (g != w).nonzero()
    else:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
        bad = (g.view(bits) != w.view(bits)).nonzero()
    assert bad.numel() == 0, f"first mismatch: got {g[bad[0]].item()!r} want {w[bad[0]].item()!r}"


def run_reduce(op: int, inout: torch.Tensor, inp: torch.Tensor) -> None:
    _core.reduce_inplace(inp.data_ptr(), inout.data_ptr(), inp.numel(), DTYPES[inp.dtype], op)


CASES = [(d, op) for d in DTYPES for op in OP_NAMES if supported(d, op)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{str(d)[6:]}-{OP_NAMES[o]}" for d, o in CASES])
def test_matches_torch(dtype: torch.dtype, op: int, n: int) -> None:
    gen = torch.Generator().manual_seed(n * 131 + op * 7 + DTYPES[dtype])
    # Slice off the first element so the buffers start one element past an allocation.
    inout_full, in_full = random_tensor(dtype, n + 1, gen), random_tensor(dtype, n + 1, gen)
    inout, inp = inout_full[1:], in_full[1:]
    want = reference(op, inout.clone(), inp)
    before_in, before_head = in_full.clone(), inout_full[:1].clone()
    run_reduce(op, inout, inp)
    assert_same(inout, want, op)
    assert torch.equal(in_full.view(torch.uint8), before_in.view(torch.uint8)), "`in` was modified"
    assert torch.equal(inout_full[:1].view(torch.uint8), before_head.view(torch.uint8)), "wrote before the buffer"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", [SUM, MIN, MAX, PRODUCT])
def test_special_value_pairs(dtype: torch.dtype, op: int) -> None:
    pairs = list(itertools.product(special_values(dtype), repeat=2))
    inout = torch.tensor([a for a, _ in pairs], dtype=torch.float64).to(dtype)
    inp = torch.tensor([b for _, b in pairs], dtype=torch.float64).to(dtype)
    want = reference(op, inout.clone(), inp)
    run_reduce(op, inout, inp)
    assert_same(inout, want, op)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", [SUM, PRODUCT])
def test_every_16bit_pattern(dtype: torch.dtype, op: int) -> None:
    # All 65536 bit patterns (incl. subnormals, NaN payloads, +-inf) against random partners:
    # the float32 round trip and round-to-nearest-even must match torch bit for bit.
    gen = torch.Generator().manual_seed(op)
    inout = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    inp = torch.randint(-32768, 32768, (65536,), generator=gen, dtype=torch.int32).to(torch.int16).view(dtype)
    want = reference(op, inout.clone(), inp)
    run_reduce(op, inout, inp)
    assert_same(inout, want, op)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", FLOATS)
def test_min_max_signed_zero_is_order_independent(dtype: torch.dtype) -> None:
    # -0.0 orders below +0.0 so every rank ends with the same bits whatever the order.
    for op, want_negative in ((MIN, True), (MAX, False)):
        for a, b in ((0.0, -0.0), (-0.0, 0.0)):
            inout, inp = torch.tensor([a], dtype=dtype), torch.tensor([b], dtype=dtype)
            run_reduce(op, inout, inp)
            assert inout.item() == 0.0 and math.copysign(1.0, inout.item()) == (-1.0 if want_negative else 1.0)


@pytest.mark.timeout(30)
def test_integer_overflow_wraps() -> None:
    for dtype in INTS:
        info = torch.iinfo(dtype)
        inout = torch.tensor([info.max, info.min, info.max], dtype=dtype)
        inp = torch.tensor([1, -1 if info.min < 0 else 0, 2], dtype=dtype)
        run_reduce(SUM, inout, inp)
        assert inout.tolist() == [info.min, info.max if info.min < 0 else info.min, info.min + 1]
        inout = torch.tensor([info.max], dtype=dtype)
        run_reduce(PRODUCT, inout, torch.tensor([info.max], dtype=dtype))
        assert inout.item() == 1  # (2^k - 1)^2 == 1 mod 2^k, for signed and unsigned


@pytest.mark.timeout(30)
def test_bool_normalizes_nonzero_bytes() -> None:
    # Bytes other than 0/1 (e.g. from a uint8 view) count as true and come out as 1.
    raw_in = torch.tensor([2, 0, 4, 0, 255], dtype=torch.uint8)
    for op, want in ((BOR, [1, 1, 1, 0, 1]), (SUM, [1, 1, 1, 0, 1]), (MAX, [1, 1, 1, 0, 1]),
                     (BAND, [1, 0, 1, 0, 0]), (PRODUCT, [1, 0, 1, 0, 0]), (MIN, [1, 0, 1, 0, 0]),
                     (BXOR, [0, 1, 0, 0, 1])):
        raw_inout = torch.tensor([8, 3, 1, 0, 0], dtype=torch.uint8)
        _core.reduce_inplace(raw_in.data_ptr(), raw_inout.data_ptr(), 5, DTYPES[torch.bool], op)
        assert raw_inout.tolist() == want, OP_NAMES[op]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64])
def test_byte_misaligned_buffers(dtype: torch.dtype) -> None:
    # A segment inside a receive buffer can start at any byte; the kernels must not care.
    n, size = 1001, torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(5)
    a, b = random_tensor(dtype, n, gen), random_tensor(dtype, n, gen)
    want = reference(SUM, a.clone(), b)
    raw_a, raw_b = torch.zeros(n * size + 3, dtype=torch.uint8), torch.zeros(n * size + 1, dtype=torch.uint8)
    raw_a[3:] = a.view(torch.uint8)
    raw_b[1:] = b.view(torch.uint8)
    _core.reduce_inplace(raw_b.data_ptr() + 1, raw_a.data_ptr() + 3, n, DTYPES[dtype], SUM)
    assert_same(raw_a[3:].clone().view(dtype), want, SUM)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.bool])
@pytest.mark.parametrize("divisor", [1, 2, 3, 7])
def test_finalize_avg(dtype: torch.dtype, divisor: int) -> None:
    gen = torch.Generator().manual_seed(divisor)
    x = random_tensor(dtype, 1003, gen)[1:]
    if dtype in FLOATS:
        want = x / divisor
    else:  # integers truncate toward zero
        want = torch.div(x, divisor, rounding_mode="trunc")
    _core.finalize_avg(x.data_ptr(), x.numel(), DTYPES[dtype], divisor)
    assert_same(x, want, AVG)


@pytest.mark.timeout(30)
def test_avg_is_sum_then_divide() -> None:
    a = torch.tensor([-7, 7, -1, 100], dtype=torch.int32)
    b = torch.tensor([0, 0, 0, 27], dtype=torch.int32)
    _core.reduce_inplace(b.data_ptr(), a.data_ptr(), 4, DTYPES[torch.int32], AVG)
    _core.finalize_avg(a.data_ptr(), 4, DTYPES[torch.int32], 2)
    assert a.tolist() == [-3, 3, 0, 63]


@pytest.mark.timeout(30)
def test_unsupported_combinations_raise_config_error() -> None:
    x = torch.zeros(4)
    for dtype, op in itertools.product(DTYPES, OP_NAMES):
        assert _core.reduce_supported(DTYPES[dtype], op) == supported(dtype, op)
        if supported(dtype, op):
            continue
        with pytest.raises(ConfigError, match=rf"\[reduce\] {OP_NAMES[op]} is not defined for {str(dtype)[6:]}"):
            _core.reduce_inplace(x.data_ptr(), x.data_ptr(), 1, DTYPES[dtype], op)
    with pytest.raises(ConfigError, match="AVG is not defined for bool"):
        _core.finalize_avg(x.data_ptr(), 1, DTYPES[torch.bool], 2)
    with pytest.raises(ConfigError, match="unknown dtype code 99"):
        _core.reduce_inplace(x.data_ptr(), x.data_ptr(), 1, 99, SUM)
    with pytest.raises(ConfigError, match="unknown reduce op code 42"):
        _core.reduce_inplace(x.data_ptr(), x.data_ptr(), 1, 0, 42)
    with pytest.raises(ConfigError, match="divisor is 0"):
        _core.finalize_avg(x.data_ptr(), 4, 0, 0)
    with pytest.raises(ConfigError, match="null pointer"):
        _core.reduce_inplace(0, x.data_ptr(), 4, 0, SUM)
    assert not _core.reduce_supported(99, SUM) and not _core.reduce_supported(0, 42)
