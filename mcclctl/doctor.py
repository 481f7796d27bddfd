"""``mcclctl doctor``: checks of this host that explain most slow or failing fleets.

Each check returns ``{"name", "status": ok|warn|fail|skip, "detail", "fix"}``; the
checks read the system through small functions with injectable roots so they can be
tested against fake /proc and /sys trees.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Callable

from mccl_common.errors import ConfigError
from mccl_common.settings import EngineConfig, load

SKEW_WARN_S = 0.5     # beyond this, log lines and timeouts of two hosts no longer line up
CONNECT_TIMEOUT_S = 2.0


def check(name: str, status: str, detail: str, fix: str = "") -> dict:
    return {"name": name, "status": status, "detail": detail, "fix": fix}


# ---- interface, speed, MTU -------------------------------------------------------------

def read_sys(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def interface_checks(ifname: str, addr: str, sys_root: Path = Path("/sys/class/net")) -> list[dict]:
    out = [check("interface", "ok", f"{ifname} with address {addr}")]
    if sys.platform == "darwin":
        speed, mtu = _macos_media(ifname)
    else:
        raw_speed = read_sys(sys_root / ifname / "speed")
        speed = int(raw_speed) if raw_speed and raw_speed.lstrip("-").isdigit() else None
        raw_mtu = read_sys(sys_root / ifname / "mtu")
        mtu = int(raw_mtu) if raw_mtu and raw_mtu.isdigit() else None
    if speed is None or speed <= 0:
        out.append(check("link speed", "skip", f"the OS does not report a speed for {ifname} "
                         "(virtual interface?)"))
    elif speed < 10000:
        out.append(check("link speed", "warn", f"{ifname} negotiated {speed} Mbit/s",
                         "use a 10 GbE (or Thunderbolt) port and cable; check the switch port with "
                         f"`ethtool {ifname}` (Linux) or System Settings > Network > Hardware (macOS)"))
    else:
        out.append(check("link speed", "ok", f"{ifname} at {speed / 1000:g} Gbit/s"))
    if mtu is None:
        out.append(check("MTU", "skip", f"cannot read the MTU of {ifname}"))
    elif mtu < 9000:
        out.append(check("MTU", "warn", f"{ifname} MTU {mtu}; jumbo frames cut per-packet CPU cost "
                         "at 10 Gbit/s",
                         f"if every host and the switch support it: `ip link set {ifname} mtu 9000` "
                         f"(Linux) or `networksetup -setMTU <service> 9000` (macOS), on ALL hosts"))
    else:
        out.append(check("MTU", "ok", f"{ifname} MTU {mtu}"))
    return out


def _macos_media(ifname: str) -> tuple[int | None, int | None]:
    try:
        text = subprocess.run(["ifconfig", ifname], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    speed = mtu = None
    for line in text.splitlines():
        parts = line.split()
        if "mtu" in parts:
            mtu = int(parts[parts.index("mtu") + 1])
        if line.strip().startswith("media:"):
            for token, mbit in (("10Gbase", 10000), ("5000base", 5000), ("2500base", 2500),
                                ("1000base", 1000), ("100base", 100)):
                if token in line:
                    speed = mbit
                    break
    return speed, mtu


# ---- socket buffers --------------------------------------------------------------------

def buffer_checks(wanted: int, sysctl: Callable[[str], int | None]) -> list[dict]:
    if sys.platform == "darwin":
        limit = sysctl("kern.ipc.maxsockbuf")
        if limit is None:
            return [check("socket buffers", "skip", "cannot read kern.ipc.maxsockbuf")]
        if limit < wanted:
            return [check("socket buffers", "warn", f"kern.ipc.maxsockbuf={limit} < {wanted} bytes "
                          "that MCCL asks for per socket",
                          f"sudo sysctl -w kern.ipc.maxsockbuf={wanted * 2}")]
        return [check("socket buffers", "ok", f"kern.ipc.maxsockbuf={limit}")]
    out = []
    for name in ("net.core.rmem_max", "net.core.wmem_max"):
        limit = sysctl(name)
        if limit is None:
            out.append(check(name, "skip", f"cannot read {name}"))
        elif limit < wanted:
            out.append(check(name, "warn", f"{name}={limit} caps SO_RCVBUF/SO_SNDBUF below the "
                             f"{wanted} bytes MCCL asks for (MCCL_SOCKET_BUFFER_BYTES); a 10 GbE "
                             "link then cannot keep its bandwidth-delay product in flight",
                             f"sudo sysctl -w {name}={wanted}  (persist it in /etc/sysctl.d/90-mccl.conf)"))
        else:
            out.append(check(name, "ok", f"{name}={limit}"))
    return out


def read_sysctl(name: str, proc_root: Path = Path("/proc/sys")) -> int | None:
    if sys.platform.startswith("linux"):
        raw = read_sys(proc_root / name.replace(".", "/"))
    else:
        try:
            raw = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True,
                                 timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            raw = None
    try:
        return int(raw.split()[0]) if raw else None
    except ValueError:
        return None


# ---- ports -----------------------------------------------------------------------------

def can_connect(addr: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when a TCP connection succeeds, else why not."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return None
    except OSError as e:
        return e.strerror or str(e)


def is_listening(addr: str, port: int) -> bool:
    """Whether something listens on addr:port, found by failing to bind it.

    Connecting would do too, but the daemon's link listener would then log a failed
    handshake from us; a bind without SO_REUSEADDR touches nobody.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, port))
        except OSError:
            return True
    return False


def fetch_metrics(addr: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when /metrics answers with MCCL metrics, else why not."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://{addr}:{port}/metrics", timeout=timeout_s) as r:
            body = r.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))
    return None if "mccl_build_info" in body else "answers, but without mccl_build_info (not mccld?)"


def port_checks(addr: str, ports: dict[str, int], peers: list[tuple[str, str, int]],
                status_ok: str | None = None, metrics_addr: str = "", ports_from: str = "") -> list[dict]:
    """Local endpoints of mccld, then the peers' status endpoints.

    ``status_ok``: None if our own status endpoint answered an authenticated query,
    else why it did not (the caller asked it with the fleet key). ``ports_from``: where the
    ports came from (the daemon's own report, or this shell's settings), said in each check.
    """
    said = f" ({ports_from})" if ports_from else ""
    fix_local = ("start mccld on this host, or check that the MCCL_*_PORT settings of mccld and "
                 "mcclctl agree and that no firewall blocks the port")
    out = []
    for name, port in ports.items():
        if port == 0:
            out.append(check(f"{name} port", "skip", f"{name} endpoint disabled (port 0){said}"))
            continue
        where = addr
        if name == "metrics":
            # A wildcard bind answers on the fleet address; a specific one only there.
            where = metrics_addr if metrics_addr not in ("", "0.0.0.0") else addr
            why = fetch_metrics(where, port)
        elif name == "status" and status_ok is not None:
            why = status_ok
        else:
            why = None if is_listening(addr, port) else "nothing listens there"
        if why is None:
            out.append(check(f"{name} port", "ok", f"{where}:{port} answers{said}"))
        else:
            out.append(check(f"{name} port", "fail", f"{where}:{port}: {why}{said}", fix_local))
    for host, peer_addr, port in peers:
        why = can_connect(peer_addr, port)
        if why is None:
            out.append(check(f"peer {host}", "ok", f"status endpoint {peer_addr}:{port} reachable"))
        else:
            out.append(check(f"peer {host}", "fail", f"{peer_addr}:{port}: {why}",
                             f"check routing to {peer_addr} from the fleet interface, the firewall "
                             f"(macOS: System Settings > Network > Firewall must allow python/mccld) "
                             f"and that mccld runs there"))
    return out


# ---- clock skew ------------------------------------------------------------------------

def skew_checks(offsets: list[tuple[str, float | None, float | None]]) -> list[dict]:
    """``offsets``: (host, daemon clock - ours, round trip) per peer that answered."""
    out = []
    for host, offset, rtt in offsets:
        if offset is None:
            continue
        bound = (rtt or 0.0) / 2
        if abs(offset) - bound > SKEW_WARN_S:
            out.append(check(f"clock {host}", "warn",
                             f"{host}'s clock is {offset:+.3f} s off ours (+/- {bound:.3f} s)",
                             "enable NTP on every host (`timedatectl set-ntp true` / macOS: "
                             "System Settings > General > Date & Time > Set automatically)"))
        else:
            out.append(check(f"clock {host}", "ok", f"{offset:+.3f} s (+/- {bound:.3f} s)"))
    if not out:
        out.append(check("clock skew", "skip", "no peer daemon answered; cannot compare clocks"))
    return out


# ---- key file --------------------------------------------------------------------------

def key_checks(read_key: Callable[[], bytes], key_file: str) -> list[dict]:
    try:
        key = read_key()
    except ConfigError as e:
        return [check("fleet key", "fail", str(e),
                      "create one with `mccld keygen /etc/mccl/fleet.key`, copy it to every host, "
                      "and `chmod 600` it")]
    if key_file:
        mode = stat.S_IMODE(os.stat(key_file).st_mode)
        return [check("fleet key", "ok", f"{key_file} mode {mode:04o}, {len(key)} bytes")]
    return [check("fleet key", "ok", f"{len(key)}-byte key loaded (MCCL_FLEET_KEY or default path)")]


def engine_socket_buffer() -> int:
    return load(EngineConfig).socket_buffer_bytes


def daemon_endpoints(status: dict | None) -> dict | None:
    """The interface and ports the local daemon says it listens on (None: it did not say: an
    older mccld, or none answered)."""
    ends = (status or {}).get("endpoints")
    if not isinstance(ends, dict) or not ends.get("addr"):
        return None
    return ends


def cmd_doctor(args) -> int:
    from mccl_common.daemon_settings import load_config
    from mccl_common.netif import choose_address, interface_of

    from . import formatting as fmt
    from .targets import Fleet, fetch, find_fleet, from_hosts, wanted_fleet

    cfg = load_config()
    checks: list[dict] = []
    try:
        ifname, addr = choose_address(cfg.iface, cfg.listen_addr, cfg.allow_wifi)
        ifname = ifname or interface_of(addr)
        iface_error = None
    except ConfigError as e:
        ifname, addr, iface_error = "", "127.0.0.1", e
    key_file = cfg.key_file if args.key_file is None else args.key_file
    key = None

    def read_key() -> bytes:
        nonlocal key
        from .targets import load_key
        key = load_key(args.key_file)
        return key

    key_results = key_checks(read_key, key_file or "")
    # The local daemon, asked first: its own interface and ports are what to check, not this
    # shell's settings (mccld may run with another environment or mccld.toml).
    status_ok = "no usable fleet key" if key is None else None
    ends = None
    if key is not None and cfg.status_port:
        (own,) = fetch(from_hosts([f"{addr}:{cfg.status_port}"]), key, "status", timeout_s=args.timeout)
        status_ok = own.error
        ends = daemon_endpoints(own.result)
    if ends is not None:
        addr, ifname = ends["addr"], ends.get("iface") or interface_of(ends["addr"])
        ports = {"link": int(ends.get("link_port") or 0), "status": int(ends.get("status_port") or 0),
                 "metrics": int(ends.get("metrics_port") or 0)}
        metrics_addr, ports_from = str(ends.get("metrics_addr") or ""), "as the local mccld reports them"
    else:
        ports = {"link": cfg.port, "status": cfg.status_port, "metrics": cfg.metrics_port}
        metrics_addr, ports_from = cfg.metrics_addr, "from this shell's settings: the local mccld did not say"
    if iface_error is not None and ends is None:
        checks.append(check("interface", "fail", str(iface_error),
                            "set MCCL_IFACE to the 10 GbE interface or MCCL_LISTEN_ADDR to its address"))
    elif ifname:
        checks += interface_checks(ifname, addr)
    else:
        checks.append(check("interface", "warn", f"no interface holds {addr}",
                            "set MCCL_IFACE to the 10 GbE interface or MCCL_LISTEN_ADDR to one of its addresses"))
    checks += buffer_checks(engine_socket_buffer(), read_sysctl)
    checks += key_results
    fleet_name = wanted_fleet(getattr(args, "fleet", None))
    try:
        fleet = (Fleet(getattr(args, "fleet", None), "--host", from_hosts(args.host)) if args.host
                 else find_fleet(args.discover_timeout, key, fleet_name))
    except ConfigError as e:
        fleet = Fleet(fleet_name, "nowhere", [])
        checks.append(check("discovery", "warn", str(e), "name peers with --host H[:port]"))
    reported = [(own.result or {}).get("fleet")] if ends is not None else []
    checks.append(check("fleet", "ok" if fleet.targets or args.host else "warn", fleet.describe(reported),
                        "start mccld on the fleet's hosts, set MCCL_FLEET or pass --fleet"))
    peers = [t for t in fleet.targets if not t.status_addr.startswith(f"{addr}:")]
    checks += port_checks(addr, ports,
                          [(t.host, t.status_addr.rsplit(":", 1)[0], int(t.status_addr.rsplit(":", 1)[1]))
                           for t in peers], status_ok, metrics_addr, ports_from)
    if key is not None and peers:
        replies = fetch(peers, key, "status", timeout_s=args.timeout)
        checks += skew_checks([(r.target.host, r.clock_offset_s, r.rtt_s) for r in replies])
    else:
        checks += skew_checks([])
    print(fmt.to_json(checks) if args.json else fmt.doctor_report(checks))
    return 1 if any(c["status"] == "fail" for c in checks) else 0
