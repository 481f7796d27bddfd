"""Wire protocol of the daemon status endpoint, both ends, and the client call.

Plain TCP, one newline-terminated JSON object per message, one request per
connection::

    server -> {"mccl_status": PROTO, "version": ..., "nonce": <hex>, "time": <epoch s>}
    client -> {"body": "<json {method, args}>", "cnonce": <hex>, "mac": <hex>}
    server -> {"ok": true, "body": "<json result>", "mac": <hex>}
              | {"ok": false, "error": {"kind", "message"}, "mac": <hex>}

``mac`` is HMAC-SHA256 with the fleet key over a domain tag, both nonces and the
exact body bytes, so a request cannot be replayed (fresh server nonce) and a reply
cannot be forged by something that is not a fleet daemon (fresh client nonce). A
request without a valid MAC gets an unsigned auth error and nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
from typing import Any

from . import errors as errmod
from .errors import AuthError, ConfigError, DaemonUnavailableError, MCCLError, ProtocolError

PROTO = 1
DEFAULT_PORT = 29651
MAX_LINE = 4 << 20           # a status answer of a large fleet fits easily
# What a server reads before the client proved the key (a request, a launch request): a
# stranger gets no more of our memory and parser than this.
MAX_PREAUTH_LINE = 16 << 10
IO_TIMEOUT_S = 10.0          # per read/write on a server connection

READ_METHODS = ("status", "links", "jobs", "linktest_result", "capacity", "fleet")
WRITE_METHODS = ("linktest",)
SINK = "linktest_sink"       # internal: the far end of another daemon's linktest

# Harvest states of a host (docs/harvesting.md), in the order a harvested night passes them.
HARVEST_STATES = ("busy", "idle", "leased", "draining")
# The states in which the host's user has left it to the fleet: what "harvestable" counts.
HARVESTED_STATES = ("idle", "leased")


def mac(key: bytes, tag: str, *parts: str) -> str:
    msg = "\0".join((tag,) + parts).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def mac_ok(key: bytes, got: Any, tag: str, *parts: str) -> bool:
    # compare_digest raises TypeError on a str with non-ASCII characters: a peer's field is
    # checked to be plain ASCII of the right length first, so a bad MAC is just a bad MAC.
    want = mac(key, tag, *parts)
    return isinstance(got, str) and len(got) == len(want) and got.isascii() and hmac.compare_digest(got, want)


def canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def signed_reply(key: bytes, cnonce: str, nonce: str, result: Any, error: dict | None) -> dict:
    if error is None:
        body = canon(result)
        return {"ok": True, "body": body, "mac": mac(key, "resp", cnonce, nonce, body)}
    return {"ok": False, "error": error, "mac": mac(key, "resp", cnonce, nonce, canon(error))}


class Conn:
    """Line-framed JSON over a socket with bounded reads. Buffering is linear in the line's
    length: chunks are appended in place and only the new bytes are searched for the end of
    the line (re-scanning and re-copying the whole buffer per chunk cost a stranger's
    megabytes quadratic CPU time)."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self._buf = bytearray()

    def send(self, obj: dict) -> None:
        self.sock.sendall(canon(obj).encode() + b"\n")

    def recv(self, what: str, limit: int = MAX_LINE) -> dict:
        """The next line as a JSON object; ProtocolError once more than ``limit`` bytes come
        without a newline (read no further than that)."""
        end = self._buf.find(b"\n")
        scanned = len(self._buf)
        while end < 0:
            if len(self._buf) > limit:
                raise ProtocolError(f"[status] {what} from peer={self.peer} exceeds {limit} bytes; "
                                    f"the other side is not speaking the MCCL status protocol")
            chunk = self.sock.recv(min(65536, limit + 1 - len(self._buf)))
            if not chunk:
                raise ConnectionError(f"connection closed while waiting for {what}")
            self._buf += chunk
            end = self._buf.find(b"\n", scanned)
            scanned = len(self._buf)
        if end > limit:
            raise ProtocolError(f"[status] {what} from peer={self.peer} exceeds {limit} bytes; "
                                f"the other side is not speaking the MCCL status protocol")
        line = bytes(self._buf[:end])
        del self._buf[:end + 1]
        return self._parse(line, what)

    def pending(self) -> bool:
        """A whole message was already read off the socket (select() would not see it)."""
        return b"\n" in self._buf

    def take_buffered(self) -> bytes:
        data = bytes(self._buf)
        self._buf.clear()
        return data

    def _parse(self, line: bytes, what: str) -> dict:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            obj = None
        if not isinstance(obj, dict):
            raise ProtocolError(f"[status] {what} from peer={self.peer} is not a JSON object; "
                                f"the other side is not speaking the MCCL status protocol")
        return obj


class Hello(dict):
    """What the server said before the request: protocol, version, nonce."""


def connect(addr: str, timeout_s: float) -> socket.socket:
    host, port = split_addr(addr)
    try:
        return socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise DaemonUnavailableError(
            f"[status] cannot reach the status endpoint, peer={host}:{port}: {e.strerror or e}; "
            f"mccld is not running there, MCCL_STATUS_PORT differs, or a firewall blocks it") from None


def split_addr(addr: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep:
        return addr, default_port
    try:
        return host, int(port)
    except ValueError:
        raise ConfigError(f"[status] bad address {addr!r}; use host or host:port") from None


def send_request(conn: Conn, key: bytes, method: str, args: dict) -> tuple[Hello, str, str]:
    hello = conn.recv("hello")
    if hello.get("mccl_status") != PROTO or not isinstance(hello.get("nonce"), str):
        raise ProtocolError(f"[status] peer={conn.peer} speaks status protocol "
                            f"{hello.get('mccl_status')!r}, mcclctl speaks {PROTO}; "
                            f"upgrade mcclctl and mccld to the same release")
    cnonce = os.urandom(16).hex()
    body = canon({"method": method, "args": args})
    conn.send({"body": body, "cnonce": cnonce, "mac": mac(key, "req", hello["nonce"], cnonce, body)})
    return Hello(hello), cnonce, hello["nonce"]


def read_reply(conn: Conn, key: bytes, cnonce: str, nonce: str) -> Any:
    reply = conn.recv("reply")
    if reply.get("ok") is False and reply.get("error", {}).get("kind") == "AuthError" \
            and "mac" not in reply:
        raise AuthError(f"[status] peer={conn.peer} refused our fleet key; use the key file of "
                        f"that fleet (MCCL_KEY_FILE / --key-file)", peer_addr=conn.peer)
    body = reply.get("body") if reply.get("ok") else canon(reply.get("error"))
    if not isinstance(body, str) or not mac_ok(key, reply.get("mac"), "resp", cnonce, nonce, body):
        raise AuthError(f"[status] reply from peer={conn.peer} is not signed with our fleet key; "
                        f"something other than a daemon of this fleet answers there", peer_addr=conn.peer)
    if not reply.get("ok"):
        err = reply["error"]
        cls = getattr(errmod, str(err.get("kind")), MCCLError)
        if not (isinstance(cls, type) and issubclass(cls, MCCLError)):
            cls = MCCLError
        raise cls(str(err.get("message")), peer_addr=conn.peer)
    return json.loads(body)


def query(addr: str, key: bytes, method: str, args: dict | None = None,
          timeout_s: float = 5.0) -> tuple[Any, Hello]:
    """One authenticated request to a daemon's status endpoint: (result, hello)."""
    if method not in READ_METHODS + WRITE_METHODS:
        raise ConfigError(f"[status] unknown status method {method!r}")
    sock = connect(addr, timeout_s)
    host, port = split_addr(addr)
    try:
        sock.settimeout(timeout_s)
        conn = Conn(sock, f"{host}:{port}")
        hello, cnonce, nonce = send_request(conn, key, method, args or {})
        return read_reply(conn, key, cnonce, nonce), hello
    except socket.timeout:
        raise DaemonUnavailableError(f"[status] Timed out after {timeout_s:.1f} s: status endpoint "
                                     f"peer={host}:{port} did not answer; the daemon is overloaded or hung",
                                     peer_addr=f"{host}:{port}") from None
    except ConnectionError as e:
        raise DaemonUnavailableError(f"[status] status endpoint peer={host}:{port} closed the "
                                     f"connection ({e}); the daemon is stopping or restarted",
                                     peer_addr=f"{host}:{port}") from None
    finally:
        sock.close()
