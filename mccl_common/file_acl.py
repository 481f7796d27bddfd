"""Access-control lists, read the way each OS enforces them, for the key-file checks.

Mode bits do not say everything about who may read or replace a file:

* Linux (POSIX.1e ACLs, ``setfacl``): named users and groups get their own entries. The group
  bits of ``st_mode`` then show the ACL's *mask*, which caps every named entry, so mode bits
  bound what they grant; but they no longer say *who* (a named user outside the file's group
  reads it through the mask), which a "can this user read it" question needs.
* macOS (extended ACLs, ``chmod +a``): entries are evaluated before the mode bits and are not
  reflected in them at all: a file of mode 0600 with ``user:bob allow read`` is readable by bob.

Both are reduced to one shape, a list of :class:`Grant`, and the decisions take that list, so
the decision logic runs (and is tested) on Linux whatever OS the list came from.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import grp
import os
import pwd
import struct
import sys
from dataclasses import dataclass

# Linux: <linux/posix_acl_xattr.h>. The xattr is a little-endian u32 version (2), then
# entries of (u16 tag, u16 perm, u32 id).
POSIX_XATTR = "system.posix_acl_access"
_POSIX_VERSION = 2
_HEADER = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_R, _W = 4, 2

# macOS perm names (acl_to_text); a directory's "list"/"add_file"/... share bits with a file's
# "read"/"write"/..., and either name may be printed.
MAC_READ = frozenset({"read", "list"})
MAC_WRITE = frozenset({"write", "add_file", "append", "add_subdirectory", "delete", "delete_child",
                       "writesecurity", "chown"})
_MAC_ACL_TYPE_EXTENDED = 0x00000100


@dataclass(frozen=True)
class Grant:
    """An allow entry of an ACL: ``kind`` "user" or "group" ("group" with id None: everyone);
    ``id`` the uid/gid (None when the OS gave no number); what it lets do."""

    kind: str
    id: int | None
    name: str
    read: bool
    write: bool

    def describe(self) -> str:
        who = self.name or _id_name(self.kind, self.id)
        what = "/".join(w for w, on in (("read", self.read), ("write", self.write)) if on)
        return f"{self.kind} {who} may {what}"


def _id_name(kind: str, ident: int | None) -> str:
    if ident is None:
        return "(unknown)"
    try:
        name = pwd.getpwuid(ident).pw_name if kind == "user" else grp.getgrgid(ident).gr_name
        return f"{name} ({'uid' if kind == 'user' else 'gid'} {ident})"
    except KeyError:
        return f"{'uid' if kind == 'user' else 'gid'} {ident}"


def parse_posix(blob: bytes) -> list[Grant]:
    """The named-user and named-group entries of a Linux ACL xattr, with the mask applied
    (what they can really do), plus the owning group's entry when a mask caps it. Entries
    that grant nothing are left out. ValueError if ``blob`` is not such an xattr."""
    if len(blob) < _HEADER.size or (len(blob) - _HEADER.size) % _ENTRY.size:
        raise ValueError(f"ACL xattr of {len(blob)} bytes is malformed")
    if _HEADER.unpack_from(blob)[0] != _POSIX_VERSION:
        raise ValueError("ACL xattr has an unknown version")
    entries = [_ENTRY.unpack_from(blob, off) for off in range(_HEADER.size, len(blob), _ENTRY.size)]
    mask = next((perm for tag, perm, _ in entries if tag == MASK), 0o7)
    grants = []
    for tag, perm, ident in entries:
        if tag not in (USER, GROUP):
            continue
        eff = perm & mask
        if eff & (_R | _W):
            grants.append(Grant("user" if tag == USER else "group", ident, "", bool(eff & _R), bool(eff & _W)))
    return grants


def parse_macos(text: str) -> list[Grant]:
    """The allow entries of a macOS ACL as ``acl_to_text`` writes it::

        !#acl 1
        user:FFFFEEEE-DDDD-CCCC-BBBB-AAAA000001F5:bob:501:allow:read,write
        group:ABCDEFAB-CDEF-ABCD-EFAB-CDEF0000000C:everyone:12:allow:read

    (tag, uuid, name, id, allow|deny, perms; inheritance flags may follow as a seventh field or
    among the perms). Deny entries only take away and are left out. A line that does not parse
    counts as a grant of everything to someone unknown: a check must refuse what it cannot read."""
    grants = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("!#acl"):
            continue
        fields = line.split(":")
        if len(fields) < 6 or fields[0] not in ("user", "group") or fields[4] not in ("allow", "deny"):
            grants.append(Grant("user", None, f"unparsed ACL entry {line!r}", True, True))
            continue
        if fields[4] == "deny":
            continue
        perms = {p.strip() for f in fields[5:] for p in f.split(",")}
        try:
            ident = int(fields[3]) if fields[3] else None
        except ValueError:
            ident = None
        everyone = fields[0] == "group" and fields[2] == "everyone"
        read, write = bool(perms & MAC_READ), bool(perms & MAC_WRITE)
        if read or write:
            grants.append(Grant(fields[0], None if everyone else ident, fields[2], read, write))
    return grants


def grants(path: str) -> list[Grant]:
    """The ACL grants on ``path`` (not following a final symlink on Linux); [] when it has no
    ACL or the filesystem keeps none. OSError when it exists but its ACL cannot be read."""
    if sys.platform == "darwin":
        text = _macos_acl_text(path)
        return parse_macos(text) if text else []
    getxattr = getattr(os, "getxattr", None)
    if getxattr is None:
        return []
    try:
        blob = getxattr(path, POSIX_XATTR, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            return []  # no ACL, a filesystem without them, or a symlink (its own has none)
        raise
    return parse_posix(blob)


def _macos_acl_text(path: str) -> str:
    """libc's acl_get_link_np + acl_to_text (macOS); "" when the file has no extended ACL."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.acl_get_link_np.restype = ctypes.c_void_p
    libc.acl_get_link_np.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.acl_to_text.restype = ctypes.c_void_p
    libc.acl_to_text.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    libc.acl_free.argtypes = [ctypes.c_void_p]
    acl = libc.acl_get_link_np(os.fsencode(path), _MAC_ACL_TYPE_EXTENDED)
    if not acl:
        err = ctypes.get_errno()
        if err == errno.ENOENT and os.path.lexists(path):
            return ""   # exists, has no extended ACL
        raise OSError(err, os.strerror(err), path)
    try:
        text = libc.acl_to_text(ctypes.c_void_p(acl), None)
        if not text:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        try:
            return ctypes.string_at(text).decode("utf-8", "replace")
        finally:
            libc.acl_free(ctypes.c_void_p(text))
    finally:
        libc.acl_free(ctypes.c_void_p(acl))


def foreign(found: list[Grant], owner: int, want_read: bool, want_write: bool) -> list[Grant]:
    """The grants that let someone other than ``owner`` read (``want_read``) or write
    (``want_write``): every group entry (its members are others), every user entry but the
    owner's own."""
    return [g for g in found
            if ((want_read and g.read) or (want_write and g.write))
            and not (g.kind == "user" and g.id == owner)]


def grants_user(found: list[Grant], uid: int, groups: set[int], read: bool = True) -> Grant | None:
    """The first grant that lets user ``uid`` (member of ``groups``) read (or write)."""
    for g in found:
        if not (g.read if read else g.write):
            continue
        if g.kind == "user" and (g.id is None or g.id == uid):
            return g
        if g.kind == "group" and (g.id is None or g.id in groups):
            return g
    return None


__all__ = ["Grant", "foreign", "grants", "grants_user", "parse_macos", "parse_posix"]
