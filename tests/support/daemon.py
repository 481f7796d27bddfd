"""An mccld for the daemon tests: one in this process on a fresh runtime dir (``daemon``,
``running_daemon``), clients that attach from spawned ranks (``connect``), raw attach clients
that speak the protocol by hand (``RawClient``, ``raw``), mccld as a subprocess
(``mccld_proc``), and what is left in /dev/shm (``our_segments``, ``job_segments``)."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from mccl_common import attach_protocol as protocol
from mccl_common import shm
from mccl_common.daemon_settings import load_config
from mccl_common.wire import (AVG, BAND, BF16, BOOL, BOR, BXOR, F16, F32, F64, I8, I32, I64, MAX, MIN,  # noqa: F401
                              PROD, SUM, U8)
from mccld.daemon import Daemon



def daemon_env(rdir: Path) -> dict[str, str]:
    # A fleet of this process's own: mDNS finds every daemon of a fleet on the machine, and the
    # daemons of test processes running side by side dialled each other (refused: other keys).
    return {"MCCL_RUNTIME_DIR": str(rdir), "MCCL_FLEET_KEY": "test-key-" + "x" * 32, "MCCL_FLEET": f"t{os.getpid()}",
            "MCCL_LISTEN_ADDR": "127.0.0.1", "MCCL_PORT": "0", "MCCL_STATUS_PORT": "0",
            "MCCL_METRICS_PORT": "0", "MCCL_HOST_ID": f"t{os.getpid()}", "MCCL_CLIENT_CHECK_INTERVAL": "0.1"}


def live_segments() -> set[str]:
    """Names of the mccl segments that still exist anywhere on this machine. On Linux they are
    sealed memfds with no name in /dev/shm: one exists while some process holds it open or
    mapped (/proc/*/fd, /proc/*/maps show "/memfd:<name> (deleted)"); named ones (/dev/shm,
    as on macOS) count too."""
    names = {p.name for p in Path("/dev/shm").glob("mccl-*")}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                at = line.find("/memfd:mccl-")
                if at >= 0:
                    names.add(line[at + len("/memfd:"):].removesuffix(" (deleted)").strip())
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/memfd:mccl-"):
                    names.add(target[len("/memfd:"):].removesuffix(" (deleted)"))
        except OSError:
            continue   # the process went, or is not ours to read
    return names


def our_segments() -> list[str]:
    """The mccl segments this test run may have left: not those of a live process outside it
    (CI runs the unit and e2e suites side by side, and they share job ids)."""
    return sorted(n for n in live_segments() if not _someone_elses(n))


def _someone_elses(name: str) -> bool:
    """Whether the segment's owner (the pid in its name) is a live process that this one did
    not start. A dead owner's segment is what a test must check was freed."""
    parts = name.split("-")
    pid = int(parts[3]) if len(parts) >= 4 and parts[3].isdigit() else None
    me = os.getpid()
    for _ in range(64):  # up the parent chain: ranks may be grandchildren (ip netns exec, torchrun)
        if pid is None or pid == me:
            return False
        try:
            state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:
            return False  # gone
        if state == "Z" or int(ppid) <= 1:
            return state != "Z"
        pid = int(ppid)
    return True


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


@contextlib.contextmanager
def loopback_hosts(n: int, tag: str, each=None, engine_env: dict[str, str] | None = None):
    """``n`` mcclds in this process on loopback, each an emulated host (its own runtime dir and
    host id ``<tag><pid>h<i>``): (daemons, their runtime dirs). ``each(i)``: settings of daemon
    ``i`` over ``daemon_env``; ``engine_env``: engine settings over this process's env."""
    from mccl_common.settings import EngineConfig, load

    dirs = [Path(tempfile.mkdtemp(prefix=f"mccl-{tag}-")) for _ in range(n)]
    engine_cfg = load(EngineConfig, env={**os.environ, **(engine_env or {})})
    running = []
    try:
        for i, d in enumerate(dirs):
            env = daemon_env(d) | {"MCCL_HOST_ID": f"{tag}{os.getpid()}h{i}"} | (each(i) if each else {})
            running.append(Daemon(load_config(env=env), engine_cfg=engine_cfg).start())
        yield running, [str(d) for d in dirs]
    finally:
        for d in running:
            d.stop()
        for d in dirs:
            for f in d.iterdir():
                f.unlink()
            d.rmdir()


@pytest.fixture
def daemon():
    with running_daemon() as d_env:
        yield d_env


def connect(rank: int, world: int, comm_id: int = 0x5eed, timeout_s: float = 30.0):
    import torch.distributed as dist
    from libmccl.daemon.client import DaemonCommunicator
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return DaemonCommunicator(rank, world, comm_id, store, None, None, timeout_s), store


class RawClient:
    """One attach connection speaking the protocol by hand, as a buggy or hostile client would."""

    def __init__(self, rdir: Path):
        self.rdir = rdir
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(protocol.endpoint(rdir))
        self.req = 0

    def send(self, msg: dict) -> int:
        self.req += 1
        self.sock.send(protocol.encode({**msg, "req": self.req}))
        return self.req

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def recv(self, timeout_s: float = 5.0) -> dict | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return protocol.decode_reply(self.sock.recv())

    def call(self, msg: dict, timeout_s: float = 5.0) -> dict:
        req = self.send(msg)
        reply = self.recv(timeout_s)
        assert reply is not None, f"mccld never answered {msg}"
        assert reply["req"] == req, reply
        return reply

    def hello(self, pid: int | None = None) -> dict:
        token = (self.rdir / protocol.TOKEN_NAME).read_text().strip()
        return self.call({"type": "hello", "token": token, "pid": os.getpid() if pid is None else pid})

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def raw(daemon):  # noqa: F811
    """The in-process daemon and one raw connection to it."""
    d, env = daemon
    c = RawClient(Path(env["MCCL_RUNTIME_DIR"]))
    try:
        yield d, c
    finally:
        c.close()


def refused(reply: dict, *words: str) -> bool:
    msg = reply["error"]["message"] if not reply.get("ok") else ""
    return not reply.get("ok") and reply["error"]["kind"] == "ProtocolError" and all(w in msg for w in words)


def hand_over(rdir: Path, seg: shm.Segment) -> None:
    """Give mccld (of this user) the segment's descriptor, as a client does before registering it."""
    from mccl_common import fd_handover
    fd_handover.hand_over(rdir, seg.name, seg.handover_fd, os.geteuid())
    seg.handed_over()


def open_own_memory(name: str) -> int:
    """A new descriptor of this process's mapping of segment ``name`` (a memfd has no name to
    open; /proc/self/map_files has the mapping, to root), for tests that write behind the client."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        if f"/memfd:{name} " in line + " ":
            return os.open(f"/proc/self/map_files/{line.split()[0]}", os.O_RDWR)
    raise FileNotFoundError(f"no mapping of {name} in this process")


def one_rank_job(client: RawClient, host_id: str, job: str, nbytes: int = 1 << 16) -> shm.Segment:
    """Join a 1-rank job and register a segment; returns the segment."""
    link = client.hello()["link_addr"]
    joined = client.call({"type": "join", "job": job, "rank": 0, "size": 1, "timeout_s": 30.0, "opts": {},
                          "hosts": [{"host_id": host_id, "link_addr": link, "ranks": [0]}]})
    assert joined["ok"], joined
    seg = shm.Segment(shm.segment_name(job, 0, os.getpid(), 1), nbytes, create=True)
    hand_over(client.rdir, seg)
    assert client.call({"type": "register", "job": job, "rank": 0, "segment": seg.name, "nbytes": nbytes})["ok"]
    return seg


@pytest.fixture
def mccld_proc(tmp_path):
    """mccld in a subprocess, so that a crash shows as its exit: (process, runtime dir, host id)."""
    rdir = tmp_path / "rt"
    env = daemon_env(rdir)
    proc = subprocess.Popen([sys.executable, "-m", "mccld"], env={**os.environ, **env}, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (rdir / "token").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "mccld did not start"
            time.sleep(0.1)
        yield proc, rdir, env["MCCL_HOST_ID"]
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM (mccld's clean stop), then SIGKILL if it does not stop in 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def job_segments(comm_id: int) -> list[str]:
    return [s for s in our_segments() if s.split("-")[1] == f"{comm_id & 0xFFFFFFFF:08x}"]


def until(condition, within_s: float = 30.0) -> bool:
    """Waits for ``condition`` (an event's sign, polled) up to ``within_s``; its last value."""
    deadline = time.monotonic() + within_s
    while not (ok := condition()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(ok)


def segments_left(comm_id: int, timeout_s: float = 30.0) -> list[str]:
    """The job's segments still mapped or named once they stop going, or after ``timeout_s``.
    A rank's leave is fire-and-forget: mccld unmaps on the job's thread after the rank's
    process has exited (ci, stop 40, caught one look made right after the ranks returned)."""
    until(lambda: not job_segments(comm_id), timeout_s)
    return job_segments(comm_id)


# -- a rank program the single-host and the fleet tests both run -----------------------------------
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
    from support.p2p import check_alltoall, check_p2p
    check_alltoall(comm, rank, world)
    check_p2p(comm, rank, world)
    comm.shutdown(10)
    return "ok"
