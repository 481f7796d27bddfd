"""The attach socket (ZeroMQ ROUTER, JSON control messages): the surface local clients reach.

Seeds are the messages a real ``DaemonCommunicator`` sends, captured from
``mccl_common.attach_protocol.encode`` while it runs collectives, with the values a batch must
supply replaced by placeholders ($TOKEN, $PID, $JOB, $SEG). Stages:

  raw     frames on a connection that never said hello (random bytes, several frames,
          mutated messages): each gets exactly one (error) reply
  authed  one mutated message on a connection that said hello and joined a one-rank
          job with a registered segment, so mutations reach the handlers and the job

Each request must get exactly one reply. Some legitimately wait (a join for ranks that
never come, an op of such a job): at the end of a batch the connection says hello
again with the batch's pid, that process (``Helper``) is killed, and the daemon must
then fail and answer everything still pending.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any

import numpy as np
import zmq
from hypothesis import strategies as st

from mccl_common import attach_protocol as protocol, fd_handover, shm

from .mutate import byte_noise, encode, mutated_json, random_bytes
from .surfaces import Input, Surface, Verdict
from .target import Helper, MemoryStore

_REPLY_WAIT_S = 0.05         # per request; one that waits longer is counted at the batch's end
_END_WAIT_S = 15.0           # for the pending requests' answers once the batch's pid is gone
_SEG_BYTES = 1 << 16
PLACEHOLDERS = ("$TOKEN", "$PID", "$JOB", "$SEG")
_BATCHES = itertools.count(1)


class AttachSurface(Surface):
    name = "attach"

    def __init__(self, daemon):
        super().__init__(daemon)
        self._sock: zmq.Socket | None = None
        self._raw: zmq.Socket | None = None
        self._helper: Helper | None = None
        self._seg: shm.Segment | None = None
        self._sent = self._got = 0
        self._batch = 0

    # -- seeds -------------------------------------------------------------------------
    def capture(self) -> None:
        sent: list[dict[str, Any]] = []
        real_encode = protocol.encode

        def recording(msg: dict[str, Any]) -> bytes:
            sent.append(json.loads(json.dumps(msg)))
            return real_encode(msg)
        protocol.encode = recording
        try:
            _real_session(self.daemon)
        finally:
            protocol.encode = real_encode
        seeds = [_placeholders(m) for m in sent if m.get("type") != "reply"]
        # What the session does not send: a status and a probe (mcclctl's), and the batch's
        # own one-rank join, so mutations of it are accepted often enough to go deeper.
        seeds += [{"type": "status", "req": 1},
                  {"type": "probe", "addr": self.daemon.link_addr, "req": 1},
                  _one_rank_join(self.daemon, 1)]
        self.seeds = {"authed": _dedup(seeds)}

    def strategy(self) -> st.SearchStrategy[Input]:
        msgs = self.seeds["authed"]
        authed = mutated_json(msgs).map(_with_version).map(encode).flatmap(byte_noise).map(
            lambda b: Input(self.name, "authed", [b]))
        raw_frames = st.lists(st.one_of(random_bytes, mutated_json(msgs).map(encode)), min_size=1, max_size=3)
        raw = raw_frames.map(lambda fs: Input(self.name, "raw", fs))
        return st.one_of(authed, authed, authed, raw)

    # -- batches -------------------------------------------------------------------------
    def begin_batch(self) -> None:
        self._batch = next(_BATCHES)      # job ids stay unique across surfaces of one process
        self._sent = self._got = 0
        ctx = zmq.Context.instance()
        self._helper = Helper()
        self._sock = self._dealer(ctx)
        self._raw = self._dealer(ctx)
        job = self.job
        self._call({"type": "hello", "token": self._token(), "pid": self._helper.pid})
        self._call(_one_rank_join(self.daemon, 1, job))
        self._seg = shm.Segment(shm.segment_name(job, 0, self._helper.pid, 1), _SEG_BYTES, create=True)
        fd_handover.hand_over(self.daemon.rdir, self._seg.name, self._seg.handover_fd, os.geteuid())
        self._seg.handed_over()
        self._call({"type": "register", "job": job, "rank": 0, "segment": self._seg.name, "nbytes": _SEG_BYTES})

    @property
    def job(self) -> str:
        return f"f{os.getpid() % 0xFFFF:04x}{self._batch % 0xFFFFFF:06x}"



    def end_batch(self) -> int:
        assert self._sock is not None and self._helper is not None
        # A mutated hello may have claimed another pid for this connection: claim the helper's again.
        self._sock.send(protocol.encode({"type": "hello", "token": self._token(), "pid": self._helper.pid,
                                         "req": 1}))
        self._sent += 1
        self._helper.kill()
        deadline = time.monotonic() + _END_WAIT_S
        while self._got < self._sent and time.monotonic() < deadline:
            self._collect(0.1)
        unanswered = max(0, self._sent - self._got)
        for s in (self._sock, self._raw):
            s.close(0)
        if self._seg is not None:
            self._seg.close()
            self._seg.unlink()
        self._sock = self._raw = self._seg = None
        return unanswered

    def send(self, inp: Input) -> Verdict:
        sock = self._raw if inp.stage == "raw" else self._sock
        assert sock is not None
        frames = [self._fill(f) for f in inp.frames] if inp.stage == "authed" else inp.frames
        before = self._got
        sock.send_multipart(frames)
        self._sent += 1
        self._collect(_REPLY_WAIT_S, want=before + 1)
        # A reply that comes later (a join waiting for its ranks) is counted at the batch's end.
        return Verdict(True)

    # -- helpers ----------------------------------------------------------------------------
    def _dealer(self, ctx: zmq.Context) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(protocol.endpoint(self.daemon.rdir))
        return s

    def _token(self) -> str:
        return (self.daemon.rdir / protocol.TOKEN_NAME).read_text().strip()

    def _fill(self, frame: bytes) -> bytes:
        assert self._helper is not None and self._seg is not None
        return (frame.replace(b'"$PID"', str(self._helper.pid).encode())
                .replace(b"$TOKEN", self._token().encode())
                .replace(b"$JOB", self.job.encode())
                .replace(b"$SEG", self._seg.name.encode()))

    def _call(self, msg: dict[str, Any]) -> None:
        """A set-up request that must succeed."""
        assert self._sock is not None
        self._sock.send(protocol.encode({**msg, "req": 1}))
        if not self._sock.poll(10_000):
            raise RuntimeError(f"[fuzz] mccld did not answer the batch's {msg['type']}")
        reply = json.loads(self._sock.recv())
        if not reply.get("ok"):
            raise RuntimeError(f"[fuzz] batch set-up {msg['type']} refused: {reply}")

    def _collect(self, wait_s: float, want: int | None = None) -> None:
        """Count replies on both connections, waiting up to ``wait_s`` for ``want`` of them."""
        deadline = time.monotonic() + wait_s
        poller = zmq.Poller()
        for s in (self._sock, self._raw):
            poller.register(s, zmq.POLLIN)
        while want is None or self._got < want:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for s, _ in poller.poll(int(left * 1000) + 1):
                while True:
                    try:
                        s.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._got += 1


def _with_version(msg: Any) -> Any:
    """Most mutants keep the version a real client sends (else they all stop at the envelope)."""
    if isinstance(msg, dict) and "v" not in msg:
        return {"v": protocol.PROTO_VERSION, **msg}
    return msg


def _placeholders(msg: dict[str, Any]) -> dict[str, Any]:
    out = dict(msg)
    for key, ph in (("token", "$TOKEN"), ("pid", "$PID"), ("job", "$JOB")):
        if key in out:
            out[key] = ph
    if isinstance(out.get("args"), dict) and "segment" in out["args"]:
        out["args"] = {**out["args"], "segment": "$SEG"}
    if "segment" in out:
        out["segment"] = "$SEG"
    return out


def _one_rank_join(daemon, req: int, job: str = "$JOB") -> dict[str, Any]:
    return {"type": "join", "job": job, "rank": 0, "size": 1, "timeout_s": 5.0, "opts": {}, "req": req,
            "hosts": [{"host_id": daemon.host_id, "link_addr": daemon.link_addr, "ranks": [0]}]}


def _dedup(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen, out = set(), []
    for m in msgs:
        key = json.dumps({k: v for k, v in m.items() if k != "req"}, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(m)
    return out


def _real_session(daemon) -> None:
    """Two ranks of this process run one of each collective through the daemon."""
    import threading
    from libmccl.daemon.client import DaemonCommunicator
    os.environ["MCCL_RUNTIME_DIR"] = str(daemon.rdir)
    store, comm_id, world, n = MemoryStore(), daemon.next_comm_id(), 2, 64
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            comm = DaemonCommunicator(r, world, comm_id, store, None, None, 20.0)
            a, b, c = np.ones(n, np.float32), np.zeros(n * world, np.float32), np.zeros(n * world, np.float32)
            for op in (comm.allreduce(a.ctypes.data, n, 0, 0), comm.broadcast(a.ctypes.data, a.nbytes, 1),
                       comm.allgather(a.ctypes.data, b.ctypes.data, a.nbytes),
                       comm.reduce_scatter(b.ctypes.data, a.ctypes.data, n, 0, 0), comm.barrier(),
                       comm.reduce(a.ctypes.data, n, 0, 3, 0), comm.gather(a.ctypes.data, b.ctypes.data, a.nbytes, 0),
                       comm.scatter(b.ctypes.data, a.ctypes.data, a.nbytes, 1),
                       comm.alltoall(b.ctypes.data, c.ctypes.data, a.nbytes)):
                comm.wait(op, 20.0)
            # A shared buffer: its register, an all-reduce naming it (past the small-op queue), its release.
            buf = comm.alloc_buffer((2 << 20) + 4096)
            big = np.frombuffer(buf.view(), np.float32)
            big[:] = 1
            comm.wait(comm.allreduce(big.ctypes.data, big.size, 0, 0), 20.0)
            del big
            buf.release()
            if r == 0:
                comm.wait(comm.send(a.ctypes.data, a.nbytes, 1, 7), 20.0)
            else:
                comm.wait(comm.recv(a.ctypes.data, a.nbytes, 0, 7), 20.0)
            comm.report_overlap(0.5)
            comm.shutdown(5.0)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise RuntimeError(f"[fuzz] the capture session failed: {errors[0]!r}") from errors[0]
