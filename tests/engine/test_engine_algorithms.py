"""The collective algorithms the cost model chooses among (libmccl/csrc/algorithms), each
pinned by MCCL_ALGO, at powers of two and not, against a reference computed here.

Ranks are threads of this process. Values are small integers (also for float dtypes), so
every reduction order gives the same bits and results are compared bit for bit with the
reference, built with the engine's own kernels in rank order. Where values are not exact
(random normals, NaNs) the test asks that every rank holds the same bits. One thread per
rank runs all of a world's cases in a row, so a 33-rank world costs one build.
"""

from __future__ import annotations

import resource
import threading

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import CollectiveMismatch, ConfigError, MCCLError
from support.engine import build, job_secret, make_options, ptr, run_ranks, run_threads

pytestmark = pytest.mark.timeout(300)

# name: (numpy storage, engine dtype); bfloat16 travels as its bits in uint16.
DTYPES = {
    "float32": (np.float32, int(_core.DType.float32)),
    "float64": (np.float64, int(_core.DType.float64)),
    "float16": (np.float16, int(_core.DType.float16)),
    "bfloat16": (np.uint16, int(_core.DType.bfloat16)),
    "int8": (np.int8, int(_core.DType.int8)),
    "uint8": (np.uint8, int(_core.DType.uint8)),
    "int32": (np.int32, int(_core.DType.int32)),
    "int64": (np.int64, int(_core.DType.int64)),
    "bool": (np.bool_, int(_core.DType.bool)),
}
OPS = {name: int(getattr(_core.ReduceOp, name))
       for name in ("SUM", "AVG", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR")}
GRID = [(d, o) for d in DTYPES for o in OPS if _core.reduce_supported(DTYPES[d][1], OPS[o])]

# Every op pinned to each of its algorithms across the variants; "auto" is the model's choice.
VARIANTS = {
    "ring": "allreduce=ring,allgather=ring,reduce_scatter=ring,broadcast=chain",
    "hypercube": "allreduce=rd,allgather=rd,reduce_scatter=halving,broadcast=binomial",
    "rabenseifner": "allreduce=rabenseifner,broadcast=scatter_allgather",
    "oneround": "allreduce=oneround,broadcast=fanout",
    "auto": "auto",
}
PINNED = {v: dict(item.split("=") for item in spec.split(",")) if "=" in spec else {}
          for v, spec in VARIANTS.items()}
SMALL_WORLDS = [2, 3, 4, 5]
LARGE_WORLDS = [7, 8, 9, 16, 17, 33]
# Which variants run at each large world: the new algorithms everywhere, the rest sampled.
LARGE_VARIANTS = {7: ["hypercube", "rabenseifner", "auto"], 8: ["hypercube", "rabenseifner", "ring"],
                  9: ["hypercube", "rabenseifner", "oneround"], 16: ["hypercube", "auto"],
                  17: ["hypercube", "rabenseifner"], 33: ["hypercube", "rabenseifner", "auto"]}
CASES = [(n, v) for n in SMALL_WORLDS for v in VARIANTS] + \
        [(n, v) for n in LARGE_WORLDS for v in LARGE_VARIANTS[n]]


@pytest.fixture(scope="module", autouse=True)
def _enough_fds():
    """33 ranks as threads hold 33 x 32 link sockets and their listeners in one process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def opts_for(spec: str, **kw):
    # One socket per peer and no helper threads: a 33-rank world stays within a few hundred fds.
    return make_options(algo=spec, sockets_per_peer=1, recv_threads=0, send_thread=False, **kw)


def values(dtype: str, op: str, rank: int, count: int, seed: int) -> np.ndarray:
    """Small integers (exact in every dtype and every order), +-1 for PRODUCT."""
    rng = np.random.default_rng(seed * 1009 + rank)
    storage, _ = DTYPES[dtype]
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(np.bool_)
    if op == "PRODUCT":
        v = rng.choice([1, -1] if dtype not in ("uint8",) else [1], count)
    else:
        v = rng.integers(0 if dtype == "uint8" else -3, 4, count)
    if dtype == "bfloat16":
        return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return v.astype(storage)


def reference(parts: list[np.ndarray], dtype: str, op: str) -> np.ndarray:
    """The engine's own kernel folded in rank order; AVG is SUM divided once at the end."""
    acc = parts[0].copy()
    dt = DTYPES[dtype][1]
    for p in parts[1:]:
        _core.reduce_inplace(ptr(p), ptr(acc), acc.size, dt, OPS[op])
    if op == "AVG":
        _core.finalize_avg(ptr(acc), acc.size, dt, len(parts))
    return acc


def cases_for(n: int) -> list[tuple[str, str, int]]:
    """(dtype, op, count): the full grid at small worlds, a rotating sample at large ones.
    Counts include 0, 1, fewer elements than ranks and sizes no power of two divides."""
    counts = sorted({0, 1, max(n - 1, 1), 2 * n + 3, 1027})
    if n in SMALL_WORLDS:
        return [(d, o, c) for i, (d, o) in enumerate(GRID) for c in (counts if i % 3 == 0 else counts[1:4:2])]
    sample = GRID[n % 5::5]
    return [(d, o, c) for i, (d, o) in enumerate(sample) for c in (counts if i == 0 else [counts[i % len(counts)]])]


def expected_algo(variant: str, op: str, n: int, nbytes: int, cost: dict, opts) -> str:
    """`nbytes`: one rank's block; choose_algorithm counts as nccl-tests do (all-gather's
    output, reduce-scatter's input: N blocks)."""
    pin = PINNED[variant].get(op)
    if pin:
        return pin
    whole = nbytes * n if op in ("allgather", "reduce_scatter") else nbytes
    return _core.choose_algorithm(op, n, whole, cost["alpha_s"], cost["beta_s_per_byte"],
                                  cost["gamma_s_per_byte"], opts)


def run_world(n: int, variant: str):
    opts = opts_for(VARIANTS[variant])
    comms = build(n, opts=opts)
    try:
        cases = cases_for(n)
        costs = [c.cost_params(30.0) for c in comms]
        assert all(c == costs[0] for c in costs), "ranks hold different cost parameters"

        def body(r, c):
            out, algos = [], []
            for i, (dtype, op, count) in enumerate(cases):
                storage, dt = DTYPES[dtype]
                es = np.dtype(storage).itemsize
                a = values(dtype, op, r, count, i)
                c.wait(c.allreduce(ptr(a), count, dt, OPS[op]), 60)
                algos.append(("allreduce", count * es, c.last_algorithm("allreduce")))
                rs_in = values(dtype, op, r, count * n, i + 7)
                rs_out = np.zeros(count, storage)
                c.wait(c.reduce_scatter(ptr(rs_in), ptr(rs_out), count, dt, OPS[op]), 60)
                algos.append(("reduce_scatter", count * es, c.last_algorithm("reduce_scatter")))
                ag_out = np.zeros(count * n, storage)
                c.wait(c.allgather(ptr(a), ptr(ag_out), count * es), 60)
                algos.append(("allgather", count * es, c.last_algorithm("allgather")))
                root = (i + n - 1) % n  # the last rank (an extra one when folded) and others
                bc = values(dtype, op, r, count, i + 13) if r == root else np.zeros(count, storage)
                c.wait(c.broadcast(ptr(bc), count * es, root), 60)
                algos.append(("broadcast", count * es, c.last_algorithm("broadcast")))
                out.append((a, rs_out, ag_out, bc))
            return out, algos

        results = run_ranks(comms, body, timeout=240)
        for i, (dtype, op, count) in enumerate(cases):
            want = reference([values(dtype, op, r, count, i) for r in range(n)], dtype, op)
            rs_want = reference([values(dtype, op, r, count * n, i + 7) for r in range(n)], dtype, op)
            root = (i + n - 1) % n
            bc_want = values(dtype, op, root, count, i + 13)
            for r, (outs, _) in enumerate(results):
                a, rs_out, ag_out, bc = outs[i]
                what = f"n={n} {variant} {dtype} {op} count={count} rank {r}"
                assert a.tobytes() == want.tobytes(), f"allreduce {what}"
                assert rs_out.tobytes() == rs_want[r * count:(r + 1) * count].tobytes(), f"reduce_scatter {what}"
                assert ag_out.tobytes() == np.concatenate(
                    [results[q][0][i][0] for q in range(n)]).tobytes(), f"allgather {what}"
                assert bc.tobytes() == bc_want.tobytes(), f"broadcast {what}"
        for r, (_, algos) in enumerate(results):
            for op, nbytes, got in algos:
                if nbytes == 0 and op != "allgather":
                    continue
                assert got == expected_algo(variant, op, n, nbytes, costs[r], opts), (n, variant, op, nbytes, r)
    finally:
        run_threads(n, lambda r: comms[r].shutdown(5.0))


@pytest.mark.parametrize("n,variant", CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_every_algorithm_matches_the_reference(n, variant):
    run_world(n, variant)


@pytest.mark.parametrize("n", [3, 5, 8])
@pytest.mark.parametrize("variant", ["ring", "hypercube", "rabenseifner", "oneround"])
def test_inexact_values_give_the_same_bits_on_every_rank(n, variant):
    """Random normals in half precision (rounding depends on the operand order) and NaNs
    of different payloads under MIN/MAX: every rank must still hold the same bits, and
    sums must be close to the float64 reference."""
    comms = build(n, opts=opts_for(VARIANTS[variant]))
    count = 4099
    cases = [(d, o) for d in ("float16", "bfloat16", "float32") for o in ("SUM", "AVG", "MIN", "MAX")]

    def data(r, dtype, op):
        rng = np.random.default_rng(r * 31 + len(dtype) + len(op))
        x = rng.standard_normal(count).astype(np.float32)
        if op in ("MIN", "MAX"):
            nan = np.array([0x7FC00000 | (r + 1)], np.uint32).view(np.float32)[0]
            x[::7] = nan       # each rank its own payload, at the same places: NaN meets NaN
            x[r + 1::11] = nan  # and at places of its own: NaN meets a number
        if dtype == "bfloat16":
            return (x.view(np.uint32) >> 16).astype(np.uint16)
        return x.astype(DTYPES[dtype][0])

    def body(r, c):
        out = []
        for dtype, op in cases:
            a = data(r, dtype, op)
            c.wait(c.allreduce(ptr(a), count, DTYPES[dtype][1], OPS[op]), 60)
            out.append(a)
        return out

    try:
        results = run_ranks(comms, body)
        for k, (dtype, op) in enumerate(cases):
            for r in range(1, n):
                assert results[r][k].tobytes() == results[0][k].tobytes(), (dtype, op, r)
            if op in ("SUM", "AVG"):
                def f64(x):
                    return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64) if dtype == "bfloat16" \
                        else x.astype(np.float64)
                want = sum(f64(data(r, dtype, op)) for r in range(n)) / (n if op == "AVG" else 1)
                np.testing.assert_allclose(f64(results[0][k]), want, rtol=0.05, atol=0.1 * n)
    finally:
        run_threads(n, lambda r: comms[r].shutdown(5.0))


def test_ticketed_allreduce_runs_the_model_below_a_piece_and_the_ring_above():
    """A ticketed all-reduce within MCCL_PIPELINE_BYTES waits for its input and runs the
    model's choice; above it the ring runs pipelined with the producer, pinned or not."""
    n = 4
    comms = build(n, opts=opts_for("allreduce=rd", pipeline_bytes=64 << 10))

    def body(r, c):
        got = []
        for count in (1000, 100_000):  # 4 KB: one piece; 400 KB: pieced
            ready, done = _core.Ticket(), _core.Ticket()
            a = np.full(count, r + 1, np.float32)
            op = c.allreduce(ptr(a), count, DTYPES["float32"][1], OPS["SUM"], ready=ready, done=done)
            threading.Timer(0.05, lambda: ready.signal(count * 4)).start()
            c.wait(op, 60)
            assert done.value >= count * 4
            got.append((a, c.last_algorithm("allreduce")))
        return got

    try:
        for outs in run_ranks(comms, body):
            (small, small_algo), (big, big_algo) = outs
            assert (small == n * (n + 1) / 2).all() and (big == n * (n + 1) / 2).all()
            assert (small_algo, big_algo) == ("rd", "ring")
    finally:
        run_threads(n, lambda r: comms[r].shutdown(5.0))


def allreduce_error(c, count: int) -> MCCLError | None:
    """The error one float32 SUM all-reduce of ``count`` ones raises on ``c``, or None."""
    a = np.ones(count, np.float32)
    try:
        c.wait(c.allreduce(ptr(a), a.size, DTYPES["float32"][1], OPS["SUM"]), 20)
    except MCCLError as e:
        return e
    return None


def test_ranks_pinning_different_algorithms_fail_with_a_mismatch():
    """Two ranks that choose differently must not exchange frames of different shapes: the
    algorithm is in every op's signature."""
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(3)]
    addrs = [x.address for x in listeners]
    specs = ["allreduce=rd", "allreduce=rd", "allreduce=ring"]
    comms = run_threads(3, lambda r: _core.Communicator(r, 3, 8, listeners[r], addrs, opts_for(specs[r]),
                                                        secret=job_secret()))

    try:
        errors = run_ranks(comms, lambda r, c: allreduce_error(c, 1000), timeout=40)
        # Rank 2 hears from both neighbours; ranks 0 and 1 at least one of them says it.
        assert isinstance(errors[2], CollectiveMismatch), errors
        assert "algorithm mismatch" in str(errors[2]) and "MCCL_ALGO" in str(errors[2])
        assert any(isinstance(e, CollectiveMismatch) and "algorithm mismatch" in str(e) for e in errors[:2]), errors
    finally:
        run_threads(3, lambda r: comms[r].shutdown(2.0))


@pytest.mark.parametrize("spec", ["bogus", "allreduce=halving", "scatter=ring", "allreduce:rd", "allgather=ring,"])
def test_a_bad_algo_setting_is_a_config_error(spec):
    lst = _core.Listener("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match="MCCL_ALGO"):
            _core.Communicator(0, 2, 9, lst, [lst.address, "127.0.0.1:1"], opts_for(spec), secret=job_secret())
    finally:
        lst.close()


@pytest.mark.parametrize("op", ["allreduce", "allgather", "reduce_scatter", "broadcast"])
def test_choice_is_the_cheapest_prediction(op):
    """choose_algorithm is the argmin of predict over the eligible algorithms, and the model
    moves from few steps (latency-bound) to few bytes (bandwidth-bound) as sizes grow."""
    opts = _core.Options()
    for alpha, beta, gamma in [(50e-6, 1e-9, 1e-10), (5e-6, 8e-10, 0.0), (1e-3, 1e-11, 1e-12)]:
        for n in (2, 3, 4, 5, 8, 16, 17, 200):
            for nbytes in (8, 4096, 1 << 20, 64 << 20):
                chosen = _core.choose_algorithm(op, n, nbytes, alpha, beta, gamma, opts)
                t = {a: _core.predict(op, a, n, nbytes, alpha, beta, gamma) for a in _core.algorithms(op)}
                eligible = {a: v for a, v in t.items()
                            if a not in ("oneround", "fanout") or (n <= 4 and nbytes * (n - 1) <= opts.small_allreduce_bytes)}
                assert t[chosen] == min(eligible.values()), (op, n, nbytes, chosen, t)
    # At 200 ranks: latency-bound small messages avoid the ring's 2(N-1) steps, big ones take it.
    assert _core.choose_algorithm("allreduce", 200, 8, 50e-6, 1e-9, 1e-10) == "rd"
    assert _core.choose_algorithm("allreduce", 200, 256 << 20, 50e-6, 1e-9, 1e-10) == "ring"


def test_direct_and_ring_name_the_same_shape_on_every_op():
    """"direct" is the one-step algorithm of all-reduce and broadcast, and a broadcast's ring
    is the chain, so MCCL_ALGO=direct or =ring pins every op that has one."""
    a, b = 30e-6, 1e-9
    assert _core.predict("allreduce", "direct", 4, 4096, a, b) == _core.predict("allreduce", "oneround", 4, 4096, a, b)
    assert _core.predict("broadcast", "direct", 4, 4096, a, b) == _core.predict("broadcast", "fanout", 4, 4096, a, b)
    assert _core.predict("broadcast", "ring", 9, 1 << 20, a, b) == _core.predict("broadcast", "chain", 9, 1 << 20, a, b)
    # Sizes as nccl-tests count them: an all-gather of S bytes gathers N blocks of S/N.
    assert _core.predict("allgather", "ring", 8, 8 << 20, a, b) == pytest.approx(7 * a + 7 * (1 << 20) * b)
    comms = build(3, opts=opts_for("direct"))
    try:
        def body(r, c):
            x = np.ones(16, np.float32)
            c.wait(c.allreduce(ptr(x), x.size, DTYPES["float32"][1], OPS["SUM"]), 30)
            c.wait(c.broadcast(ptr(x), x.nbytes, 2), 30)
            return c.last_algorithm("allreduce"), c.last_algorithm("broadcast"), x
        for algos in run_ranks(comms, body):
            assert algos[:2] == ("oneround", "fanout") and (algos[2] == 3).all()
    finally:
        run_threads(3, lambda r: comms[r].shutdown(5.0))


def test_ring_prediction_follows_the_formula():
    alpha, beta, n, b = 30e-6, 1e-9, 12, 1 << 20
    assert _core.predict("allreduce", "ring", n, b, alpha, beta) == pytest.approx(
        2 * (n - 1) * alpha + 2 * (n - 1) / n * b * beta)
    with pytest.raises(ConfigError):
        _core.predict("allreduce", "binomial", n, b, alpha, beta)


def test_pinned_parameters_are_what_every_rank_reports():
    comms = build(3, opts=opts_for("auto", alpha_us=25.0, beta_gbps=10.0))
    try:
        for c in comms:
            alpha, beta = c.alpha_beta()
            assert alpha == pytest.approx(25e-6) and beta == pytest.approx(8 / 10e9)
    finally:
        run_threads(3, lambda r: comms[r].shutdown(5.0))


def test_a_stalled_step_is_named_in_the_timeout():
    """Rank 2 (folded onto rank 0 at N=3) never calls: rank 0's timeout says it waited in
    the fold-in; rank 1, waiting on rank 0, hears of it."""
    from mccl_common.errors import CollectiveTimeout
    comms = build(3, opts=opts_for("allreduce=rd", timeout_s=1.0))

    try:
        errors = run_ranks(comms, lambda r, c: None if r == 2 else allreduce_error(c, 10), timeout=40)
        assert isinstance(errors[0], CollectiveTimeout) and "fold-in from the extra rank" in str(errors[0]), errors
        assert isinstance(errors[1], MCCLError), errors
    finally:
        run_threads(3, lambda r: comms[r].shutdown(2.0))


def collective_peers(r: int, n: int) -> set[int]:
    """algorithms/partners.h, restated: ring neighbours, fold partner, hypercube partners."""
    p = 1
    while p * 2 <= n:
        p *= 2
    out = {(r + 1) % n, (r - 1) % n}
    if r < n - p:
        out.add(r + p)
    if r >= p:
        out.add(r - p)
    if r < p:
        out |= {r ^ d for d in (1 << k for k in range(p.bit_length() - 1))}
    return out - {r}


@pytest.mark.parametrize("n", [6, 12, 13])
@pytest.mark.parametrize("variant", ["hypercube", "rabenseifner", "ring"])
def test_the_algorithms_talk_only_to_collective_peers(n, variant):
    """Links open only to collective_peers (another change of this issue), so every
    whole-communicator algorithm but the one-step ones keeps to them; so does the start."""
    comms = build(n, opts=opts_for(VARIANTS[variant]))

    def body(r, c):
        a = np.ones(1000, np.float32)
        out = np.zeros(1000 * n, np.float32)
        c.wait(c.allreduce(ptr(a), a.size, DTYPES["float32"][1], OPS["SUM"]), 60)
        c.wait(c.reduce_scatter(ptr(out), ptr(a), a.size, DTYPES["float32"][1], OPS["SUM"]), 60)
        c.wait(c.allgather(ptr(a), ptr(out), a.nbytes), 60)
        for root in (0, n - 1):
            c.wait(c.broadcast(ptr(a), a.nbytes, root), 60)
        return c.stats()

    try:
        for r, s in enumerate(run_ranks(comms, body)):
            talked = {q for q, p in s["per_peer"].items() if p["sent"] or p["received"]}
            assert talked and talked <= collective_peers(r, n), (r, sorted(talked), sorted(collective_peers(r, n)))
    finally:
        run_threads(n, lambda r: comms[r].shutdown(5.0))
