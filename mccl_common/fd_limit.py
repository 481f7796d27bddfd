"""The open-file limit (RLIMIT_NOFILE) of this process: raised towards what a component
needs, up to the hard limit (no privilege needed), or a ConfigError naming ``ulimit -n``.

Every socket is an open file, and macOS starts processes with a soft limit of 256: a
daemon serving many jobs and peers would otherwise fail later, with EMFILE, mid-job. The
engine does the same in C++ (libmccl/csrc/core/fd_limit.h) when a communicator is built.
"""

from __future__ import annotations

import logging
import os
import sys

from .errors import ConfigError

log = logging.getLogger(__name__)


def open_file_count() -> int:
    """Files this process has open now (-1 if it cannot tell)."""
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(d)) - 1  # listdir's own fd
        except OSError:
            continue
    return -1


def ensure_open_files(more: int, want: int, who: str) -> int:
    """Makes room for ``more`` files beyond those open now, raising the soft limit towards
    ``want`` (at most the hard limit). Returns the soft limit in force; raises ConfigError
    when even the hard limit leaves no room for ``more``."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to go by
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    is_open = max(open_file_count(), 0)
    need = is_open + more
    target = max(need, want)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    raised = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if sys.platform == "darwin":
        raised = min(raised, 10240)  # OPEN_MAX: setrlimit refuses more there
    if raised > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            log.debug("%s raised the open-file limit from %d to %d", who, soft, raised)
            soft = raised
        except (ValueError, OSError) as e:
            log.debug("%s could not raise the open-file limit to %d: %s", who, raised, e)
    if soft >= need:
        return soft
    hard_s = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    raise ConfigError(f"{who} needs to open {more} more files (sockets; {is_open} open already) but the open-file "
                      f"limit is {soft} (hard limit {hard_s}); raise it before starting: `ulimit -n {target}` "
                      "(or the hard limit in /etc/security/limits.conf / launchctl limit maxfiles)")
