"""What every emulated fleet of network namespaces shares: its lifecycle.

``Fleet`` (one bridge, switches and uplinks; tools/fleet.py) and ``SubnetFleet`` (routed
subnets; tools/fleet_subnets.py) differ in what they build, not in how they are started,
run things and torn down:

- ``start()`` runs once: it checks the prerequisites, registers the teardown at exit, claims
  an id (creating a bridge named after it is the atomic claim across processes) and builds;
  a failure half-way tears down what was built.
- ``stop()`` is idempotent and runs only in the process that started the fleet: a forked
  child inherits the atexit hook, and its exit must not pull the network from under its
  parent. It kills every tracked process group and every process in the namespaces by pid,
  then deletes what the fleet made.
- ``popen``/``run`` start a command inside a host, in a session of its own, tracked so that
  ``stop()`` kills it; ``run`` kills the group at its timeout.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from mccl_common.errors import ConfigError, MCCLError

log = logging.getLogger(__name__)

KILL_WAIT_S = 5.0
CMD_TIMEOUT_S = 20.0
_CLAIM_TRIES = 50


def _is_root() -> bool:
    return os.geteuid() == 0


def check_prerequisites() -> None:
    """Raise ConfigError unless this process can build namespaces (root, Linux, ip, tc)."""
    if not sys.platform.startswith("linux"):
        raise ConfigError(
            f"[fleet] network namespaces need Linux, this is {sys.platform}; "
            "run the fleet tests and benchmarks on a Linux machine")
    if not _is_root():
        raise ConfigError(
            "[fleet] needs root (network namespaces, veths and tc qdiscs), running as uid "
            f"{os.geteuid()}; run as root, or use loopback mode (python -m tools.bench --hosts 0)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ConfigError(
                f"[fleet] the '{tool}' command is missing; install iproute2 "
                "(apt-get install iproute2) or put it on PATH")


def _sh(argv: Sequence[str], *, check: bool = True, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise MCCLError(f"[fleet] Timed out after {timeout:.0f}s: '{' '.join(argv)}' did not finish; "
                        "the machine may be overloaded, retry") from None
    if check and res.returncode != 0:
        raise MCCLError(f"[fleet] '{' '.join(argv)}' failed (rc={res.returncode}): "
                        f"{res.stderr.strip() or res.stdout.strip()}")
    return res


def list_namespaces() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_links(kind: str | None = None) -> list[str]:
    argv = ["ip", "-o", "link", "show"] + (["type", kind] if kind else [])
    out = _sh(argv, check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(": ")
        if len(parts) >= 2:
            names.append(parts[1].split("@")[0])
    return names


def kill_namespace_pids(namespaces: Sequence[str]) -> None:
    """SIGKILL every process inside the given namespaces and wait until they are gone."""
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        alive = []
        for ns in namespaces:
            res = _sh(["ip", "netns", "pids", ns], check=False)
            alive += [int(x) for x in res.stdout.split() if x.isdigit()]
        if not alive:
            return
        if time.monotonic() > deadline:
            log.warning("[fleet] pids %s still in namespaces %s after SIGKILL; deleting anyway", alive, namespaces)
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)



class NamespaceFleet:
    """The lifecycle; a subclass names its namespaces and builds and removes its network."""

    def __init__(self) -> None:
        self.id: str | None = None
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._started = False
        self._stopped = False
        self._owner_pid = os.getpid()

    # ---- what a subclass provides ----------------------------------------------------
    def _build(self) -> None:
        """Claim an id (``_claim_id``) and build the network; called once by start()."""
        raise NotImplementedError

    def _namespaces(self) -> list[str]:
        """The hosts' namespaces, whose processes stop() kills by pid."""
        raise NotImplementedError

    def _teardown(self) -> None:
        """Delete whatever exists of this fleet (it may be half-built)."""
        raise NotImplementedError

    def _ns(self, host: Any) -> str:
        """The namespace of ``host``; ConfigError for a host the fleet does not have."""
        raise NotImplementedError

    # ---- lifecycle ---------------------------------------------------------------------
    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self):
        if self._started:
            raise MCCLError(f"[fleet] start() called twice; a {type(self).__name__} is started once, then stopped")
        check_prerequisites()
        self._started = True
        self._owner_pid = os.getpid()
        atexit.register(self.stop)
        try:
            self._build()
        except BaseException:
            self.stop()
            raise
        return self

    def _claim_id_from(self, candidates: Iterable[str], bridge_of: Callable[[str], str],
                  taken: Callable[[str], bool], failed_hint: str) -> None:
        """The first candidate id nobody uses: ``taken(id)`` says a namespace of it exists,
        and creating the bridge ``bridge_of(id)`` claims it against other processes."""
        tried = []
        for cand in candidates:
            tried.append(cand)
            if taken(cand):
                continue
            res = _sh(["ip", "link", "add", bridge_of(cand), "type", "bridge"], check=False)
            if res.returncode == 0:
                self.id = cand
                return
            if "exists" not in res.stderr:
                raise MCCLError(f"[fleet] could not create bridge {bridge_of(cand)}: {res.stderr.strip()}")
        raise ConfigError(f"[fleet] no free fleet id (tried {', '.join(tried[:5])}...); {failed_hint}")

    @staticmethod
    def random_ids() -> list[str]:
        import random

        return [str(random.randint(1, 9999)) for _ in range(_CLAIM_TRIES)]

    def stop(self) -> None:
        """Kill every process in the fleet, then delete what it made. Idempotent; only in
        the process that started it."""
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            if self._stopped or not self._started:
                self._stopped = self._stopped or self._started
                return
            self._stopped = True
        try:
            atexit.unregister(self.stop)
        except Exception:  # pragma: no cover - interpreter shutting down
            pass
        if self.id is None:
            return
        self._kill_all()
        self._teardown()
        log.info("%s %s down", type(self).__name__, self.id)

    def release(self) -> None:
        """Forget the fleet without tearing it down (``python -m tools.fleet up``)."""
        with self._lock:
            self._stopped = True
        atexit.unregister(self.stop)

    def _kill_all(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                # Each child leads its own session, so its pid is also its group's id.
                for kill in (lambda: os.killpg(p.pid, signal.SIGKILL), lambda: os.kill(p.pid, signal.SIGKILL)):
                    try:
                        kill()
                    except (ProcessLookupError, PermissionError):
                        pass
        kill_namespace_pids(self._namespaces())
        for p in self._procs:
            try:
                p.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("[fleet] pid %d survived SIGKILL for %.0fs (stuck in the kernel?)", p.pid, KILL_WAIT_S)

    # ---- running things inside hosts ---------------------------------------------------
    def _running(self) -> None:
        if not self._started or self._stopped:
            raise MCCLError(f"[fleet] the {type(self).__name__} is not running; call start() "
                            "(or use it as a context manager) first")

    def exec_argv(self, host: Any, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` inside ``host`` (``ip netns exec`` execs, so pids match)."""
        self._running()
        return ["ip", "netns", "exec", self._ns(host), *argv]

    def popen(self, host: Any, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kw) -> subprocess.Popen:
        """Start ``argv`` inside ``host``, ``env`` on top of this process's environment, in a
        session of its own (so stop() can kill its children too); tracked: stop() kills it."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.exec_argv(host, argv), env={**os.environ, **(env or {})}, **kw)
        self._procs.append(p)
        return p

    def run(self, host: Any, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
            check: bool = False, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to completion, output captured as text. After
        ``timeout`` seconds its group is killed and subprocess.TimeoutExpired raised."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        p = self.popen(host, argv, env=env, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate(timeout=KILL_WAIT_S)
            raise
        res = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            res.check_returncode()
        return res
