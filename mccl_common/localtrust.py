"""Trust between local users: whose runtime dir, whose socket, whose process.

mccld and its clients meet in a runtime directory. Whoever controls that directory controls
the attach socket and the token in it, so before either side uses it the directory itself is
checked (``check_runtime_dir``): not a symlink, a directory, owned by the expected user (the
caller itself, or for the service's directory the daemon's user) and writable by nobody else.
A directory in a world-writable place like /tmp that another user created first is refused:
that user could swap the socket for a daemon of their own.

Then each side checks the other end of the socket with the kernel's word, never the peer's:

* the client, before it sends anything, connects a plain Unix socket to the attach path and
  asks the kernel who listens there (``listener_uid``: SO_PEERCRED on Linux, getpeereid on
  macOS/BSD); it must be the runtime dir's owner. The ZeroMQ connection made next goes to the
  same path in the same checked directory, which only that owner can change; the hello
  reply's ``Peer-Address`` (below) confirms it on the real connection.
* mccld reads the peer of every control message from ZeroMQ's ``Peer-Address`` metadata,
  which libzmq fills for ipc:// connections from SO_PEERCRED (LOCAL_PEERCRED on macOS) when it
  accepts the connection: ``localhost:<uid>:<gid>:<pid>`` (``peer_creds``). This is the
  connection's own credentials, taken once by the kernel, so a file descriptor number reused
  by a later connection cannot lend its owner to an earlier message (ZMQ_SRCFD could).
  ``uid_allowed`` admits mccld's own user, root, and members of MCCL_ATTACH_GROUP.

Group membership is read from the group database (a user's primary group or the group's
member list) plus the gid the kernel reports for the connection, not from anything the peer
says.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import AuthError, ConfigError, DaemonUnavailableError

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 2.0


def owner_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_runtime_dir(path: Path, allowed_owners: set[int], check_mode: bool = True) -> int:
    """The owner of ``path`` once it passed the checks; ConfigError naming the path and its owner
    otherwise. lstat, so a symlink is seen as one rather than followed to whatever it names.
    ``check_mode`` off: the caller owns the directory and sets its mode itself (mccld)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ConfigError(f"[config] cannot inspect runtime dir {path}: {e.strerror}; set MCCL_RUNTIME_DIR to "
                          "a directory of yours") from None
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"[config] runtime dir {path} is a symlink (owned by {owner_name(st.st_uid)}); refusing "
                          "it: whoever made it could point it at their own daemon. Remove it, or set "
                          "MCCL_RUNTIME_DIR to a directory of yours")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"[config] runtime dir {path} is not a directory (owned by {owner_name(st.st_uid)}); "
                          "remove it, or set MCCL_RUNTIME_DIR to a directory of yours")
    if st.st_uid not in allowed_owners:
        want = " or ".join(owner_name(u) for u in sorted(allowed_owners))
        raise ConfigError(f"[config] runtime dir {path} belongs to {owner_name(st.st_uid)}, not {want}; another "
                          "user may have created it to stand up a daemon of their own. Remove it (as root) or set "
                          "MCCL_RUNTIME_DIR to a directory of yours")
    if check_mode and st.st_mode & 0o022:
        raise ConfigError(f"[config] runtime dir {path} (owned by {owner_name(st.st_uid)}) has mode "
                          f"{stat.S_IMODE(st.st_mode):o}: others may write in it and replace the attach socket; "
                          "its owner must make it 0700 (0750 with MCCL_ATTACH_GROUP)")
    return st.st_uid


def trusted_parent(path: Path) -> bool:
    """Whether only root or the dir's owner could have made ``path``: its parent is not group- or
    world-writable (a sticky /tmp is, so a name in it may be anyone's)."""
    try:
        pst, st = os.stat(path.parent), os.lstat(path)
    except OSError:
        return False
    return pst.st_uid in (0, st.st_uid) and not pst.st_mode & 0o022


@dataclass(frozen=True)
class PeerCreds:
    uid: int
    gid: int
    pid: int       # 0 where the OS does not say (macOS's LOCAL_PEERCRED has no pid)


def peer_creds(peer_address: str | None) -> PeerCreds | None:
    """The credentials libzmq recorded for an ipc:// connection: its ``Peer-Address`` is
    ``localhost:<uid>:<gid>:<pid>`` on Linux (``...:<uid>:<gid>:`` on macOS); None if absent."""
    if not peer_address:
        return None
    parts = peer_address.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid = int(parts[1]), int(parts[2])
        pid = int(parts[3]) if parts[3] else 0
    except ValueError:
        return None
    return PeerCreds(uid, gid, pid)


def socket_peer_creds(sock: socket.socket) -> PeerCreds:
    """The kernel's credentials for the other end of a connected Unix socket."""
    if hasattr(socket, "SO_PEERCRED"):
        pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
        return PeerCreds(uid, gid, pid)
    # macOS/BSD: getpeereid(3) is LOCAL_PEERCRED underneath; Python exposes neither, so read the
    # xucred (version, uid, ngroups, groups[16]) at level SOL_LOCAL (0), option LOCAL_PEERCRED (1).
    raw = sock.getsockopt(0, 1, struct.calcsize("Iih16I"))
    _version, uid, _n, *groups = struct.unpack("Iih16I", raw)
    return PeerCreds(uid, groups[0], 0)


def listener_uid(sock_path: Path) -> int:
    """The uid of the process listening on the Unix socket ``sock_path``, asked of the kernel
    over a connection that sends nothing. DaemonUnavailableError if nobody listens."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(_PROBE_TIMEOUT_S)
    try:
        s.connect(str(sock_path))
        return socket_peer_creds(s).uid
    except OSError as e:
        raise DaemonUnavailableError(f"[daemon-client] nothing listens on {sock_path} ({e.strerror or e}); is "
                                     "mccld running with this MCCL_RUNTIME_DIR?") from None
    finally:
        s.close()


def in_group(uid: int, gid: int, group: int) -> bool:
    """Whether user ``uid`` (whose connection reported primary gid ``gid``) belongs to ``group``."""
    if gid == group:
        return True
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return False
    if pw.pw_gid == group:
        return True
    try:
        return pw.pw_name in grp.getgrgid(group).gr_mem
    except KeyError:
        return False


def uid_allowed(creds: PeerCreds, group: int | None) -> bool:
    """mccld serves its own user, root (who could read its memory anyway) and, with
    MCCL_ATTACH_GROUP, that group's members."""
    if creds.uid in (os.geteuid(), 0):
        return True
    return group is not None and in_group(creds.uid, creds.gid, group)


def daemon_owners(path: Path, explicit: bool, service: Path) -> set[int]:
    """Users a client accepts as the owner of runtime dir ``path`` (and so as its daemon's user):
    itself always; another user (the service user) only for the service's directory or an
    explicit MCCL_RUNTIME_DIR, and only where nobody but root or that user could have created it."""
    me = os.geteuid()
    if path == service or explicit:
        try:
            owner = os.lstat(path).st_uid
        except OSError:
            return {me}
        if owner == 0 or trusted_parent(path):
            return {me, owner}
    return {me}

def verify_daemon(rdir: Path, owners: set[int], sock_name: str) -> int:
    """The uid of the daemon serving ``rdir``, checked before anything is sent to it: the
    directory passes ``check_runtime_dir`` and the process listening on its socket runs as the
    directory's owner. AuthError naming both users if another user's process listens there."""
    try:
        owner = check_runtime_dir(rdir, owners)
    except FileNotFoundError:
        raise DaemonUnavailableError(f"[daemon-client] no runtime dir {rdir}; is mccld running with this "
                                     "MCCL_RUNTIME_DIR?") from None
    uid = listener_uid(rdir / sock_name)
    if uid != owner:
        raise AuthError(f"[daemon-client] the process listening on {rdir / sock_name} runs as {owner_name(uid)}, "
                        f"not as {owner_name(owner)} who owns the runtime dir; another local user may be "
                        "impersonating mccld. Nothing was sent to it; stop that process (or ask root to) and "
                        "restart mccld")
    return owner


def check_reply_peer(peer_address: str | None, expected_uid: int, where: str) -> None:
    """The real ZeroMQ connection's peer (from libzmq's Peer-Address) must be the daemon's user
    too; an OS whose libzmq records no credentials leaves only the listener check."""
    creds = peer_creds(peer_address)
    if creds is not None and creds.uid != expected_uid:
        raise AuthError(f"[daemon-client] the daemon at {where} answered from {owner_name(creds.uid)}, not "
                        f"{owner_name(expected_uid)}; another local user may be impersonating mccld. Stop "
                        "that process (or ask root to) and restart mccld")
