"""Compressed all-reduce through mccld (MCCL_DAEMON=1, docs/compression.md): the engine among the
job's daemons runs the job's MCCL_COMPRESSION on what crosses hosts.

"Hosts" are daemons in this process on loopback (one LinkManager, pool and engine each), the ranks
spawned processes attached each to its host's daemon. With one rank per host the daemons' engine
has the job's ranks, so its compressed all-reduce must give the in-process engine's bits (ranks as
threads here), step after step with error feedback, whether the op goes through the job thread
whole or pipelined through the segment's tickets. With two ranks per host the host's sum is exact
and only it is compressed. Also: ranks that disagree fail with a ConfigError naming both settings,
a hostile compression value is refused at the boundary, and the exporter and `mcclctl jobs` show
bytes before and after compression.
"""

from __future__ import annotations

import datetime
import os
import time

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import ConfigError
from mccld.daemon import Daemon
from support.daemon import loopback_hosts, refused
from support.engine import make_options, ptr, ranks
from support.engine import run_ranks as run_threads_ranks
from support.ranks import run_ranks

pytestmark = pytest.mark.timeout(240)

F32, SUM, AVG = 0, 0, 1
# 100,003 float32 (400 KB): above MCCL_COMPRESSION_MIN_BYTES, below a pipelined op, so the job
# thread runs it whole; 600,011 (2.4 MB) is pipelined through the tickets (MCCL_PIPELINE_BYTES 2 MB).
# Two buckets of the same size, as DDP often has: only a key per tensor keeps their feedback apart
# (the segment mccld runs both on is the same).
SMALL, LARGE = 100_003, 600_011
SIZES = (SMALL, SMALL, LARGE)
STEPS = 2


@pytest.fixture
def hosts(request):
    """``request.param`` daemons on loopback, each its own "host" (or (n, engine settings of mccld))."""
    n, extra = request.param if isinstance(request.param, tuple) else (request.param, {})
    with loopback_hosts(n, "cm", engine_env=extra) as running_dirs:
        yield running_dirs


def step_input(rank: int, step: int, count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed * 1000 + step * 10 + rank).standard_normal(count).astype(np.float32)


def _comm(rank: int, world: int, rdir: str, comm_id: int, codec: str, feedback: bool = True):
    os.environ["MCCL_RUNTIME_DIR"] = rdir      # this rank's host's daemon
    import torch.distributed as dist
    from libmccl.daemon.client import DaemonCommunicator
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    opts = make_options(compression=codec, compression_feedback=feedback)
    return DaemonCommunicator(rank, world, comm_id, dist.PrefixStore(f"job{comm_id}", store), opts, None, 60.0)


def rank_steps(rank: int, world: int, dirs: list[str], placement: list[int], codec: str, op: int,
               seed: int) -> list[list[bytes]]:
    """STEPS all-reduces of each size, each from one persistent buffer (a DDP bucket's way)."""
    comm = _comm(rank, world, dirs[placement[rank]], 0xc0de00 + seed, codec)
    bufs = [np.zeros(n, np.float32) for n in SIZES]
    out = []
    for step in range(STEPS):
        got = []
        for i, a in enumerate(bufs):
            a[:] = step_input(rank, step * 10 + i, a.size, seed)
            comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, op), 60)
            got.append(a.tobytes())
        out.append(got)
    comm.shutdown(10)
    return out


def in_process(parts: list[list[np.ndarray]], codec: str, op: int) -> list[list[bytes]]:
    """The in-process engine (ranks as threads), the same steps: ``parts[step][rank]`` per size."""
    n = len(parts[0][0])
    out = []
    with ranks(n, opts=make_options(compression=codec)) as comms:
        bufs = [[np.zeros(c, np.float32) for c in SIZES] for _ in range(n)]
        for step in range(STEPS):
            got = []
            for i, c in enumerate(SIZES):
                def body(r, comm, c=c, i=i):
                    bufs[r][i][:] = parts[step][i][r]
                    comm.wait(comm.allreduce(ptr(bufs[r][i]), c, F32, op), 60)
                    return bufs[r][i].tobytes()
                res = run_threads_ranks(comms, body)
                assert all(x == res[0] for x in res)
                got.append(res[0])
            out.append(got)
    return out


def _transpose(world: int, fn) -> list[list[list[np.ndarray]]]:
    """parts[step][size index][contributor]"""
    return [[[fn(r, step * 10 + i, c) for r in range(world)] for i, c in enumerate(SIZES)] for step in range(STEPS)]


@pytest.mark.parametrize("hosts,codec,op", [(2, "int8", SUM), (3, "int8", SUM), (3, "bf16", AVG), (2, "bf16", SUM)],
                         indirect=["hosts"], ids=["2-int8", "3-int8", "3-bf16-avg", "2-bf16"])
def test_through_mccld_equals_in_process_bit_for_bit(hosts, codec, op):
    daemons, dirs = hosts
    world, seed = len(daemons), 1
    got = run_ranks(rank_steps, world, dirs, list(range(world)), codec, op, seed, timeout_s=180)
    for r in range(1, world):
        assert got[r] == got[0], f"rank {r}'s results differ from rank 0's"
    parts = _transpose(world, lambda r, step, c: step_input(r, step, c, seed))
    want = in_process(parts, codec, op)
    for step in range(STEPS):
        for i, c in enumerate(SIZES):
            a = np.frombuffer(got[0][step][i], np.float32)
            b = np.frombuffer(want[step][i], np.float32)
            exact = np.sum([p.astype(np.float64) for p in parts[step][i]], axis=0) / (world if op == AVG else 1)
            assert np.linalg.norm(a - exact) > 0, "not compressed"
            # Step > 0 includes what feedback carried over: equal only if mccld keyed it per buffer.
            assert got[0][step][i] == want[step][i], \
                f"step {step}, {c} elements: mccld's result is not the in-process one " \
                f"(max difference {np.max(np.abs(a - b))})"
    _counters_say_compressed(daemons, 0xc0de00 + seed, codec, world)


def _counters_say_compressed(daemons: list[Daemon], comm_id: int, codec: str, world: int) -> None:
    """The exporter's bytes before and after compression, and the `mcclctl jobs` row."""
    from mcclctl import formatting as fmt
    from mccld.report.metrics import make_registry
    from mccld.report.status_server import merge_status
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    job = f"{comm_id & 0xFFFFFFFF:08x}"
    given = STEPS * sum(SIZES) * 4
    encoded = STEPS * sum(_core.compress_encoded_bytes(codec, c) for c in SIZES)
    for d in daemons:
        deadline = time.monotonic() + 20
        while True:
            js = d.stats.snapshot()["jobs"].get(job, {})
            if js.get("allreduce_input_bytes") == given and js.get("wire_bytes", 0) > 0:
                break
            assert time.monotonic() < deadline, js
            time.sleep(0.05)
        assert js["compression"] == codec and js["allreduce_encoded_bytes"] == encoded, js
        # Each link carries 2(N-1)/N of the encoded buffer: what the engine sent is that, plus framing.
        assert encoded * 2 * (world - 1) / world <= js["wire_bytes"] < given * 2 * (world - 1) / world, js
        scraped = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(generate_latest(make_registry(d.stats)).decode())
                   for s in fam.samples}
        labels = (("compression", codec), ("job_id", job))
        assert scraped[("mccl_job_allreduce_input_bytes_total", labels)] == given
        assert scraped[("mccl_job_allreduce_encoded_bytes_total", labels)] == encoded
        assert scraped[("mccl_job_wire_bytes_total", (("job_id", job),))] == js["wire_bytes"]
        status = merge_status(d.status_provider(), d.stats.snapshot())
        (row,) = [j for j in status["jobs"] if j["job"] == job]
        assert row["compression"] == codec and row["allreduce_input_bytes"] == given
        table = fmt.jobs_table([(d.host_id, status["jobs"], None)])
        assert "COMPRESSION" in table.splitlines()[0]
        assert f"{codec} {given / encoded:.2f}x" in table, table


def rank_two_per_host(rank: int, world: int, dirs: list[str], placement: list[int]) -> bytes:
    comm = _comm(rank, world, dirs[placement[rank]], 0xc0de77, "int8")
    a = step_input(rank, 0, LARGE, 7)
    comm.wait(comm.allreduce(a.ctypes.data, LARGE, F32, SUM), 60)
    comm.shutdown(10)
    return a.tobytes()


@pytest.mark.parametrize("hosts", [2], indirect=True)
def test_a_hosts_ranks_are_summed_exactly_and_only_the_host_sum_is_compressed(hosts):
    _daemons, dirs = hosts
    placement = [0, 0, 1, 1]
    got = run_ranks(rank_two_per_host, 4, dirs, placement, timeout_s=180)
    assert all(g == got[0] for g in got)
    xs = [step_input(r, 0, LARGE, 7) for r in range(4)]
    host_sums = [xs[0] + xs[1], xs[2] + xs[3]]       # float32, leader first: mccld's local reduction
    with ranks(2, opts=make_options(compression="int8")) as comms:
        def body(r, comm):
            comm.wait(comm.allreduce(ptr(host_sums[r]), LARGE, F32, SUM), 60)
            return host_sums[r].tobytes()
        want = run_threads_ranks(comms, body)[0]
    assert got[0] == want


def rank_mean(rank: int, world: int, dirs: list[str], feedback: bool, steps: int) -> list[bytes]:
    """The mean of ``steps`` all-reduces of one tensor (the engine test's convergence check)."""
    comm = _comm(rank, world, dirs[rank], 0xc0de50 + feedback, "int8", feedback)
    x = step_input(rank, 0, 1 << 17, 5)
    a = np.empty_like(x)
    total = np.zeros(x.size, np.float64)
    first = None
    for _ in range(steps):
        a[:] = x
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 60)
        first = a.tobytes() if first is None else first
        total += a
    comm.shutdown(10)
    return [first, (total / steps).tobytes()]


@pytest.mark.parametrize("hosts", [3], indirect=True)
def test_error_feedback_through_mccld_converges(hosts):
    _daemons, dirs = hosts
    xs = [step_input(r, 0, 1 << 17, 5) for r in range(3)]
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0)

    def err(b: bytes, dtype) -> float:
        v = np.frombuffer(b, dtype).astype(np.float64)
        return float(np.linalg.norm(v - ref) / np.linalg.norm(ref))

    errs = {}
    for fb in (False, True):
        out = run_ranks(rank_mean, 3, dirs, fb, 16, timeout_s=180)
        assert all(o == out[0] for o in out)
        errs[fb] = (err(out[0][0], np.float32), err(out[0][1], np.float64))
    assert errs[False][1] == pytest.approx(errs[False][0], rel=0.01), errs   # every step rounds alike
    assert errs[True][1] < errs[True][0] / 4, errs                           # what one drops, the next sends


def rank_two_buckets(rank: int, world: int, dirs: list[str]) -> list[bytes]:
    comm = _comm(rank, world, dirs[rank], 0xc0de60, "int8")
    bufs = [np.zeros(SMALL, np.float32) for _ in range(2)]
    out = []
    for step in range(2):
        for i, a in enumerate(bufs):
            a[:] = step_input(rank, step * 10 + i, SMALL, 3)
            comm.wait(comm.allreduce(a.ctypes.data, SMALL, F32, SUM), 60)
            out.append(a.tobytes())
    comm.shutdown(10)
    return out


@pytest.mark.parametrize("hosts", [(2, {"MCCL_COMPRESSION_FEEDBACK_MAX_BYTES": str(4 * SMALL)})], indirect=True)
def test_mccld_caps_a_jobs_residuals_with_its_own_setting(hosts):
    """Room for one bucket's residual in mccld: each op drops the other's, so every op runs as
    without feedback (the client cannot raise mccld's cap: the join does not carry it)."""
    _daemons, dirs = hosts
    got = run_ranks(rank_two_buckets, 2, dirs, timeout_s=120)
    with ranks(2, opts=make_options(compression="int8", compression_feedback=False)) as comms:
        want = []
        for step in range(2):
            for i in range(2):
                xs = [step_input(r, step * 10 + i, SMALL, 3) for r in range(2)]

                def body(r, comm, xs=xs):
                    comm.wait(comm.allreduce(ptr(xs[r]), SMALL, F32, SUM), 60)
                    return xs[r].tobytes()
                want.append(run_threads_ranks(comms, body)[0])
    assert got[0] == want


def rank_mismatch(rank: int, world: int, dirs: list[str]) -> str:
    try:
        comm = _comm(rank, world, dirs[rank], 0xc0de99, "int8" if rank == 0 else "off")
    except ConfigError as e:
        return str(e)
    comm.shutdown(5)
    return "joined"


@pytest.mark.parametrize("hosts", [2], indirect=True)
def test_ranks_that_disagree_fail_with_both_settings_named(hosts):
    _daemons, dirs = hosts
    started = time.monotonic()
    out = run_ranks(rank_mismatch, 2, dirs, timeout_s=90)
    for msg in out:
        assert "MCCL_COMPRESSION=int8" in msg and "MCCL_COMPRESSION=off" in msg, out
    assert time.monotonic() - started < 60   # not the set-up timeout of a hung join


def test_a_daemon_refuses_a_local_rank_that_disagrees():
    """A client that skipped the store's check: its host's daemon compares the joins."""
    from mccl_common import attach_protocol as protocol
    from mccld.jobs.job import Job
    from support.job_host import StandInHost

    host = StandInHost()
    placement = (protocol.Host("h0", "127.0.0.1:1", (0, 1)),)
    job = Job(host, "abc", 2, placement, 5.0, {}, protocol.Compression("int8", 1 << 16, True))
    try:
        job.join(b"a", 1, 0, os.getpid(), 2, placement, {}, protocol.Compression("int8", 1 << 16, True))
        with pytest.raises(ConfigError) as e:
            job.join(b"b", 2, 1, os.getpid(), 2, placement, {}, protocol.Compression("bf16", 1 << 16, True))
        assert "MCCL_COMPRESSION=bf16" in str(e.value) and "MCCL_COMPRESSION=int8" in str(e.value)
        assert job.failed is e.value   # the rank already waiting on its join gets it too
    finally:
        job.close(stopping=True)


@pytest.mark.parametrize("value", ["zstd", "INT8", 8, None, "int8" * 40, ["int8"]])
def test_a_hostile_compression_value_is_refused_at_the_boundary(raw, value):
    _d, c = raw
    assert c.hello()["ok"]
    hosts = [{"host_id": _d.host_id, "link_addr": "127.0.0.1:1", "ranks": [0]}]
    reply = c.call({"type": "join", "job": "c0de", "rank": 0, "size": 1, "hosts": hosts, "timeout_s": 5.0,
                    "opts": {}, "compression": value})
    assert refused(reply, "'compression'"), reply
    for bad in ({"compression_min_bytes": -1}, {"compression_min_bytes": 1 << 60}, {"compression_feedback": "yes"}):
        reply = c.call({"type": "join", "job": "c0de", "rank": 0, "size": 1, "hosts": hosts, "timeout_s": 5.0,
                        "opts": {}, "compression": "int8", **bad})
        assert refused(reply, repr(next(iter(bad)))), (bad, reply)


@pytest.mark.parametrize("key", [-1, 1 << 64, "0x10", 1.5])
def test_a_hostile_feedback_key_is_refused(key):
    from mccl_common import attach_protocol as protocol
    from mccl_common.errors import ProtocolError
    with pytest.raises(ProtocolError, match="'key'"):
        protocol.build_request({"type": "op", "req": 1, "job": "c0de", "rank": 0, "seq": 1, "op": "allreduce",
                                "args": {"count": 4, "dtype": 0, "op": 0, "offset": 0, "key": key}})
