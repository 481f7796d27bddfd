"""Single-host daemon path: MCCL_DAEMON clients (spawned processes) through one mccld.

The daemon runs in the test process; ranks talk to it over its ipc socket and shared
memory exactly as a training script would.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zmq

from conftest import run_ranks
from mccl_common.errors import DaemonUnavailableError, ProtocolError

from mccl_common import attach_protocol as protocol
from mccld.attach import local_request
from mccl_common.daemon_settings import load_config
from mccld.daemon import Daemon

F32, F64, F16, BF16, I8, U8, I32, I64, BOOL = range(9)
SUM, AVG, MIN, MAX, PROD, BAND, BOR, BXOR = range(8)


def daemon_env(rdir: Path) -> dict[str, str]:
    return {"MCCL_RUNTIME_DIR": str(rdir), "MCCL_FLEET_KEY": "test-key-" + "x" * 16,
            "MCCL_LISTEN_ADDR": "127.0.0.1", "MCCL_PORT": "0", "MCCL_STATUS_PORT": "0",
            "MCCL_METRICS_PORT": "0", "MCCL_HOST_ID": f"t{os.getpid()}", "MCCL_CLIENT_CHECK_INTERVAL": "0.1"}


def our_segments() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("mccl-*"))


@contextlib.contextmanager
def running_daemon(**overrides: str):
    """An in-process daemon on a fresh runtime dir, its env with ``overrides``: (daemon, env)."""
    rdir = Path(tempfile.mkdtemp(prefix="mccl-dtest-"))
    env = {**daemon_env(rdir), **overrides}
    d = Daemon(load_config(env=env)).start()
    try:
        yield d, env
    finally:
        d.stop()
        for p in rdir.iterdir():
            p.unlink()
        rdir.rmdir()


@pytest.fixture
def daemon():
    with running_daemon() as d_env:
        yield d_env


def connect(rank: int, world: int, comm_id: int = 0x5eed, timeout_s: float = 30.0):
    import torch.distributed as dist
    from libmccl.daemon_client import DaemonCommunicator
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return DaemonCommunicator(rank, world, comm_id, store, None, None, timeout_s), store


def _expected(op: int, parts: list[np.ndarray]) -> np.ndarray:
    out = parts[0].copy()
    for p in parts[1:]:
        if op in (SUM, AVG):
            out = out + p
        elif op == MIN:
            out = np.minimum(out, p)
        elif op == MAX:
            out = np.maximum(out, p)
        elif op == PROD:
            out = out * p
        elif op == BAND:
            out = out & p
        elif op == BOR:
            out = out | p
        elif op == BXOR:
            out = out ^ p
    if op == AVG:
        out = out / len(parts) if out.dtype.kind == "f" else np.sign(out) * (np.abs(out) // len(parts))
    return out.astype(parts[0].dtype)


CASES = [(F32, op) for op in (SUM, AVG, MIN, MAX, PROD)] + [(F64, SUM), (F16, SUM), (I32, AVG), (I64, BXOR),
                                                               (U8, BOR), (I8, BAND), (BOOL, SUM)]
NP = {F32: np.float32, F64: np.float64, F16: np.float16, I8: np.int8, U8: np.uint8, I32: np.int32,
      I64: np.int64, BOOL: np.bool_}


def _data(rank: int, dtype: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(rank + 10 * dtype)
    if dtype == BOOL:
        return rng.integers(0, 2, n).astype(np.bool_)
    if dtype in (F32, F64, F16):
        return rng.integers(-4, 5, n).astype(NP[dtype])  # exact in every float type
    return rng.integers(-20 if dtype != U8 else 0, 20, n).astype(NP[dtype])


def rank_all_collectives(rank: int, world: int) -> str:
    comm, _store = connect(rank, world)
    n = 1000
    for dtype, op in CASES:
        a = _data(rank, dtype, n)
        comm.wait(comm.allreduce(a.ctypes.data, n, dtype, op), 20)
        want = _expected(op, [_data(r, dtype, n) for r in range(world)])
        assert np.array_equal(a, want), (dtype, op, a[:8], want[:8])
    # bfloat16 as raw uint16 bits: rank 0 gives 1.0 (0x3f80), the others 2.0 (0x4000)
    b = np.full(7, 0x3F80 if rank == 0 else 0x4000, dtype=np.uint16)
    comm.wait(comm.allreduce(b.ctypes.data, 7, BF16, SUM), 20)
    want_bits = int(np.float32(1 + 2 * (world - 1)).view(np.uint32)) >> 16
    assert (b == want_bits).all(), (b, want_bits)
    # broadcast from the last rank
    x = np.full(33, rank, dtype=np.int64)
    comm.wait(comm.broadcast(x.ctypes.data, x.nbytes, world - 1), 20)
    assert (x == world - 1).all()
    # allgather
    s = np.full(5, rank + 1, dtype=np.int32)
    g = np.zeros(5 * world, dtype=np.int32)
    comm.wait(comm.allgather(s.ctypes.data, g.ctypes.data, s.nbytes), 20)
    assert g.tolist() == [r + 1 for r in range(world) for _ in range(5)]
    # reduce_scatter
    rs_in = np.arange(4 * world, dtype=np.float32) * (rank + 1)
    rs_out = np.zeros(4, dtype=np.float32)
    comm.wait(comm.reduce_scatter(rs_in.ctypes.data, rs_out.ctypes.data, 4, F32, SUM), 20)
    total = sum(r + 1 for r in range(world))
    assert rs_out.tolist() == (np.arange(4 * world, dtype=np.float32)[rank * 4:(rank + 1) * 4] * total).tolist()
    # reduce to root 0: non-root buffers unchanged
    red = np.full(6, rank + 1, dtype=np.float64)
    comm.wait(comm.reduce(red.ctypes.data, 6, F64, SUM, 0), 20)
    assert (red == (total if rank == 0 else rank + 1)).all()
    # gather / scatter at root 1
    gs = np.full(3, rank * 10, dtype=np.int64)
    gr = np.zeros(3 * world, dtype=np.int64)
    comm.wait(comm.gather(gs.ctypes.data, gr.ctypes.data if rank == 1 else 0, gs.nbytes, 1), 20)
    if rank == 1:
        assert gr.tolist() == [r * 10 for r in range(world) for _ in range(3)]
    sc_in = np.arange(2 * world, dtype=np.int32) + 100
    sc_out = np.zeros(2, dtype=np.int32)
    comm.wait(comm.scatter(sc_in.ctypes.data if rank == 1 else 0, sc_out.ctypes.data, sc_out.nbytes, 1), 20)
    assert sc_out.tolist() == [100 + 2 * rank, 101 + 2 * rank]
    comm.wait(comm.barrier(), 20)
    # zero-size ops keep their place in the sequence
    empty = np.zeros(0, dtype=np.float32)
    comm.wait(comm.allreduce(empty.ctypes.data, 0, F32, SUM), 20)
    comm.wait(comm.allgather(empty.ctypes.data, empty.ctypes.data, 0), 20)
    comm.wait(comm.broadcast(empty.ctypes.data, 0, 0), 20)
    comm.report_overlap(0.25 + 0.5 * (rank % 2))   # fire and forget, shares the attach socket
    # a segment regrow mid-run (64 MB > the first 1 MB segment)
    big = np.ones(16 << 20, dtype=np.float32)
    comm.wait(comm.allreduce(big.ctypes.data, big.size, F32, SUM), 60)
    assert big[0] == world and big[-1] == world
    from test_daemon_p2p import check_alltoall, check_p2p
    check_alltoall(comm, rank, world)
    check_p2p(comm, rank, world)
    comm.shutdown(10)
    return "ok"


@pytest.mark.timeout(180)
def test_every_collective_two_ranks(daemon):
    d, env = daemon
    assert run_ranks(rank_all_collectives, 2, env=env, timeout_s=150) == ["ok", "ok"]
    overlap = {o["rank"]: o["latest"] for o in d.stats.snapshot()["overlap"] if o["job"] == "00005eed"}
    assert overlap == {0: 0.25, 1: 0.75}
    assert not [s for s in our_segments() if s.split("-")[1] == "00005eed"]
    assert d.status_provider()["attached"] == 0


def rank_callbacks(rank: int, world: int) -> list:
    import threading
    from libmccl.daemon_client import DaemonCommunicator
    import torch.distributed as dist
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    seen, done = [], threading.Event()

    def on_complete(batch):
        seen.extend(batch)
        if len(seen) >= 20:
            done.set()
    comm = DaemonCommunicator(rank, world, 0x77, store, None, on_complete, 30.0)
    bufs = [np.full(3, i, dtype=np.float32) for i in range(20)]
    ids = [comm.allreduce(b.ctypes.data, 3, F32, SUM) for b in bufs]   # 20 queued at once
    assert done.wait(30)
    pid = os.fork()   # a DataLoader-style fork must leave the parent's communicator alone
    if pid == 0:
        del comm
        import gc
        gc.collect()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    x = np.ones(3, dtype=np.float32)
    comm.wait(comm.allreduce(x.ctypes.data, 3, F32, SUM), 20)
    assert (x == world).all()
    comm.shutdown(5)
    seen = seen[:20]
    assert [op for op, err, info in seen] == ids and all(err is None for _, err, _ in seen)
    assert all((b == 2 * i).all() for i, b in enumerate(bufs))
    return ids


@pytest.mark.timeout(120)
def test_queued_ops_complete_in_order_through_callback(daemon):
    _d, env = daemon
    run_ranks(rank_callbacks, 2, env=env, timeout_s=90)


@pytest.mark.timeout(30)
def test_no_daemon_raises_daemon_unavailable(tmp_path, monkeypatch):
    from libmccl.daemon_client import DaemonCommunicator
    monkeypatch.setenv("MCCL_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(DaemonUnavailableError, match="no mccld answers at ipc://.*start it with `mccld`"):
        DaemonCommunicator(0, 1, 1, store=None, opts=None, on_complete=None, timeout_s=5)


@pytest.mark.timeout(60)
def test_malformed_and_unauthenticated_messages_are_rejected(daemon, caplog):
    d, env = daemon
    caplog.set_level("DEBUG", logger="mccld.attach")
    rdir = Path(env["MCCL_RUNTIME_DIR"])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(protocol.endpoint(rdir))
    try:
        def ask(frame: bytes) -> dict:
            sock.send(frame)
            assert sock.poll(5000), "daemon stopped answering"
            return protocol.decode_reply(sock.recv())
        bad = ask(b"\xff not json")
        assert not bad["ok"] and bad["error"]["kind"] == "ProtocolError"
        wrong_version = ask(b'{"v": 99, "type": "status", "req": 1}')
        assert wrong_version["error"]["kind"] == "ProtocolError" and "version" in wrong_version["error"]["message"]
        unauth = ask(protocol.encode({"type": "status", "req": 2}))
        assert unauth["error"]["kind"] == "AuthError"
        bad_token = ask(protocol.encode({"type": "hello", "req": 3, "token": "guess", "pid": os.getpid()}))
        assert bad_token["error"]["kind"] == "AuthError"
        missing_field = ask(protocol.encode({"type": "join", "req": 4, "job": "ab"}))
        assert missing_field["error"]["kind"] in ("AuthError", "ProtocolError")
    finally:
        sock.close(0)
    # Logged: the first rejection from a client at WARNING, its repeats at DEBUG.
    mine = [r for r in caplog.records if r.name == "mccld.attach"]
    assert mine[0].levelname == "WARNING" and "not JSON" in mine[0].getMessage()
    assert any(r.levelname == "DEBUG" and "wrong attach token" in r.getMessage() for r in mine)
    # ...and the daemon still serves a well-behaved client.
    assert local_request(rdir, {"type": "status"})["status"]["host"] == d.host_id


@pytest.mark.timeout(60)
def test_foreign_segment_name_is_refused(daemon):
    _d, env = daemon
    rdir = Path(env["MCCL_RUNTIME_DIR"])
    with pytest.raises(ProtocolError):
        local_request(rdir, {"type": "register", "job": "ab", "rank": 0, "segment": "../etc/passwd", "nbytes": 8})
