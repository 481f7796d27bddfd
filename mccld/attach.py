"""The attach endpoint: a ZeroMQ ROUTER on an ``ipc://`` socket in the runtime dir.

Only processes of this user can reach the socket (the directory is 0700), or with
MCCL_ATTACH_GROUP those of the group's members too (directory 0750, socket 0660, token
0640, all in that group), and a client must prove it can read the daemon's token file
in its ``hello`` before any other request is served. Malformed or unauthenticated messages get an error reply
and a log line; the server keeps serving.

The ROUTER socket is owned by the server thread. Other threads (job threads finishing
collectives) hand replies over an inproc PUSH/PULL pair, so a completion reaches its
client as soon as it is ready, without polling.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Any, Callable

import zmq

from mccl_common import attach_protocol as protocol
from mccl_common import localtrust
from mccl_common.errors import AuthError, MCCLError, ProtocolError

from .logutil import OnceLogger

log = logging.getLogger(__name__)

_FLUSH_LINGER_MS = 500

# (identity, typed request) -> reply payload, or None when the reply comes later via reply().
Handler = Callable[[bytes, protocol.Request], "dict[str, Any] | None"]


class AttachServer:
    def __init__(self, runtime_dir: Path, handler: Handler, on_disconnect: Callable[[], None] | None = None,
                 group: int | None = None):
        self.runtime_dir = runtime_dir
        self._group = group
        self.endpoint = protocol.endpoint(runtime_dir)
        self._handler = handler
        self._on_disconnect = on_disconnect or (lambda: None)
        self._ctx = zmq.Context.instance()
        self._token = secrets.token_hex(32)
        self._authenticated: set[bytes] = set()
        self._peers: dict[bytes, localtrust.PeerCreds] = {}   # identity -> the kernel's word on its connection
        self._auth_lock = threading.Lock()
        self._once = OnceLogger(log)
        self._push_lock = threading.Lock()
        self._push: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._inproc = f"inproc://mccld-replies-{id(self)}"
        self._start_error: BaseException | None = None
        self._owns_files = False   # stop() removes the socket and token only if start() made them

    def start(self) -> None:
        sock_path = self.runtime_dir / protocol.SOCKET_NAME
        if sock_path.exists():
            sock_path.unlink()  # a stale socket of a dead daemon (the caller checked none answers)
        self._owns_files = True
        self._thread = threading.Thread(target=self._serve, name="mccld-attach", daemon=True)
        self._thread.start()
        if not self._ready.wait(10.0) or self._start_error is not None:
            raise MCCLError(f"[daemon] attach endpoint {self.endpoint} failed to start: {self._start_error}")
        if self._group is not None:
            # Connecting to a unix socket takes write permission on it, which the umask withholds
            # from the group; the 0750 directory already keeps everyone else out.
            os.chown(sock_path, -1, self._group)
            os.chmod(sock_path, 0o660)
        # The token last: clients (and tests, and the fuzzer) take its appearance to mean the
        # socket answers. Written before the bind, a client beside two busy loops once found the
        # token and no socket yet (CI, 6 Dec).
        token_path = self.runtime_dir / protocol.TOKEN_NAME
        tmp = token_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fd, 0o600)    # a stale .tmp keeps its mode: set it, never trust it
            if self._group is not None:
                os.fchown(fd, -1, self._group)
                os.fchmod(fd, 0o640)
            fh.write(self._token)
        tmp.replace(token_path)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(self._inproc)
        log.info("attach endpoint %s", self.endpoint)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with self._push_lock:
            if self._push is not None:
                self._push.close(0)
                self._push = None
        if not self._owns_files:
            return
        self._owns_files = False
        for name in (protocol.SOCKET_NAME, protocol.TOKEN_NAME):
            try:
                (self.runtime_dir / name).unlink()
            except FileNotFoundError:
                pass

    def reply(self, ident: bytes, req: int, payload: dict[str, Any]) -> None:
        """Send a reply from any thread."""
        frame = protocol.encode({"type": "reply", "req": req, **payload})
        with self._push_lock:
            if self._push is not None:
                self._push.send_multipart([ident, frame])

    def reply_error(self, ident: bytes, req: int, exc: BaseException) -> None:
        self.reply(ident, req, {"ok": False, "error": protocol.error_payload(exc)})

    # -- server thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to a vanished client are dropped
            router.bind(self.endpoint)
            pull = self._ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            pull.bind(self._inproc)
            monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except zmq.ZMQError as e:
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(200))
                if pull in events:
                    while True:
                        try:
                            router.send_multipart(pull.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                if router in events:
                    while True:
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        if self._peer_allowed(router, frames):
                            self._handle(router, [f.bytes for f in frames])
                if monitor in events:
                    # ROUTER cannot say which identity went: have the daemon check its clients now.
                    monitor.recv_multipart()
                    self._on_disconnect()
        finally:
            # Replies queued before stop() (jobs failed because the daemon stops) still go out.
            while True:
                try:
                    router.send_multipart(pull.recv_multipart(zmq.NOBLOCK), zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
            router.disable_monitor()
            monitor.close(0)
            router.close(linger=_FLUSH_LINGER_MS)
            pull.close(0)

    def _handle(self, router: zmq.Socket, frames: list[bytes]) -> None:
        ident = frames[0]
        req = -1
        try:
            if len(frames) != 2:
                raise ProtocolError(f"[daemon] control message with {len(frames) - 1} frames, expected 1")
            envelope = protocol.parse_request(frames[1])
            req = envelope["req"]  # from here on, errors reach the request that caused them
            msg = protocol.build_request(envelope)
            if isinstance(msg, protocol.Hello):
                if not hmac.compare_digest(msg.token.encode(), self._token.encode()):
                    raise AuthError("[daemon] client presented a wrong attach token; it read the token "
                                    f"of another daemon (check MCCL_RUNTIME_DIR={self.runtime_dir})")
                with self._auth_lock:
                    self._authenticated.add(ident)
            elif not self._is_authenticated(ident):
                raise AuthError(f"[daemon] {msg.type} request before hello; the client must "
                                "authenticate with the daemon's token first")
            payload = self._handler(ident, msg)
        except MCCLError as e:
            self._once.warn(f"bad:{ident.hex()}", "%s (client %s)", e, ident.hex())
            payload = {"ok": False, "error": protocol.error_payload(e)}
        except Exception as e:  # noqa: BLE001 - the server must keep serving
            log.exception("[daemon] handling a control message failed")
            payload = {"ok": False, "error": protocol.error_payload(e)}
        if payload is not None:
            router.send_multipart([ident, protocol.encode({"type": "reply", "req": req, **payload})])

    def _peer_allowed(self, router: zmq.Socket, frames: list[zmq.Frame]) -> bool:
        """Whether the kernel says the sender may use this daemon (mccl_common/localtrust.py):
        its uid is ours, root's, or a member's of MCCL_ATTACH_GROUP. Checked on every message,
        not once per identity: a ROUTER identity outlives its connection, a message's metadata
        is its own connection's. A refused sender gets one error reply and nothing is parsed."""
        ident = frames[0].bytes
        creds = localtrust.peer_creds(frames[-1].get("Peer-Address"))
        if creds is None:
            # libzmq built without SO_PEERCRED/LOCAL_PEERCRED: only the directory's mode guards.
            self._once.warn("nocreds", "[daemon] libzmq reports no peer credentials on %s; only the runtime "
                            "dir's mode keeps other users out", self.endpoint)
            return True
        if localtrust.uid_allowed(creds, self._group):
            with self._auth_lock:
                self._peers[ident] = creds
            return True
        err = AuthError(f"[daemon] refused a client running as {localtrust.owner_name(creds.uid)} (pid "
                        f"{creds.pid}): it is neither mccld's user nor in MCCL_ATTACH_GROUP; add that user to "
                        "the group if it should attach")
        self._once.warn(f"uid:{creds.uid}", "%s", err)
        router.send_multipart([ident, protocol.encode({"type": "reply", "req": -1, "ok": False,
                                                       "error": protocol.error_payload(err)})])
        return False

    def _is_authenticated(self, ident: bytes) -> bool:
        with self._auth_lock:
            return ident in self._authenticated

    def forget(self, ident: bytes) -> None:
        """The client is gone: a new connection reusing its identity must say hello again."""
        with self._auth_lock:
            self._authenticated.discard(ident)
            self._peers.pop(ident, None)

    def peer_of(self, ident: bytes) -> localtrust.PeerCreds | None:
        """The credentials of the connection that last sent as ``ident``: while its handler runs,
        the one it is handling. None where libzmq reports none."""
        with self._auth_lock:
            return self._peers.get(ident)


def local_request(runtime_dir: Path, msg: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
    """One request to the daemon serving ``runtime_dir`` (hello first); for CLIs and tests."""
    from mccl_common.daemon_settings import DaemonConfig, runtime_dir_owners
    from mccl_common.errors import DaemonUnavailableError
    from mccl_common.settings import load
    daemon_uid = localtrust.verify_daemon(runtime_dir, runtime_dir_owners(load(DaemonConfig), runtime_dir),
                                          protocol.SOCKET_NAME)
    try:
        token = (runtime_dir / protocol.TOKEN_NAME).read_text().strip()
    except OSError as e:
        raise DaemonUnavailableError(f"[daemon] no mccld token in {runtime_dir} ({e.strerror}); is mccld "
                                     "running with this MCCL_RUNTIME_DIR?") from None
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(protocol.endpoint(runtime_dir))
        reply: dict[str, Any] = {}
        for req, m in enumerate(({"type": "hello", "token": token, "pid": os.getpid()}, msg), start=1):
            sock.send(protocol.encode({**m, "req": req}))
            if not sock.poll(int(timeout_s * 1000)):
                raise DaemonUnavailableError(f"[daemon] Timed out after {timeout_s:.0f}s: mccld at "
                                             f"{protocol.endpoint(runtime_dir)} did not answer {m['type']}; "
                                             "it is stopped, wedged or overloaded: check its log, restart it "
                                             "if need be")
            frame = sock.recv(copy=False)
            localtrust.check_reply_peer(frame.get("Peer-Address"), daemon_uid, protocol.endpoint(runtime_dir))
            reply = protocol.decode_reply(frame.bytes)
            if not reply.get("ok"):
                raise protocol.error_from_payload(reply.get("error") or {})
        return reply
    finally:
        sock.close(0)
