"""Whether a key file may be trusted: who else could read it, and who could swap it.

A key file is refused (ConfigError naming the file and the fix, never its contents) when

* its mode lets group or others read or write it;
* an ACL lets another user or a group read or write it (mccl_common/file_acl.py: on macOS
  such an entry is invisible in the mode bits);
* a folder on the way to it (every one the path resolves through, symlinks followed) belongs
  to someone other than root, this user or the file's owner, or lets others write in it
  (mode or ACL) without the sticky bit: whoever can write there can rename the key away and
  put their own in its place, and every link of the fleet would then trust their key;
* under a sticky, world-writable folder (/tmp), the entry in it is not this user's or root's:
  anyone may create a name there first.

``extra_owners`` are users the caller already trusts with the key (the job's daemon, which
wrote the run key into its own runtime dir).
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path
from typing import Iterable

from . import file_acl
from .errors import ConfigError

_MAX_LINKS = 40


def _name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def walk(path: str | os.PathLike) -> tuple[list[tuple[str, str, os.stat_result]], str]:
    """Resolve ``path`` as the kernel does, recording each (folder, entry, entry's lstat) it
    passes through, symlinks included; returns them and the resolved file. OSError as lstat
    gives it (FileNotFoundError for a missing part), or ELOOP."""
    todo = [c for c in os.path.abspath(os.fspath(path)).split("/") if c][::-1]
    cur, steps, links = "/", [], 0
    final = "/"
    while todo:
        comp = todo.pop()
        if comp in ("", "."):
            continue
        if comp == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, comp)
        st = os.lstat(nxt)
        steps.append((cur, comp, st))
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise OSError(40, "too many levels of symbolic links", os.fspath(path))
            target = os.readlink(nxt)
            if target.startswith("/"):
                cur = "/"
            todo.extend([c for c in target.split("/") if c][::-1])
            continue
        if todo:
            cur = nxt
        else:
            final = nxt
    return steps, final


def check(path: str | os.PathLike, extra_owners: Iterable[int] = ()) -> None:
    """ConfigError unless the key file ``path`` passes the checks in the module doc."""
    shown = os.fspath(path)
    me = os.geteuid()
    steps, final = walk(path)
    st = os.stat(final)
    mode = stat.S_IMODE(st.st_mode)
    for g in file_acl.foreign(_acl(final, shown), st.st_uid, want_read=True, want_write=True):
        raise ConfigError(f"[config] key file {shown} has an ACL entry that lets another {g.kind} in ({g.describe()}); "
                          f"the key must be readable by its owner alone: remove the ACL "
                          f"({_acl_fix(final)}) and keep mode 0600")
    if mode & 0o077:
        raise ConfigError(f"[config] key file {shown} has mode {mode:04o}; it must not be readable "
                          f"by group or others: run `chmod 600 {shown}`")
    trusted = {0, me, st.st_uid, *extra_owners}
    seen: set[str] = set()
    for folder, entry, est in steps:
        if folder not in seen:
            seen.add(folder)
            _check_folder(folder, trusted, shown)
        _sticky_entry(folder, entry, est, me, shown)


def _check_folder(folder: str, trusted: set[int], shown: str) -> None:
    dst = os.stat(folder)
    if dst.st_uid not in trusted:
        raise ConfigError(f"[config] key file {shown}: the folder {folder} on its path belongs to "
                          f"{_name(dst.st_uid)}, who could replace the key with one of their own; keep the "
                          f"key in a folder that only root or you own (e.g. ~/.config/mccl or /etc/mccl)")
    writers = _other_writers(folder, dst)
    if writers and not dst.st_mode & stat.S_ISVTX:
        acl_fix = f" and remove the ACL ({_acl_fix(folder)})" if "ACL" in writers else ""
        raise ConfigError(f"[config] key file {shown}: the folder {folder} on its path lets {writers} write in "
                          f"it without the sticky bit, so they could swap the key for their own; run "
                          f"`chmod go-w {folder}`{acl_fix}, or move the key to a folder only you or root can write")


def _sticky_entry(folder: str, entry: str, est: os.stat_result, me: int, shown: str) -> None:
    dst = os.stat(folder)
    if dst.st_mode & stat.S_ISVTX and est.st_uid not in (0, me) and _other_writers(folder, dst):
        raise ConfigError(f"[config] key file {shown}: {os.path.join(folder, entry)} in the shared folder "
                          f"{folder} belongs to {_name(est.st_uid)}, not to you or root: anyone may create a name "
                          f"there first; keep the key in a folder of your own (e.g. ~/.config/mccl)")


def _other_writers(folder: str, dst: os.stat_result) -> str:
    """Who besides the folder's owner may write in it, in words; "" when nobody."""
    who = []
    if dst.st_mode & 0o002:
        who.append("everyone")
    found = _acl(folder, folder)
    acl = file_acl.foreign(found, dst.st_uid, want_read=False, want_write=True)
    if dst.st_mode & 0o020 and not (acl and os.uname().sysname == "Linux"):
        who.append("its group")     # (with a Linux ACL these bits are its mask: the entries say who)
    if acl:
        who.append("an ACL (" + "; ".join(g.describe() for g in acl) + ")")
    return " and ".join(who)


def _acl(path: str, shown: str) -> list[file_acl.Grant]:
    try:
        return file_acl.grants(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"[config] cannot read the ACL of {shown} ({e}); a key file whose readers cannot be "
                          "checked is refused: keep it on a local filesystem, mode 0600") from None


def _acl_fix(path: str) -> str:
    return f"`chmod -N {path}`" if os.uname().sysname == "Darwin" else f"`setfacl -b {path}`"


def readable_by(path: Path, uid: int, groups: set[int]) -> bool:
    """Whether user ``uid`` (member of ``groups``) may read ``path`` by its mode bits or an ACL
    entry (root may read anything); a file whose ACL cannot be read counts as readable."""
    if uid == 0:
        return True
    try:
        st = os.stat(path)
    except OSError:
        return False
    try:
        found = file_acl.grants(str(path))
    except (OSError, ValueError):
        return True
    if st.st_uid != uid and file_acl.grants_user(found, uid, groups) is not None:
        return True
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == uid:
        return bool(mode & 0o400)
    if st.st_gid in groups:
        return bool(mode & 0o040)
    return bool(mode & 0o004)


__all__ = ["check", "readable_by", "walk"]
