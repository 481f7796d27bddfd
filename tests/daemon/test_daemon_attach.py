"""Single-host daemon path: MCCL_DAEMON clients (spawned processes) through one mccld.

The daemon runs in the test process; ranks talk to it over its ipc socket and shared
memory exactly as a training script would.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import numpy as np
import pytest
import zmq

from support.ranks import run_ranks
from mccl_common.errors import DaemonUnavailableError, ProtocolError

from mccl_common import attach_protocol as protocol
from mccld.attach import local_request
from mccld.report.status_server import merge_status
from support.daemon import F32, SUM, rank_all_collectives, segments_left, until
@pytest.mark.timeout(180)
def test_every_collective_two_ranks(daemon):
    d, env = daemon
    assert run_ranks(rank_all_collectives, 2, env=env, timeout_s=150) == ["ok", "ok"]
    overlap = {o["rank"]: o["latest"] for o in d.stats.snapshot()["overlap"] if o["job"] == "00005eed"}
    assert overlap == {0: 0.25, 1: 0.75}
    assert segments_left(0x5eed) == []
    assert until(lambda: d.status_provider()["attached"] == 0, 30), "a finished rank stayed attached"
    # Once over, the job is listed as ended (with its age), not as a live job without ranks.
    status = merge_status(d.status_provider(), d.stats.snapshot(), tcp_text="")
    (job,) = [j for j in status["jobs"] if j["job"] == "00005eed"]
    assert job["state"] == "ended" and job["outcome"] == "ok" and job["age_s"] >= job["ended_s_ago"] >= 0


def rank_callbacks(rank: int, world: int) -> list:
    import threading
    from libmccl.daemon.client import DaemonCommunicator
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
    from libmccl.daemon.client import DaemonCommunicator
    monkeypatch.setenv("MCCL_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(DaemonUnavailableError, match="no mccld answers at ipc://.*start it with `mccld`") as e:
        DaemonCommunicator(0, 1, 1, store=None, opts=None, on_complete=None, timeout_s=5)
    # The hint names the launchd domain the macOS package installs into (a system daemon).
    assert "launchctl kickstart system/com.mccl.mccld" in str(e.value) and "gui/" not in str(e.value)


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


@pytest.mark.parametrize("cut", [
    {"pipeline_bytes": "2M", "small_allreduce_bytes": 65536},       # not a byte count
    {"pipeline_bytes": 2 << 20, "small_allreduce_bytes": -1},
    {"pipeline_bytes": True, "small_allreduce_bytes": 65536},       # JSON true is no size
    {"pipeline_bytes": 2 << 20},                                    # a key missing
    {"pipeline_bytes": 1 << 50, "small_allreduce_bytes": 65536},    # beyond any buffer
    [2 << 20, 65536],
])
def test_a_malformed_engine_cut_in_hello_is_refused_naming_the_daemon(cut):
    from libmccl.daemon.attach import _engine_cut
    with pytest.raises(ProtocolError, match=r"mccld at ipc:///x answered hello with engine_cut=.*restart mccld"):
        _engine_cut(cut, "ipc:///x")


def test_engine_cut_from_hello_sets_the_client_pieces():
    from libmccl.daemon.attach import _engine_cut
    from libmccl.daemon.client import _daemon_cut
    from mccl_common.settings import EngineConfig, load
    cfg = load(EngineConfig)
    told = _engine_cut({"pipeline_bytes": 4 << 20, "small_allreduce_bytes": 4096}, "ipc:///x")
    o = _daemon_cut(cfg, told)
    assert (o.pipeline_bytes, o.small_allreduce_bytes) == (4 << 20, 4096)
    older = _daemon_cut(cfg, _engine_cut(None, "ipc:///x"))  # an mccld that does not say: our own settings
    assert (older.pipeline_bytes, older.small_allreduce_bytes) == (cfg.pipeline_bytes, cfg.small_allreduce_bytes)
