"""Keeping a leased host awake: a Mac that idles into sleep would take its jobs down with it.

``keep_awake()`` gives this platform's ``KeepAwake``: on macOS a ``caffeinate -i -w <mccld
pid>`` child (an idle-sleep power assertion the OS drops by itself should mccld die, so a
crashed daemon never keeps a Mac awake); elsewhere a no-op that says so once, because on
Linux the daemon does not manage suspend (mask sleep.target, or let logind's idle action
alone, on harvested hosts).

NOT VERIFIED ON A MAC: the caffeinate path is exercised here with a stand-in command only.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 2.0


class KeepAwake:
    """Held while the host is leased or draining; ``hold``/``release`` are idempotent."""

    def hold(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    @property
    def held(self) -> bool:
        raise NotImplementedError


class NoKeepAwake(KeepAwake):
    """Linux and others: nothing to assert. Says so once, the first time a lease would need it."""

    def __init__(self) -> None:
        self._held = False
        self._told = False

    def hold(self) -> None:
        if not self._told:
            self._told = True
            log.info("[harvest] leased: this platform has no power assertion in mccld; make sure the host "
                     "does not suspend while jobs run (e.g. `systemctl mask sleep.target`)")
        self._held = True

    def release(self) -> None:
        self._held = False

    @property
    def held(self) -> bool:
        return self._held


class Caffeinate(KeepAwake):
    """macOS: ``caffeinate -i -w <our pid>`` prevents idle sleep while it runs."""

    def __init__(self, argv: list[str] | None = None) -> None:
        self._argv = argv or ["caffeinate", "-i", "-w", str(os.getpid())]
        self._proc: subprocess.Popen | None = None

    def hold(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        try:
            self._proc = subprocess.Popen(self._argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
        except OSError as e:
            self._proc = None
            log.warning("[harvest] cannot keep the Mac awake while leased: %s failed (%s); it may sleep "
                        "under a running job: disable sleep in System Settings > Energy", self._argv[0], e)

    def release(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)

    @property
    def held(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


def keep_awake(platform: str = sys.platform) -> KeepAwake:
    return Caffeinate() if platform == "darwin" else NoKeepAwake()
