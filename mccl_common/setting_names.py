"""Unknown MCCL_* names: a mistyped setting name (DAEMON spelt DEAMON) would otherwise be ignored without a
word. Each entry point (the torch backend's process group, mccld, mcclctl) calls ``warn_unknown``
once it starts; it lives apart from settings.py because it needs every registry, the daemon's
(daemon_settings, which imports settings) included."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Mapping

from . import daemon_settings  # noqa: F401 - registers DaemonConfig's settings
from .settings import ALL_SETTINGS, closest_name

log = logging.getLogger(__name__)

# MCCL_* names that are not settings and yet belong in an environment, each with who sets it:
# none of them warns. Everything else starting with MCCL_ is a setting's name or a mistake.
OTHER_NAMES: dict[str, str] = {
    "MCCL_DRAIN_FILE": "set by mccld for each job it launches (mccl_common/launch_protocol.py)",
    "MCCL_REFORM_FILE": "set by mccld for each job it launches (mccl_common/launch_protocol.py)",
    "MCCL_BENCH_TC_QUEUE": "tools/bench/scale.py: the shaped links' queue discipline",
    "MCCL_BENCH_TICKETS": "tools/bench/worker.py: the gated all-reduce benchmark",
    "MCCL_REFORM_TRIAL": "tools/bench/reform.py: marks the processes of a trial",
    "MCCL_TEST_MARKERS": "tests/e2e/test_daemon_fleet.py: where ranks leave their markers",
}

_warned: set[str] = set()
_warned_lock = threading.Lock()


def registered_names() -> set[str]:
    """Every setting's variable, the daemon's included (daemon_settings, imported above, registers them)."""
    return {f.metadata["env"] for cls in ALL_SETTINGS for f in dataclasses.fields(cls)}


def warn_unknown(env: Mapping[str, str]) -> list[str]:
    """Warns once per process for each MCCL_* name in ``env`` that no setting declares (a typo
    would otherwise be ignored without a word: a mistyped MCCL_DAEMON ran in-process), naming the
    closest registered name. Returns the names warned about now."""
    names = [n for n in env if n.startswith("MCCL_") and n not in OTHER_NAMES]
    if not names:
        return []
    known = registered_names()
    with _warned_lock:
        new = sorted(n for n in names if n not in known and n not in _warned)
        _warned.update(new)
    for name in new:
        close = closest_name(name, known)
        hint = f"; did you mean {close}?" if close else ""
        log.warning("[config] %s is set but is no MCCL setting, so it is ignored%s (the settings table in "
                    "README.md lists them all; `python -m mccl_common.settings_table` prints it)", name, hint)
    return new
