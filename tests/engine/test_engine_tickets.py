"""Segment tickets (libmccl/csrc/core/ticket.h) and the all-reduce that honours them.

Ranks are threads of this process (test_engine_helpers); the producer of each rank's
buffer is another thread that writes the buffer piece by piece with random delays and
raises ``ready``, so the engine must never read a piece before its ticket covers it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import threading
import time

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import AbortedError, CollectiveMismatch, CollectiveTimeout, ConfigError, MCCLError
from support.engine import AVG, DT, MAX, SUM, make_options, ptr, ranks, run_ranks, run_threads

PIPE = 16 << 10  # pipeline bytes small enough that a 1 MB op has 64 pieces


# -- the ticket itself ---------------------------------------------------------------------

def test_signal_is_an_atomic_max_and_wakes_a_waiter():
    t = _core.Ticket()
    assert t.value == 0
    t.signal(10)
    t.signal(3)  # lower: ignored
    assert t.value == 10
    woke = []
    th = threading.Thread(target=lambda: (t.wait(25, 10.0), woke.append(time.monotonic())))
    th.start()
    time.sleep(0.1)
    assert not woke
    start = time.monotonic()
    t.signal(25)
    th.join(5)
    assert woke and woke[0] - start < 1.0  # woken, not timed out (10 s)
    t.wait(5, 0.0)  # already reached: returns at once


def test_wait_times_out_and_poison_fails_waiters():
    t = _core.Ticket()
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"^Timed out after 0\.2 s: \[test\] input waited"):
        t.wait(1, 0.2, "[test] input")
    assert 0.19 < time.monotonic() - t0 < 2.0
    errs = []

    def waiter():
        try:
            t.wait(1 << 40, 30.0)
        except AbortedError as e:
            errs.append(e)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.05)
    t.poison()
    th.join(5)
    assert len(errs) == 1 and "poisoned" in str(errs[0])
    assert t.poisoned and t.value == _core.Ticket.POISON
    t.signal(5)  # a poisoned ticket stays poisoned
    with pytest.raises(AbortedError):
        t.wait(0, 1.0)  # even a target it passed: the producer's data is not to be trusted
    with pytest.raises(ConfigError, match="poison"):
        _core.Ticket().signal(_core.Ticket.POISON)


def test_view_of_a_shared_word_crosses_processes():
    """A word in a MAP_SHARED mapping: the child signals, the parent's futex wait wakes."""
    m = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    with pytest.raises(ConfigError, match="aligned"):
        _core.Ticket.at(addr + 4)
    t = _core.Ticket.at(addr + 64)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            time.sleep(0.2)
            _core.Ticket.at(addr + 64).signal(4096)
        finally:
            os._exit(0)
    try:
        start = time.monotonic()
        t.wait(4096, 10.0)
        assert time.monotonic() - start < 5.0
        assert t.value == 4096
    finally:
        os.waitpid(pid, 0)


# -- the engine honours them -----------------------------------------------------------------

def _produce(buf: np.ndarray, src: np.ndarray, ready, base: int, piece: int, seed: int) -> None:
    """Writes src into buf piece by piece with random pauses, raising ``ready`` after each."""
    rnd = random.Random(seed)
    raw, nb = buf.view(np.uint8), src.nbytes
    srcb = src.view(np.uint8)
    off = 0
    while off < nb:
        n = min(nb - off, rnd.choice([piece // 3, piece, 3 * piece]) or 1)
        if rnd.random() < 0.3:
            time.sleep(rnd.random() * 0.004)
        raw[off:off + n] = srcb[off:off + n]
        off += n
        ready.signal(base + off)


@pytest.mark.parametrize("n", [2, 3])
def test_pipelined_allreduce_with_a_delayed_producer_is_exact(n):
    counts = [1 << 18, 100_003, 7, 1 << 18]  # 1 MB f32 (64 pieces), odd, one-round, again
    with ranks(n, opts=make_options(pipeline_bytes=PIPE)) as comms:
        tickets = [(_core.Ticket(), _core.Ticket()) for _ in range(n)]
        inputs = [[np.random.default_rng(100 * r + i).integers(-50, 50, c).astype(np.float32)
                   for i, c in enumerate(counts)] for r in range(n)]

        def body(r, c):
            ready, done = tickets[r]
            base, outs = 0, []
            for i, count in enumerate(counts):
                buf = np.full(count, np.nan, dtype=np.float32)  # garbage until produced
                op = c.allreduce(ptr(buf), count, DT[buf.dtype], SUM if i % 2 == 0 else AVG,
                                 ready=ready, done=done, base=base)
                _produce(buf, inputs[r][i], ready, base, PIPE, seed=r * 31 + i)
                done.wait(base + buf.nbytes, 60.0)
                outs.append(buf.copy())  # final once done covers it, before the op completes
                c.wait(op, 60.0)
                base += buf.nbytes
            return outs

        results = run_ranks(comms, body)
    for i, count in enumerate(counts):
        total = sum(inputs[r][i] for r in range(n))
        ref = total if i % 2 == 0 else total / np.float32(n)
        for r in range(n):
            np.testing.assert_array_equal(results[r][i], ref)


def test_done_advances_piece_by_piece():
    """Results become final in prefix order while the producer is still writing."""
    count = 1 << 18
    with ranks(2, opts=make_options(pipeline_bytes=PIPE)) as comms:
        seen = [[], []]

        def body(r, c):
            ready, done = _core.Ticket(), _core.Ticket()
            buf = np.zeros(count, dtype=np.float32)
            op = c.allreduce(ptr(buf), count, DT[buf.dtype], SUM, ready=ready, done=done)
            half = buf.nbytes // 2
            buf[:] = r + 1
            ready.signal(half)
            done.wait(half, 30.0)
            seen[r].append(done.value)
            np.testing.assert_array_equal(buf[:count // 2], 3.0)  # the first half is final
            ready.signal(buf.nbytes)
            c.wait(op, 30.0)
            assert done.value == buf.nbytes

        run_ranks(comms, body)
    # done stopped between the halves: it covered the first before the rest was ready
    assert all(count * 2 <= v[0] < count * 4 for v in seen)


def test_done_rises_while_the_ring_runs_when_every_piece_is_ready_at_once():
    """A producer ahead of the links (mccld's client copies in far faster than the wire)
    makes every piece ready at the start; the ring keeps only a few in flight, so the first
    pieces finish, and ``done`` rises, long before the last: a consumer copies out behind
    the ring. (Started all at once, every piece finished at the end.)"""
    count = 4 << 20   # 16 MB in 256 KB pieces: 64 of them
    with ranks(4, opts=make_options(pipeline_bytes=256 << 10)) as comms:
        seen: list[list[int]] = [[] for _ in comms]

        def body(r, c):
            ready, done = _core.Ticket(), _core.Ticket()
            buf = np.full(count, r + 1, dtype=np.float32)
            ready.signal(buf.nbytes)
            op = c.allreduce(ptr(buf), count, DT[buf.dtype], SUM, ready=ready, done=done)
            while done.value < buf.nbytes:
                seen[r].append(done.value)
                time.sleep(0.0002)
            c.wait(op, 60.0)
            np.testing.assert_array_equal(buf, 10.0)

        run_ranks(comms, body)
    total = count * 4
    for r, values in enumerate(seen):
        partial = sorted({v for v in values if 0 < v < total})
        # Several distinct prefixes, the first of them in the op's first half.
        assert len(partial) >= 3 and partial[0] <= total // 2, (r, partial[:10], len(values))


def test_waiting_for_a_slow_producer_uses_little_cpu():
    """While its input is not ready the ring sleeps in its 2 ms slices: it polled with a
    timeout rounded down to whole milliseconds, so the last one of every slice was a
    busy loop of poll(0) (about half a core per rank)."""
    count = 1 << 18
    stall_s = 1.0
    with ranks(2, opts=make_options(pipeline_bytes=PIPE)) as comms:
        def body(r, c):
            ready = _core.Ticket()
            buf = np.ones(count, dtype=np.float32)
            op = c.allreduce(ptr(buf), count, DT[buf.dtype], SUM, ready=ready, done=_core.Ticket())
            time.sleep(stall_s)  # every rank's engine waits for its first piece meanwhile
            ready.signal(buf.nbytes)
            c.wait(op, 30.0)

        cpu = time.process_time()
        run_ranks(comms, body)
        cpu = time.process_time() - cpu
    # Both ranks' engines (and this process's Python threads) for the whole stall: the
    # spin cost ~0.5 s per rank; sleeping, a few ms.
    assert cpu < 0.25 * stall_s, f"{cpu:.2f} s of CPU while waiting {stall_s} s for the producers"


def test_a_ring_waiting_for_its_first_piece_starts_when_the_producer_signals():
    """The ready ticket of a producer in another thread or process cannot wake poll():
    waiting for the first piece in poll slices noticed it up to 2 ms late (median 1.2-2.2
    ms from signal to result for a one-piece op here); sleeping on the ticket, ~0.2 ms."""
    count = 1 << 16  # 256 KB, one piece
    # Frames bare: this measures the wake-up, and tagging 256 KB each way (~0.4 ms on a
    # loaded core) would swamp the 0.8 ms bound. The protected paths have their own tests.
    with ranks(2, opts=make_options(wire_security=_core.WireSecurity.off)) as comms:
        lat = [[], []]

        def body(r, c):
            ready, done = _core.Ticket(), _core.Ticket()
            buf = np.ones(count, dtype=np.float32)
            for i in range(40):
                base = i * buf.nbytes
                op = c.allreduce(ptr(buf), count, DT[buf.dtype], SUM, ready=ready, done=done, base=base)
                time.sleep(0.003)  # the engine is waiting for the piece by now
                t0 = time.perf_counter()
                ready.signal(base + buf.nbytes)
                done.wait(base + buf.nbytes, 30.0)
                lat[r].append(time.perf_counter() - t0)
                c.wait(op, 30.0)

        run_ranks(comms, body)
    medians = [sorted(v)[len(v) // 2] for v in lat]
    assert max(medians) < 0.8e-3, f"signal to result took {[f'{m * 1e3:.2f}' for m in medians]} ms (median)"


def test_pieces_grow_until_ring_messages_reach_a_megabyte():
    """A piece is at least pipeline_bytes, and for large ops as large as N MB (a 1 MB ring
    message, whose stripes the send and receive threads take), up to 1/16 of the buffer.
    With 16K pieces a 32 MB op between 2 ranks was 2048 pieces of 8K messages; now 2 MB
    pieces: ready at 3 MB lets done reach 2 MB and no further."""
    count = 8 << 20  # 32 MB of float32
    with ranks(2, opts=make_options(pipeline_bytes=PIPE)) as comms:
        def body(r, c):
            ready, done = _core.Ticket(), _core.Ticket()
            buf = np.full(count, float(r + 1), dtype=np.float32)
            op = c.allreduce(ptr(buf), count, DT[buf.dtype], SUM, ready=ready, done=done)
            ready.signal(3 << 20)
            done.wait(2 << 20, 30.0)
            time.sleep(0.3)  # time for a wrongly cut piece to finish beyond 2 MB
            stalled_at = done.value
            ready.signal(buf.nbytes)
            c.wait(op, 30.0)
            np.testing.assert_array_equal(buf, 3.0)
            return stalled_at

        assert run_ranks(comms, body) == [2 << 20, 2 << 20]


def test_a_rank_with_tickets_and_one_without_is_a_mismatch():
    count = 1 << 18
    with ranks(2, opts=make_options(pipeline_bytes=PIPE, timeout_s=20.0)) as comms:
        def body(r, c):
            buf = np.ones(count, dtype=np.float32)
            kw = {"ready": _core.Ticket(), "done": _core.Ticket()} if r == 0 else {}
            if r == 0:
                kw["ready"].signal(buf.nbytes)
            try:
                c.wait(c.allreduce(ptr(buf), count, DT[buf.dtype], SUM, **kw), 20.0)
            except MCCLError as e:
                return e
            raise AssertionError(f"rank {r}: the mixed all-reduce succeeded")

        errs = run_ranks(comms, body)
    # Whoever sees the other's first frame names the disagreement; the other hears it in
    # that rank's ABORT, or (about 1 run in 13 here) its send hits the closed socket first
    # and it reports the peer lost: the transport reads no ABORT after a failed write.
    assert any(isinstance(e, CollectiveMismatch) and "pipelining mismatch" in str(e) for e in errs), errs


def test_producer_that_stalls_times_out_and_poisons_done():
    count = 1 << 18
    with ranks(2, opts=make_options(pipeline_bytes=PIPE, timeout_s=1.0)) as comms:
        dones = [_core.Ticket(), _core.Ticket()]

        def body(r, c):
            ready = _core.Ticket()
            buf = np.ones(count, dtype=np.float32)
            op = c.allreduce(ptr(buf), count, DT[buf.dtype], MAX, ready=ready, done=dones[r])
            ready.signal(buf.nbytes if r == 1 else buf.nbytes // 4)  # rank 0's producer stalls
            c.wait(op, 30.0)

        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout) as ei:
            run_ranks(comms, body)
        assert time.monotonic() - t0 < 15.0
    assert str(ei.value).startswith("Timed out") and "waited for this rank's input" in str(ei.value)
    assert all(d.poisoned for d in dones)  # nobody waits on a result that will never come


def test_poisoned_ready_fails_the_op_on_every_rank():
    count = 1 << 18
    with ranks(2, opts=make_options(pipeline_bytes=PIPE, timeout_s=30.0)) as comms:
        def body(r, c):
            ready, done = _core.Ticket(), _core.Ticket()
            buf = np.ones(count, dtype=np.float32)
            op = c.allreduce(ptr(buf), count, DT[buf.dtype], SUM, ready=ready, done=done)
            if r == 0:
                ready.signal(PIPE * 3)
                ready.poison()
            else:
                ready.signal(buf.nbytes)
            try:
                c.wait(op, 30.0)
            finally:
                assert done.poisoned

        t0 = time.monotonic()
        with pytest.raises(AbortedError, match="poisoned"):
            run_ranks(comms, body)
        assert time.monotonic() - t0 < 10.0


def test_abort_while_the_engine_waits_for_the_producer():
    count = 1 << 18
    with ranks(2, opts=make_options(pipeline_bytes=PIPE, timeout_s=60.0)) as comms:
        dones = [_core.Ticket(), _core.Ticket()]
        bufs = [np.ones(count, dtype=np.float32) for _ in range(2)]
        ops = [c.allreduce(ptr(bufs[r]), count, DT[bufs[r].dtype], SUM, ready=_core.Ticket(), done=dones[r])
               for r, c in enumerate(comms)]
        time.sleep(0.2)
        t0 = time.monotonic()
        comms[0].abort("test")

        def waiter(r):
            with pytest.raises(AbortedError):
                comms[r].wait(ops[r], 20.0)
            with pytest.raises(AbortedError):
                dones[r].wait(1, 20.0)

        run_threads(2, waiter)
        assert time.monotonic() - t0 < 10.0


def test_world_size_one_and_empty_ops_honour_tickets():
    with ranks(1, opts=make_options(pipeline_bytes=PIPE)) as (c,):
        ready, done = _core.Ticket(), _core.Ticket()
        buf = np.arange(1000, dtype=np.float32)
        op = c.allreduce(ptr(buf), 1000, DT[buf.dtype], SUM, ready=ready, done=done, base=100)
        time.sleep(0.05)
        assert done.value == 0  # waits for its input
        ready.signal(100 + buf.nbytes)
        c.wait(op, 10.0)
        assert done.value == 100 + buf.nbytes
        c.wait(c.allreduce(ptr(buf), 0, DT[buf.dtype], SUM, ready=ready, done=done, base=done.value), 10.0)
