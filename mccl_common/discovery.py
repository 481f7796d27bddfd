"""Zero-configuration discovery: every daemon advertises ``_mccl._tcp.local.`` over
mDNS (python-zeroconf) and keeps a live table of the daemons of its fleet.

TXT record: fleet, proto, host (id), addrs, cores, mem (bytes), device, state
(idle/training: whether a job runs on the daemon), harvest (busy/idle/leased/draining:
whether the host's user left it to the fleet, docs/harvesting.md; empty: a daemon that
predates harvesting), ver, sport / mport (status and metrics ports; 0: disabled).
Records carry MCCL_MDNS_TTL; a host that vanishes without a goodbye packet drops out of
every table when its records expire.

mDNS is unauthenticated: anyone on the LAN can announce as many services as it likes. The
names waiting to be resolved (MAX_PENDING, each once) and the table (MAX_HOSTS) are
bounded, so a flood of announcements costs bounded memory and resolver time; past the
table's bound new names are ignored (logged once a minute) until known ones leave.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from typing import Any, Callable

from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from .errors import MCCLError
from .hostinfo import cpu_cores, device_kind, memory_bytes

from . import PROTO_VERSION, __version__

log = logging.getLogger(__name__)

SERVICE_TYPE = "_mccl._tcp.local."
_RESOLVE_TIMEOUT_MS = 3000
MAX_HOSTS = 1024          # daemons one table holds (a fleet larger than this is not one LAN's)
MAX_PENDING = 1024        # distinct names waiting to be resolved
_REWARN_S = 60.0


def _entry(info: ServiceInfo) -> dict[str, Any] | None:
    props = {k.decode(errors="replace"): (v or b"").decode(errors="replace")
             for k, v in (info.properties or {}).items()}
    if "fleet" not in props or "host" not in props:
        return None

    def num(key: str) -> int:
        try:
            return int(props.get(key, "0"))
        except ValueError:
            return 0
    return {
        "host_id": props["host"], "fleet": props["fleet"], "proto": num("proto"),
        "addresses": [a for a in props.get("addrs", "").split(",") if a] or info.parsed_addresses(),
        "port": info.port, "cores": num("cores"), "memory": num("mem"), "device": props.get("device", ""),
        "state": props.get("state", ""), "harvest": props.get("harvest", ""),
        "version": props.get("ver", ""), "name": info.name,
        "status_port": num("sport"), "metrics_port": num("mport"),
        "seen_at": time.time(),
    }


class FleetTable:
    """Browses the LAN for daemons of ``fleet`` (None: every fleet); explicit start/stop."""

    def __init__(self, fleet: str | None, interfaces: list[str] | None = None,
                 on_change: Callable[[str, dict | None], None] | None = None, ttl_s: float = 60.0):
        self.fleet = fleet
        self._recheck_s = max(1.0, ttl_s / 2)
        self._interfaces = interfaces
        self._on_change = on_change or (lambda host, entry: None)
        self._entries: dict[str, dict[str, Any]] = {}   # service name -> entry
        self._lock = threading.Lock()
        self._todo: queue.Queue = queue.Queue(maxsize=MAX_PENDING)
        self._pending: set[str] = set()              # names in _todo: each waits once
        self._dropped = 0                           # announcements ignored: queue or table full
        self._warned_at = -_REWARN_S
        self._stop = threading.Event()
        self.zc: Zeroconf | None = None
        self._browser: ServiceBrowser | None = None
        self._resolver: threading.Thread | None = None

    def start(self) -> None:
        try:
            self.zc = Zeroconf(interfaces=self._interfaces or __import__("zeroconf").InterfaceChoice.All,
                               ip_version=IPVersion.V4Only)
        except OSError as e:
            raise MCCLError(f"[discovery] cannot open mDNS on {self._interfaces or 'all interfaces'}: {e}; "
                            "multicast may be blocked on this interface") from None
        self._resolver = threading.Thread(target=self._resolve_loop, name="mccld-mdns-resolve", daemon=True)
        self._resolver.start()
        self._browser = ServiceBrowser(self.zc, SERVICE_TYPE, handlers=[self._on_service])

    def stop(self) -> None:
        self._stop.set()
        if self._browser is not None:
            self._browser.cancel()
            self._browser = None
        if self._resolver is not None:
            self._resolver.join(timeout=_RESOLVE_TIMEOUT_MS / 1000 + 1)
            self._resolver = None
        if self.zc is not None:
            self.zc.close()
            self.zc = None

    def entries(self) -> list[dict[str, Any]]:
        with self._lock:
            return sorted((dict(e) for e in self._entries.values()), key=lambda e: e["host_id"])

    def _on_service(self, zeroconf: Zeroconf, service_type: str, name: str,
                    state_change: ServiceStateChange) -> None:
        # Called on zeroconf's thread: resolve elsewhere, never block it.
        if state_change is ServiceStateChange.Removed:
            with self._lock:
                entry = self._entries.pop(name, None)
            if entry is not None:
                log.info("fleet: %s left (goodbye or TTL expiry)", entry["host_id"])
                self._on_change(entry["host_id"], None)
        else:
            self._enqueue(name)

    def _enqueue(self, name: str) -> None:
        """Queue ``name`` for resolving, unless it already waits or the queue is full (a flood:
        dropped, and counted; a real daemon re-announces, and known ones are rechecked anyway)."""
        with self._lock:
            if name in self._pending:
                return
            try:
                self._todo.put_nowait(name)
            except queue.Full:
                self._flooded("the resolve queue is full")
                return
            self._pending.add(name)

    def _flooded(self, why: str) -> None:
        # Under self._lock.
        self._dropped += 1
        now = time.monotonic()
        level = logging.DEBUG
        if now - self._warned_at >= _REWARN_S:
            self._warned_at, level = now, logging.WARNING
        log.log(level, "[discovery] ignoring an mDNS announcement: %s (%d ignored so far; %d hosts known, at most "
                "%d); something on the LAN floods _mccl._tcp announcements", why, self._dropped, len(self._entries),
                MAX_HOSTS)

    def _resolve_loop(self) -> None:
        next_check = time.monotonic() + self._recheck_s
        while not self._stop.is_set():
            if time.monotonic() >= next_check:
                # A host that died without a goodbye stops answering; once its records'
                # TTL has run out of the cache, resolving it fails and it is dropped.
                with self._lock:
                    names = list(self._entries)
                for name in names:
                    self._enqueue(name)
                next_check = time.monotonic() + self._recheck_s
            try:
                name = self._todo.get(timeout=0.5)
            except queue.Empty:
                continue
            with self._lock:
                self._pending.discard(name)
            zc = self.zc
            if zc is None:
                return
            try:
                info = zc.get_service_info(SERVICE_TYPE, name, timeout=_RESOLVE_TIMEOUT_MS)
            except Exception as e:  # noqa: BLE001 - zeroconf raises on shutdown; keep resolving others
                log.debug("resolving %s failed: %s", name, e)
                continue
            entry = _entry(info) if info is not None else None
            if entry is None:
                with self._lock:
                    gone = self._entries.pop(name, None)
                if gone is not None:
                    log.info("fleet: %s expired (no answer after its TTL)", gone["host_id"])
                    self._on_change(gone["host_id"], None)
                continue
            if self.fleet is not None and entry["fleet"] != self.fleet:
                continue
            with self._lock:
                old = self._entries.get(name)
                if old is None and len(self._entries) >= MAX_HOSTS:
                    self._flooded("the fleet table is full")
                    continue
                self._entries[name] = entry
            if old is None:
                log.info("fleet: %s joined (%s, %s)", entry["host_id"], ",".join(entry["addresses"]),
                         entry["device"])
            if old is None or {**old, "seen_at": 0} != {**entry, "seen_at": 0}:
                self._on_change(entry["host_id"], entry)


class Advertiser:
    """Announces this daemon on a FleetTable's zeroconf instance; ``set_state`` re-announces."""

    def __init__(self, zc: Zeroconf, fleet: str, host_id: str, addr: str, port: int, ttl_s: int,
                 status_port: int = 0, metrics_port: int = 0):
        self._zc = zc
        self._sport, self._mport = status_port, metrics_port
        self._fleet, self._host_id, self._addr, self._port, self._ttl = fleet, host_id, addr, port, ttl_s
        self._state = "idle"
        self._harvest = "busy"
        self._info: ServiceInfo | None = None
        self._lock = threading.Lock()

    def _make_info(self) -> ServiceInfo:
        props = {"fleet": self._fleet, "proto": str(PROTO_VERSION), "host": self._host_id, "addrs": self._addr,
                 "cores": str(cpu_cores()), "mem": str(memory_bytes()), "device": device_kind(),
                 "state": self._state, "harvest": self._harvest, "ver": __version__, "sport": str(self._sport),
                 "mport": str(self._mport)}
        return ServiceInfo(SERVICE_TYPE, f"{self._host_id}.{SERVICE_TYPE}",
                           addresses=[socket.inet_aton(self._addr)], port=self._port, properties=props,
                           server=f"{self._host_id}.local.", host_ttl=self._ttl, other_ttl=self._ttl)

    def start(self) -> None:
        with self._lock:
            self._info = self._make_info()
            try:
                self._zc.register_service(self._info, ttl=self._ttl)
            except Exception as e:  # noqa: BLE001 - NonUniqueNameException and friends
                raise MCCLError(f"[discovery] cannot advertise {self._host_id} on mDNS: {e}; another host "
                                "may use the same MCCL_HOST_ID") from None
        log.info("advertising %s on mDNS (%s:%d, fleet %s)", self._host_id, self._addr, self._port, self._fleet)

    def set_state(self, state: str) -> None:
        self._update("_state", state)

    def set_harvest(self, harvest: str) -> None:
        self._update("_harvest", harvest)

    def _update(self, attr: str, value: str) -> None:
        with self._lock:
            if self._info is None or getattr(self, attr) == value:
                return
            setattr(self, attr, value)
            self._info = self._make_info()
            try:
                self._zc.update_service(self._info)
            except Exception as e:  # noqa: BLE001 - a missed state update is cosmetic
                log.debug("mDNS state update failed: %s", e)

    def stop(self) -> None:
        with self._lock:
            info, self._info = self._info, None
        if info is not None:
            try:
                self._zc.unregister_service(info)  # goodbye: peers drop us at once
            except Exception as e:  # noqa: BLE001 - zeroconf may already be closing
                log.debug("mDNS unregister failed: %s", e)


def browse_fleet(timeout_s: float = 2.0, fleet: str | None = None,
                 interfaces: list[str] | None = None) -> list[dict[str, Any]]:
    """Daemons seen on the LAN within ``timeout_s`` (for ``mcclctl``)."""
    table = FleetTable(fleet, interfaces)
    table.start()
    try:
        time.sleep(timeout_s)
        return table.entries()
    finally:
        table.stop()
