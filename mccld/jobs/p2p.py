"""Point-to-point between the ranks of one job: send, recv, any-source recv.

Sends are eager: a send completes once its data left the sender's segment (copied into
the daemon for a rank of this host, written to the engine for another host), so it
never waits for the matching recv. The receiving daemon holds messages until a recv
takes them and matches exactly on (source rank, destination rank, user tag): a recv
gets the oldest held message it accepts, a message the oldest posted recv accepting
it, so the order of one (source, destination, tag) stream is kept.

A recv is two requests: ``recv`` posts it and is answered when a message matched
(with its source, for any-source recvs); ``take`` then copies the message into the
client's segment. Only ``take`` and ``send`` touch segments, and a client issues them
one at a time between its collectives, so a rank blocked in a recv does not hold its
segment, and p2p never waits for the job's collective ordering (a rank may do p2p only).

Across hosts each message is a fixed header (source, destination, user tag, size) on
engine tag ``_TAG_HEADER`` followed by its payload on ``_TAG_DATA``: engine tags are 32
bits, too narrow for the triple, and the engine keeps one peer's messages of one tag
in order, so payload k from a host belongs to header k from that host.

The receiving daemon keeps one any-source header receive posted for the job's whole
life (the "mailbox"), without a deadline: an idle job must not time out, and a message
is held by the daemon until a local recv takes it, so whether a local rank waits makes
no difference to the engine. A dead peer host still fails it at once (its sockets end),
and a failed job's engine abort cancels it. The engine cannot cancel a receive by
itself, so at close every daemon sends a "closing" header to the hosts it was linked to
at set-up (ondemand.setup_hosts: the same relation on both ends, and a link that
exists from the job's start, so no host is linked just to say goodbye): the mailbox
receive completes once each of them closed and is not posted again, the data sockets
end between messages (clean, so pooled for the next job), and closing waits for nothing.
The headers go out only after the job's closing barrier (jobs.py), when every host's
ranks have left: a host that is not a set-up host sends none, so before that barrier a
late message from it could still be on its way to a rank here that waits for it.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from mccl_common.errors import AbortedError, CollectiveMismatch, CollectiveTimeout, MCCLError, ProtocolError
from mccl_common.wire import MAX_TAG

from ..net.ondemand import setup_hosts
from .collectives import Topology
from .rawbuf import RawBuffer

if TYPE_CHECKING:
    from mccl_common import shm

log = logging.getLogger(__name__)

P2P_OPS = ("send", "recv", "take")
_HEADER = struct.Struct("<iiQQ")          # source rank, destination rank, user tag, payload bytes
_TAG_HEADER, _TAG_DATA = 1, 2
_CLOSING = -2                             # the source rank of a closing header; its dst is the host
_INLINE_BYTES = 256 << 10                 # same-host copies up to this size run on the attach thread
_HELD_CAP_BYTES = 1 << 30                 # messages no recv took yet, per job (the engine's own cap)
_JOIN_S = 5.0


class P2PHost(Protocol):
    """What point-to-point needs of the daemon behind its job (a part of job.JobHost)."""

    def reply(self, ident: bytes, req: int, payload: dict[str, Any]) -> None: ...
    def reply_error(self, ident: bytes, req: int, exc: BaseException) -> None: ...
    def record_collective(self, job: Any, op: str, nbytes: int, seconds: float) -> None: ...


class P2PJob(Protocol):
    """What point-to-point needs of its job (job.Job, which owns it: typed here so that
    the two modules do not import each other)."""
    id: str
    size: int
    timeout_s: float
    topo: Topology
    failed: MCCLError | None
    members: dict[int, Any]
    segment_lock: Any                     # a threading.RLock

    @property
    def host(self) -> P2PHost: ...
    @property
    def local_ranks(self) -> list[int]: ...
    def fail(self, exc: MCCLError, local: bool) -> None: ...
    def segment_of(self, rank: int, name: str, nbytes: int) -> "shm.Segment": ...


@dataclass
class Posted:
    ident: bytes
    req: int
    rank: int          # destination (a local rank)
    src: int           # -1: any source
    tag: int
    nbytes: int
    post: int          # the client's id for this recv
    since: float = field(default_factory=time.monotonic)

    def accepts(self, msg: "Message") -> bool:
        return msg.tag == self.tag and self.src in (-1, msg.src)


@dataclass
class Message:
    src: int
    dst: int
    tag: int
    data: RawBuffer   # owned by the daemon until taken


class Mailbox:
    """Held messages and posted recvs of one job's local ranks. Not thread-safe: the
    owner locks."""

    def __init__(self) -> None:
        self._posted: dict[int, list[Posted]] = {}
        self._held: dict[int, list[Message]] = {}
        self._matched: dict[tuple[int, int], Message] = {}    # (rank, post) -> message until taken
        self._held_bytes = 0

    def post(self, p: Posted) -> Message | None:
        held = self._held.get(p.rank, [])
        for i, m in enumerate(held):
            if p.accepts(m):
                self._match(p, m)
                del held[i]
                self._held_bytes -= m.data.nbytes
                return m
        self._posted.setdefault(p.rank, []).append(p)
        return None

    def deliver(self, m: Message) -> Posted | None:
        posted = self._posted.get(m.dst, [])
        for i, p in enumerate(posted):
            if p.accepts(m):
                self._match(p, m)
                del posted[i]
                return p
        if self._held_bytes + m.data.nbytes > _HELD_CAP_BYTES:
            # Messages are pulled off the network as they come, so without a cap a rank
            # that never receives could grow the daemon without bound.
            raise CollectiveMismatch(
                f"[daemon] rank {m.src}'s message to rank {m.dst} (tag {m.tag}, {m.data.nbytes} bytes) "
                f"would put more than {_HELD_CAP_BYTES >> 20} MiB of unreceived messages in the daemon; "
                "the receivers post fewer recvs than they are sent, or with other tags", peer_rank=m.dst)
        self._held_bytes += m.data.nbytes
        self._held.setdefault(m.dst, []).append(m)
        return None

    def _match(self, p: Posted, m: Message) -> None:
        """Raises (leaving both where they were) when the sizes differ."""
        if m.data.nbytes != p.nbytes:
            raise CollectiveMismatch(
                f"[daemon] recv size mismatch: rank {m.src} sent {m.data.nbytes} bytes with tag {m.tag}, "
                f"rank {p.rank} posted a recv of {p.nbytes}; a recv must have the size of the matching send",
                peer_rank=m.src)
        self._matched[(p.rank, p.post)] = m

    def take(self, rank: int, post: int) -> Message:
        m = self._matched.pop((rank, post), None)
        if m is None:
            raise ProtocolError(f"[daemon] rank {rank}: take of recv #{post}, which has no matched message")
        return m

    def matched_bytes(self, rank: int, post: int) -> int:
        m = self._matched.get((rank, post))
        return m.data.nbytes if m is not None else 0

    def waiting(self) -> list[Posted]:
        return [p for ps in self._posted.values() for p in ps]

    def forget(self, rank: int) -> None:
        """The rank left: its recvs and messages go (nobody can take them any more)."""
        self._posted.pop(rank, None)
        self._held_bytes -= sum(m.data.nbytes for m in self._held.pop(rank, []))
        for key in [k for k in self._matched if k[0] == rank]:
            del self._matched[key]

    def drain(self) -> list[Posted]:
        out = self.waiting()
        self._posted.clear()
        self._held.clear()
        self._held_bytes = 0
        self._matched.clear()
        return out


def _copy(dst: int, src: int, nbytes: int) -> None:
    if nbytes:
        ctypes.memmove(dst, src, nbytes)


class PointToPoint:
    """A job's p2p: requests from the attach thread, copies and engine sends on its own
    thread, engine receives on another (multi-host jobs)."""

    def __init__(self, job: P2PJob):
        self.job = job
        self._box = Mailbox()
        self._lock = threading.Lock()
        self._tasks: queue.Queue = queue.Queue()
        self._stopping = False
        self._engine: Callable[..., None] | None = None
        self._rx: threading.Thread | None = None
        self._tx = threading.Thread(target=self._tx_loop, name=f"mccld-p2p-{job.id}", daemon=True)
        self._tx.start()

    def start_network(self, engine: Callable[..., None]) -> None:
        """The job's engine is built: messages to and from other hosts can flow."""
        self._engine = engine
        self._rx = threading.Thread(target=self._rx_loop, name=f"mccld-p2p-rx-{self.job.id}", daemon=True)
        self._rx.start()

    # -- requests (attach thread) -------------------------------------------------------------
    def submit(self, ident: bytes, req: int, rank: int, op: str, args: dict[str, Any]) -> None:
        if op == "recv":
            src, tag, nbytes, post = (self._int(args, k, lo) for k, lo in
                                      (("src", -1), ("tag", 0), ("nbytes", 0), ("post", 0)))
            self._check_peer(rank, src, "src", any_ok=True)
            self._check_tag(tag)
            try:
                with self._lock:
                    if self._stopping:
                        raise AbortedError(f"[daemon] job {self.job.id} is closing; recv refused")
                    matched = self._box.post(Posted(ident, req, rank, src, tag, nbytes, post))
            except CollectiveMismatch as e:
                self.job.fail(e, local=True)      # like the engine: a size mismatch fails the job
                raise
            if matched is not None:
                self.job.host.reply(ident, req, {"ok": True, "src": matched.src})
        else:
            if op == "send":
                self._check_peer(rank, self._int(args, "dst", 0), "dst", any_ok=False)
                self._check_tag(self._int(args, "tag", 0))
                self._int(args, "nbytes", 0)
            else:
                self._int(args, "post", 0)
            # A small copy between this host's ranks is done here, saving two thread hops
            # (a third of a same-host message's latency); one rank's sends and takes come
            # one at a time, so doing some here and some on the p2p thread keeps their order.
            if self._small_and_local(rank, op, args) and self.job.segment_lock.acquire(blocking=False):
                try:
                    self._execute(ident, req, rank, op, args)
                finally:
                    self.job.segment_lock.release()
            else:
                self._tasks.put((ident, req, rank, op, args))

    def _small_and_local(self, rank: int, op: str, args: dict[str, Any]) -> bool:
        if op == "send":
            return args["dst"] in self.job.local_ranks and args["nbytes"] <= _INLINE_BYTES
        with self._lock:
            return self._box.matched_bytes(rank, args["post"]) <= _INLINE_BYTES

    @staticmethod
    def _int(args: dict[str, Any], key: str, lo: int) -> int:
        v = args.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ProtocolError(f"[daemon] p2p argument {key!r}={v!r} is not an integer >= {lo}")
        return v

    def _check_peer(self, rank: int, peer: int, what: str, any_ok: bool) -> None:
        if not (any_ok and peer == -1) and not (0 <= peer < self.job.size and peer != rank):
            raise ProtocolError(f"[daemon] job {self.job.id} rank {rank}: {what}={peer} is not another rank "
                                f"of the job (size {self.job.size})")

    @staticmethod
    def _check_tag(tag: int) -> None:
        if tag > MAX_TAG:
            raise ProtocolError(f"[daemon] p2p tag {tag} outside 0..2^32-1")

    def forget(self, rank: int) -> None:
        with self._lock:
            self._box.forget(rank)

    def overdue(self, now: float) -> CollectiveTimeout | None:
        """The error for the oldest recv waiting longer than the job timeout, if any."""
        with self._lock:
            late = [p for p in self._box.waiting() if now - p.since > self.job.timeout_s]
        if not late:
            return None
        p = min(late, key=lambda p: p.since)
        src = "any rank" if p.src == -1 else f"rank {p.src}"
        return CollectiveTimeout(
            f"[daemon] Timed out after {self.job.timeout_s:.0f}s in job {self.job.id}: rank {p.rank}'s recv "
            f"from {src} (tag {p.tag}, {p.nbytes} bytes) matched no send; the sender is stuck, skipped the send or "
            "used another tag", peer_rank=p.src)

    def fail(self, exc: MCCLError) -> None:
        """The job failed: every waiting recv gets ``exc`` (queued sends get it when they run)."""
        with self._lock:
            waiting = self._box.drain()
        for p in waiting:
            self.job.host.reply_error(p.ident, p.req, exc)

    def stop(self) -> None:
        """Every local rank left: finish the queued sends (then ``close_network``)."""
        with self._lock:
            self._stopping = True
            self._box.drain()
        self._tasks.put(None)
        if self._tx is not threading.current_thread():
            self._tx.join(_JOIN_S)

    def close_network(self) -> None:
        """Past the job's closing barrier (every host's ranks left and its sends are written):
        tell the set-up hosts this one sends no more, which ends their mailbox receive."""
        if self._engine is None or self.job.failed is not None:
            return  # a failed job's engine is aborted, which ended the mailbox receive already
        me = self.job.topo.host_rank
        header = RawBuffer.of(_HEADER.pack(_CLOSING, me, 0, 0))
        try:
            for h in setup_hosts(me, len(self.job.topo.hosts)):
                self._engine("send", header.addr, header.nbytes, h, _TAG_HEADER)
        except MCCLError as e:
            log.debug("job %s: closing header not sent: %s", self.job.id, e)

    def network_done(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the mailbox to end (every other host's closing
        header read, or the job failed); True if no engine receive is left pending."""
        if self._rx is None:
            return True
        self._rx.join(timeout_s)
        return not self._rx.is_alive()

    # -- sends and takes (the p2p thread) --------------------------------------------------------
    def _tx_loop(self) -> None:
        while True:
            # No timeout: stop() always queues the None that ends this loop.
            task = self._tasks.get()
            if task is None:
                return
            self._execute(*task)

    def _execute(self, ident: bytes, req: int, rank: int, op: str, args: dict[str, Any]) -> None:
        started = time.monotonic()
        try:
            if self.job.failed is not None:
                raise self.job.failed
            nbytes = self._send(rank, args) if op == "send" else self._take(rank, args)
        except MCCLError as e:
            self.job.host.reply_error(ident, req, e)
            self.job.fail(e, local=True)
            return
        self.job.host.reply(ident, req, {"ok": True})
        self.job.host.record_collective(self.job, "send" if op == "send" else "recv", nbytes,
                                        time.monotonic() - started)

    def _send(self, rank: int, args: dict[str, Any]) -> int:
        dst, tag, nbytes = args["dst"], args["tag"], args["nbytes"]
        with self.job.segment_lock:
            addr = self.job.segment_of(rank, args.get("segment", ""), nbytes).addr if nbytes else 0
            if dst in self.job.local_ranks:
                data = RawBuffer(nbytes)
                _copy(data.addr, addr, nbytes)
                self._deliver(Message(rank, dst, tag, data))
                return nbytes
            host = self.job.topo.host_of(dst)
            header = RawBuffer.of(_HEADER.pack(rank, dst, tag, nbytes))
            self._engine("send", header.addr, header.nbytes, host, _TAG_HEADER)
            if nbytes:
                self._engine("send", addr, nbytes, host, _TAG_DATA)
        return nbytes

    def _take(self, rank: int, args: dict[str, Any]) -> int:
        with self._lock:
            m = self._box.take(rank, args["post"])
        if m.data.nbytes:
            with self.job.segment_lock:
                seg = self.job.segment_of(rank, args.get("segment", ""), m.data.nbytes)
                _copy(seg.addr, m.data.addr, m.data.nbytes)
        return m.data.nbytes

    def _deliver(self, m: Message) -> None:
        with self._lock:
            if m.dst not in self.job.members or self._stopping:
                return  # the rank left: nobody will take it
            p = self._box.deliver(m)
        if p is not None:
            self.job.host.reply(p.ident, p.req, {"ok": True, "src": m.src})

    # -- receives from other hosts (the rx thread) -------------------------------------------------
    def _rx_loop(self) -> None:
        header = RawBuffer(_HEADER.size)
        me = self.job.topo.host_rank
        sending = set(setup_hosts(me, len(self.job.topo.hosts)))   # hosts not yet closed
        try:
            while sending:
                self._engine("recv", header.addr, header.nbytes, -1, _TAG_HEADER, deadline=False)
                src, dst, tag, nbytes = _HEADER.unpack(header.tobytes())
                if src == _CLOSING:
                    sending.discard(dst)
                    continue
                if not (0 <= src < self.job.size and dst in self.job.local_ranks):
                    raise ProtocolError(f"[daemon] job {self.job.id}: p2p header for rank {dst} from rank {src}; "
                                        "that rank is not placed on this host; the daemons disagree on the job")
                data = RawBuffer(nbytes)
                if nbytes:
                    self._engine("recv", data.addr, nbytes, self.job.topo.host_of(src), _TAG_DATA)
                self._deliver(Message(src, dst, tag, data))
        except MCCLError as e:
            if not self._stopping:
                self.job.fail(e, local=True)
