"""Who a job that `mcclctl run` starts runs as, and what it inherits from mccld.

A launched job runs code the submitter chose. Run as mccld's own user it could read mccld's
key files and, through /proc (same uid, ptrace rules), mccld's memory and environment: the
fleet key that every host shares. So a job never runs as a user that can read a key file
mccld holds, nor as mccld's own user, nor as root, unless MCCL_LAUNCH_USER names that user
explicitly (the demo names root; a personal mccld may name its own user, accepting that its
jobs can read its keys).

Its environment is built from an allow-list, not copied: mccld's environment may hold
MCCL_FLEET_KEY and the paths of its key files. The job gets the locale and search paths
below, the engine's own MCCL_* settings (libmccl reads them; none of mccld's), then what
the submitter passed with --env, then the values the launcher itself sets.
"""

from __future__ import annotations

import logging
import os
import pwd
from pathlib import Path
from typing import Iterable, Mapping

from mccl_common import key_file_trust
from mccl_common.errors import ConfigError

log = logging.getLogger(__name__)

_PASSED = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "TERM",
                     "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTORCH_ENABLE_MPS_FALLBACK"})
_PASSED_PREFIXES = ("LC_",)


def _engine_settings() -> frozenset[str]:
    # The job's libmccl reads these (its job key file among them: the job's, which a job user that
    # cannot read it simply does not get); mccld's own settings (MCCL_FLEET_KEY, MCCL_KEY_FILE,
    # MCCL_SUBMIT_KEY_FILE, ...) are DaemonConfig's and never pass.
    from mccl_common.daemon_settings import DaemonConfig
    from mccl_common.settings import EngineConfig
    daemon = {f.metadata["env"] for f in DaemonConfig.__dataclass_fields__.values()}
    return frozenset(f.metadata["env"] for f in EngineConfig.__dataclass_fields__.values()) - daemon


def readable_by(path: Path, pw: pwd.struct_passwd) -> bool:
    """Whether user ``pw`` may read ``path``: by its mode bits or an ACL entry naming the user,
    one of its groups or everyone (mccl_common/key_file_trust.py); root may read anything."""
    return key_file_trust.readable_by(path, pw.pw_uid, set(os.getgrouplist(pw.pw_name, pw.pw_gid)))


def launch_user(setting: str, secret_files: Iterable[Path], host_id: str) -> pwd.struct_passwd:
    """The passwd entry jobs run as, or ConfigError saying why none may. ``setting`` is
    MCCL_LAUNCH_USER; ``secret_files`` the key files mccld read (named in the error, never read)."""
    me = os.geteuid()
    try:
        pw = pwd.getpwnam(setting) if setting else pwd.getpwuid(me)
    except KeyError:
        raise ConfigError(f"[launch] MCCL_LAUNCH_USER={setting!r} names no user on {host_id}; create it or fix "
                          "the setting") from None
    if pw.pw_uid == 0 and setting != "root":
        raise ConfigError(f"[launch] {host_id} refuses to start jobs: mccld runs as root and jobs never do unless "
                          "told; run mccld as its service user (docs/service.md) or set MCCL_LAUNCH_USER")
    if pw.pw_uid == me and not setting:
        raise ConfigError(f"[launch] {host_id} refuses to start jobs as mccld's own user {pw.pw_name}: they could "
                          "read its fleet key (its key files, its memory); set MCCL_LAUNCH_USER to a user without "
                          f"access to the keys, or to {pw.pw_name} to accept that")
    if pw.pw_uid in (0, me):
        # Named explicitly (checked above): the operator accepted that its jobs can read the keys.
        log.debug("[launch] jobs run as %s, who can read mccld's keys (MCCL_LAUNCH_USER says so)", pw.pw_name)
        return pw
    for path in secret_files:
        if readable_by(path, pw):
            raise ConfigError(f"[launch] {host_id} refuses to start jobs as {pw.pw_name}: that user can read "
                              f"mccld's key file {path}; launch as a user that cannot (MCCL_LAUNCH_USER)")
    return pw


def job_environment(parent: Mapping[str, str], requested: Mapping[str, str], pw: pwd.struct_passwd,
                    fixed: Mapping[str, str]) -> dict[str, str]:
    """The environment of a launched job: the allow-listed part of ``parent`` (mccld's), then the
    submitter's --env (``requested``), then the user's identity and the launcher's ``fixed`` values."""
    engine = _engine_settings()
    env = {k: v for k, v in parent.items()
           if k in _PASSED or k.startswith(_PASSED_PREFIXES) or k in engine}
    env.update(requested)
    env.update({"HOME": pw.pw_dir, "USER": pw.pw_name, "LOGNAME": pw.pw_name})
    env.update(fixed)
    return env
