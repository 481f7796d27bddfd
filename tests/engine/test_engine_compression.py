"""Compressed all-reduce and reduce-scatter (MCCL_COMPRESSION; algorithms/compressed.cc).

Ranks are threads; data is N(0,1). Every mode at 2-9 ranks (non-powers of two included),
every float dtype a codec takes: every rank ends with the same bits, the error against the
exact float64 sum stays within the measured bounds (docs/compression.md) and does not grow
with N, small ops and other ops stay exact, and error feedback makes the mean of repeated
all-reduces of one buffer converge to the exact sum.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import CollectiveMismatch, CollectiveTimeout, MCCLError
from support.engine import AVG, DT, MAX, SUM, make_options, ptr, ranks, run_ranks

pytestmark = pytest.mark.timeout(120)

BF16 = int(_core.DType.bfloat16)
# Relative L2 error of one all-reduce of N(0,1) data against the float64 sum (measured at
# 2-9 ranks: int8 0.73-0.82 %, bf16 0.20-0.23 %, fp16 0.03 %; docs/compression.md). The
# issue's 0.5 % for int8 is out of reach of 8 bits per element with two roundings (see there).
BOUND = {"int8": 0.0095, "bf16": 0.003, "fp16": 0.0005}
COUNT = 100_003  # odd: chunks and int8 blocks of unequal length


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def as_f64(a: np.ndarray, dtype: str) -> np.ndarray:
    return from_bf16(a).astype(np.float64) if dtype == "bfloat16" else a.astype(np.float64)


def inputs(n: int, count: int, dtype: str, seed: int = 0) -> list[np.ndarray]:
    xs = [np.random.default_rng(seed * 100 + r).standard_normal(count).astype(np.float32) for r in range(n)]
    if dtype == "bfloat16":
        return [to_bf16(x) for x in xs]
    return [x.astype(dtype) for x in xs]


def code(dtype: str) -> int:
    return BF16 if dtype == "bfloat16" else DT[np.dtype(dtype)]


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def allreduce_all(comms, xs, dtype, op=SUM):
    def body(r, c):
        a = xs[r].copy()
        c.wait(c.allreduce(ptr(a), a.size, code(dtype), op), 60.0)
        return a
    return run_ranks(comms, body)


CASES = [("int8", "float32"), ("int8", "bfloat16"), ("int8", "float16"), ("bf16", "float32"), ("fp16", "float32")]


@pytest.mark.parametrize("n", [2, 3, 5, 8, 9])
def test_every_mode_is_bit_identical_on_every_rank_and_within_its_error(n):
    for codec in ("int8", "bf16", "fp16"):
        with ranks(n, opts=make_options(compression=codec, compression_feedback=False)) as comms:
            for c2, dtype in CASES:
                if c2 != codec:
                    continue
                xs = inputs(n, COUNT, dtype, seed=n)
                ref = np.sum([as_f64(x, dtype) for x in xs], axis=0)
                for op in (SUM, AVG):
                    outs = allreduce_all(comms, xs, dtype, op)
                    for o in outs[1:]:
                        assert o.tobytes() == outs[0].tobytes(), f"{codec} {dtype} ranks differ"
                    want = ref if op == SUM else ref / n
                    err = rel_err(as_f64(outs[0], dtype), want)
                    # 16-bit inputs carry their own rounding of the result (~0.2 % for bfloat16).
                    bound = BOUND[codec] + (0.003 if dtype == "bfloat16" else 0.0005 if dtype == "float16" else 0)
                    assert err <= bound, f"{codec} {dtype} n={n}: error {err:.4%} > {bound:.2%}"
                    assert err > 1e-6, "the op was not compressed"


@pytest.mark.parametrize("n", [3, 4])
def test_reduce_scatter_every_mode(n):
    count = 50_001
    for codec, dtype in CASES:
        with ranks(n, opts=make_options(compression=codec, compression_feedback=False)) as comms:
            xs = inputs(n, count * n, dtype, seed=7)
            ref = np.sum([as_f64(x, dtype) for x in xs], axis=0)

            def body(r, c):
                out = np.zeros(count, dtype=xs[r].dtype)
                c.wait(c.reduce_scatter(ptr(xs[r]), ptr(out), count, code(dtype), SUM), 60.0)
                return out
            outs = run_ranks(comms, body)
            for r, o in enumerate(outs):
                err = rel_err(as_f64(o, dtype), ref[r * count:(r + 1) * count])
                # Only contributions are encoded (the owner's sum never travels): less than all-reduce.
                assert 1e-7 < err <= BOUND[codec] + 0.003, f"{codec} {dtype} rank {r}: {err:.4%}"


def test_int8_error_does_not_grow_with_ranks():
    errs = {}
    for n in (2, 8):
        with ranks(n, opts=make_options(compression="int8", compression_feedback=False)) as comms:
            xs = inputs(n, 1 << 18, "float32", seed=3)
            ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
            errs[n] = rel_err(allreduce_all(comms, xs, "float32")[0].astype(np.float64), ref)
    assert errs[8] <= 1.5 * errs[2], errs


def test_small_ops_other_ops_and_dtypes_stay_exact():
    n, small = 3, 1000  # 4000 bytes, below MCCL_COMPRESSION_MIN_BYTES (64K)
    with ranks(n, opts=make_options(compression="int8")) as comms:
        ints = [np.random.default_rng(r).integers(-8, 9, 200_000).astype(np.float32) for r in range(n)]
        exact = np.sum(ints, axis=0)
        outs = allreduce_all(comms, [x[:small].copy() for x in ints], "float32")
        for o in outs:
            np.testing.assert_array_equal(o, exact[:small])
        for o in allreduce_all(comms, ints, "float32", MAX):  # MAX is never compressed
            np.testing.assert_array_equal(o, np.max(ints, axis=0))
        f64 = [x.astype(np.float64) for x in ints]
        for o in allreduce_all(comms, f64, "float64"):  # no codec takes float64
            np.testing.assert_array_equal(o, exact.astype(np.float64))
        # A large float32 sum of small integers is compressed, so it is not exact.
        assert not np.array_equal(allreduce_all(comms, ints, "float32")[0], exact)


def test_off_is_exact():
    n = 3
    with ranks(n, opts=make_options(compression="off")) as comms:
        ints = [np.random.default_rng(r).integers(-8, 9, 300_000).astype(np.float32) for r in range(n)]
        for o in allreduce_all(comms, ints, "float32"):
            np.testing.assert_array_equal(o, np.sum(ints, axis=0))


def repeated_mean(comms, xs, steps, views=None):
    """The mean of `steps` all-reduces of the same inputs, each through the same buffer per rank."""
    def body(r, c):
        buf = np.empty_like(xs[r])
        total = np.zeros(xs[r].size, np.float64)
        for _ in range(steps):
            buf[:] = xs[r]
            c.wait(c.allreduce(ptr(buf), buf.size, DT[buf.dtype], SUM), 60.0)
            total += buf
        return total / steps
    return run_ranks(comms, body)


@pytest.mark.parametrize("codec", ["int8", "bf16"])
def test_error_feedback_mean_converges_to_the_exact_sum(codec):
    n, steps = 3, 16
    xs = inputs(n, 1 << 17, "float32", seed=5)
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
    errs = {}
    for fb in (False, True):
        with ranks(n, opts=make_options(compression=codec, compression_feedback=fb)) as comms:
            single = rel_err(allreduce_all(comms, xs, "float32")[0].astype(np.float64), ref)
            means = repeated_mean(comms, xs, steps)
            for m in means[1:]:
                assert m.tobytes() == means[0].tobytes()
            errs[fb] = (single, rel_err(means[0], ref))
    # Without feedback every step rounds the same way: the mean is as wrong as one op.
    assert errs[False][1] == pytest.approx(errs[False][0], rel=0.01), errs
    # With it, the error of the mean shrinks about as 1/steps.
    assert errs[True][1] < errs[True][0] / 4, errs


def test_a_resized_buffer_starts_without_residual():
    """A DDP bucket rebuilt at another size over the same memory: its first op is what an op
    without any feedback gives, bit for bit."""
    n, big, small = 2, 1 << 17, 1 << 16
    xs = inputs(n, big, "float32", seed=9)
    with ranks(n, opts=make_options(compression="int8", compression_feedback=False)) as comms:
        fresh = allreduce_all(comms, [x[:small].copy() for x in xs], "float32")[0]
    with ranks(n, opts=make_options(compression="int8", compression_feedback=True)) as comms:
        def body(r, c):
            buf = np.empty(big, np.float32)
            for _ in range(3):  # leaves a residual for (buf, big)
                buf[:] = xs[r]
                c.wait(c.allreduce(ptr(buf), big, DT[buf.dtype], SUM), 60.0)
            first = buf[:small]
            first[:] = xs[r][:small]
            c.wait(c.allreduce(ptr(first), small, DT[buf.dtype], SUM), 60.0)
            again = first.copy()
            first[:] = xs[r][:small]
            c.wait(c.allreduce(ptr(first), small, DT[buf.dtype], SUM), 60.0)
            return again, first.copy()
        outs = run_ranks(comms, body)
    assert outs[0][0].tobytes() == fresh.tobytes()
    assert outs[0][1].tobytes() != fresh.tobytes()  # the second op carries the first one's residual


def test_ranks_that_disagree_on_compression_fail_with_a_mismatch():
    import random

    from support.engine import job_secret, run_threads
    opts = [make_options(compression="int8", timeout_s=10.0), make_options(compression="off", timeout_s=10.0)]
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(2)]
    addrs = [lst.address for lst in listeners]
    cid = random.getrandbits(64)
    comms = run_threads(2, lambda r: _core.Communicator(r, 2, cid, listeners[r], addrs, opts[r], None,
                                                        secret=job_secret(opts[r])))
    try:
        def body(r, c):
            a = np.ones(1 << 16, np.float32)
            with pytest.raises(CollectiveMismatch, match="compressed-int8"):
                c.wait(c.allreduce(ptr(a), a.size, DT[a.dtype], SUM), 30.0)
        run_ranks(comms, body)
    finally:
        run_threads(2, lambda r: comms[r].shutdown(5.0))


def test_codec_round_trip_and_non_finite_blocks():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    x[130] = np.inf
    enc = np.zeros(_core.compress_encoded_bytes("int8", x.size), np.uint8)
    _core.compress_encode("int8", DT[x.dtype], ptr(x), x.size, ptr(enc))
    out = np.empty_like(x)
    _core.compress_decode("int8", ptr(enc), x.size, DT[x.dtype], ptr(out))
    block = _core.compress_block
    bad = slice(130 // block * block, (130 // block + 1) * block)
    assert np.isnan(out[bad]).all()  # a non-finite gradient stays visible
    keep = np.ones(x.size, bool)
    keep[bad] = False
    assert rel_err(out[keep].astype(np.float64), x[keep].astype(np.float64)) < 0.008
    z = np.zeros(500, np.float32)
    enc = np.zeros(_core.compress_encoded_bytes("int8", z.size), np.uint8)
    _core.compress_encode("int8", DT[z.dtype], ptr(z), z.size, ptr(enc))
    _core.compress_decode("int8", ptr(enc), z.size, DT[z.dtype], ptr(out[:500]))
    assert (out[:500] == 0).all()
    with pytest.raises(Exception, match="does not encode"):
        _core.compress_encode("bf16", DT[np.dtype(np.float64)], ptr(z), 1, ptr(enc))


def test_16_bit_codecs_round_to_nearest_even_and_keep_non_finite_values():
    """bf16/fp16 encode as numpy rounds (nearest-even, fp16 overflowing to inf past 65504), NaN
    stays NaN, and the residual holds exactly what the code dropped, nothing where the code is
    not finite. Long enough for the vector loops (x86-64: the AVX2/F16C ones) and a tail."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(4099) * np.exp2(rng.integers(-30, 20, 4099))).astype(np.float32)
    x[[3, 17, 40]] = [np.nan, np.inf, -np.inf]
    x[[5, 6, 4098]] = [1e6, -7e4, 65519.0]     # fp16: inf, -inf, rounds down to 65504
    x[7] = -np.float32(np.nan)
    for codec in ("bf16", "fp16"):
        r0 = (rng.standard_normal(x.size) * 1e-3).astype(np.float32)
        r0[3] = 0
        res = r0.copy()
        enc = np.zeros(_core.compress_encoded_bytes(codec, x.size), np.uint8)
        _core.compress_encode(codec, DT[x.dtype], ptr(x), x.size, ptr(enc), ptr(res))
        v = x + r0
        with np.errstate(over="ignore", invalid="ignore"):
            want = from_bf16(to_bf16(v)) if codec == "bf16" else v.astype(np.float16).astype(np.float32)
        out = np.empty_like(x)
        _core.compress_decode(codec, ptr(enc), x.size, DT[x.dtype], ptr(out))
        nan = np.isnan(v)
        assert np.isnan(out[nan]).all(), codec
        np.testing.assert_array_equal(out[~nan], want[~nan], err_msg=codec)
        fin = np.isfinite(out)
        with np.errstate(invalid="ignore"):
            np.testing.assert_array_equal(res[fin], (v - out)[fin], err_msg=codec)
        assert (res[~fin] == 0).all(), codec
        acc = np.ones_like(x)
        _core.compress_decode_add(codec, ptr(enc), x.size, ptr(acc))
        np.testing.assert_array_equal(acc[~nan], (np.float32(1) + out)[~nan], err_msg=codec)
        if codec == "fp16":
            assert out[5] == np.inf and out[6] == -np.inf and out[4098] == 65504.0


def test_int8_block_of_tiny_values_is_sent_as_zeros_and_carried_whole():
    """Below 1e-36 a block's 127 / absmax would overflow: the block goes as zeros (scale 0) and
    error feedback keeps all of it; zeros stay exactly zero next to it."""
    block = _core.compress_block
    x = np.zeros(3 * block, np.float32)
    x[:block] = np.float32(1e-38) * np.arange(block, dtype=np.float32) / block
    x[2 * block:] = np.random.default_rng(9).standard_normal(block).astype(np.float32)
    res = np.zeros_like(x)
    enc = np.zeros(_core.compress_encoded_bytes("int8", x.size), np.uint8)
    _core.compress_encode("int8", DT[x.dtype], ptr(x), x.size, ptr(enc), ptr(res))
    out = np.full_like(x, 5.0)
    _core.compress_decode("int8", ptr(enc), x.size, DT[x.dtype], ptr(out))
    assert (out[:2 * block] == 0).all()
    np.testing.assert_array_equal(res[:block], x[:block])
    assert rel_err(out[2 * block:].astype(np.float64), x[2 * block:].astype(np.float64)) < 0.008
    np.testing.assert_array_equal(res[2 * block:], x[2 * block:] - out[2 * block:])


def test_a_ticketed_op_starts_each_group_as_its_input_is_ready_and_announces_it_done():
    """Device buffers (in-process CUDA/MPS staging) and mccld's client feed the op through
    tickets: each group of chunks reads only its own range of the input, so the first group
    (here the first half: 2 groups) finishes, and ``done`` covers it, while the second half
    is not even produced; then the rest, with the same bits on both ranks."""
    n, count = 2, 1 << 18
    xs = inputs(n, count, "float32", seed=4)
    with ranks(n, opts=make_options(compression="int8", pipeline_bytes=64 << 10)) as comms:
        def body(r, c):
            ready, done = _core.Ticket(), _core.Ticket()
            buf = np.zeros(count, np.float32)
            op = c.allreduce(ptr(buf), count, DT[buf.dtype], SUM, ready=ready, done=done)
            half = buf.nbytes // 2
            buf[: count // 2] = xs[r][: count // 2]
            ready.signal(half)
            done.wait(half, 30.0)
            assert done.value == half  # the second group's input is not there yet
            first = buf[: count // 2].copy()
            buf[count // 2:] = xs[r][count // 2:]
            ready.signal(buf.nbytes)
            c.wait(op, 30.0)
            assert done.value == buf.nbytes
            np.testing.assert_array_equal(first, buf[: count // 2])  # final when announced
            return buf
        outs = run_ranks(comms, body)
    assert outs[0].tobytes() == outs[1].tobytes()
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
    assert 1e-6 < rel_err(outs[0].astype(np.float64), ref) <= BOUND["int8"]


def _produce(buf: np.ndarray, src: np.ndarray, ready, base: int, piece: int, seed: int) -> None:
    """Writes src into buf in pieces of varying size with random pauses, raising ``ready``
    after each (as a staging copy or mccld's client does)."""
    rnd = random.Random(seed)
    raw, srcb = buf.view(np.uint8), src.view(np.uint8)
    off = 0
    while off < src.nbytes:
        k = min(src.nbytes - off, rnd.choice([piece // 3, piece, 3 * piece]))
        if rnd.random() < 0.3:
            time.sleep(rnd.random() * 0.004)
        raw[off:off + k] = srcb[off:off + k]
        off += k
        ready.signal(base + off)


@pytest.mark.parametrize("codec,dtype", [("int8", "float32"), ("bf16", "float32"), ("int8", "bfloat16")])
def test_input_arriving_in_pieces_gives_the_bits_of_the_unticketed_op(codec, dtype):
    """Three rounds of one buffer (error feedback carried between them) at 3 ranks, in 4+
    groups: fed piece by piece with pauses through tickets, every rank ends each round with
    exactly the bits of the same rounds run without tickets, and ``done`` covers each op."""
    n, count, rounds = 3, (1 << 20) + 3, 3
    piece = 96 << 10
    xs = [inputs(n, count, dtype, seed=10 + i) for i in range(rounds)]

    def run(ticketed: bool) -> list[list[bytes]]:
        with ranks(n, opts=make_options(compression=codec)) as comms:
            def body(r, c):
                buf = np.zeros(count, xs[0][r].dtype)
                ready, done = _core.Ticket(), _core.Ticket()
                base, outs = 0, []
                for i in range(rounds):
                    if ticketed:
                        buf[:] = 0
                        op = c.allreduce(ptr(buf), count, code(dtype), SUM, ready=ready, done=done, base=base)
                        _produce(buf, xs[i][r], ready, base, piece, seed=7 * r + i)
                        c.wait(op, 60.0)
                        assert done.value == base + buf.nbytes
                        base += buf.nbytes
                    else:
                        buf[:] = xs[i][r]
                        c.wait(c.allreduce(ptr(buf), count, code(dtype), SUM), 60.0)
                    outs.append(buf.tobytes())
                return outs
            return run_ranks(comms, body)

    plain, ticketed = run(False), run(True)
    for i in range(rounds):
        assert len({plain[r][i] for r in range(n)}) == 1
        for r in range(n):
            assert ticketed[r][i] == plain[r][i], (i, r)


def test_input_that_never_becomes_ready_times_out_naming_the_ticket():
    """Rank 0's producer stops halfway through its first group (4 groups of 1 MB): the op ends
    on both ranks (rank 0 with a CollectiveTimeout naming its input, the ready ticket's value
    and what it needed), and ``done`` is poisoned so nobody waits for results that never come."""
    n, count = 2, 1 << 20
    with ranks(n, opts=make_options(compression="int8", timeout_s=1.0)) as comms:
        dones = [_core.Ticket() for _ in range(n)]
        errors: list = [None] * n

        def body(r, c):
            ready = _core.Ticket()
            buf = np.ones(count, np.float32)
            op = c.allreduce(ptr(buf), count, DT[buf.dtype], SUM, ready=ready, done=dones[r])
            ready.signal(buf.nbytes if r == 1 else buf.nbytes // 8)
            try:
                c.wait(op, 30.0)
            except MCCLError as e:
                errors[r] = e

        run_ranks(comms, body)
    e = errors[0]
    assert isinstance(e, CollectiveTimeout), errors
    msg = str(e)
    assert msg.startswith("Timed out after 1.0 s: ") and "[compressed all-reduce] waited for this rank's input" in msg
    assert f"ready ticket at {count * 4 // 8}, needs " in msg  # the ticket, where it stands, and the need
    assert isinstance(errors[1], MCCLError)  # the peer's op ends too, not hangs
    assert all(d.poisoned for d in dones)


def test_the_cost_model_counts_the_codecs_time():
    alpha, beta, gamma = 50e-6, 1 / 0.125e9, 0.0   # 1 Gbit/s
    nbytes = 64 << 20
    ring = _core.predict("allreduce", "ring", 8, nbytes, alpha, beta, gamma)
    int8 = _core.predict("allreduce", "compressed-int8", 8, nbytes, alpha, beta, gamma)
    bf16 = _core.predict("allreduce", "compressed-bf16", 8, nbytes, alpha, beta, gamma)
    # Fewer bytes on a slow link: faster, but not by the whole byte ratio (the codec's CPU time).
    assert int8 < bf16 < ring
    assert int8 > ring * 1.0625 / 4 and bf16 > ring / 2
    # On a link faster than the codec, compression would cost more than it saves.
    fast = 1 / 100e9
    assert (_core.predict("allreduce", "compressed-int8", 8, nbytes, alpha, fast, gamma)
            > _core.predict("allreduce", "ring", 8, nbytes, alpha, fast, gamma))
    with pytest.raises(Exception, match="no algorithm"):
        _core.predict("broadcast", "compressed-int8", 8, nbytes, alpha, beta, gamma)


def test_a_buffer_left_unused_for_two_rounds_loses_its_residual():
    """A freed bucket's residual is not kept for ever: once the other buffers have been reduced
    twice over (2 x entries + 16 compressed ops) without it, it is dropped, and the buffer's
    next op is what an op without feedback gives, bit for bit."""
    n, count = 2, 1 << 15   # 128 KB: compressed
    xs = inputs(n, count, "float32", seed=12)
    with ranks(n, opts=make_options(compression="int8", compression_feedback=False)) as comms:
        fresh = allreduce_all(comms, xs, "float32")[0]
    with ranks(n, opts=make_options(compression="int8")) as comms:
        def body(r, c):
            a, b = np.empty(count, np.float32), np.empty(count, np.float32)
            outs = []
            for others in (2, 40):   # a few ops on another buffer, then more than two rounds' worth
                a[:] = xs[r]
                c.wait(c.allreduce(ptr(a), count, DT[a.dtype], SUM), 60.0)   # leaves a residual
                for _ in range(others):
                    b[:] = xs[r]
                    c.wait(c.allreduce(ptr(b), count, DT[b.dtype], SUM), 60.0)
                a[:] = xs[r]
                c.wait(c.allreduce(ptr(a), count, DT[a.dtype], SUM), 60.0)
                outs.append(a.copy())
            return outs
        kept, dropped = run_ranks(comms, body)[0]
    assert kept.tobytes() != fresh.tobytes()      # the residual of the op before was added
    assert dropped.tobytes() == fresh.tobytes()   # gone after 40 ops on another buffer


@pytest.mark.parametrize("n", [3, 5])
def test_codec_threads_give_the_same_bits_as_the_worker_alone(n):
    """MCCL_COMPRESSION_THREADS splits each large chunk's encode, sum and decode into parts on
    helper threads: every mode, all-reduce (two ops, so the error feedback of the first feeds
    the second) and reduce-scatter, gives exactly the bytes of one thread, at a non-power-of-two
    N, with chunks of unequal length that end in short int8 blocks."""
    count = 3 * (1 << 20) + 17          # chunks of ~256K elements: 4 parts of whole blocks
    names = [t.name for t in __import__("threading").enumerate()]
    for codec, dtype in CASES:
        xs = inputs(n, count, dtype, seed=21)
        got = {}
        for threads in (1, 4):
            with ranks(n, opts=make_options(compression=codec, compression_threads=threads)) as comms:
                first = allreduce_all(comms, xs, dtype)
                second = allreduce_all(comms, xs, dtype, AVG)
                block = count // n

                def body(r, c):
                    out = np.zeros(block, dtype=xs[r].dtype)
                    c.wait(c.reduce_scatter(ptr(xs[r][: block * n]), ptr(out), block, code(dtype), SUM), 60.0)
                    return out
                scattered = run_ranks(comms, body)
            got[threads] = [o.tobytes() for o in first + second + scattered]
        assert got[4] == got[1], f"{codec} {dtype}: the codec threads changed the result"
        assert len(set(got[4][:n])) == 1 and len(set(got[4][n:2 * n])) == 1
    assert [t.name for t in __import__("threading").enumerate()] == names


def test_codec_threads_setting_out_of_range_is_a_config_error_naming_it():
    from mccl_common.errors import ConfigError
    from mccl_common.settings import EngineConfig, load
    assert load(EngineConfig, env={}).compression_threads == 1
    cfg = load(EngineConfig, env={"MCCL_COMPRESSION_THREADS": "4"})
    assert cfg.engine_options(_core.Options(), 30.0, 20.0).compression_threads == 4
    for bad in ("0", "65", "-1"):
        with pytest.raises(ConfigError, match="MCCL_COMPRESSION_THREADS"):
            load(EngineConfig, env={"MCCL_COMPRESSION_THREADS": bad})
    with pytest.raises(ConfigError, match="MCCL_COMPRESSION_THREADS"):
        load(EngineConfig, env={"MCCL_COMPRESSION_THREADS": "two"})
    # The engine checks it too (options built by hand, as pg_options are).
    with pytest.raises(ConfigError, match="compression_threads=0.*MCCL_COMPRESSION_THREADS"):
        with ranks(1, opts=make_options(compression="int8", compression_threads=0)):
            pass
