"""The small-op fast path: all-reduces up to MCCL_DAEMON_FAST_BYTES and barriers go through
each client's shared-memory queue to mccld's native dispatcher (docs/daemon-fastpath.md).

One mccld in the test process, clients in spawned processes, as in test_daemon_attach.py.
A client killed in a small op, and mccld killed under one, are test_daemon_failures.py's
cases (their all-reduces are small).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from support.ranks import run_ranks
from support.daemon import AVG, BAND, F16, F32, F64, I32, I64, MAX, MIN, SUM, connect
from support.daemon import open_own_memory, segments_left
ENTRY_OFF = 3072   # libmccl/csrc/opqueue/layout.h


def thread_cpu_s(pid: int, name: str) -> float | None:
    """CPU seconds of the threads of ``pid`` named ``name``; None if there is none."""
    total, found = 0, False
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == name:
                fields = (task / "stat").read_text().rpartition(")")[2].split()
                total += int(fields[11]) + int(fields[12])
                found = True
        except OSError:
            continue
    return total / os.sysconf("SC_CLK_TCK") if found else None


def rank_mixed_order(rank: int, world: int, daemon_pid: int) -> str:
    comm, _store = connect(rank, world, comm_id=0xfa57)
    fast_on = comm._fastq is not None  # the client lets go of its queue at shutdown
    assert fast_on == (os.environ.get("MCCL_DAEMON_FAST_BYTES") != "0")
    # Back-to-back ops on one buffer, none waited for before the next is issued: each must
    # read the previous one's result, whichever path each takes (small: fast; 1 MB: ZeroMQ).
    small = np.full(16, 1.0, dtype=np.float64)
    big = np.full(1 << 17, 1.0, dtype=np.float64)
    ops = []
    for step in range(6):
        ops.append(comm.allreduce(small.ctypes.data, small.size, F64, SUM))
        if step % 2:
            ops.append(comm.allreduce(big.ctypes.data, big.size, F64, SUM))
            ops.append(comm.barrier())
    for op in ops:
        comm.wait(op, 30)
    assert (small == world ** 6).all(), small[:4]
    assert (big == world ** 3).all(), big[:4]
    # Every reduce op the engine has, AVG included, on a few dtypes.
    for dtype, npt, op in [(F32, np.float32, AVG), (F16, np.float16, MAX), (I32, np.int32, MIN),
                           (I64, np.int64, AVG), (I32, np.int32, BAND)]:
        a = np.full(5, 4 * (rank + 1), dtype=npt)
        comm.wait(comm.allreduce(a.ctypes.data, a.size, dtype, op), 20)
        vals = [4 * (r + 1) for r in range(world)]
        want = {AVG: sum(vals) // world if dtype != F32 else sum(vals) / world, MAX: max(vals), MIN: min(vals),
                BAND: np.bitwise_and.reduce(np.array(vals))}[op]
        assert (a == want).all(), (dtype, op, a, want)
    # Idle: neither the daemon's dispatcher nor our completer spins.
    comm.wait(comm.barrier(), 20)
    before = thread_cpu_s(daemon_pid, "mccld-fastpath"), thread_cpu_s(os.getpid(), "mccl-fastq")
    time.sleep(2.0)
    after = thread_cpu_s(daemon_pid, "mccld-fastpath"), thread_cpu_s(os.getpid(), "mccl-fastq")
    comm.wait(comm.barrier(), 20)
    comm.shutdown(10)
    assert comm._fastq is None
    if not fast_on:
        assert after == (None, None), after
        return "idle cpu 0 0"
    return f"idle cpu {after[0] - before[0]:.3f} {after[1] - before[1]:.3f}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fast_bytes", ["65536", "0"])
def test_small_and_large_ops_keep_one_order(daemon, fast_bytes):  # noqa: F811
    d, env = daemon
    out = run_ranks(rank_mixed_order, 2, os.getpid(), env={**env, "MCCL_DAEMON_FAST_BYTES": fast_bytes})
    for line in out:
        daemon_cpu, client_cpu = map(float, line.split()[-2:])
        assert daemon_cpu <= 0.05 and client_cpu <= 0.05, out
    assert segments_left(0xfa57) == []


def rank_mismatch(rank: int, world: int, big_on_rank1: bool) -> str:
    from mccl_common.errors import CollectiveMismatch, CollectiveTimeout
    comm, _store = connect(rank, world, comm_id=0xfa58, timeout_s=4)
    a = np.ones(1 << 15 if big_on_rank1 and rank == 1 else 4 + 4 * rank, dtype=np.float32)
    try:
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 30)
    except (CollectiveMismatch, CollectiveTimeout) as e:
        comm.shutdown(5)
        return f"{type(e).__name__}: {e}"
    raise AssertionError("mismatched all-reduces succeeded")


@pytest.mark.timeout(120)
def test_mismatched_small_ops_fail_naming_both_ranks(daemon):  # noqa: F811
    d, env = daemon
    for line in run_ranks(rank_mismatch, 2, False, env=env):
        assert line.startswith("CollectiveMismatch") and "rank 1" in line and "rank 0" in line, line


@pytest.mark.timeout(120)
def test_small_op_against_a_large_one_fails_the_job(daemon):  # noqa: F811
    # Rank 1's 128 KB all-reduce goes over ZeroMQ while rank 0's 4 floats wait in the queue.
    d, env = daemon
    for line in run_ranks(rank_mismatch, 2, True, env={**env, "MCCL_DAEMON_FAST_BYTES": "64K"}):
        assert line.startswith(("CollectiveMismatch", "CollectiveTimeout")), line
        assert "Timed out" in line or "rank 1" in line, line


def rank_skips_op(rank: int, world: int) -> str:
    from mccl_common.errors import CollectiveTimeout, MCCLError
    comm, _store = connect(rank, world, comm_id=0xfa59, timeout_s=2)
    a = np.ones(4, dtype=np.float32)
    if rank == 1:
        time.sleep(5)  # never issues the all-reduce rank 0 waits in
        with pytest.raises(MCCLError):
            comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 10)
        comm.shutdown(5)
        return "later op failed"
    started = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 30)
    comm.shutdown(5)
    return f"{time.monotonic() - started:.1f}s {info.value}"


@pytest.mark.timeout(120)
def test_local_rank_that_never_submits_times_out_the_others(daemon):  # noqa: F811
    d, env = daemon
    waited, skipped = run_ranks(rank_skips_op, 2, env=env)
    assert skipped == "later op failed"
    took, msg = waited.split(" ", 1)
    # The daemon's verdict, naming rank 1, at the job's timeout: the client's own margin past it
    # would have raised its own timeout, which names no rank (a < 6 s bound stood here).
    assert "Timed out" in msg and "[1]" in msg, msg


def rank_plain(rank: int, world: int, comm_id: int) -> str:
    comm, _store = connect(rank, world, comm_id=comm_id)
    a = np.full(4, rank + 1.0, dtype=np.float32)
    comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 20)
    comm.shutdown(10)
    return str(a[0])


def rank_writes_garbage(rank: int, world: int, entry: bytes) -> str:
    from libmccl import _core
    from mccl_common.errors import ProtocolError
    comm, _store = connect(rank, world, comm_id=0xfa5c)
    a = np.ones(4, dtype=np.float32)
    comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 20)
    fd = open_own_memory(comm._fastq.name)
    mem = mmap.mmap(fd, 4096)
    os.close(fd)
    mem[ENTRY_OFF:ENTRY_OFF + len(entry)] = entry
    view = (ctypes.c_char * 4096).from_buffer(mem)
    submitted = _core.Ticket.at(ctypes.addressof(view))
    submitted.signal(submitted.value + 1)   # published behind the client's back
    del submitted, view
    time.sleep(0.5)
    with pytest.raises(ProtocolError) as info:
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 20)
    comm.shutdown(5)
    mem.close()
    return str(info.value)


GARBAGE = {
    "unknown kind": struct.pack("<QIIIIQ", 2, 77, 0, 0, 0, 4),
    "dtype out of range": struct.pack("<QIIIIQ", 2, 1, 99, 0, 0, 4),
    "band on floats": struct.pack("<QIIIIQ", 2, 1, F32, BAND, 0, 4),
    "count past the slot": struct.pack("<QIIIIQ", 2, 1, F32, SUM, 0, 1 << 60),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", sorted(GARBAGE))
def test_malformed_entry_fails_its_job_with_protocol_error(daemon, what):  # noqa: F811
    d, env = daemon
    (msg,) = run_ranks(rank_writes_garbage, 1, GARBAGE[what], env=env)
    assert "fast-path entry" in msg and "rank 0" in msg, msg
    assert run_ranks(rank_plain, 1, 0xfa5d, env=env) == ["1.0"]   # mccld lives on


def rank_own_fast_bytes(rank: int, world: int) -> str:
    from mccl_common.errors import ConfigError
    os.environ["MCCL_DAEMON_FAST_BYTES"] = "0" if rank == 1 else "64K"
    with pytest.raises(ConfigError) as info:
        connect(rank, world, comm_id=0xfa5e)
    return str(info.value)


@pytest.mark.timeout(120)
def test_ranks_of_a_host_with_different_fast_bytes_fail_at_join(daemon):  # noqa: F811
    d, env = daemon
    for msg in run_ranks(rank_own_fast_bytes, 2, env=env):
        assert "MCCL_DAEMON_FAST_BYTES" in msg and "[1]" in msg, msg
    assert segments_left(0xfa5e) == []
