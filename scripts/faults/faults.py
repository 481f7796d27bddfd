"""The faults a campaign trial injects, and what every rank must raise for each.

A fault has a target (a rank, a host's link, a host's mccld), a way in (``inject``) and a
way back (``restore``, so the next trial finds the fleet whole), and the errors each
rank may raise: a rank on the faulted host can see a different symptom than one far
from it. ``named`` says whether the survivors' errors must name the culprit: every one
of them ("all"), at least one ("any": the ranks that waited on it directly blame it, the
rest may blame a neighbour that failed first), or none (a reset socket can surface on
either end first).
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass

_CMD_TIMEOUT_S = 10.0

PEER_LOST, TIMEOUT, NO_DAEMON = "PeerLostError", "CollectiveTimeout", "DaemonUnavailableError"


@dataclass(frozen=True)
class FaultKind:
    name: str
    modes: tuple[str, ...]
    near: frozenset[str]          # errors allowed on the faulted host's ranks
    far: frozenset[str]           # ... on the others
    named: str                    # "all" | "any" | "none"
    kills_daemon: bool = False
    named_inproc: str | None = None   # where the in-process engine can promise less

    def naming(self, mode: str) -> str:
        return self.named_inproc if mode == "inproc" and self.named_inproc else self.named


KINDS = {k.name: k for k in (
    FaultKind("rank_sigkill", ("inproc", "daemon"), frozenset({PEER_LOST}), frozenset({PEER_LOST}), "all"),
    # In-process, 1 trial in 100 had every survivor blame a live neighbour it waited on (the
    # engine blames whom a rank waits for; probably the stopped rank's last sends were already
    # in its peers' socket buffers). In daemon mode its daemon knows which local rank did not submit.
    FaultKind("rank_sigstop", ("inproc", "daemon"), frozenset({TIMEOUT}), frozenset({TIMEOUT}), "any",
              named_inproc="none"),
    # inproc: the victim rank's own TCP connections; daemon: its host mccld's links to other hosts.
    FaultKind("socket_reset", ("inproc", "daemon"), frozenset({PEER_LOST}), frozenset({PEER_LOST}), "none"),
    # No FIN, no RST: only the timeout can tell. The cut host's own ranks lose their address too.
    FaultKind("link_down", ("inproc", "daemon"), frozenset({TIMEOUT, PEER_LOST}), frozenset({TIMEOUT}), "any"),
    FaultKind("daemon_sigkill", ("daemon",), frozenset({NO_DAEMON}), frozenset({PEER_LOST, TIMEOUT}), "none",
              kills_daemon=True),
    FaultKind("daemon_sigstop", ("daemon",), frozenset({NO_DAEMON}), frozenset({PEER_LOST, TIMEOUT}), "none",
              kills_daemon=True),
)}


def kinds_for(mode: str) -> list[str]:
    return [k.name for k in KINDS.values() if mode in k.modes]


def _sh(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)


def _tcp_ports_of(pid: int) -> list[int]:
    """Local ports of the established TCP sockets process ``pid`` holds (its namespace's
    /proc/<pid>/net/tcp, matched by socket inode)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "01" and f[9] in inodes:     # 01: ESTABLISHED
                ports.append(int(f[1].rsplit(":", 1)[1], 16))
    return sorted(set(ports))


def reset_sockets(netns: str, pid: int) -> int:
    """Abort (RST to the peer, ECONNABORTED here) every established TCP connection of ``pid``,
    as a middlebox or a NIC reset would; returns how many ports were hit."""
    ports = _tcp_ports_of(pid)
    if ports:
        flt = " or ".join(f"sport = :{p}" for p in ports)
        _sh(["ip", "netns", "exec", netns, "ss", "-K", "-t", "state", "established", f"( {flt} )"])
    return len(ports)


def set_link(netns: str, up: bool, ifname: str = "eth0") -> None:
    res = _sh(["ip", "-n", netns, "link", "set", ifname, "up" if up else "down"])
    if res.returncode != 0:
        raise RuntimeError(f"[campaign] ip link set {ifname} {'up' if up else 'down'} in {netns} failed: "
                           f"{res.stderr.strip()}")


def signal_pid(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
