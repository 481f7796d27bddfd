"""Per-socket TCP statistics from the OS, for the links view of mcclctl.

The link sockets belong to the engine (C++), so rather than reaching into them we ask
the kernel about every established socket between our fleet address and a peer's: on
Linux ``ss -tin`` reads TCP_INFO for all sockets of the network namespace. Other systems do
not expose per-socket retransmits without privileges; there the answer is ``None`` and
callers show "n/a".
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys

log = logging.getLogger(__name__)

_SS_TIMEOUT_S = 3.0
_FIELD = re.compile(r"(\w+):(\S+)")


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def parse_ss(text: str) -> list[dict]:
    """Sockets from ``ss -tinH state established``: local, peer and TCP_INFO fields."""
    sockets: list[dict] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            cols = line.split()
            if len(cols) < 4:
                continue
            sockets.append({"local": cols[2], "peer": cols[3]})
            continue
        if not sockets:
            continue
        info = sockets[-1]
        fields = dict(_FIELD.findall(line))
        if "retrans" in fields:  # "retrans:<in flight>/<total>"
            info["retransmits"] = int(fields["retrans"].split("/")[-1])
        else:
            info["retransmits"] = 0
        for name in ("bytes_sent", "bytes_received", "bytes_retrans"):
            if name in fields:
                info[name] = int(fields[name])
        if "rtt" in fields:
            info["rtt_ms"] = float(fields["rtt"].split("/")[0])
        m = re.search(r"delivery_rate (\d+)bps", line)
        if m:
            info["delivery_rate_bits_per_s"] = float(m.group(1))
    return sockets


def link_sockets(local_addr: str, peer_addr: str, text: str | None = None,
                 exclude_ports: frozenset[int] = frozenset()) -> list[dict] | None:
    """Established sockets between our fleet address and the peer's.

    Matched on the address pair, not on ports: besides the daemons' control link
    (MCCL_PORT), a job's engine stripes its data over sockets on ephemeral ports, and
    those carry the traffic whose retransmits matter. ``exclude_ports`` drops sockets of
    our own endpoints (a status query in flight). ``None``: no per-socket view here.
    """
    if text is None:
        text = run_ss()
        if text is None:
            return None
    local_host, _ = _split(local_addr)
    peer_host, _ = _split(peer_addr)
    found = []
    for s in parse_ss(text):
        s_local_host, s_local_port = _split(s["local"])
        s_peer_host, s_peer_port = _split(s["peer"])
        if s_local_host == local_host and s_peer_host == peer_host \
                and s_local_port not in exclude_ports and s_peer_port not in exclude_ports:
            found.append(s)
    return found


def run_ss() -> str | None:
    if not sys.platform.startswith("linux") or shutil.which("ss") is None:
        return None
    try:
        out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True,
                             text=True, timeout=_SS_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("ss failed: %s", e)
        return None
    return out.stdout if out.returncode == 0 else None


def summarize(sockets: list[dict] | None) -> dict:
    """Totals over a link's sockets, as shown by ``mcclctl links``."""
    if sockets is None:
        return {"sockets": None, "retransmits": None, "rtt_ms": None}
    rtts = [s["rtt_ms"] for s in sockets if "rtt_ms" in s]
    return {"sockets": len(sockets),
            "retransmits": sum(s.get("retransmits", 0) for s in sockets),
            "rtt_ms": max(rtts) if rtts else None}
