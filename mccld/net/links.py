"""Persistent authenticated TCP links between daemons.

A link is dialled the first time a job needs a peer and kept for later jobs. Links
carry the daemons' control traffic (which pooled data sockets a job uses; job failure
notices). Tensor data flows over data sockets (mccld/net/datalinks.py) that are dialled to
the same port and pass the same fleet-key handshake, tagged with their purpose; this
class authenticates them and hands them to the pool instead of keeping them as links.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable

from mccl_common.errors import AuthError, MCCLError, PeerLostError, ProtocolError

from . import auth
from .gate import REWARN_S, Gate, Ticket
from ..logutil import OnceLogger

log = logging.getLogger(__name__)

Handler = Callable[[str, dict[str, Any]], None]  # (peer host id, message)
PeerHandler = Callable[[str, str, bool], None]   # (peer host id, peer link address, up)
DataHandler = Callable[[socket.socket, str, str, auth.Session], None]  # (socket, peer host, socket id, session)


# A peer that vanishes (power loss, cable pulled) sends no FIN: keepalive probes notice an
# idle link within ~25 s, and TCP_USER_TIMEOUT fails a send stuck on unacknowledged data.
_KEEPIDLE_S, _KEEPINTVL_S, _KEEPCNT = 10, 5, 3
_USER_TIMEOUT_MS = 30_000
_REDIAL_S = (0.01, 0.5)   # first and longest pause before dialing a peer that closed our handshake again


def bound_dead_link(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", _KEEPIDLE_S), ("TCP_KEEPALIVE", _KEEPIDLE_S),  # macOS spelling
                        ("TCP_KEEPINTVL", _KEEPINTVL_S), ("TCP_KEEPCNT", _KEEPCNT),
                        ("TCP_USER_TIMEOUT", _USER_TIMEOUT_MS)):
        opt = getattr(socket, name, None)
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:
                pass  # not supported by this kernel: keepalive defaults still apply


class Link:
    def __init__(self, sock: socket.socket, session: auth.Session, peer_host: str, peer_addr: str):
        self.sock = sock
        self.session = session
        self.peer_host = peer_host
        self.peer_addr = peer_addr      # the peer daemon's link (listen) address, as it announced it
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, msg: dict[str, Any]) -> None:
        with self._send_lock:
            if self.closed:
                raise PeerLostError(f"[link] link to peer={self.peer_addr} ({self.peer_host}) is closed")
            try:
                self.sock.sendall(self.session.seal(msg))
            except OSError as e:
                self.close()
                raise PeerLostError(f"[link] send to peer={self.peer_addr} ({self.peer_host}) failed: {e}; "
                                    "the peer daemon died or the network is down") from None

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class LinkManager:
    """Listens for, dials, authenticates and keeps links; hands received messages to ``on_message``."""

    def __init__(self, key: bytes, fleet: str, host_id: str, addr: str, port: int, timeout_s: float,
                 on_message: Handler, on_peer: PeerHandler | None = None, on_data: DataHandler | None = None,
                 gate: Gate | None = None):
        self._key, self._fleet, self.host_id = key, fleet, host_id
        self._bind = (addr, port)
        self._timeout = timeout_s
        self.gate = gate or Gate.from_config("link")   # bounds the handshakes of accepted sockets
        self._on_message = on_message
        self._on_peer = on_peer or (lambda host, addr, up: None)
        self.on_data = on_data  # set by the data-socket pool; None: data sockets are refused
        self._links: dict[str, Link] = {}        # peer host id -> live link
        self._readers: dict[Link, threading.Thread] = {}   # every open link (a crossed dial's spare too)
        self._by_addr: dict[str, str] = {}       # "ip:port" dialled -> peer host id
        self._lock = threading.Lock()
        self._dial_locks: dict[str, threading.Lock] = {}
        self._once = OnceLogger(log, rewarn_s=REWARN_S)
        self._server: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.address = ""

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind(self._bind)
        except OSError as e:
            srv.close()
            raise MCCLError(f"[link] cannot listen on {self._bind[0]}:{self._bind[1]}: {e}; another mccld "
                            "may be running, or set MCCL_PORT / MCCL_LISTEN_ADDR") from None
        srv.listen(64)
        srv.settimeout(0.5)
        self._server = srv
        self.gate.start()
        host, port = srv.getsockname()
        self.address = f"{host}:{port}"
        t = threading.Thread(target=self._accept_loop, name="mccld-link-accept", daemon=True)
        t.start()
        self._threads.append(t)
        log.info("link listener on %s", self.address)

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.close()
        with self._lock:
            links = list(self._links.values()) + list(self._readers)
            readers = list(self._readers.values())
            self._links.clear()
        for link in links:
            link.close()
        for t in self._threads + readers:
            if t.ident is not None:   # a reader adopted just now may not have started yet
                t.join(timeout=2.0)
        self.gate.close()

    # -- public ------------------------------------------------------------------------
    def link_to(self, addr: str, quiet: bool = False) -> Link:
        """An authenticated link to the daemon at ``ip:port``, dialled if none is up. ``quiet``: a
        failed dial logs at DEBUG (gossip tries peers it merely heard of, and logs seeds itself)."""
        with self._lock:
            host = self._by_addr.get(addr)
            link = self._links.get(host) if host else None
            if link is not None and not link.closed:
                return link
            dial_lock = self._dial_locks.setdefault(addr, threading.Lock())
        with dial_lock:
            with self._lock:
                host = self._by_addr.get(addr)
                link = self._links.get(host) if host else None
                if link is not None and not link.closed:
                    return link
            link = self._dial(addr, quiet)
            with self._lock:
                self._by_addr[addr] = link.peer_host
            return link

    def send(self, addr: str, msg: dict[str, Any]) -> None:
        self.link_to(addr).send(msg)

    def send_host(self, peer_host: str, msg: dict[str, Any]) -> None:
        """Send over the live link to ``peer_host`` (an answer to what it sent us); never dials."""
        with self._lock:
            link = self._links.get(peer_host)
        if link is None or link.closed:
            raise PeerLostError(f"[link] no live link to {peer_host}; it went down before we could answer")
        link.send(msg)

    def peers(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"host": h, "peer": l.peer_addr, "up": True} for h, l in self._links.items() if not l.closed]

    def dial_data(self, addr: str, sock_id: str) -> tuple[socket.socket, str, auth.Session]:
        """A new data socket to the daemon at ``ip:port``, authenticated and named ``sock_id``
        on both sides; returns it (blocking, no timeout), the peer's host id and the
        handshake's session (the engine's frame keys come from it)."""
        sock, peer_host, _, session = self._connect(addr, f"data:{sock_id}")
        sock.settimeout(None)
        return sock, peer_host, session

    # -- internals ---------------------------------------------------------------------
    def _connect(self, addr: str, purpose: str, quiet: bool = False) -> tuple[socket.socket, str, str, auth.Session]:
        host, _, port = addr.rpartition(":")
        warn = (lambda key, msg, *a: log.debug(msg, *a)) if quiet else self._once.warn
        # A peer whose port's gate is full of strangers' connections closes its oldest to make
        # room (gate.py): ours may be one. Dial again, with backoff, for up to the timeout.
        until = time.monotonic() + self._timeout
        pause, closed = _REDIAL_S[0], 0
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=self._timeout)
            except (OSError, ValueError) as e:
                warn(f"dial:{addr}", "[link] cannot connect to peer=%s: %s", addr, e)
                raise PeerLostError(f"[link] cannot connect to peer={addr}: {e}; is mccld running there "
                                    "and reachable on MCCL_PORT?") from None
            try:
                peer_host, peer_listen, session = auth.initiate(sock, self._key, self._fleet, self.host_id,
                                                                self.address, addr, purpose)
                break
            except auth.ClosedBeforeAnswer as e:
                sock.close()
                closed += 1
                if time.monotonic() + pause < until and not self._stopping.wait(pause):
                    pause = min(pause * 2, _REDIAL_S[1])
                    continue
                warn(f"flood:{addr}", "[link] peer=%s closed our handshake %d time(s) before answering",
                     addr, closed)
                raise PeerLostError(f"[link] peer={addr} closed our handshake {closed} time(s) before "
                                    f"answering ({e}) within {self._timeout:.0f} s; likely cause: its port is "
                                    "flooded by connections from a host without the fleet key (see that "
                                    "daemon's log), or it is stopping") from None
            except (AuthError, ProtocolError) as e:
                sock.close()
                warn(f"auth:{addr}", "%s", e)
                raise
            except OSError as e:
                sock.close()
                raise PeerLostError(f"[link] handshake with peer={addr} failed: {e}; the peer daemon "
                                    "closed the link (wrong fleet key on one side?)") from None
        self._once.forget(f"dial:{addr}")
        # A daemon that proved the fleet key to us is a fleet peer: its own dials (data sockets,
        # a relink after a restart) get the handshake slots kept for known addresses.
        self.gate.know(host)
        return sock, peer_host, peer_listen, session

    def _dial(self, addr: str, quiet: bool = False) -> Link:
        sock, peer_host, peer_listen, session = self._connect(addr, auth.CONTROL, quiet)
        return self._adopt(sock, session, peer_host, peer_listen)

    def _accept_loop(self) -> None:
        self.gate.accept_loop(self._server, self._stopping, self._handshake, "mccld-link-handshake")

    def _handshake(self, sock: socket.socket, peer: str, ticket: Ticket) -> None:
        sock.settimeout(self._timeout)
        try:
            peer_host, peer_listen, session, purpose = auth.respond(sock, self._key, self._fleet, self.host_id,
                                                                    self.address, peer)
        except (AuthError, ProtocolError) as e:
            ticket.release()  # before the close: the gate's watchdog must not shut down a reused fd
            self._once.warn(f"auth:{peer.rpartition(':')[0]}", "%s", e)
            sock.close()
            return
        except (OSError, ValueError) as e:
            ticket.release()
            self._once.warn(f"hs:{peer.rpartition(':')[0]}",
                            "[link] handshake with peer=%s failed: %s (it may hold another fleet key)",
                            peer, e)
            sock.close()
            return
        except BaseException:
            ticket.release()
            raise
        ticket.passed()
        if purpose.startswith("data:") and self.on_data is not None:
            sock.settimeout(None)
            self.on_data(sock, peer_host, purpose[len("data:"):], session)
        elif purpose == auth.CONTROL:
            try:
                self._adopt(sock, session, peer_host, peer_listen)
            except PeerLostError:
                pass      # we are stopping; _adopt closed it
        else:
            self._once.warn(f"purpose:{peer_host}", "[link] peer=%s (%s) opened a socket for %r, which this "
                            "daemon does not serve; closing it (mixed mccld versions?)", peer, peer_host, purpose)
            sock.close()

    def _adopt(self, sock: socket.socket, session: auth.Session, peer_host: str, addr: str) -> Link:
        sock.settimeout(None)  # the reader waits for frames; the kernel bounds dead links (below)
        bound_dead_link(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = Link(sock, session, peer_host, addr)
        reader = threading.Thread(target=self._read_loop, args=(link,), name="mccld-link-read", daemon=True)
        with self._lock:
            if self._stopping.is_set():
                # A handshake that finished while stop() ran: its reader would outlive us.
                link.close()
                raise PeerLostError(f"[link] link to peer={addr} ({peer_host}) came up while mccld stops")
            old = self._links.get(peer_host)
            # Two daemons dialling each other at once keep both links; either works for sending.
            if old is None or old.closed:
                self._links[peer_host] = link
            self._by_addr[addr] = peer_host  # an accepted link also serves our own sends
            self._readers[link] = reader     # under the same lock as the stop check: stop() joins it
        log.info("link up: peer=%s (%s)", addr, peer_host)
        self._on_peer(peer_host, addr, True)
        reader.start()
        return link

    def _read_loop(self, link: Link) -> None:
        while not self._stopping.is_set():
            try:
                msg = link.session.open(link.sock)
            except (AuthError, ProtocolError) as e:
                self._once.warn(f"frame:{link.peer_host}", "%s", e)
                break
            except (OSError, ConnectionError):
                break
            try:
                self._on_message(link.peer_host, msg)
            except Exception:  # a bad message must not kill the link's reader
                log.exception("[link] handling %s from %s failed", msg.get("type"), link.peer_host)
        link.close()
        with self._lock:
            if self._links.get(link.peer_host) is link:
                del self._links[link.peer_host]
            self._readers.pop(link, None)
        if not self._stopping.is_set():
            log.info("link down: peer=%s (%s)", link.peer_addr, link.peer_host)
            self._on_peer(link.peer_host, link.peer_addr, False)
