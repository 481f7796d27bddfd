"""Attacker tests for key files (mccl_common/key_file_trust.py, file_acl.py): a key another user
can read through an ACL, or swap through a folder above it, is refused with a message naming the
file and the fix, never the key."""

from __future__ import annotations

import errno
import os
import pwd
import struct
from pathlib import Path

import pytest

from mccl_common import file_acl, key_file_trust
from mccl_common.daemon_settings import read_key_file
from mccl_common.errors import ConfigError
from mccld.host import launch_identity

pytestmark = pytest.mark.timeout(20)

KEY_HEX = "ab" * 32
NOBODY = pwd.getpwnam("nobody")
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="makes files of another user: needs root")


def _acl_blob(named_user: tuple[int, int] | None = None, named_group: tuple[int, int] | None = None,
              owner: int = 6, group: int = 0, other: int = 0) -> bytes:
    """A Linux ACL xattr (the kernel's own format, as setfacl writes it): entries sorted by tag."""
    ent = [(file_acl.USER_OBJ, owner, 0xFFFFFFFF)]
    if named_user:
        ent.append((file_acl.USER, named_user[1], named_user[0]))
    ent.append((file_acl.GROUP_OBJ, group, 0xFFFFFFFF))
    if named_group:
        ent.append((file_acl.GROUP, named_group[1], named_group[0]))
    mask = group | (named_user[1] if named_user else 0) | (named_group[1] if named_group else 0)
    ent += [(file_acl.MASK, mask, 0xFFFFFFFF), (file_acl.OTHER, other, 0xFFFFFFFF)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in ent)


def _set_acl(path: Path, blob: bytes) -> None:
    try:
        os.setxattr(path, file_acl.POSIX_XATTR, blob)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            pytest.skip(f"{path}'s filesystem keeps no POSIX ACLs")
        raise


def _key(folder: Path, name: str = "fleet.key") -> Path:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / name
    path.write_text(KEY_HEX + "\n")
    path.chmod(0o600)
    return path


def _refused(path: Path, *words: str) -> str:
    with pytest.raises(ConfigError) as ei:
        read_key_file(str(path), (), "MCCL_KEY_FILE")
    msg = str(ei.value)
    assert str(path) in msg and KEY_HEX not in msg and "abab" not in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_a_private_key_in_private_folders_is_read(tmp_path):
    assert read_key_file(str(_key(tmp_path / "keys")), (), "MCCL_KEY_FILE") == bytes.fromhex(KEY_HEX)


@root_only
def test_an_acl_granting_another_user_read_is_refused_and_named(tmp_path):
    key = _key(tmp_path / "keys")
    _set_acl(key, _acl_blob(named_user=(NOBODY.pw_uid, 4)))
    _refused(key, "ACL", "nobody", "setfacl -b")


@root_only
def test_the_launch_user_named_in_a_keys_acl_is_refused(tmp_path):
    """Mode bits alone say 0640 root:root, which nobody (not in group root) cannot read; its
    own ACL entry lets it read: jobs as nobody could read mccld's key."""
    key = _key(tmp_path / "keys")
    _set_acl(key, _acl_blob(named_user=(NOBODY.pw_uid, 4)))
    with pytest.raises(ConfigError, match=f"can read mccld's key file {key}"):
        launch_identity.launch_user("nobody", [key], "hostA")
    key.chmod(0o600)   # the mask drops to nothing: nobody's entry grants nothing any more
    assert launch_identity.launch_user("nobody", [key], "hostA").pw_uid == NOBODY.pw_uid


@root_only
def test_a_group_acl_granting_the_launch_users_group_is_refused(tmp_path):
    key = _key(tmp_path / "keys")
    _set_acl(key, _acl_blob(named_group=(NOBODY.pw_gid, 4)))
    assert launch_identity.readable_by(key, NOBODY)
    _refused(key, "ACL", "group")


def test_a_world_writable_folder_without_sticky_bit_is_refused(tmp_path):
    folder = tmp_path / "shared"
    key = _key(folder)
    folder.chmod(0o777)
    _refused(key, f"folder {folder}", "everyone", "chmod go-w")
    folder.chmod(0o770)
    _refused(key, f"folder {folder}", "its group")
    folder.chmod(0o700)
    assert read_key_file(str(key), (), "MCCL_KEY_FILE")


def test_a_symlink_through_a_writable_folder_is_refused(tmp_path):
    key = _key(tmp_path / "private")
    hub = tmp_path / "hub"
    hub.mkdir(mode=0o777)
    hub.chmod(0o777)
    (hub / "fleet.key").symlink_to(key)
    _refused(hub / "fleet.key", f"folder {hub}")
    # ... and a symlink whose target sits under such a folder
    link = tmp_path / "private" / "via.key"
    target = _key(hub / "inner")
    link.symlink_to(target)
    _refused(link, f"folder {hub}")


@root_only
def test_a_folder_of_another_user_is_refused(tmp_path):
    folder = tmp_path / "theirs"
    key = _key(folder)
    os.chown(folder, NOBODY.pw_uid, -1)
    _refused(key, f"folder {folder}", "nobody")


@root_only
def test_a_folder_acl_letting_another_user_write_is_refused(tmp_path):
    folder = tmp_path / "keys"
    key = _key(folder)
    _set_acl(folder, _acl_blob(named_user=(NOBODY.pw_uid, 7), owner=7))
    _refused(key, f"folder {folder}", "ACL", "nobody")


@root_only
def test_in_a_sticky_shared_folder_only_my_own_or_roots_entry_counts(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    mine = _key(tmp, "mine.key")
    assert read_key_file(str(mine), (), "MCCL_KEY_FILE")
    theirs = _key(tmp, "theirs.key")
    os.chown(theirs, NOBODY.pw_uid, -1)   # root could read it: a stranger's key planted in /tmp
    _refused(theirs, "nobody", "anyone may create a name there first")


def test_macos_acl_text_is_read_as_the_os_enforces_it():
    text = ("!#acl 1\n"
            "user:FFFFEEEE-DDDD-CCCC-BBBB-AAAA000001F5:bob:501:allow:read\n"
            "group:ABCDEFAB-CDEF-ABCD-EFAB-CDEF0000000C:everyone:12:deny:read\n"
            "group:ABCDEFAB-CDEF-ABCD-EFAB-CDEF00000050:admin:80:allow:readattr,readsecurity\n"
            "user:FFFFEEEE-DDDD-CCCC-BBBB-AAAA000001F6:carol:502:allow:add_file,delete_child\n"
            "group:ABCDEFAB-CDEF-ABCD-EFAB-CDEF0000000C:everyone:12:allow:list\n")
    got = file_acl.parse_macos(text)
    assert [(g.kind, g.id, g.read, g.write) for g in got] == [
        ("user", 501, True, False), ("user", 502, False, True), ("group", None, True, False)]
    assert file_acl.foreign(got, 501, want_read=True, want_write=False) == [got[2]]
    assert file_acl.grants_user(got, 777, {20}) == got[2]   # everyone
    assert file_acl.parse_macos("garbage line")[0].read       # what cannot be read is refused


def test_an_acl_the_mode_bits_do_not_show_is_refused(tmp_path, monkeypatch):
    """macOS's case, run on any OS: mode 0600, and an ACL entry (invisible in the mode bits)
    lets another user read."""
    key = _key(tmp_path / "keys")
    acl = file_acl.parse_macos("!#acl 1\nuser:FFFFEEEE-DDDD-CCCC-BBBB-AAAA000001F5:bob:501:allow:read\n")
    monkeypatch.setattr(file_acl, "grants", lambda p: acl if p == str(key) else [])
    _refused(key, "ACL", "bob")
    bob = pwd.struct_passwd(("bob", "x", 501, 501, "", "/", "/bin/sh"))
    monkeypatch.setattr(os, "getgrouplist", lambda name, gid: [gid])
    assert launch_identity.readable_by(key, bob)


def test_walk_records_every_folder_a_symlink_goes_through(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "k").write_text("x")
    (tmp_path / "l").symlink_to("a/b")
    steps, final = key_file_trust.walk(tmp_path / "l" / "k")
    assert final == str(tmp_path / "a" / "b" / "k")
    assert str(tmp_path / "a") in [f for f, _, _ in steps]
