"""The topology-aware all-reduce (algorithms/hierarchical.cc), ranks as threads.

Switches of equal and unequal sizes, a switch of one host, switch ids not in rank order;
every dtype and op against a local reference, and the same bits on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import MCCLError
from support.engine import (AVG, DT, MAX, MIN, PRODUCT, SUM, make_options, ptr, ranks, run_ranks)

pytestmark = pytest.mark.timeout(180)

REF = {SUM: lambda xs: np.sum(xs, axis=0), MAX: lambda xs: np.max(xs, axis=0),
       MIN: lambda xs: np.min(xs, axis=0), PRODUCT: lambda xs: np.prod(xs, axis=0)}

# switch of every rank: {3,5} interleaved, {4,4}, {1,3}, {2,3,2} with ids out of order.
LAYOUTS = {
    "3+5": [7, 2, 7, 2, 2, 7, 2, 2],
    "4+4": [0, 0, 0, 0, 1, 1, 1, 1],
    "1+3": [5, 9, 9, 9],
    "2+3+2": [3, 1, 2, 1, 3, 1, 2],
}


def warm(c) -> None:
    """One small op first: the cost model's calibration, which each worker runs at start, is
    over by then, so it counts in no op's bytes."""
    w = np.ones(8, dtype=np.float32)
    c.wait(c.allreduce(ptr(w), w.size, DT[w.dtype], SUM), 60.0)


def options(layout, **kw):
    o = make_options(**kw)
    o.switch_of_rank = layout
    o.hierarchy_min_bytes = 0
    o.hierarchy_ring = False  # the tree; the ring has tests of its own below
    return o


def data(rank: int, n: int, dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * seed + rank)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_)
    if op_is_product(seed):
        return rng.choice(np.array([-1, 1, 2], dtype=np.int64), n).astype(dtype)
    lo = 0 if np.issubdtype(dtype, np.unsignedinteger) else -8
    return rng.integers(lo, 9, n).astype(dtype)


def op_is_product(seed: int) -> bool:
    return seed % 10 == PRODUCT


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def comms(request):
    with ranks(len(LAYOUTS[request.param]), opts=options(LAYOUTS[request.param])) as cs:
        # The hierarchy talks to peers beyond the collectives' own, whose links open at first
        # use: open them here, or the module's first test holds sockets the leak check did
        # not see before it.
        run_ranks(cs, lambda r, c: warm(c))
        yield cs


CASES = [(np.float32, SUM), (np.float64, MAX), (np.float16, SUM), (np.int8, MIN), (np.uint8, MAX),
         (np.int32, PRODUCT), (np.int64, SUM), (np.float32, PRODUCT), (np.int64, MIN)]


@pytest.mark.parametrize("dtype,op", CASES)
def test_every_dtype_and_op_matches_the_reference(comms, dtype, op):
    n = len(comms)
    for count in (n, 1003, 100_003):  # the world size, and counts no switch size divides
        seed = count * 10 + op
        ref = REF[op](np.stack([data(r, count, dtype, seed) for r in range(n)])).astype(dtype)

        def body(r, c):
            a = data(r, count, dtype, seed)
            c.wait(c.allreduce(ptr(a), count, DT[a.dtype], op), 60.0)
            return a

        for out in run_ranks(comms, body):
            np.testing.assert_array_equal(out, ref)


def test_avg_is_finished_once_and_every_rank_holds_the_same_bits(comms):
    n = len(comms)
    count = 250_001
    inputs = [np.random.default_rng(r).standard_normal(count).astype(np.float32) for r in range(n)]
    ints = [np.random.default_rng(50 + r).integers(-100, 100, count).astype(np.int32) for r in range(n)]

    def body(r, c):
        a, b = inputs[r].copy(), ints[r].copy()
        c.wait(c.allreduce(ptr(a), count, DT[a.dtype], AVG), 60.0)
        c.wait(c.allreduce(ptr(b), count, DT[b.dtype], AVG), 60.0)
        return a, b

    outs = run_ranks(comms, body)
    np.testing.assert_allclose(outs[0][0], np.mean(np.stack(inputs), axis=0), rtol=1e-5, atol=1e-6)
    # Integer AVG truncates toward zero, after the whole sum: divided more than once it would not.
    np.testing.assert_array_equal(outs[0][1], np.trunc(np.sum(np.stack(ints), axis=0) / n).astype(np.int32))
    for a, b in outs[1:]:
        assert a.tobytes() == outs[0][0].tobytes()
        assert b.tobytes() == outs[0][1].tobytes()


def test_bool_sum_is_logical_or(comms):
    n = len(comms)
    count = 4099
    inputs = [data(r, count, np.bool_, 1) for r in range(n)]

    def body(r, c):
        a = inputs[r].copy()
        c.wait(c.allreduce(ptr(a), count, DT[a.dtype], MAX), 60.0)
        return a

    for out in run_ranks(comms, body):
        np.testing.assert_array_equal(out, np.any(np.stack(inputs), axis=0))


def test_the_hierarchy_runs_only_from_the_threshold_and_talks_across_switches_by_slice():
    # Switches {0,2,4,6} and {1,3,5,7}: the flat ring sends rank 0's bytes only to rank 1;
    # the hierarchy sends them within its switch (rank 2) and to its slice partner (rank 1).
    layout = [0, 1, 0, 1, 0, 1, 0, 1]
    opts = options(layout)
    opts.hierarchy_min_bytes = 1 << 20
    opts.algo = "allreduce=ring"  # below the threshold: the flat ring, whose peers are known
    with ranks(8, opts=opts) as comms:
        def op(count):
            def body(r, c):
                a = np.full(count, r, dtype=np.float32)
                warm(c)
                before = c.stats()["per_peer"]
                c.wait(c.allreduce(ptr(a), count, DT[a.dtype], SUM), 60.0)
                after = c.stats()["per_peer"]
                assert np.all(a == sum(range(8)))
                return {p: after[p]["sent"] - before[p]["sent"] for p in after}
            return run_ranks(comms, body)

        small = op(1 << 16)  # 256 KB: under the threshold, the flat ring
        assert small[0][2] == 0 and small[0][1] > 0
        big = op(1 << 19)  # 2 MB
        assert big[0][2] > 0 and big[0][1] > 0
        assert big[0][3] == 0 and big[0][7] == 0  # never to another switch's other ranks


def test_the_peers_it_talks_to_are_those_the_hierarchy_names(comms, request):
    n = len(comms)
    layout = LAYOUTS[request.node.callspec.params["comms"]]

    def body(r, c):
        a = np.ones(4099, dtype=np.float32)
        warm(c)
        before = c.stats()["per_peer"]
        c.wait(c.allreduce(ptr(a), a.size, DT[a.dtype], SUM), 60.0)
        after = c.stats()["per_peer"]
        return {p for p in after if after[p]["sent"] > before[p]["sent"]}

    sent = run_ranks(comms, body)
    for r in range(n):
        talked = sent[r] | {p for p in range(n) if r in sent[p]}
        assert talked == set(_core.hierarchy_peers(layout, r)), (r, talked)


def test_a_pipelined_allreduce_with_tickets_runs_by_switch_and_is_exact():
    layout = LAYOUTS["3+5"]
    n, count, pipe = len(layout), 1 << 18, 64 << 10
    inputs = [np.random.default_rng(7 + r).integers(-50, 50, count).astype(np.float32) for r in range(n)]
    with ranks(n, opts=options(layout, pipeline_bytes=pipe)) as comms:
        def body(r, c):
            ready, done = _core.Ticket(), _core.Ticket()
            buf = np.full(count, np.nan, dtype=np.float32)
            op = c.allreduce(ptr(buf), count, DT[buf.dtype], AVG, ready=ready, done=done, base=0)
            raw, src = buf.view(np.uint8), inputs[r].view(np.uint8)
            for off in range(0, buf.nbytes, pipe):  # produced a piece at a time
                raw[off:off + pipe] = src[off:off + pipe]
                ready.signal(min(off + pipe, buf.nbytes))
            done.wait(buf.nbytes, 60.0)
            c.wait(op, 60.0)
            return buf

        outs = run_ranks(comms, body)
    ref = sum(inputs) / np.float32(n)
    for out in outs:
        assert out.tobytes() == outs[0].tobytes()
        np.testing.assert_allclose(out, ref, rtol=1e-6)


def _mismatch_errors(opts: list, comm_id: int) -> list:
    """What each of four ranks built with ``opts[r]`` gets from one all-reduce."""
    from support.engine import job_secret, run_threads
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(4)]
    addrs = [x.address for x in listeners]
    comms = run_threads(4, lambda r: _core.Communicator(r, 4, comm_id, listeners[r], addrs, opts[r],
                                                        secret=job_secret()))
    try:
        def body(r, c):
            a = np.ones(1 << 18, dtype=np.float32)
            try:
                c.wait(c.allreduce(ptr(a), a.size, DT[a.dtype], SUM), 30.0)
            except MCCLError as e:
                return str(e)
            return None

        errors = run_ranks(comms, body)
    finally:
        run_threads(4, lambda r: comms[r].abort("test over"))
    assert all(errors), errors  # every rank fails, none hangs or succeeds
    return errors


def test_ranks_given_different_groupings_fail_with_a_topology_mismatch():
    layouts = [[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1], [0, 1, 0, 1]]
    errors = _mismatch_errors([options(layouts[r], timeout_s=10.0) for r in range(4)], 11)
    assert any("topology mismatch" in e and "MCCL_TOPOLOGY" in e for e in errors), errors


def test_a_switch_list_of_the_wrong_length_is_refused():
    from mccl_common.errors import ConfigError
    lst = _core.Listener("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match="MCCL_TOPOLOGY"):
            _core.Communicator(0, 1, 12, lst, [lst.address], options([0, 1]), secret=None)
    finally:
        lst.close()


@pytest.mark.parametrize("name", ["3+5", "2+3+2"])
def test_the_switch_ring_is_exact_and_talks_only_to_its_ring_neighbours_in_switch_order(name):
    layout = LAYOUTS[name]
    n = len(layout)
    opts = options(layout, pipeline_bytes=64 << 10)
    opts.hierarchy_ring = True
    inputs = [np.random.default_rng(r).standard_normal(100_003).astype(np.float32) for r in range(n)]
    ints = [data(r, 1003, np.int64, 3) for r in range(n)]
    with ranks(n, opts=opts) as comms:
        def body(r, c):
            a, b = inputs[r].copy(), ints[r].copy()
            warm(c)
            before = c.stats()["per_peer"]
            c.wait(c.allreduce(ptr(a), a.size, DT[a.dtype], AVG), 60.0)
            after = c.stats()["per_peer"]
            # small enough for the one-round all-reduce (to every peer), whatever the order
            c.wait(c.allreduce(ptr(b), b.size, DT[b.dtype], MAX), 60.0)
            # pipelined with tickets, as mccld runs it
            ready, done = _core.Ticket(), _core.Ticket()
            t = inputs[r][:1 << 16].copy()
            op = c.allreduce(ptr(t), t.size, DT[t.dtype], SUM, ready=ready, done=done, base=0)
            ready.signal(t.nbytes)
            c.wait(op, 60.0)
            # Sends only: frames of the next op may already have arrived when `after` is read.
            sent = {p for p in after if after[p]["sent"] > before[p]["sent"]}
            return a, b, t, sent

        outs = run_ranks(comms, body)
    np.testing.assert_allclose(outs[0][0], np.mean(np.stack(inputs), axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(outs[0][1], np.max(np.stack(ints), axis=0))
    np.testing.assert_allclose(outs[0][2], np.sum(np.stack([x[:1 << 16] for x in inputs]), axis=0), rtol=1e-5,
                               atol=1e-5)
    for r, (a, b, t, sent) in enumerate(outs):
        assert a.tobytes() == outs[0][0].tobytes() and t.tobytes() == outs[0][2].tobytes()
        talked = sent | {p for p in range(n) if r in outs[p][3]}
        assert talked == set(_core.hierarchy_peers(layout, r, ring=True)), (r, talked)


def test_ranks_running_the_tree_and_the_ring_fail_with_a_topology_mismatch():
    opts = [options([0, 1, 0, 1], timeout_s=10.0) for _ in range(4)]
    opts[2].hierarchy_ring = True
    errors = _mismatch_errors(opts, 13)
    assert any("topology mismatch" in e and "MCCL_HIERARCHY" in e for e in errors), errors
