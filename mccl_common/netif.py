"""Which network interface and address the daemon uses.

Links must run over a wired interface: Wi-Fi's latency jitter stalls every ring step,
so a Wi-Fi interface is refused unless MCCL_ALLOW_WIFI=1.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
import subprocess
import sys
from pathlib import Path

from .errors import ConfigError

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def is_wireless(ifname: str) -> bool:
    if sys.platform == "darwin":
        return ifname in _macos_wifi_devices()
    base = Path("/sys/class/net") / ifname
    return (base / "wireless").exists() or (base / "phy80211").exists()


def _macos_wifi_devices() -> set[str]:
    try:
        out = subprocess.run(["networksetup", "-listallhardwareports"], capture_output=True,
                             text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    devices, port = set(), ""
    for line in out.splitlines():
        if line.startswith("Hardware Port:"):
            port = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and port in ("Wi-Fi", "AirPort"):
            devices.add(line.split(":", 1)[1].strip())
    return devices


def ipv4_of(ifname: str) -> str | None:
    """The first IPv4 address of an interface, or None if it has none."""
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["ifconfig", ifname], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "inet":
                return parts[1]
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def interface_of(addr: str) -> str:
    """The name of the interface holding IPv4 ``addr`` ("" if none does): what an address given
    by MCCL_LISTEN_ADDR is on, for checks and messages that name the interface."""
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        return ""
    return next((n for n in names if ipv4_of(n) == addr), "")


# Never links: tunnels, Apple peer-to-peer Wi-Fi, bridges and container plumbing.
_VIRTUAL = ("lo", "utun", "awdl", "llw", "gif", "stf", "anpi", "ap", "bridge", "docker", "veth", "virbr",
            "tun", "tap", "br-", "ifb")


def _candidates() -> list[str]:
    """Interfaces in the order they are tried: Ethernet-like names first."""
    names = [n for _, n in socket.if_nameindex() if not n.startswith(_VIRTUAL)]
    return sorted(names, key=lambda n: (not n.startswith(("en", "eth")), n))


def choose_address(iface: str, listen_addr: str, allow_wifi: bool) -> tuple[str, str]:
    """(interface name or "", IPv4 address) the daemon should listen and advertise on."""
    if listen_addr:
        try:
            ipaddress.IPv4Address(listen_addr)
        except ValueError:
            raise ConfigError(f"[config] MCCL_LISTEN_ADDR={listen_addr!r} is not an IPv4 address; "
                              "give a dotted address or set MCCL_IFACE instead") from None
        return iface, listen_addr
    names = [iface] if iface else _candidates()
    skipped_wifi = []
    for name in names:
        if is_wireless(name) and not allow_wifi:
            if iface:
                raise ConfigError(f"[config] MCCL_IFACE={iface} is a Wi-Fi interface; collectives over "
                                  "Wi-Fi are slow and jittery. Use a wired (10 GbE/Thunderbolt) "
                                  "interface, or set MCCL_ALLOW_WIFI=1 to use it anyway")
            skipped_wifi.append(name)
            continue
        addr = ipv4_of(name)
        if addr and (iface or not addr.startswith("169.254.")):  # link-local: no DHCP, likely unplugged
            return name, addr
        if iface:
            raise ConfigError(f"[config] MCCL_IFACE={iface} has no IPv4 address (down or missing?); "
                              "bring it up or pick another interface")
    hint = f" (skipped Wi-Fi: {', '.join(skipped_wifi)}; MCCL_ALLOW_WIFI=1 allows it)" if skipped_wifi else ""
    raise ConfigError(f"[config] no wired interface with an IPv4 address found{hint}; "
                      "set MCCL_IFACE or MCCL_LISTEN_ADDR")
