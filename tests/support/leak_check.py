"""What a test left behind in the pytest process: threads, fds, child processes, shm segments.

``snapshot()`` before the test and ``leftovers(before)`` after it compare identities, not
counts: the threads (task ids), fds, child pids and /dev/shm/mccl* segments that exist
now and did not before. Only what this process can own is counted, since other suites
run beside this one on a shared machine: child processes are direct children and the ranks
forked by the session's rank server (support/ranks.py; alive, not
zombies), and a new segment counts when this process maps or holds it, or its name's pid
field is this process or one of its children. ``warm_up()`` creates once the per-process
singletons that a first user would otherwise be blamed for (ZeroMQ's I/O threads, torch's
intra-op pool, multiprocessing's resource tracker, libuv's signal pipe under TCPStore).

Linux reads all of it from /proc. Elsewhere (the macOS workflow) threads and children come
from psutil, fds from /dev/fd, and shared-memory segments are not counted: macOS's POSIX
shared memory has no directory to list.
"""

from __future__ import annotations

import gc
import os
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

GRACE_S = 5.0        # threads still exiting, sockets still closing, children still being reaped
_POLL_S = 0.1


@dataclass(frozen=True)
class Snapshot:
    tasks: frozenset[int]
    fds: frozenset[int]
    children: frozenset[int]
    segments: frozenset[str]


LINUX = sys.platform.startswith("linux")
_FD_DIR = "/proc/self/fd" if LINUX else "/dev/fd"
_F_GETPATH = 50    # macOS fcntl: the path a file descriptor is open on


def _tasks() -> frozenset[int]:
    if LINUX:
        return frozenset(int(t) for t in os.listdir("/proc/self/task"))
    import psutil
    return frozenset(t.id for t in psutil.Process().threads())


def _fds() -> frozenset[int]:
    return frozenset(int(f) for f in os.listdir(_FD_DIR))


def _fd_target(fd: int) -> str:
    """As Linux's /proc/self/fd links name it ("pipe:[…]", "socket:[…]", a path); raises OSError
    once the fd is closed."""
    if LINUX:
        return os.readlink(f"/proc/self/fd/{fd}")
    mode = os.fstat(fd).st_mode
    if stat.S_ISFIFO(mode):
        return f"pipe:[{os.fstat(fd).st_ino}]"
    if stat.S_ISSOCK(mode):
        return f"socket:[{os.fstat(fd).st_ino}]"
    import fcntl
    return fcntl.fcntl(fd, _F_GETPATH, b"\0" * 1024).rstrip(b"\0").decode(errors="replace")


def fd_targets() -> list[str]:
    """What each of this process's fds is open on ("pipe:[…]", "/dev/shm/x (deleted)", …)."""
    out = []
    for fd in os.listdir(_FD_DIR):
        try:
            out.append(_fd_target(int(fd)))
        except OSError:
            pass       # closed since the listing (the listing's own fd is)
    return out


def pipe_fds() -> int:
    """How many of this process's fds are pipes (an engine's wake pipes are)."""
    return sum(t.startswith("pipe:") for t in fd_targets())


def _children() -> frozenset[int]:
    if not LINUX:
        import psutil
        kids = []
        for c in psutil.Process().children(recursive=True):
            try:
                parent_is_me = c.ppid() == os.getpid()
                if c.status() != psutil.STATUS_ZOMBIE and (parent_is_me or _is_rank_server(c.ppid())):
                    kids.append(c.pid)
            except psutil.NoSuchProcess:
                pass
        return frozenset(kids)
    me, parent = os.getpid(), {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            parent[int(d)] = int(fields[1])
    out = {pid for pid, pp in parent.items() if pp == me}
    # The ranks' forkserver (support/ranks.py) is ours for the whole session; the ranks it
    # forks are this test's children as much as spawned ones were.
    servers = {pid for pid in out if _is_rank_server(pid)}
    return frozenset(out | {pid for pid, pp in parent.items() if pp in servers})


def _is_rank_server(pid: int) -> bool:
    return "multiprocessing.forkserver" in _cmdline(pid)


def _task_name(tid: int) -> str:
    """The kernel's name of a thread (engine threads name themselves: core/thread_name.h)."""
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return f"{tid} (gone)"


def _segments() -> frozenset[str]:
    return frozenset(p.name for p in Path("/dev/shm").glob("mccl*")) if LINUX else frozenset()


def snapshot() -> Snapshot:
    return Snapshot(_tasks(), _fds(), _children(), _segments())


def held_segments() -> set[str]:
    """Names of the /dev/shm/mccl* segments this process maps or holds open."""
    held: set[str] = set()
    if not LINUX:
        return held
    with open("/proc/self/maps") as f:
        held.update(Path(line.split()[-1]).name for line in f if "/dev/shm/mccl" in line)
    held.update(Path(t).name for t in fd_targets() if t.startswith("/dev/shm/mccl"))
    return held


def _owner_pid(name: str) -> int | None:
    """mccl-<job>-<rank>-<pid>-<gen> (libmccl/daemon/client.py names them so)."""
    parts = name.split("-")
    return int(parts[3]) if len(parts) >= 4 and parts[3].isdigit() else None


def _describe_fd(fd: int) -> str:
    try:
        return f"{fd}->{_fd_target(fd)}"
    except OSError:
        return str(fd)


def _diff(before: Snapshot) -> dict[str, list[str]]:
    now = snapshot()
    out: dict[str, list[str]] = {}
    threads = now.tasks - before.tasks
    if threads:
        names = sorted(t.name for t in threading.enumerate() if t.native_id in threads)
        native = sorted(_task_name(t) for t in threads)
        out["threads"] = [f"{len(threads)} new task(s) named {native}, Python threads among them: {names}"]
    fds = sorted(now.fds - before.fds)
    if fds:
        out["fds"] = [_describe_fd(fd) for fd in fds]
    children = now.children - before.children
    if children:
        out["children"] = [f"{pid} {_cmdline(pid)}" for pid in sorted(children)]
    new = now.segments - before.segments
    if new:
        mine = {os.getpid()} | set(now.children)
        held = held_segments()
        ours = sorted(n for n in new if n in held or _owner_pid(n) in mine)
        if ours:
            out["segments"] = ours
    return out


def _cmdline(pid: int) -> str:
    if not LINUX:
        import psutil
        try:
            return " ".join(psutil.Process(pid).cmdline())[:200]
        except psutil.Error:
            return "(gone)"
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "(gone)"


def leftovers(before: Snapshot, grace_s: float = GRACE_S) -> dict[str, list[str]]:
    """What the test created and still holds, once ``grace_s`` passed without it going away."""
    deadline = time.monotonic() + grace_s
    while True:
        gc.collect()
        left = _diff(before)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(_POLL_S)


def warm_up() -> None:
    import multiprocessing.resource_tracker as rt

    import torch
    import torch.distributed as dist
    import zmq

    from support.ranks import start_rank_server

    start_rank_server()                                 # the ranks' forkserver lives as long as we do
    zmq.Context.instance().socket(zmq.PAIR).close()     # its I/O threads start with the first socket
    torch.ones(1 << 20).add_(1).sum()
    rt.ensure_running()
    # libuv's signal lock: a pipe the first TCPStore server opens and the process keeps.
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    del store
