"""What daemons tell each other about the fleet, beyond one subnet: MCCL_PEERS seeds and the
gossip messages that spread fleet tables over the authenticated daemon links (mccld/net/gossip.py).

Messages (JSON over a link, after the fleet-key handshake; mccld/net/auth.py)::

    {"type": "gossip_digest", "digest": [[host_id, incarnation, counter], ...]}
    {"type": "gossip_entries", "entries": [ENTRY, ...], "want": [host_id, ...]}

A digest says which version of each entry the sender holds. The receiver answers with the
entries it holds newer (or the sender lacks) and names the ones it wants; the sender's answer to
a ``want`` carries no ``want`` of its own, so an exchange is at most three messages.

An ENTRY is what mDNS announces on one subnet (mccl_common/discovery.py) plus its version:
``incarnation`` (the owner's start time in ms: a restarted daemon outranks its old entry) and
``counter`` (bumped by the owner on every heartbeat). Only the owner makes a new version of its
entry; everyone else relays it unchanged, so a relay cannot make an entry younger than its owner
did. ``check_digest`` / ``check_entries`` validate a message once at the boundary: anything that
is not exactly this shape, within these bounds, is refused as a whole (ValueError naming what).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import asdict, dataclass
from typing import Any

from .errors import ConfigError

DIGEST = "gossip_digest"
ENTRIES = "gossip_entries"

MAX_TABLE = 4096              # hosts one daemon's gossip table holds
MAX_ENTRIES_PER_MESSAGE = 256  # ~300 bytes each: a message stays far below the link's 1 MiB frame
MAX_ADDRESSES = 8
MAX_SEEDS = 64
MAX_SEED_ADDRESSES = 16       # addresses one seed name may resolve to (a DNS round robin)
# An incarnation is the owner's start time; one further ahead of our clock than this is refused
# (a clock that wrong, or a member forging an entry that would outrank its owner's for good).
MAX_FUTURE_MS = 3600_000
MAX_COUNTER = 1 << 53

_HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TEXT = re.compile(r"^[A-Za-z0-9 ._:+/-]{0,64}$")
_STATES = ("", "idle", "training")
_HARVEST = ("", "busy", "idle", "leased", "draining")
_SEED_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?$")


@dataclass(frozen=True)
class Entry:
    host_id: str
    incarnation: int
    counter: int
    fleet: str
    proto: int
    addresses: tuple[str, ...]
    port: int
    status_port: int
    metrics_port: int
    cores: int
    memory: int
    device: str
    state: str
    harvest: str
    version: str

    @property
    def key(self) -> tuple[int, int]:
        return (self.incarnation, self.counter)

    @property
    def link_addr(self) -> str:
        return f"{self.addresses[0]}:{self.port}"

    def wire(self) -> dict[str, Any]:
        return {**asdict(self), "addresses": list(self.addresses)}

    def table_row(self) -> dict[str, Any]:
        """The shape of a discovery.FleetTable entry (what status and mcclctl read)."""
        return {"host_id": self.host_id, "fleet": self.fleet, "proto": self.proto,
                "addresses": list(self.addresses), "port": self.port, "cores": self.cores,
                "memory": self.memory, "device": self.device, "state": self.state, "harvest": self.harvest,
                "version": self.version, "name": self.host_id, "status_port": self.status_port,
                "metrics_port": self.metrics_port, "source": "gossip"}


def _int(obj: dict, field: str, lo: int, hi: int) -> int:
    v = obj.get(field)
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{field}={str(v)[:32]!r} is not an integer in {lo}..{hi}")
    return v


def _str(obj: dict, field: str, pattern: re.Pattern, allowed: tuple[str, ...] | None = None) -> str:
    v = obj.get(field)
    if not isinstance(v, str) or not pattern.fullmatch(v) or (allowed is not None and v not in allowed):
        raise ValueError(f"{field}={str(v)[:32]!r} is malformed")
    return v


def check_ipv4(text: Any) -> str:
    """A dotted IPv4 unicast address a daemon may be dialled on; ValueError otherwise."""
    if not isinstance(text, str) or len(text) > 15:
        raise ValueError(f"address {str(text)[:32]!r} is not IPv4")
    addr = ipaddress.IPv4Address(text)   # ValueError on anything else
    if addr.is_multicast or addr.is_unspecified or addr == ipaddress.IPv4Address("255.255.255.255"):
        raise ValueError(f"address {text} is not a unicast host address")
    return str(addr)


def check_entry(obj: Any, fleet: str, now_ms: int) -> Entry:
    if not isinstance(obj, dict) or len(obj) > 24:
        raise ValueError("an entry is not an object of the expected fields")
    addresses = obj.get("addresses")
    if not isinstance(addresses, list) or not 1 <= len(addresses) <= MAX_ADDRESSES:
        raise ValueError(f"addresses must be a list of 1..{MAX_ADDRESSES} IPv4 addresses")
    if obj.get("fleet") != fleet:
        raise ValueError(f"entry of fleet {str(obj.get('fleet'))[:32]!r}, we are {fleet!r}")
    entry = Entry(
        host_id=_str(obj, "host_id", _HOST_ID),
        incarnation=_int(obj, "incarnation", 0, now_ms + MAX_FUTURE_MS),
        counter=_int(obj, "counter", 0, MAX_COUNTER), fleet=fleet, proto=_int(obj, "proto", 0, 1 << 16),
        addresses=tuple(check_ipv4(a) for a in addresses), port=_int(obj, "port", 1, 65535),
        status_port=_int(obj, "status_port", 0, 65535), metrics_port=_int(obj, "metrics_port", 0, 65535),
        cores=_int(obj, "cores", 0, 1 << 20), memory=_int(obj, "memory", 0, 1 << 60),
        device=_str(obj, "device", _TEXT), state=_str(obj, "state", _TEXT, _STATES),
        harvest=_str(obj, "harvest", _TEXT, _HARVEST), version=_str(obj, "version", _TEXT))
    return entry


def check_entries(msg: dict, fleet: str, now_ms: int) -> tuple[list[Entry], list[str]]:
    """A gossip_entries message: its entries and the host ids it wants; ValueError if malformed."""
    entries, want = msg.get("entries"), msg.get("want", [])
    if not isinstance(entries, list) or len(entries) > MAX_ENTRIES_PER_MESSAGE:
        raise ValueError(f"entries must be a list of at most {MAX_ENTRIES_PER_MESSAGE}")
    if not isinstance(want, list) or len(want) > MAX_TABLE:
        raise ValueError(f"want must be a list of at most {MAX_TABLE} host ids")
    out = [check_entry(e, fleet, now_ms) for e in entries]
    if len({e.host_id for e in out}) != len(out):
        raise ValueError("an entry is repeated")
    for h in want:
        if not isinstance(h, str) or not _HOST_ID.fullmatch(h):
            raise ValueError(f"want names {str(h)[:32]!r}, not a host id")
    return out, want


def check_digest(msg: dict, now_ms: int) -> dict[str, tuple[int, int]]:
    """A gossip_digest message as {host_id: (incarnation, counter)}; ValueError if malformed."""
    digest = msg.get("digest")
    if not isinstance(digest, list) or len(digest) > MAX_TABLE:
        raise ValueError(f"digest must be a list of at most {MAX_TABLE} rows")
    out: dict[str, tuple[int, int]] = {}
    for row in digest:
        if (not isinstance(row, list) or len(row) != 3 or not isinstance(row[0], str) or not _HOST_ID.fullmatch(row[0])
                or type(row[1]) is not int or type(row[2]) is not int
                or not 0 <= row[1] <= now_ms + MAX_FUTURE_MS or not 0 <= row[2] <= MAX_COUNTER):
            raise ValueError(f"digest row {str(row)[:64]!r} is not [host id, incarnation, counter]")
        out[row[0]] = (row[1], row[2])
    return out


# ---- seeds ----------------------------------------------------------------------------------

def parse_peers(text: str, default_port: int) -> list[tuple[str, int]]:
    """MCCL_PEERS ("a.example:29650, 10.1.2.3, b") as [(host, port)]; ConfigError naming the bad entry."""
    out: list[tuple[str, int]] = []
    if not text.strip():
        return out
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise ConfigError(f"[config] MCCL_PEERS={text!r} has an empty entry; use host[:port], comma-separated")
        host, sep, port_text = item.rpartition(":")
        if not sep:
            host, port_text = item, ""
        port = default_port
        if port_text:
            if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
                raise ConfigError(f"[config] MCCL_PEERS entry {item!r} has port {port_text!r}, not 1-65535; "
                                  "use host[:port], comma-separated")
            port = int(port_text)
        if not _valid_seed_host(host):
            raise ConfigError(f"[config] MCCL_PEERS entry {item!r} is not host[:port] (an IPv4 address or a DNS "
                              "name); use e.g. MCCL_PEERS=mccl-seeds.example.net,10.2.0.5:29650")
        out.append((host, port))
    if len(out) > MAX_SEEDS:
        raise ConfigError(f"[config] MCCL_PEERS names {len(out)} seeds, at most {MAX_SEEDS}; a few per subnet "
                          "are enough (gossip finds the rest), or use one DNS name with several addresses")
    return out


def _valid_seed_host(host: str) -> bool:
    if not host or len(host) > 253:
        return False
    try:
        check_ipv4(host)
        return True
    except ValueError:
        pass
    # Digits and dots only, yet not an address (300.1.1.1, 10.1): a typo, not a name.
    return bool(_SEED_HOST.fullmatch(host)) and not host.replace(".", "").isdigit()


def resolve_seed(host: str, port: int) -> list[str]:
    """The link addresses (ip:port) of a seed; a name may resolve to several (at most
    MAX_SEED_ADDRESSES). OSError when it does not resolve. getaddrinfo blocks: call it off the
    daemon's critical threads (mccld/net/gossip.py runs it in its bounded dial pool)."""
    infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    addrs = sorted({info[4][0] for info in infos})
    return [f"{a}:{port}" for a in addrs[:MAX_SEED_ADDRESSES]]
