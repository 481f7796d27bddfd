"""Where benchmark processes run: N local processes on loopback, or one per fleet host.

A launcher starts one process per host and knows each host's address; ``run_group``
starts a set of processes, fails fast when one of them fails (killing the rest), and
kills everything at its deadline, so a wedged backend never hangs the benchmark.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from mccl_common.errors import CollectiveTimeout


class LocalLauncher:
    """N "hosts" that are all this machine, reached over 127.0.0.1 (each may run several ranks)."""

    kind = "loopback"

    def __init__(self, n: int):
        self.n = n
        self.rate = None
        self.cpu = None     # tools.cpucap.CpuCaps: the processes of capped hosts go into their groups

    def addr(self, i: int) -> str:
        return "127.0.0.1"

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw) -> subprocess.Popen:
        full = dict(os.environ)
        full.update(env or {})
        p = subprocess.Popen(list(argv), env=full, start_new_session=True, **kw)
        if self.cpu is not None:
            self.cpu.add(i, p.pid)
        return p

    def free_port(self, preferred: int) -> int:
        # Other programs share loopback: ask the kernel for a port nobody holds right now.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def rank_env(self, i: int) -> dict[str, str]:
        return {}

    def close(self) -> None:
        pass


class FleetLauncher:
    """One emulated host (network namespace) per process; see tools.fleet."""

    kind = "fleet"

    def __init__(self, n: int, rate: str | None, **fleet_kw):
        from ..fleet import Fleet

        self.n = n
        self.rate = rate
        self.fleet = Fleet(n, rate=rate, **fleet_kw).start()   # fleet_kw: delay, burst (tools/fleet.py)
        self.cpu = None     # as LocalLauncher's

    def addr(self, i: int) -> str:
        return self.fleet.hosts[i].addr

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw) -> subprocess.Popen:
        p = self.fleet.popen(i, argv, env=env, **kw)   # ip netns exec execs: p.pid is the process's own
        if self.cpu is not None:
            self.cpu.add(i, p.pid)
        return p

    def free_port(self, preferred: int) -> int:
        return preferred  # the namespaces are ours alone

    def rank_env(self, i: int) -> dict[str, str]:
        # Gloo binds to what the hostname resolves to (127.0.0.1 here, shared by every
        # namespace's own loopback), so it must be told the host's interface.
        return {"GLOO_SOCKET_IFNAME": self.fleet.hosts[i].ifname}

    def close(self) -> None:
        self.fleet.stop()


@dataclass
class Finished:
    returncode: int
    log: str        # the tail of the process's stdout+stderr, for error messages
    log_path: str   # all of it
    pid: int        # what its shared-memory segments are named after (daemon.py's leftover check)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            p.kill()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_group(launcher, argvs: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], log_dir: str,
              timeout_s: float, what: str, stream_first: bool = False,
              soft_codes: Sequence[int] = (), hosts: Sequence[int] | None = None) -> list[Finished]:
    """Run argvs[i] on host hosts[i] (default: host i), all at once; wait for all of them,
    at most timeout_s.

    When one exits non-zero the others are killed at once (they would only wait for it
    until their own timeouts), except for exit codes in ``soft_codes``: failures that
    leave the others' work intact. Raises CollectiveTimeout at the deadline; returns each
    process's exit code and log tail otherwise. ``stream_first`` lets process 0 write
    to our stderr (progress lines) instead of its log file.
    """
    procs, logs = [], []
    hosts = list(range(len(argvs))) if hosts is None else hosts
    try:
        for i, (argv, env, host) in enumerate(zip(argvs, envs, hosts)):
            path = os.path.join(log_dir, f"{what}-{i}.log")
            logs.append(path)
            with open(path, "wb") as f:
                err = None if (stream_first and i == 0) else subprocess.STDOUT
                procs.append(launcher.popen(host, argv, env=env, stdout=f, stderr=err))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0, *soft_codes) for p in procs):
                break
            if time.monotonic() > deadline:
                raise CollectiveTimeout(
                    f"[bench] Timed out: {what} did not finish within {timeout_s:.0f}s on {launcher.n} hosts; "
                    f"the backend may be hung or the sizes too large for the link rate; logs in {log_dir}")
            time.sleep(0.05)
    finally:
        for p in procs:
            _kill(p)
    out = []
    for p, path in zip(procs, logs):
        with open(path, "rb") as f:
            tail = f.read()[-4000:].decode(errors="replace")
        out.append(Finished(p.returncode, tail, path, p.pid))
    return out


def first_failure(results: Sequence[Finished], soft_codes: Sequence[int] = ()) -> str | None:
    """A readable reason from a process that failed by itself (not killed by us), if any."""
    ok = (0, *soft_codes)
    own = [(i, r) for i, r in enumerate(results) if r.returncode not in (*ok, -signal.SIGKILL)]
    if not own and any(r.returncode not in ok for r in results):
        own = [(i, r) for i, r in enumerate(results) if r.returncode not in ok]
    if not own:
        return None
    i, r = own[0]
    lines = [ln for ln in r.log.strip().splitlines() if ln.strip()]
    return f"host {i} exited with {r.returncode}: " + " | ".join(lines[-3:])[-600:]

