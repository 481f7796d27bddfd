"""This daemon's switch: named in MCCL_TOPOLOGY, else inferred from RTTs to the fleet.

Inference (mccl_common/topology.py does the arithmetic): the daemon measures the round trip
of an echo over its authenticated link to a fixed sample of the fleet (``measure_row``: every
peer up to MCCL_TOPOLOGY_PROBES, that many beyond), the smallest of a few tries each, then
asks the peers it measured for their rows and clusters the union. Its switch is the cluster
it falls in, named after the cluster's first host, so daemons that saw the same RTTs give
their switch the same name. Each rank passes its daemon's switch into the job's host list
(libmccl/daemon/attach.py), which every rank builds alike from the store, so the daemons'
engine groups its ranks by switch the same way everywhere (build_engine).

The echo carries PROBE_BYTES each way, so a round trip is a few packets: an idle RTT on
emulated links (no netem on some kernels) shows no switch hop, but a line-rate uplink does.
It costs at most probes x SAMPLES echoes per daemon when the fleet changes, and one small
row request per measured peer a little later; the fleet's rows are re-gathered every
MCCL_TOPOLOGY_INTERVAL.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable

from mccl_common import topology
from mccl_common.errors import MCCLError

log = logging.getLogger(__name__)

PROBE_BYTES = 32 << 10
SAMPLES = 3
ECHO_TIMEOUT_S = 2.0
_TICK_S = 1.0
_SETTLE_S = 1.0          # after the peer set changed, before measuring (more daemons may show up)
_GATHER_FAST_S = 3.0     # gathering rows this often for a while after a change
_FAST_FOR_S = 60.0
_MAX_ROW = 256           # entries taken from a peer's row


class SwitchMap:
    def __init__(self, host_id: str, addr: str, links: Any, peers: Callable[[], dict[str, str]],
                 topology_path: str = "", probes: int = 48, interval_s: float = 300.0):
        """``peers()``: the fleet's other daemons, host id -> link address (discovery)."""
        self.host_id = host_id
        self.addr = addr
        self._links = links
        self._peers = peers
        self._probes = probes
        self._interval_s = interval_s
        self.configured = topology.load(topology_path) if topology_path else None
        self._lock = threading.Lock()
        self._pongs: dict[str, threading.Event] = {}
        self._row: dict[str, float] = {}
        self._rows: dict[str, dict[str, float]] = {}   # peers' rows, by host
        self._groups: dict[str, list[str]] = {}
        self._label = ""
        self._measured_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.configured is not None and self._configured_switch() is None:
            log.warning("[topology] %s names no switch for this host (%s, %s, %s); it runs its jobs flat",
                        self.configured.source, host_id, socket.gethostname(), addr)

    # -- what others ask ---------------------------------------------------------------------
    def switch(self) -> str:
        """This host's switch ('' while unknown: its jobs then run flat)."""
        if self.configured is not None:
            return self._configured_switch() or ""
        with self._lock:
            return self._label

    def status(self) -> dict[str, Any]:
        switch = self.switch()
        with self._lock:
            return {"host": self.host_id, "switch": switch,
                    "source": "file" if self.configured is not None else "rtt",
                    "configured": ({k: list(v) for k, v in self.configured.switches.items()}
                                   if self.configured is not None else None),
                    "row": dict(self._row), "measured_at": self._measured_at or None,
                    "probe_bytes": PROBE_BYTES}

    def _configured_switch(self) -> str | None:
        assert self.configured is not None
        ip = self.addr.rsplit(":", 1)[0] if self.addr.count(":") == 1 else self.addr
        return self.configured.switch_of(self.host_id, socket.gethostname(), ip)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "SwitchMap":
        if self.configured is None:
            self._thread = threading.Thread(target=self._loop, name="mccld-topology", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _loop(self) -> None:
        known: frozenset[str] = frozenset()
        changed_at = last_gather = 0.0
        while not self._stop.wait(_TICK_S):
            try:
                peers = self._peers()
                now = time.monotonic()
                if frozenset(peers) != known:
                    if not changed_at:
                        changed_at = now
                    if now - changed_at < _SETTLE_S:
                        continue
                    known, changed_at = frozenset(peers), 0.0
                    self._measure(peers)
                    last_gather = 0.0
                fast = now - self._measured_at < _FAST_FOR_S
                if self._row and now - last_gather >= (_GATHER_FAST_S if fast else self._interval_s):
                    last_gather = now
                    self._gather(peers)
            except Exception:  # noqa: BLE001 - the loop must survive anything; the next tick retries
                log.exception("[topology] inference round failed")

    # -- measuring ---------------------------------------------------------------------------
    def _measure(self, peers: dict[str, str]) -> None:
        hosts = [self.host_id, *peers]
        row = topology.measure_row(self.host_id, hosts, lambda h: self.rtt(peers[h]), self._probes)
        with self._lock:
            self._row = row
            self._measured_at = time.monotonic()
        self._recompute()
        log.info("[topology] measured RTTs to %d of %d peers", len(row), len(peers))

    def rtt(self, addr: str) -> float | None:
        """Smallest round trip of SAMPLES echoes to the daemon at ``addr``; None if it cannot."""
        best = None
        for _ in range(SAMPLES):
            nonce = os.urandom(8).hex()
            ev = threading.Event()
            with self._lock:
                self._pongs[nonce] = ev
            try:
                # Dialled quietly and before the clock starts: the peers come from the fleet
                # table, which holds whatever mDNS heard (a host of another fleet key included,
                # whose refusal the gossip and the link listener already report).
                link = self._links.link_to(addr, quiet=True)
                t0 = time.perf_counter()
                link.send({"type": "rtt_ping", "nonce": nonce, "pad": "0" * PROBE_BYTES})
                if not ev.wait(ECHO_TIMEOUT_S):
                    continue
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            except MCCLError as e:
                log.debug("[topology] no RTT to %s: %s", addr, e)
                return best
            finally:
                with self._lock:
                    self._pongs.pop(nonce, None)
        return best

    def _gather(self, peers: dict[str, str]) -> None:
        with self._lock:
            targets = [h for h in self._row if h in peers]
        for h in targets:
            try:
                self._links.link_to(peers[h], quiet=True).send({"type": "topo_row_req"})
            except MCCLError as e:
                log.debug("[topology] cannot ask %s for its row: %s", h, e)

    def _recompute(self) -> None:
        with self._lock:
            rtt = {(self.host_id, h): v for h, v in self._row.items()}
            for peer, row in self._rows.items():
                rtt.update({(peer, h): v for h, v in row.items()})
            hosts = sorted({h for pair in rtt for h in pair} | {self.host_id})
        groups = topology.cluster_by_rtt(hosts, rtt)
        label = next((name for name, members in groups.items() if self.host_id in members), "")
        with self._lock:
            if label != self._label:
                log.info("[topology] this host is on switch %s (%d switches among %d hosts)", label,
                         len(groups), len(hosts))
            self._groups, self._label = groups, label

    # -- link messages -----------------------------------------------------------------------
    def on_message(self, peer_host: str, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "rtt_ping":
            self._reply(peer_host, {"type": "rtt_pong", "nonce": str(msg.get("nonce"))[:32],
                                    "pad": "0" * PROBE_BYTES})
        elif kind == "rtt_pong":
            with self._lock:
                ev = self._pongs.get(str(msg.get("nonce")))
            if ev is not None:
                ev.set()
        elif kind == "topo_row_req":
            with self._lock:
                row = dict(self._row)
            self._reply(peer_host, {"type": "topo_row", "row": row})
        elif kind == "topo_row":
            row = msg.get("row")
            if not isinstance(row, dict):
                return
            clean = {str(h)[:255]: float(v) for h, v in list(row.items())[:_MAX_ROW]
                     if isinstance(v, (int, float)) and 0 < v < 60}
            with self._lock:
                self._rows[peer_host] = clean
            self._recompute()

    def _reply(self, peer_host: str, msg: dict[str, Any]) -> None:
        addr = next((p["peer"] for p in self._links.peers() if p["host"] == peer_host), None)
        if addr is None:
            return
        try:
            self._links.send(addr, msg)
        except MCCLError as e:
            log.debug("[topology] cannot answer %s: %s", peer_host, e)


def fleet_peers(rows: list[dict[str, Any]], host_id: str) -> dict[str, str]:
    """The other daemons of the fleet table (mDNS and gossip rows), host id -> link address."""
    out: dict[str, str] = {}
    for e in rows:
        if e.get("host_id") and e["host_id"] != host_id and e.get("addresses") and e.get("port"):
            out[e["host_id"]] = f"{e['addresses'][0]}:{e['port']}"
    return out
