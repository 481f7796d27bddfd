"""Is somebody using this host? The activity monitor behind the harvest state (harvest.py).

Sources, each optional, combined by taking the most recent input any of them saw:

- macOS: the HID idle time (``HIDIdleTime`` of ``IOHIDSystem``, nanoseconds, from
  ``ioreg``), the console user and whether the screen is locked (``IOConsoleUsers`` of the
  IORegistry root), the power source (``pmset -g batt``);
- Linux: logind's idle hint of the local user sessions (``loginctl``; no logind, as in a
  container, is "unknown", not an error), the power source from /sys/class/power_supply;
- everywhere: ``MCCL_ACTIVITY_FILE``, whose modification time counts as input. Hosts
  emulated as network namespaces share one kernel and one logind, so tests drive each
  daemon's activity through its own file.

NOT VERIFIED ON A MAC: the macOS parsers are written against the documented output of
``ioreg`` and ``pmset`` and unit-tested on captured text only; nobody has run them on macOS.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..logutil import OnceLogger

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 3.0       # per ioreg / loginctl / pmset run: a hung tool must not stall the monitor
POWER_SUPPLY_DIR = "/sys/class/power_supply"
LOGIND_RETRY_S = 60.0       # logind absent or failing: ask again this much later, not every poll


@dataclass(frozen=True)
class Activity:
    """One sample of the user's activity; None: no source could tell."""
    idle_s: float | None                    # seconds since the last input any source saw
    sources: tuple[str, ...] = ()           # the sources that answered
    console_user: str | None = None         # macOS: who is logged in at the screen
    screen_locked: bool | None = None       # macOS
    on_ac: bool | None = None               # None: not detectable (a desktop) or unknown

    @property
    def user_away(self) -> bool:
        """A locked screen, or nobody at the console (the login window): the user left on purpose."""
        return self.screen_locked is True or ("ioreg-console" in self.sources and self.console_user is None)

    def as_dict(self) -> dict:
        return {"idle_s": self.idle_s, "sources": list(self.sources), "console_user": self.console_user,
                "screen_locked": self.screen_locked, "on_ac": self.on_ac}


Runner = Callable[[list[str]], str]


def run_tool(argv: list[str]) -> str:
    """stdout of a short probe; raises OSError / SubprocessError when it fails or hangs."""
    out = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    if out.returncode != 0:
        raise subprocess.SubprocessError(f"{argv[0]} exited {out.returncode}: {out.stderr.strip()[:200]}")
    return out.stdout


# ---- parsers (pure: tested on captured output) ------------------------------------------

def parse_hid_idle_s(text: str) -> float | None:
    """``ioreg -c IOHIDSystem -d 4 -r -k HIDIdleTime``: nanoseconds since the last HID input.
    Several HID systems may answer; the smallest is the latest input."""
    values = [int(v) for v in re.findall(r'"HIDIdleTime"\s*=\s*(\d+)', text)]
    return min(values) / 1e9 if values else None


def parse_console(text: str) -> tuple[str | None, bool | None]:
    """``ioreg -n Root -d1``'s IOConsoleUsers: (user on the console, its screen locked?).
    The user whose session is on the console counts; none: the login window is showing."""
    m = re.search(r'"IOConsoleUsers"\s*=\s*\((.*?)\)\s*$', text, re.M | re.S)
    if m is None:
        return None, None
    for session in re.findall(r"\{([^{}]*)\}", m.group(1)):
        if re.search(r'"kCGSSessionOnConsoleKey"\s*=\s*Yes', session):
            user = re.search(r'"kCGSSessionUserNameKey"\s*=\s*"([^"]*)"', session)
            locked = re.search(r'"CGSSessionScreenIsLocked"\s*=\s*(Yes|No)', session)
            return (user.group(1) if user else None), (locked is not None and locked.group(1) == "Yes")
    return None, None


def parse_pmset_ac(text: str) -> bool | None:
    """``pmset -g batt``: "Now drawing from 'AC Power'" or "'Battery Power'"."""
    m = re.search(r"drawing from '([^']+)'", text)
    if m is None:
        return None
    return m.group(1) == "AC Power"


def parse_loginctl_sessions(text: str) -> list[str]:
    """``loginctl list-sessions --no-legend``: the first column is the session id."""
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def parse_logind_idle_s(text: str, now: float) -> float | None:
    """``loginctl show-session ID... -p IdleHint -p IdleSinceHint -p Remote -p Class``: blocks
    separated by blank lines. Only local user sessions count: a person at an ssh prompt is not
    at the keyboard, and ssh sessions never set the idle hint, so they would block harvesting
    forever. A session not idle counts as input now."""
    best = None
    for block in re.split(r"\n\s*\n", text.strip()):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if props.get("Class", "user") != "user" or props.get("Remote") == "yes":
            continue
        if props.get("IdleHint") == "yes":
            try:
                since_us = int(props.get("IdleSinceHint", "0"))
            except ValueError:
                continue
            idle = max(0.0, now - since_us / 1e6) if since_us else None
        elif props.get("IdleHint") == "no":
            idle = 0.0
        else:
            continue
        if idle is not None:
            best = idle if best is None else min(best, idle)
    return best


def linux_on_ac(root: Path) -> bool | None:
    """A mains supply online: on AC; batteries but no mains online: on battery; neither: unknown."""
    try:
        supplies = list(root.iterdir())
    except OSError:
        return None
    mains, battery = [], False
    for s in supplies:
        try:
            kind = (s / "type").read_text().strip()
            if kind == "Mains":
                mains.append((s / "online").read_text().strip() == "1")
            elif kind == "Battery":
                battery = True
        except OSError:
            continue
    if any(mains):
        return True
    return False if battery else None


# ---- the monitor ------------------------------------------------------------------------

class ActivityMonitor:
    """Samples every source this platform has. ``run`` and ``clock`` (wall clock) are seams
    for tests; a source that fails repeatedly warns once, then logs at DEBUG."""

    def __init__(self, activity_file: str = "", *, platform: str = sys.platform, run: Runner = run_tool,
                 clock: Callable[[], float] = time.time, power_supply_dir: str = POWER_SUPPLY_DIR):
        self._file = Path(activity_file).expanduser() if activity_file else None
        self._platform = platform
        self._run = run
        self._clock = clock
        self._power_dir = Path(power_supply_dir)
        self._started = clock()
        self._once = OnceLogger(log)
        self._logind_after = 0.0    # wall clock before which logind is not asked again

    def sample(self) -> Activity:
        now = self._clock()
        idle: list[float] = []
        sources: list[str] = []
        user, locked, on_ac = None, None, None
        if self._platform == "darwin":
            hid = self._probe("ioreg-hid", ["ioreg", "-c", "IOHIDSystem", "-d", "4", "-r", "-k", "HIDIdleTime"],
                              parse_hid_idle_s)
            if hid is not None:
                idle.append(hid)
                sources.append("ioreg-hid")
            console = self._probe("ioreg-console", ["ioreg", "-n", "Root", "-d1"], parse_console)
            if console is not None:
                user, locked = console
                sources.append("ioreg-console")
            on_ac = self._probe("pmset", ["pmset", "-g", "batt"], parse_pmset_ac)
        elif self._platform.startswith("linux"):
            logind = self._logind_idle_s(now)
            if logind is not None:
                idle.append(logind)
                sources.append("logind")
            on_ac = linux_on_ac(self._power_dir)
        if self._file is not None:
            idle.append(self._file_idle_s(now))
            sources.append("activity-file")
        return Activity(min(idle) if idle else None, tuple(sources), user, locked, on_ac)

    def _probe(self, name: str, argv: list[str], parse):
        try:
            out = parse(self._run(argv))
        except (OSError, subprocess.SubprocessError) as e:
            self._once.warn(name, "[harvest] %s failed (%s); the harvest state goes without it", argv[0], e)
            return None
        self._once.forget(name)
        return out

    def _logind_idle_s(self, now: float) -> float | None:
        if now < self._logind_after:
            return None
        try:
            ids = parse_loginctl_sessions(self._run(["loginctl", "list-sessions", "--no-legend"]))
            if not ids:
                return None
            text = self._run(["loginctl", "show-session", *ids, "-p", "IdleHint", "-p", "IdleSinceHint",
                              "-p", "Remote", "-p", "Class"])
        except (OSError, subprocess.SubprocessError) as e:
            # No logind (containers, non-systemd hosts): unknown, not an error.
            log.debug("logind's idle hint is unavailable: %s", e)
            self._logind_after = now + LOGIND_RETRY_S
            return None
        return parse_logind_idle_s(text, now)

    def _file_idle_s(self, now: float) -> float:
        try:
            mtime = self._file.stat().st_mtime
        except OSError:
            # Not written yet (a login hook creates it later): no input since we started.
            mtime = self._started
        return max(0.0, now - mtime)
