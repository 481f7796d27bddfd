"""Every engine collective at world sizes 2, 3, 4 against a locally computed reference.

Ranks are threads of this process; buffers are numpy arrays. Values are small integers
(also for float dtypes) so sums are exact and results can be compared bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from support.engine import AVG, DT, MAX, MIN, PRODUCT, SUM, make_options, ptr, ranks, run_ranks

pytestmark = pytest.mark.timeout(120)

REF = {SUM: lambda xs: np.sum(xs, axis=0), MAX: lambda xs: np.max(xs, axis=0),
       MIN: lambda xs: np.min(xs, axis=0), PRODUCT: lambda xs: np.prod(xs, axis=0)}
# Sizes in elements: 1, odd, not divisible by any world size, ring path, one 16 MB case.
SIZES = [1, 7, 1023, 100_003]
BIG = 4 << 20  # float32 elements = 16 MB


def data(rank: int, n: int, dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * seed + rank)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_)
    lo = 0 if np.issubdtype(dtype, np.unsignedinteger) else -8
    return rng.integers(lo, 9, n).astype(dtype)


@pytest.fixture(scope="module", params=[2, 3, 4])
def comms(request):
    with ranks(request.param) as cs:
        yield cs


def wait(c, op_id):
    c.wait(op_id, 60.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.uint8])
@pytest.mark.parametrize("op", [SUM, MAX, MIN])
def test_allreduce(comms, dtype, op):
    n = len(comms)
    for count in SIZES:
        ref = REF[op](np.stack([data(r, count, dtype, count) for r in range(n)])).astype(dtype)

        def body(r, c):
            a = data(r, count, dtype, count)
            wait(c, c.allreduce(ptr(a), count, DT[a.dtype], op))
            return a

        for out in run_ranks(comms, body):
            np.testing.assert_array_equal(out, ref)


def test_allreduce_avg_product_and_identical_bits(comms):
    n = len(comms)
    for count in (5, 100_003):
        rng = [np.random.default_rng(r).standard_normal(count).astype(np.float32) for r in range(n)]

        def body(r, c):
            a = rng[r].copy()
            wait(c, c.allreduce(ptr(a), count, DT[a.dtype], AVG))
            p = np.where(rng[r] > 0, 2, -1).astype(np.int64)
            wait(c, c.allreduce(ptr(p), count, DT[p.dtype], PRODUCT))
            return a, p

        outs = run_ranks(comms, body)
        np.testing.assert_allclose(outs[0][0], np.mean(np.stack(rng), axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(outs[0][1], np.prod(np.stack([np.where(x > 0, 2, -1) for x in rng]), axis=0))
        for a, p in outs[1:]:  # float sums in another order would differ in the last bits
            assert a.tobytes() == outs[0][0].tobytes()
            np.testing.assert_array_equal(p, outs[0][1])


def test_allreduce_large(comms):
    n = len(comms)

    def body(r, c):
        a = np.full(BIG, r + 1, np.float32)
        a[::4097] = -r
        wait(c, c.allreduce(ptr(a), BIG, DT[a.dtype], SUM))
        return a

    ref = np.full(BIG, n * (n + 1) / 2, np.float32)
    ref[::4097] = -sum(range(n))
    for out in run_ranks(comms, body):
        np.testing.assert_array_equal(out, ref)


def test_broadcast(comms):
    n = len(comms)
    for nbytes in (1, 1001, 300_001, 16 << 20):
        for root in range(n) if nbytes < 1 << 20 else [n - 1]:
            src = data(root, nbytes, np.uint8, nbytes)

            def body(r, c):
                a = src.copy() if r == root else np.zeros(nbytes, np.uint8)
                wait(c, c.broadcast(ptr(a), nbytes, root))
                return a

            for out in run_ranks(comms, body):
                np.testing.assert_array_equal(out, src)


def test_allgather(comms):
    n = len(comms)
    for nbytes in (1, 13, 280_004):
        blocks = [data(r, nbytes, np.uint8, nbytes) for r in range(n)]

        def body(r, c):
            out = np.zeros(n * nbytes, np.uint8)
            wait(c, c.allgather(ptr(blocks[r]), ptr(out), nbytes))
            # in place: the send block is the rank's own slot of the output
            inplace = np.zeros(n * nbytes, np.uint8)
            inplace[r * nbytes:(r + 1) * nbytes] = blocks[r]
            wait(c, c.allgather(ptr(inplace) + r * nbytes, ptr(inplace), nbytes))
            return out, inplace

        for out, inplace in run_ranks(comms, body):
            np.testing.assert_array_equal(out, np.concatenate(blocks))
            np.testing.assert_array_equal(inplace, np.concatenate(blocks))


@pytest.mark.parametrize("op", [SUM, MAX, AVG])
def test_reduce_scatter(comms, op):
    n = len(comms)
    for count in (1, 5, 50_001):
        ins = [data(r, n * count, np.float32, count) for r in range(n)]
        full = np.mean(np.stack(ins), axis=0) if op == AVG else REF[op](np.stack(ins))

        def body(r, c):
            send = ins[r].copy()
            out = np.zeros(count, np.float32)
            wait(c, c.reduce_scatter(ptr(send), ptr(out), count, DT[send.dtype], op))
            np.testing.assert_array_equal(send, ins[r])  # the input is never modified
            return out

        for r, out in enumerate(run_ranks(comms, body)):
            np.testing.assert_allclose(out, full[r * count:(r + 1) * count], rtol=1e-6)

        def in_place(r, c):
            # The output is the rank's own block of the input (torch allows that view).
            buf = ins[r].copy()
            wait(c, c.reduce_scatter(ptr(buf), ptr(buf) + r * count * 4, count, DT[buf.dtype], op))
            return buf[r * count:(r + 1) * count]

        for r, out in enumerate(run_ranks(comms, in_place)):
            np.testing.assert_allclose(out, full[r * count:(r + 1) * count], rtol=1e-6)


def test_reduce_scatter_reuses_scratch_slots():
    # 4 MB segments and 5 per block: at N=4 the out-of-place ring's 8 scratch slots are
    # each handed on (after the send forwarding their partial sum completes) at least once.
    n, count = 4, 5 << 20
    with ranks(n, opts=make_options(segment_bytes=4 << 20)) as cs:

        def body(r, c):
            send = np.arange(n * count, dtype=np.float32) % 1000 + r
            out = np.zeros(count, np.float32)
            wait(c, c.reduce_scatter(ptr(send), ptr(out), count, DT[send.dtype], SUM))
            return out

        outs = run_ranks(cs, body)
    full = (np.arange(n * count, dtype=np.float32) % 1000) * n + sum(range(n))
    for r, out in enumerate(outs):
        np.testing.assert_array_equal(out, full[r * count:(r + 1) * count])


def test_reduce(comms):
    n = len(comms)
    for count in (3, 200_001):
        ins = [data(r, count, np.int32, count) for r in range(n)]
        for root in range(n):

            def body(r, c):
                a = ins[r].copy()
                wait(c, c.reduce(ptr(a), count, DT[a.dtype], SUM, root))
                return a

            outs = run_ranks(comms, body)
            for r, out in enumerate(outs):
                np.testing.assert_array_equal(out, np.sum(np.stack(ins), axis=0) if r == root else ins[r])


def test_gather_scatter(comms):
    n = len(comms)
    for nbytes in (1, 77, 100_000):
        blocks = [data(r, nbytes, np.uint8, nbytes) for r in range(n)]
        for root in range(n):

            def body(r, c):
                out = np.zeros(n * nbytes, np.uint8)
                wait(c, c.gather(ptr(blocks[r]), ptr(out) if r == root else 0, nbytes, root))
                mine = np.zeros(nbytes, np.uint8)
                src = np.concatenate(blocks[::-1]) if r == root else None
                wait(c, c.scatter(ptr(src) if r == root else 0, ptr(mine), nbytes, root))
                return out, mine

            outs = run_ranks(comms, body)
            np.testing.assert_array_equal(outs[root][0], np.concatenate(blocks))
            for r, (_, mine) in enumerate(outs):
                np.testing.assert_array_equal(mine, blocks[::-1][r])


def test_alltoall_and_alltoallv(comms):
    n = len(comms)
    nbytes = 1001
    ins = [data(r, n * nbytes, np.uint8, 3) for r in range(n)]

    def body(r, c):
        out = np.zeros(n * nbytes, np.uint8)
        wait(c, c.alltoall(ptr(ins[r]), ptr(out), nbytes))
        # v: rank r sends (r + q + 1) * 10 bytes to rank q
        ss = [(r + q + 1) * 10 for q in range(n)]
        rs = [(q + r + 1) * 10 for q in range(n)]
        so = list(np.cumsum([0] + ss[:-1]))
        ro = list(np.cumsum([0] + rs[:-1]))
        send = data(r, sum(ss), np.uint8, 4)
        recv = np.zeros(sum(rs), np.uint8)
        wait(c, c.alltoallv(ptr(send), ss, [int(x) for x in so], ptr(recv), rs, [int(x) for x in ro]))
        return out, send, so, recv, ro

    outs = run_ranks(comms, body)
    for r, (out, _, _, recv, ro) in enumerate(outs):
        want = np.concatenate([ins[q][r * nbytes:(r + 1) * nbytes] for q in range(n)])
        np.testing.assert_array_equal(out, want)
        for q in range(n):
            _, qsend, qso, _, _ = outs[q]
            size = (q + r + 1) * 10
            np.testing.assert_array_equal(recv[ro[q]:ro[q] + size], qsend[qso[r]:qso[r] + size])


def test_barrier_and_p2p(comms):
    n = len(comms)

    def body(r, c):
        wait(c, c.barrier())
        # recv before send on every rank, around the ring, two tags
        got = [np.zeros(5000, np.int64) for _ in range(2)]
        left, right = (r - 1) % n, (r + 1) % n
        rids = [c.recv(ptr(got[t]), got[t].nbytes, left, t) for t in (0, 1)]
        payload = [np.arange(5000, dtype=np.int64) * (r + 1) + t for t in (0, 1)]
        sids = [c.send(ptr(payload[t]), payload[t].nbytes, right, t) for t in (1, 0)]
        for i in rids + sids:
            wait(c, i)
        wait(c, c.barrier())
        return got

    for r, got in enumerate(run_ranks(comms, body)):
        left = (r - 1) % n
        for t in (0, 1):
            np.testing.assert_array_equal(got[t], np.arange(5000, dtype=np.int64) * (left + 1) + t)


def test_any_source_recv(comms):
    n = len(comms)
    sources = {}

    def body(r, c):
        if r == 0:
            bufs = [np.zeros(8, np.int32) for _ in range(n - 1)]
            ids = [c.recv(ptr(b), b.nbytes, -1, 7) for b in bufs]
            for i in ids:
                wait(c, i)
            return sorted(int(b[0]) for b in bufs)
        a = np.full(8, r, np.int32)
        wait(c, c.send(ptr(a), a.nbytes, 0, 7))
        return None

    assert run_ranks(comms, body)[0] == list(range(1, n))
    del sources


def test_stats_count_payload_bytes(comms):
    n = len(comms)
    count = 1 << 20  # the ring, pinned (the cost model may take another): each rank sends 2 (n-1)/n of the buffer
    with ranks(n, opts=make_options(algo="allreduce=ring")) as ring:
        before = [(c.alpha_beta(), c.stats())[1] for c in ring]  # after the start's own exchanges

        def body(r, c):
            a = np.ones(count, np.float32)
            wait(c, c.allreduce(ptr(a), count, DT[a.dtype], SUM))

        run_ranks(ring, body)
        for r, c in enumerate(ring):
            s = c.stats()
            sent = s["bytes_sent"] - before[r]["bytes_sent"]
            assert sent == pytest.approx(2 * (n - 1) / n * count * 4, rel=0.01)
            assert s["ops_completed"] == before[r]["ops_completed"] + 1
            assert set(s["per_peer"]) == set(range(n)) - {r}
            assert sum(p["sent"] for p in s["per_peer"].values()) == s["bytes_sent"]


def test_any_source_completion_names_the_source():
    import threading
    got = []
    done = threading.Event()

    def on_complete(batch):
        got.extend(batch)
        if len(got) >= 2:
            done.set()

    with ranks(3, on_complete=[on_complete, None, None]) as comms:
        def body(r, c):
            if r == 0:
                bufs = [np.zeros(4, np.int32) for _ in range(2)]
                ids = [c.recv(ptr(b), b.nbytes, -1, 5) for b in bufs]
                for i in ids:
                    wait(c, i)
                return ids, [int(b[0]) for b in bufs]
            a = np.full(4, r, np.int32)
            wait(c, c.send(ptr(a), a.nbytes, 0, 5))

        ids, firsts = run_ranks(comms, body)[0]
        assert done.wait(5)
    info = {op: src for op, err, src in got}
    assert sorted(info[i] for i in ids) == [1, 2]
    assert [info[i] for i in ids] == firsts  # each completion names who filled that buffer


def test_ipv6_loopback_mesh():
    import socket
    try:
        s = socket.socket(socket.AF_INET6)
        s.bind(("::1", 0))
        s.close()
    except OSError:
        pytest.skip("no IPv6 loopback")
    from libmccl import _core
    from support.engine import job_secret, run_threads
    listeners = [_core.Listener("::1", 0) for _ in range(2)]
    addrs = [x.address for x in listeners]
    assert addrs[0].startswith("[::1]:")
    comms = run_threads(2, lambda r: _core.Communicator(r, 2, 3, listeners[r], addrs, make_options(),
                                                        secret=job_secret()))
    try:
        def body(r, c):
            a = np.full(10, r + 1, np.float64)
            wait(c, c.allreduce(ptr(a), 10, DT[a.dtype], SUM))
            return a

        for out in run_ranks(comms, body):
            np.testing.assert_array_equal(out, np.full(10, 3.0))
    finally:
        run_threads(2, lambda r: comms[r].shutdown(5.0))


def test_many_async_ops_in_flight_mixed_with_p2p(comms):
    """Every rank enqueues the same random mix of collectives and ring sends/receives
    without waiting in between; unexpected messages, striping and matching all get
    exercised at once."""
    n = len(comms)
    rng = np.random.default_rng(42)
    plan = [(rng.choice(["allreduce", "broadcast", "allgather", "p2p", "barrier"]),
             int(rng.choice([1, 3, 5000, 70_000, 300_000])), int(rng.integers(0, n))) for _ in range(60)]

    def body(r, c):
        keep, checks = [], []
        for i, (kind, count, root) in enumerate(plan):
            if kind == "allreduce":
                a = np.full(count, r + i, np.int64)
                keep.append(c.allreduce(ptr(a), count, DT[a.dtype], SUM))
                checks.append((a, np.full(count, sum(q + i for q in range(n)), np.int64)))
            elif kind == "broadcast":
                a = np.full(count, i if r == root else -1, np.int32)
                keep.append(c.broadcast(ptr(a), a.nbytes, root))
                checks.append((a, np.full(count, i, np.int32)))
            elif kind == "allgather":
                a = np.full(count, r * 1000 + i, np.int32)
                out = np.zeros(count * n, np.int32)
                keep.append(c.allgather(ptr(a), ptr(out), a.nbytes))
                checks.append((out, np.repeat(np.arange(n, dtype=np.int32) * 1000 + i, count)))
                checks.append((a, a.copy()))
            elif kind == "p2p":
                src = np.full(count, r * 7 + i, np.int32)
                dst = np.zeros(count, np.int32)
                keep.append(c.recv(ptr(dst), dst.nbytes, (r - 1) % n, i % 3))
                keep.append(c.send(ptr(src), src.nbytes, (r + 1) % n, i % 3))
                checks.append((dst, np.full(count, ((r - 1) % n) * 7 + i, np.int32)))
                checks.append((src, src.copy()))
            else:
                keep.append(c.barrier())
        for op in keep:
            wait(c, op)
        for got, want in checks:
            np.testing.assert_array_equal(got, want)
        return len(keep)

    assert len(set(run_ranks(comms, body, timeout=120))) == 1


def test_without_send_thread():
    # MCCL_SEND_THREAD=0: the progress thread writes every frame itself (POLLOUT path).
    n, count = 3, 3 << 20  # 12 MB: bulk frames that would otherwise go to the send thread
    with ranks(n, opts=make_options(send_thread=False)) as cs:

        def body(r, c):
            a = np.full(count, r + 1, np.float32)
            wait(c, c.allreduce(ptr(a), count, DT[a.dtype], SUM))
            b = np.arange(count, dtype=np.float32) if r == 1 else np.zeros(count, np.float32)
            wait(c, c.broadcast(ptr(b), b.nbytes, 1))
            return a, b

        for a, b in run_ranks(cs, body):
            np.testing.assert_array_equal(a, np.full(count, n * (n + 1) / 2, np.float32))
            np.testing.assert_array_equal(b, np.arange(count, dtype=np.float32))
