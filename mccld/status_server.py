"""Authenticated status endpoint of a daemon, for remote ``mcclctl``.

Plain TCP, one newline-terminated JSON object per message, one request per
connection::

    server -> {"mccl_status": PROTO, "version": ..., "nonce": <hex>, "time": <epoch s>}
    client -> {"body": "<json {method, args}>", "cnonce": <hex>, "mac": <hex>}
    server -> {"ok": true, "body": "<json result>", "mac": <hex>}
              | {"ok": false, "error": {"kind", "message"}, "mac": <hex>}

``mac`` is HMAC-SHA256 with the fleet key over a domain tag, both nonces and the
exact body bytes, so a request cannot be replayed (fresh server nonce) and a reply
cannot be forged by something that is not a fleet daemon (fresh client nonce). A
request without a valid MAC gets an auth error and nothing else.

Every method is read-only except ``linktest``, the one write action: the daemon
measures TCP goodput to another daemon's status endpoint (which sinks the bytes via
``linktest_sink``) and records it as that link's ceiling. Both sides authenticate.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

from libmccl.errors import (AuthError, ConfigError, DaemonUnavailableError, MCCLError, ProtocolError)

from . import tcpinfo
from .stats import DaemonStats, mccl_version

log = logging.getLogger(__name__)

PROTO = 1
MAX_LINE = 4 << 20           # a status answer of a large fleet fits easily
IO_TIMEOUT_S = 10.0          # per read/write on a connection
MAX_CONNECTIONS = 16         # concurrent clients; more are refused, not queued forever
LINKTEST_MAX_S = 30.0
LINKTEST_MAX_STREAMS = 16
_CHUNK = 1 << 20

READ_METHODS = ("status", "links", "jobs", "linktest_result")
WRITE_METHODS = ("linktest",)
_SINK = "linktest_sink"      # internal: the far end of another daemon's linktest


def _mac(key: bytes, tag: str, *parts: str) -> str:
    msg = "\0".join((tag,) + parts).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


class _Conn:
    """Line-framed JSON over a socket with bounded reads."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self._buf = b""

    def send(self, obj: dict) -> None:
        self.sock.sendall(_canon(obj).encode() + b"\n")

    def recv(self, what: str) -> dict:
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_LINE:
                raise ProtocolError(f"[status] {what} from peer={self.peer} exceeds {MAX_LINE} bytes; "
                                    f"the other side is not speaking the MCCL status protocol")
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"connection closed while waiting for {what}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return self._parse(line, what)

    def take_buffered(self) -> bytes:
        data, self._buf = self._buf, b""
        return data

    def _parse(self, line: bytes, what: str) -> dict:
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            raise ProtocolError(f"[status] {what} from peer={self.peer} is not a JSON object; "
                                f"the other side is not speaking the MCCL status protocol")
        return obj


# ---- server ---------------------------------------------------------------------------


def merge_status(daemon: dict, snap: dict | None, tcp_text: str | None = None) -> dict:
    """The full status answer: what the daemon knows, completed from its DaemonStats.

    ``daemon`` holds host, address, jobs, links and last_error (docs/dev/interfaces.md
    §4); counters, rates, ceilings, state and uptime come from the stats snapshot, and
    per-socket TCP figures from the OS. Fields the daemon set win.
    """
    out = dict(daemon)
    snap = snap or {}
    peers = snap.get("peers", {})
    if "links" in out:
        links = [dict(link) for link in out["links"] or []]
    else:  # a daemon that does not list links: every peer the stats know of
        links = [{"peer": p, "up": v["up"]} for p, v in peers.items()]
    local = out.get("address") or ""
    if tcp_text is None and local:
        tcp_text = tcpinfo.run_ss()
    for link in links:
        # Daemons may name a link by "addr"/"host_id"; the answer always has "peer"/"host".
        link.setdefault("peer", link.get("addr"))
        link.setdefault("host", link.get("host_id"))
        ps = peers.get(link.get("peer")) or peers.get(link.get("host")) or {}
        if "up" not in link and ps.get("up") is None:
            link["up"] = True  # listed by the daemon without a state: it is a live link
        for key in ("sent_bytes", "received_bytes", "tx_bytes_per_s", "rx_bytes_per_s",
                    "ceiling_bits_per_s"):
            link.setdefault(key, ps.get(key))
        if ps.get("up") is not None:
            link.setdefault("up", bool(ps["up"]))
        if local and link.get("peer") and tcp_text is not None:
            tcp = tcpinfo.summarize(tcpinfo.link_sockets(local, link["peer"], tcp_text))
        else:
            tcp = tcpinfo.summarize(None)
        for key, value in tcp.items():
            if link.get(key) is None:
                link[key] = value
    # Peers the daemon does not list still show: seen going down (a down link), or only
    # known by a link test ceiling (up unknown: not a link, so not counted below).
    listed = {link.get("peer") for link in links} | {link.get("host") for link in links}
    for name, ps in sorted(peers.items()):
        if name not in listed and (ps.get("up") is False or ps.get("ceiling_bits_per_s")):
            links.append({"peer": name, "host": None, "up": ps.get("up"), "sent_bytes": ps.get("sent_bytes"),
                          "received_bytes": ps.get("received_bytes"), "tx_bytes_per_s": 0.0,
                          "rx_bytes_per_s": 0.0, "ceiling_bits_per_s": ps.get("ceiling_bits_per_s"),
                          **tcpinfo.summarize(None)})
    out["links"] = links
    out.setdefault("links_up", sum(1 for link in links if link.get("up")))
    out.setdefault("links_total", sum(1 for link in links if link.get("up") is not None))
    out.setdefault("tx_bytes_per_s", sum(link.get("tx_bytes_per_s") or 0.0 for link in links))
    out.setdefault("rx_bytes_per_s", sum(link.get("rx_bytes_per_s") or 0.0 for link in links))
    for key, skey in (("version", "version"), ("state", "state"), ("uptime_s", "uptime_s"),
                      ("start_time", "start_time"), ("attached", "attached"), ("errors", "errors")):
        if skey in snap:
            out.setdefault(key, snap[skey])
    out.setdefault("version", mccl_version())
    out.setdefault("last_error", None)
    jobs = [dict(j) for j in out.get("jobs") or
            [{"job": name, "world": j["world"]} for name, j in snap.get("jobs", {}).items()]]
    for job in jobs:
        job.setdefault("ranks", job.get("local_ranks"))
        js = snap.get("jobs", {}).get(job.get("job"), {})
        job.setdefault("world", js.get("world"))
        job.setdefault("collectives", js.get("ops", 0))
        job.setdefault("bytes", js.get("bytes", 0))
        job.setdefault("overlap", {str(o["rank"]): o["latest"] for o in snap.get("overlap", [])
                                   if o["job"] == job.get("job")})
    out["jobs"] = jobs
    return out


class StatusServer:
    """Answers authenticated status queries with sections of the daemon's status.

    ``provider`` returns what only the daemon knows (host, address, jobs, links,
    last_error; see docs/dev/interfaces.md §4); with ``stats`` the answer is completed
    from the DaemonStats (see ``merge_status``) and linktest results are recorded as
    link ceilings there. Without ``stats`` nor ``record_ceiling``, ``linktest`` is refused.
    """

    def __init__(self, provider: Callable[[], dict], key: bytes, addr: str = "0.0.0.0",
                 port: int = 29651, stats: DaemonStats | None = None,
                 record_ceiling: Callable[[str, float], None] | None = None) -> None:
        if not key:
            raise ConfigError("[status] no fleet key for the status endpoint; set MCCL_KEY_FILE")
        self._provider = provider
        self._key = key
        self._addr = addr
        self._port = port
        self._stats = stats
        self._record_ceiling = record_ceiling or (stats.set_link_ceiling if stats else None)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._linktests: dict[str, dict] = {}      # peer link address -> last result
        self._linktest_running = threading.Lock()  # one measurement at a time per host
        self._warned: set[str] = set()

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1] if self._sock else self._port

    @property
    def address(self) -> str:
        return f"{self._addr}:{self.port}"

    def start(self) -> None:
        if self._sock is not None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._addr, self._port))
        except OSError as e:
            sock.close()
            raise ConfigError(f"[status] cannot listen on {self._addr}:{self._port}: {e.strerror}; "
                              f"another mccld holds the port or the address is not local; stop it or "
                              f"set MCCL_STATUS_PORT") from e
        sock.listen(64)
        sock.settimeout(0.5)  # the accept loop wakes to notice stop()
        self._sock = sock
        self._stop.clear()
        self._thread = threading.Thread(target=self._accept_loop, name="mccld-status", daemon=True)
        self._thread.start()
        log.info("status endpoint listening on %s", self.address)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._sock is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self._sock.close()
        self._sock = self._thread = None

    def linktest_results(self) -> dict[str, dict]:
        with self._lock:
            return {k: dict(v) for k, v in self._linktests.items()}

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, (host, port) = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if not self._stop.is_set():
                    log.exception("status endpoint accept failed")
                return
            if not self._slots.acquire(blocking=False):
                log.warning("status endpoint: %d clients already connected, refusing %s:%d",
                            MAX_CONNECTIONS, host, port)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, f"{host}:{port}"),
                             name="mccld-status-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.settimeout(IO_TIMEOUT_S)
            conn = _Conn(sock, peer)
            nonce = os.urandom(16).hex()
            # The wall clock lets mcclctl doctor estimate clock skew between hosts.
            conn.send({"mccl_status": PROTO, "version": mccl_version(), "nonce": nonce,
                       "time": time.time()})
            req = conn.recv("request")
            body, cnonce, mac = req.get("body"), req.get("cnonce"), req.get("mac")
            if not all(isinstance(x, str) for x in (body, cnonce, mac)):
                raise ProtocolError(f"[status] malformed request from peer={peer}")
            if not hmac.compare_digest(mac, _mac(self._key, "req", nonce, cnonce, body)):
                self._warn_once(peer, f"status request from peer={peer} failed fleet-key "
                                      f"authentication; the client uses another fleet's key")
                conn.send({"ok": False, "error": {"kind": "AuthError", "message":
                           "[status] request MAC does not match; use this fleet's key (MCCL_KEY_FILE)"}})
                return
            try:
                call = json.loads(body)
                method, args = call["method"], call.get("args") or {}
                if method == _SINK:
                    self._sink(conn, args, nonce, cnonce)
                    return
                result, error = self._dispatch(method, args), None
            except MCCLError as e:
                result, error = None, {"kind": type(e).__name__, "message": str(e)}
            except (ValueError, KeyError, TypeError) as e:
                result, error = None, {"kind": "ProtocolError",
                                       "message": f"[status] bad request from peer={peer}: {e!r}"}
            self._reply(conn, nonce, cnonce, result, error)
        except ConnectionError as e:
            # Port probes (mcclctl doctor, load balancers) connect and leave: not a problem.
            log.debug("status connection from peer=%s closed early: %s", peer, e)
        except (OSError, ProtocolError) as e:
            self._warn_once(peer, f"status connection from peer={peer} failed: {e}")
        except Exception:
            log.exception("status endpoint: unexpected failure serving peer=%s", peer)
        finally:
            sock.close()
            self._slots.release()

    def _reply(self, conn: _Conn, nonce: str, cnonce: str, result: Any, error: dict | None) -> None:
        if error is None:
            body = _canon(result)
            conn.send({"ok": True, "body": body, "mac": _mac(self._key, "resp", cnonce, nonce, body)})
        else:
            body = _canon(error)
            conn.send({"ok": False, "error": error,
                       "mac": _mac(self._key, "resp", cnonce, nonce, body)})

    def _dispatch(self, method: str, args: dict) -> Any:
        if method in ("status", "links", "jobs"):
            snap = self._stats.snapshot() if self._stats else None
            # Socket details (an `ss` run) only matter where links are shown.
            status = merge_status(self._provider(), snap, tcp_text="" if method == "jobs" else None)
            status["linktests"] = self.linktest_results()
            if method == "status":
                return status
            return {"host": status.get("host"), "address": status.get("address"),
                    "version": status.get("version"), method: status.get(method, [])}
        if method == "linktest_result":
            return self.linktest_results()
        if method == "linktest":
            return self._run_linktest(args)
        raise ProtocolError(f"[status] unknown method {method!r}; this endpoint answers "
                            f"{READ_METHODS + WRITE_METHODS}")

    # ---- linktest -----------------------------------------------------------------

    def _run_linktest(self, args: dict) -> dict:
        if self._record_ceiling is None:
            raise ConfigError("[status] this daemon does not record link ceilings (started without "
                              "a stats sink); linktest is unavailable here")
        target = str(args["target"])
        seconds = min(float(args.get("seconds", 3.0)), LINKTEST_MAX_S)
        streams = max(1, min(int(args.get("streams", 2)), LINKTEST_MAX_STREAMS))
        if seconds <= 0:
            raise ConfigError(f"[status] linktest seconds={seconds} must be positive")
        if not self._linktest_running.acquire(timeout=LINKTEST_MAX_S + IO_TIMEOUT_S):
            raise MCCLError("[status] another linktest is still running on this host; retry later")
        try:
            result = measure_goodput(target, self._key, seconds, streams)
        finally:
            self._linktest_running.release()
        peer = result["peer_address"]
        self._record_ceiling(peer, result["bits_per_s"])
        with self._lock:
            self._linktests[peer] = result
        log.info("linktest to %s (%s): %.3f Gbit/s over %d streams", peer, target,
                 result["bits_per_s"] / 1e9, streams)
        return result

    def _sink(self, conn: _Conn, args: dict, nonce: str, cnonce: str) -> None:
        # Only an authenticated sender gets here. Count bytes until it half-closes, then
        # report the count: goodput is what arrived, not what the sender's kernel buffered.
        seconds = min(float(args.get("seconds", 3.0)), LINKTEST_MAX_S)
        status = self._provider()
        self._reply(conn, nonce, cnonce, {"address": status.get("address"),
                                          "host": status.get("host")}, None)
        received = len(conn.take_buffered())
        buf = bytearray(_CHUNK)
        deadline = time.monotonic() + seconds + IO_TIMEOUT_S
        while True:
            if time.monotonic() > deadline:
                raise ProtocolError(f"[status] linktest sender peer={conn.peer} kept streaming past "
                                    f"its {seconds:.1f} s; closing")
            n = conn.sock.recv_into(buf)
            if n == 0:
                break
            received += n
        body = _canon({"received": received})
        conn.send({"ok": True, "body": body, "mac": _mac(self._key, "sink", cnonce, nonce, body)})

    def _warn_once(self, peer: str, message: str) -> None:
        host = peer.rsplit(":", 1)[0]
        if host in self._warned:
            log.debug(message)
        else:
            self._warned.add(host)
            log.warning(message)


# ---- client ---------------------------------------------------------------------------


class Hello(dict):
    """What the server said before the request: protocol, version, nonce."""


def _connect(addr: str, timeout_s: float) -> socket.socket:
    host, port = split_addr(addr)
    try:
        return socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise DaemonUnavailableError(
            f"[mcclctl] cannot reach the status endpoint, peer={host}:{port}: {e.strerror or e}; "
            f"mccld is not running there, MCCL_STATUS_PORT differs, or a firewall blocks it") from None


def split_addr(addr: str, default_port: int = 29651) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep:
        return addr, default_port
    try:
        return host, int(port)
    except ValueError:
        raise ConfigError(f"[mcclctl] bad address {addr!r}; use host or host:port") from None


def _request(conn: _Conn, key: bytes, method: str, args: dict) -> tuple[Hello, str, str]:
    hello = conn.recv("hello")
    if hello.get("mccl_status") != PROTO or not isinstance(hello.get("nonce"), str):
        raise ProtocolError(f"[mcclctl] peer={conn.peer} speaks status protocol "
                            f"{hello.get('mccl_status')!r}, mcclctl speaks {PROTO}; "
                            f"upgrade mcclctl and mccld to the same release")
    cnonce = os.urandom(16).hex()
    body = _canon({"method": method, "args": args})
    conn.send({"body": body, "cnonce": cnonce, "mac": _mac(key, "req", hello["nonce"], cnonce, body)})
    return Hello(hello), cnonce, hello["nonce"]


def _read_reply(conn: _Conn, key: bytes, cnonce: str, nonce: str) -> Any:
    reply = conn.recv("reply")
    if reply.get("ok") is False and reply.get("error", {}).get("kind") == "AuthError" \
            and "mac" not in reply:
        raise AuthError(f"[mcclctl] peer={conn.peer} refused our fleet key; use the key file of "
                        f"that fleet (MCCL_KEY_FILE / --key-file)", peer_addr=conn.peer)
    body = reply.get("body") if reply.get("ok") else _canon(reply.get("error"))
    mac = reply.get("mac")
    if not isinstance(body, str) or not isinstance(mac, str) or \
            not hmac.compare_digest(mac, _mac(key, "resp", cnonce, nonce, body)):
        raise AuthError(f"[mcclctl] reply from peer={conn.peer} is not signed with our fleet key; "
                        f"something other than a daemon of this fleet answers there", peer_addr=conn.peer)
    if not reply.get("ok"):
        err = reply["error"]
        from libmccl import errors as errmod
        cls = getattr(errmod, str(err.get("kind")), MCCLError)
        if not (isinstance(cls, type) and issubclass(cls, MCCLError)):
            cls = MCCLError
        raise cls(str(err.get("message")), peer_addr=conn.peer)
    return json.loads(body)


def query(addr: str, key: bytes, method: str, args: dict | None = None,
          timeout_s: float = 5.0) -> tuple[Any, Hello]:
    """One authenticated request to a daemon's status endpoint: (result, hello)."""
    if method not in READ_METHODS + WRITE_METHODS:
        raise ConfigError(f"[mcclctl] unknown status method {method!r}")
    sock = _connect(addr, timeout_s)
    host, port = split_addr(addr)
    try:
        sock.settimeout(timeout_s)
        conn = _Conn(sock, f"{host}:{port}")
        hello, cnonce, nonce = _request(conn, key, method, args or {})
        return _read_reply(conn, key, cnonce, nonce), hello
    except socket.timeout:
        raise DaemonUnavailableError(f"[mcclctl] status endpoint peer={host}:{port} did not answer "
                                     f"within {timeout_s:.1f} s; the daemon is overloaded or hung",
                                     peer_addr=f"{host}:{port}") from None
    except ConnectionError as e:
        raise DaemonUnavailableError(f"[mcclctl] status endpoint peer={host}:{port} closed the "
                                     f"connection ({e}); the daemon is stopping or restarted",
                                     peer_addr=f"{host}:{port}") from None
    finally:
        sock.close()


def measure_goodput(target: str, key: bytes, seconds: float, streams: int) -> dict:
    """Stream bytes to ``target``'s status endpoint for ``seconds`` on ``streams`` sockets.

    Goodput = bytes the sink reports it received / time until the last sink reported,
    so data still sitting in socket buffers when the clock stops is not counted early.
    """
    host, port = split_addr(target)
    peer = f"{host}:{port}"
    conns: list[tuple[_Conn, str, str]] = []
    sink_info: dict = {}
    try:
        for _ in range(streams):
            sock = _connect(target, IO_TIMEOUT_S)
            sock.settimeout(IO_TIMEOUT_S)
            conn = _Conn(sock, peer)
            _, cnonce, nonce = _request(conn, key, _SINK, {"seconds": seconds})
            conns.append((conn, cnonce, nonce))
            sink_info = _read_reply(conn, key, cnonce, nonce)
        failures: list[BaseException] = []
        start = time.monotonic()
        end = start + seconds

        def pump(conn: _Conn) -> None:
            payload = memoryview(os.urandom(_CHUNK))  # incompressible, like real gradients
            try:
                while time.monotonic() < end:
                    conn.sock.send(payload)
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError as e:
                failures.append(e)

        threads = [threading.Thread(target=pump, args=(c,), daemon=True) for c, _, _ in conns]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=seconds + IO_TIMEOUT_S)
        if failures or any(t.is_alive() for t in threads):
            raise MCCLError(f"[status] linktest stream to peer={peer} failed: "
                            f"{failures[0] if failures else 'send stalled'}; the peer daemon stopped "
                            f"or the link dropped")
        received = 0
        for conn, cnonce, nonce in conns:
            reply = conn.recv("linktest result")
            body, mac = reply.get("body"), reply.get("mac")
            if not isinstance(body, str) or not isinstance(mac, str) or \
                    not hmac.compare_digest(mac, _mac(key, "sink", cnonce, nonce, body)):
                raise AuthError(f"[status] linktest result from peer={peer} is not signed with the "
                                f"fleet key", peer_addr=peer)
            received += int(json.loads(body)["received"])
        elapsed = time.monotonic() - start
    except socket.timeout:
        raise MCCLError(f"[status] linktest to peer={peer} timed out; the link is stalled or the "
                        f"peer daemon is overloaded", peer_addr=peer) from None
    finally:
        for conn, _, _ in conns:
            conn.sock.close()
    if received == 0:
        raise MCCLError(f"[status] linktest to peer={peer} delivered no bytes in {elapsed:.1f} s; "
                        f"the link is down", peer_addr=peer)
    return {"target": peer, "peer_address": sink_info.get("address") or peer,
            "peer_host": sink_info.get("host"), "bytes": received, "seconds": elapsed,
            "streams": streams, "bits_per_s": received * 8.0 / elapsed, "time": time.time()}
