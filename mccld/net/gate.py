"""Admission and deadlines for connections that have not authenticated yet.

Every TCP port of mccld (links, status, metrics) accepts anyone on the LAN. Until a
connection has proven it holds the fleet key it may cost us only a bounded share of
threads and fds, for a bounded time:

* ``admit`` never blocks the accept loop; past a cap per port and per peer address it
  makes room by closing the OLDEST unauthenticated connection of the busiest address
  (of the new connection's own address when that one is over its cap), so one noisy host
  cannot take every slot from the others, and a flood from the address a real peer dials
  from too (a shared host, NAT, loopback) cannot keep that peer out: its connection is
  the newest and it authenticates at once. Refusing the newest instead, as this gate once
  did, let 8 idle connections from a daemon's own address turn every later dial of it
  away (issue 34). ``reserved`` of the port's slots are kept for addresses that
  authenticated here before (the fleet's daemons, the operator's mcclctl), so a few
  hostile addresses together cannot take every slot either: a known peer still gets in.
  A connection younger than ``GRACE_S`` is not closed for room (when only such remain,
  the new one is refused): a flood faster than a real handshake cannot churn it away;
* the accept loop outlives accept() errors (out of fds, a connection reset before it was
  accepted): it backs off and logs once, where a dead loop would close the port for good;
* each admitted connection has one deadline for its whole handshake / request. A
  per-``recv`` timeout does not bound that: a peer dribbling a byte a second resets
  it forever. When the deadline passes the watchdog shuts the socket down, which
  wakes whatever thread is blocked reading it (the read sees EOF and the serving
  code's ordinary "closed early" path cleans up).

``Ticket.passed()`` ends both once the peer authenticated; ``Ticket.release()`` (always,
in the serving thread's ``finally``) gives the slot back.
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import logging
import socket
import threading
import time
from typing import Callable

from mccl_common.daemon_settings import DaemonConfig

from ..logutil import OnceLogger

log = logging.getLogger(__name__)

REWARN_S = 60.0            # a refusal of one peer is logged at WARNING at most once a minute
MAX_KNOWN = 1024           # addresses remembered as having authenticated (oldest forgotten first)
GRACE_S = 0.5              # a connection this young is never closed to make room (a real peer's handshake)
_ACCEPT_BACKOFF_S = (0.05, 1.0)   # first and longest pause after a failed accept()
# accept() errors that say the listener itself is gone: the loop ends. Any other (EMFILE,
# ENFILE, ENOBUFS, ENOMEM, ECONNABORTED, EPROTO, ...) is about one connection or a passing
# shortage, and the port must keep serving once it passes.
_LISTENER_GONE = {errno.EBADF, errno.EINVAL, errno.ENOTSOCK}


class Ticket:
    """One admitted connection's slot and deadline."""

    def __init__(self, gate: "Gate", sock: socket.socket, peer_ip: str, deadline: float, stranger: bool):
        self._gate = gate
        self.sock = sock
        self.peer_ip = peer_ip
        self.deadline = deadline
        self.counted = True       # holds a slot of the gate
        self.stranger = stranger  # counted among the addresses not known to the gate
        self.admitted = time.monotonic()

    def passed(self) -> None:
        """The peer authenticated: no deadline and no slot among the unauthenticated any more;
        its address is known from now on (it may use the reserved slots)."""
        self._gate.know(self.peer_ip)
        self._gate._drop(self)

    def release(self) -> None:
        """The connection is done (or failed); idempotent, and a no-op after ``passed``."""
        self._gate._drop(self)


class Gate:
    """Caps and deadlines of the unauthenticated connections of one listening port."""

    def __init__(self, name: str, max_total: int, max_per_peer: int, deadline_s: float, reserved: int = 0):
        self.name = name
        self.max_total = max_total
        self.max_per_peer = max_per_peer
        self.deadline_s = deadline_s
        self.reserved = min(reserved, max_total - 1)   # strangers always keep at least one slot
        self._known: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._strangers = 0       # slots held by addresses not known
        self.refused = 0          # closed at accept: over a cap
        self.expired = 0          # shut down at their deadline
        self._per_peer: dict[str, int] = {}
        self._live: dict[Ticket, None] = {}   # counted tickets, oldest first
        self._total = 0
        self._heap: list[tuple[float, int, Ticket]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._once = OnceLogger(log, rewarn_s=REWARN_S)
        # Started with the port's server, not lazily at the first connection: a daemon's
        # thread count is then the same before and after its ports are first used (the
        # fuzzer and the campaign compare footprints across a run).
        self._watchdog: threading.Thread | None = None

    @classmethod
    def from_config(cls, name: str, cfg: DaemonConfig | None = None, authenticates: bool = True) -> "Gate":
        """A gate with the daemon's MCCL_UNAUTH_* / MCCL_MAX_UNAUTH_* settings (their defaults without ``cfg``).
        A port whose clients never authenticate (metrics) reserves nothing: no one would ever be known."""
        cfg = cfg or DaemonConfig()
        return cls(name, cfg.max_unauth_connections, cfg.max_unauth_per_peer, cfg.unauth_timeout_s,
                   reserved=cfg.unauth_reserved if authenticates else 0)

    def know(self, peer_ip: str) -> None:
        """``peer_ip`` proved a key here: from now on it may use the reserved slots too."""
        with self._cv:
            self._known[peer_ip] = None
            self._known.move_to_end(peer_ip)
            if len(self._known) > MAX_KNOWN:
                self._known.popitem(last=False)

    def start(self) -> None:
        """Start the deadline watchdog (with the port's server); idempotent."""
        with self._cv:
            if self._watchdog is not None:
                return
            self._closed = False
            self._watchdog = threading.Thread(target=self._watch, name=f"mccld-gate-{self.name}", daemon=True)
            self._watchdog.start()

    def admit(self, sock: socket.socket, peer_ip: str) -> Ticket | None:
        """A ticket for a just-accepted socket, or None after closing it (over a cap)."""
        if self._watchdog is None:
            raise RuntimeError(f"[{self.name}] Gate.admit before Gate.start: no deadline would be enforced")
        with self._cv:
            n = self._per_peer.get(peer_ip, 0)
            stranger = peer_ip not in self._known
            full = self._full(peer_ip, stranger)
            if full and self._make_room(peer_ip, stranger):
                full = self._full(peer_ip, stranger)
            if not full:
                self._per_peer[peer_ip] = self._per_peer.get(peer_ip, 0) + 1
                self._total += 1
                self._strangers += stranger
                ticket = Ticket(self, sock, peer_ip, time.monotonic() + self.deadline_s, stranger)
                self._live[ticket] = None
                heapq.heappush(self._heap, (ticket.deadline, next(self._seq), ticket))
                self._cv.notify()
                return ticket
            self.refused += 1
        self._once.warn(f"full:{peer_ip}", "[%s] refusing a connection from peer=%s: %d unauthenticated "
                        "connections from it, %d on the port, %d from addresses that never authenticated here "
                        "(caps %d, %d and %d: MCCL_MAX_UNAUTH_PER_PEER, MCCL_MAX_UNAUTH_CONNECTIONS less "
                        "MCCL_UNAUTH_RESERVED); a scanner or a misconfigured client floods this port",
                        self.name, peer_ip, n, self._total, self._strangers, self.max_per_peer, self.max_total,
                        self.max_total - self.reserved)
        try:
            sock.close()
        except OSError:
            pass
        return None

    def _full(self, peer_ip: str, stranger: bool) -> bool:
        return (self._total >= self.max_total or self._per_peer.get(peer_ip, 0) >= self.max_per_peer
                or (stranger and self._strangers >= self.max_total - self.reserved))

    def _make_room(self, peer_ip: str, stranger: bool) -> bool:
        """Under the lock: close the oldest connection (past GRACE_S) of the address whose cap
        the new one hits: its own address, else the busiest stranger (the strangers' share is
        full), else the busiest address. False when none can go."""
        if self._per_peer.get(peer_ip, 0) >= self.max_per_peer:
            pool = [t for t in self._live if t.peer_ip == peer_ip]
        elif stranger and self._strangers >= self.max_total - self.reserved:
            pool = [t for t in self._live if t.stranger]
        else:
            pool = list(self._live)
        young = time.monotonic() - GRACE_S
        pool = [t for t in pool if t.admitted <= young]
        if not pool:
            return False
        load = max(self._per_peer[t.peer_ip] for t in pool)
        victim = next(t for t in pool if self._per_peer[t.peer_ip] == load)   # the oldest of the busiest
        self.refused += 1
        # Under the lock, as the watchdog does: the serving thread drops its ticket (same lock)
        # before it closes the socket, so this never shuts down a reused fd.
        try:
            victim.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._drop_locked(victim)
        self._once.warn(f"full:{victim.peer_ip}", "[%s] closed an unauthenticated connection from peer=%s to "
                        "make room: the port's caps (%d from one address, %d in all, %d for addresses that "
                        "never authenticated here: MCCL_MAX_UNAUTH_PER_PEER, MCCL_MAX_UNAUTH_CONNECTIONS, "
                        "MCCL_UNAUTH_RESERVED) were reached; a scanner or a flood of connections",
                        self.name, victim.peer_ip, self.max_per_peer, self.max_total,
                        self.max_total - self.reserved)
        return True

    def unauthenticated(self) -> int:
        with self._cv:
            return self._total

    def accept_loop(self, listener: socket.socket, stop: threading.Event,
                    handle: Callable[[socket.socket, str, "Ticket"], None], thread_name: str,
                    started: Callable[[threading.Thread], None] | None = None) -> None:
        """A port's accept loop: until ``stop`` is set or the listener closes, admit each
        connection through this gate and handle it on a thread of its own (``started`` sees
        the thread before it runs). The listener needs a timeout so that ``stop`` is noticed."""
        backoff = 0.0
        while not stop.is_set():
            try:
                sock, (ip, port) = listener.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if stop.is_set() or e.errno in _LISTENER_GONE or listener.fileno() < 0:
                    return
                # Out of fds (EMFILE) the pending connection stays queued and accept() fails
                # again at once: pause, so that the loop does not spin while fds come back.
                backoff = min(max(backoff * 2, _ACCEPT_BACKOFF_S[0]), _ACCEPT_BACKOFF_S[1])
                self._once.warn(f"accept:{e.errno}", "[%s] accept() failed: %s; retrying in %.2f s (out of "
                                "file descriptors? raise the service's LimitNOFILE / ulimit -n)",
                                self.name, e, backoff)
                stop.wait(backoff)
                continue
            backoff = 0.0
            ticket = self.admit(sock, ip)
            if ticket is None:
                continue
            t = threading.Thread(target=handle, args=(sock, f"{ip}:{port}", ticket), name=thread_name, daemon=True)
            if started is not None:
                started(t)
            t.start()

    def close(self) -> None:
        """Stop the watchdog (the port is closed); ``start`` starts it again."""
        with self._cv:
            watchdog, self._watchdog = self._watchdog, None
            self._closed = True
            self._cv.notify()
        if watchdog is not None:
            watchdog.join(timeout=2.0)

    def _drop(self, ticket: Ticket) -> None:
        with self._cv:
            self._drop_locked(ticket)

    def _drop_locked(self, ticket: Ticket) -> None:
        if not ticket.counted:
            return
        ticket.counted = False
        self._live.pop(ticket, None)
        self._total -= 1
        self._strangers -= ticket.stranger
        left = self._per_peer[ticket.peer_ip] - 1
        if left:
            self._per_peer[ticket.peer_ip] = left
        else:
            del self._per_peer[ticket.peer_ip]
        # Its heap entry stays until its deadline; the watchdog skips uncounted tickets.

    def _watch(self) -> None:
        with self._cv:
            while not self._closed and self._watchdog is threading.current_thread():
                while self._heap and not self._heap[0][2].counted:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cv.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                ticket = heapq.heappop(self._heap)[2]
                self.expired += 1
                # Under the lock: the serving thread drops the ticket (in _drop, same lock)
                # before it closes the socket, so this never shuts down a reused fd.
                try:
                    ticket.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass      # already closed by its peer
                self._once.warn(f"late:{ticket.peer_ip}", "[%s] peer=%s did not authenticate within %.1f s "
                                "(MCCL_UNAUTH_TIMEOUT); closed its connection (a slow or hostile client)",
                                self.name, ticket.peer_ip, self.deadline_s)
