"""Authenticated status endpoint of a daemon, for remote ``mcclctl``.

Answers the requests of ``status_protocol`` with sections of the daemon's status
(``merge_status``: what the daemon knows, completed from its DaemonStats and the OS).
Every method is read-only except ``linktest``, the one write action: measure TCP
goodput to another daemon (``linktest``) and record it as that link's ceiling.
``query`` is the client call mcclctl uses.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

from mccl_common.errors import ConfigError, MCCLError, ProtocolError
from mccl_common.status_protocol import (IO_TIMEOUT_S, MAX_PREAUTH_LINE, PROTO, READ_METHODS, SINK, WRITE_METHODS,
                                         Conn, mac_ok, query, signed_reply, split_addr)

from ..net import linktest, tcpinfo
from ..net.gate import REWARN_S, Gate, Ticket
from ..logutil import OnceLogger
from .stats import DaemonStats, mccl_version

__all__ = ["StatusServer", "merge_status", "query", "split_addr"]

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16         # concurrent authenticated clients; more are refused, not queued forever


def merge_status(daemon: dict, snap: dict | None, tcp_text: str | None = None,
                 exclude_ports: frozenset[int] = frozenset()) -> dict:
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
    pools = {p.get("host"): p for p in out.get("data_links") or []}
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
            tcp = tcpinfo.summarize(tcpinfo.link_sockets(local, link["peer"], tcp_text, exclude_ports))
        else:
            tcp = tcpinfo.summarize(None)
        for key, value in tcp.items():
            if link.get(key) is None:
                link[key] = value
        pool = pools.get(link.get("host"))
        if pool is not None:
            link.setdefault("data_sockets", {k: pool.get(k, 0) for k in ("idle", "leased", "dialled",
                                                                         "accepted", "discarded")})
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
    for key, skey in (("version", "version"), ("state", "state"), ("harvest", "harvest"),
                      ("uptime_s", "uptime_s"), ("start_time", "start_time"), ("attached", "attached"),
                      ("errors", "errors")):
        if skey in snap:
            out.setdefault(key, snap[skey])
    out.setdefault("version", mccl_version())
    out.setdefault("last_error", None)
    listed = out.get("jobs")
    jobs = [dict(j) for j in listed or
            [{"job": name, "world": j["world"]} for name, j in snap.get("jobs", {}).items()
             if "jobs" not in out]]
    if "jobs" in out:
        # Jobs the daemon no longer holds: ended (or failed) a while ago, listed as such with
        # their age until the stats forget them, not as live jobs with no ranks.
        live = {j.get("job") for j in jobs}
        for name, js in sorted(snap.get("jobs", {}).items()):
            if name not in live:
                jobs.append({"job": name, "state": "ended", "ranks": [], "world": js.get("world"),
                             "compression": js.get("compression", "off"),
                             "age_s": js.get("age_s"), "outcome": js.get("outcome") or "ok",
                             "ended_s_ago": js["ended_s_ago"] if js.get("ended_s_ago") is not None
                             else js.get("idle_s")})
    for job in jobs:
        job.setdefault("ranks", job.get("local_ranks"))
        js = snap.get("jobs", {}).get(job.get("job"), {})
        job.setdefault("world", js.get("world"))
        job.setdefault("collectives", js.get("ops", 0))
        job.setdefault("bytes", js.get("bytes", 0))
        job.setdefault("compression", js.get("compression", "off"))
        for key in ("allreduce_input_bytes", "allreduce_encoded_bytes", "wire_bytes"):
            job.setdefault(key, js.get(key, 0))
        job.setdefault("overlap", {str(o["rank"]): o["latest"] for o in snap.get("overlap", [])
                                   if o["job"] == job.get("job")})
        job.setdefault("balance", {str(b["rank"]): {"speed": b["speed"], "share": b["share"]}
                                   for b in snap.get("balance", []) if b["job"] == job.get("job")})
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
                 record_ceiling: Callable[[str, float], None] | None = None, gate: Gate | None = None,
                 capacity: Callable[[], dict] | None = None) -> None:
        if not key:
            raise ConfigError("[status] no fleet key for the status endpoint; set MCCL_KEY_FILE")
        self._provider = provider
        self._key = key
        self._addr = addr
        self._port = port
        self._stats = stats
        self._record_ceiling = record_ceiling or (stats.set_link_ceiling if stats else None)
        self._capacity = capacity    # the daemon's host facts, harvest state and its history
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Until its MAC checks out a connection holds a slot of the gate (capped, with one
        # deadline for hello + request); after that, one of the authenticated slots.
        self._gate = gate or Gate.from_config("status")
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._linktests: dict[str, dict] = {}      # peer link address -> last result
        self._linktest_running = threading.Lock()  # one measurement at a time per host
        self._once = OnceLogger(log, rewarn_s=REWARN_S)

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1] if self._sock else self._port

    @property
    def address(self) -> str:
        return f"{self._addr}:{self.port}"

    @property
    def gate(self) -> Gate:
        return self._gate

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
        self._gate.start()
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
        self._gate.close()
        self._sock = self._thread = None

    def linktest_results(self) -> dict[str, dict]:
        with self._lock:
            return {k: dict(v) for k, v in self._linktests.items()}

    def _accept_loop(self) -> None:
        self._gate.accept_loop(self._sock, self._stop, self._serve, "mccld-status-conn")

    def _serve(self, sock: socket.socket, peer: str, ticket: Ticket) -> None:
        slot = False
        try:
            sock.settimeout(IO_TIMEOUT_S)
            conn = Conn(sock, peer)
            nonce = os.urandom(16).hex()
            # The wall clock lets mcclctl doctor estimate clock skew between hosts.
            conn.send({"mccl_status": PROTO, "version": mccl_version(), "nonce": nonce,
                       "time": time.time()})
            req = conn.recv("request", limit=MAX_PREAUTH_LINE)
            body, cnonce, mac = req.get("body"), req.get("cnonce"), req.get("mac")
            if not all(isinstance(x, str) for x in (body, cnonce, mac)):
                raise ProtocolError(f"[status] malformed request from peer={peer}")
            if not mac_ok(self._key, mac, "req", nonce, cnonce, body):
                self._warn_once(peer, f"status request from peer={peer} failed fleet-key "
                                      f"authentication; the client uses another fleet's key")
                conn.send({"ok": False, "error": {"kind": "AuthError", "message":
                           "[status] request MAC does not match; use this fleet's key (MCCL_KEY_FILE)"}})
                return
            ticket.passed()
            slot = self._slots.acquire(blocking=False)
            if not slot:
                self._once.warn("<too many clients>", "[status] %d clients already connected, refusing peer=%s; "
                                "something polls this daemon too often", MAX_CONNECTIONS, peer)
                self._reply(conn, nonce, cnonce, None, {"kind": "MCCLError", "message": (
                    f"[status] {MAX_CONNECTIONS} clients are already being served; retry later")})
                return
            try:
                call = json.loads(body)
                method, args = call["method"], call.get("args") or {}
                if method == SINK:
                    status = self._provider()
                    linktest.serve_sink(conn, self._key, nonce, cnonce, float(args.get("seconds", 3.0)),
                                        {"address": status.get("address"), "host": status.get("host")})
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
            self._once.warn(f"bug:{peer.rsplit(':', 1)[0]}", "[status] unexpected failure serving peer=%s",
                            peer, exc_info=True)
        finally:
            ticket.release()  # before the close: the gate's watchdog must not shut down a reused fd
            sock.close()
            if slot:
                self._slots.release()

    def _reply(self, conn: Conn, nonce: str, cnonce: str, result: Any, error: dict | None) -> None:
        conn.send(signed_reply(self._key, cnonce, nonce, result, error))

    def _dispatch(self, method: str, args: dict) -> Any:
        if method in ("status", "links", "jobs"):
            snap = self._stats.snapshot() if self._stats else None
            # Socket details (an `ss` run) only matter where links are shown.
            status = merge_status(self._provider(), snap, tcp_text="" if method == "jobs" else None,
                                  exclude_ports=frozenset({self.port}))
            status["linktests"] = self.linktest_results()
            if method == "status":
                return status
            out = {"host": status.get("host"), "address": status.get("address"), "fleet": status.get("fleet"),
                   "version": status.get("version"), method: status.get(method, [])}
            if method == "links":
                out["topology"] = status.get("topology")  # this host's switch and RTT row (mccld/net/topology.py)
            return out
        if method == "fleet":
            # The daemon's fleet table (mDNS and gossip): where mcclctl finds every host at once.
            status = self._provider()
            return {"host": status.get("host"), "address": status.get("address"), "fleet": status.get("fleet"),
                    "fleet_table": status.get("fleet_table") or []}
        if method == "linktest_result":
            return self.linktest_results()
        if method == "capacity":
            if self._capacity is None:
                raise ConfigError("[status] this daemon keeps no harvest state; capacity is unavailable here")
            status = self._provider()
            return {"host": status.get("host"), "address": status.get("address"), "fleet": status.get("fleet"),
                    "version": status.get("version") or mccl_version(), **self._capacity()}
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
        seconds = min(float(args.get("seconds", 3.0)), linktest.MAX_SECONDS)
        streams = max(1, min(int(args.get("streams", 2)), linktest.MAX_STREAMS))
        if seconds <= 0:
            raise ConfigError(f"[status] linktest seconds={seconds} must be positive")
        if not self._linktest_running.acquire(timeout=linktest.MAX_SECONDS + IO_TIMEOUT_S):
            raise MCCLError("[status] another linktest is still running on this host; retry later")
        try:
            result = linktest.measure_goodput(target, self._key, seconds, streams)
        finally:
            self._linktest_running.release()
        peer = result["peer_address"]
        self._record_ceiling(peer, result["bits_per_s"])
        with self._lock:
            self._linktests[peer] = result
        log.info("linktest to %s (%s): %.3f Gbit/s over %d streams", peer, target,
                 result["bits_per_s"] / 1e9, streams)
        return result

    def _warn_once(self, peer: str, message: str) -> None:
        self._once.warn(peer.rsplit(":", 1)[0], "%s", message)
