"""A reclaim as a user sees it (tests/e2e/test_reclaim_fleet.py, tools/reclaim_trials.py): ``mcclctl
run`` of examples/count_steps.py, a plain script without libmccl.elastic, and a ``Watch`` on one
host's job processes from the moment its user is back."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path

from mccld.host.priority import is_background

from .elastic import FLEET_KEY, PY, REPO, job_pids

SCRIPT = REPO / "examples" / "count_steps.py"
COUNT_LINE = re.compile(r"count step (\d+) world (\d+)")


class Watch:
    """Watches one host's job processes from the moment the user is back: when every one of
    them (all threads) first runs at background priority, and when the last one is gone."""

    def __init__(self, host: str, needle: str):
        self.host, self.needle = host, needle
        self.touched: float | None = None
        self.lowered: float | None = None
        self.gone: float | None = None
        self.seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reclaim-watch", daemon=True)

    def touch(self, activity: Path) -> None:
        self.touched = time.monotonic()
        activity.touch()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            pids = job_pids(self.host, self.needle)
            self.seen = max(self.seen, len(pids))
            if not pids:
                if self.seen or now - self.touched > 30:
                    self.gone = now
                    return
            elif self.lowered is None and _all_background(pids):
                self.lowered = now
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def report(self) -> str:
        def after(t):
            return "never" if t is None else f"{t - self.touched:.2f} s"
        return (f"priority lowered {after(self.lowered)} and job processes gone {after(self.gone)} "
                "after the user's return")


def _all_background(pids: list[int]) -> bool:
    try:
        return all(is_background(int(t)) for p in pids for t in os.listdir(f"/proc/{p}/task"))
    except (OSError, ProcessLookupError):
        return False        # one ended meanwhile: look again


def run_plain(hosts, n_min: int, n_max: int, steps: int, ckpt: Path) -> subprocess.Popen:
    """``mcclctl run`` of count_steps.py on ``hosts`` (support.elastic.start_hosts), its output
    (both streams) on stdout."""
    return subprocess.Popen(
        [PY, "-m", "mcclctl", "run", "--min", str(n_min), "--max", str(n_max), *hosts.args,
         "--submit-key-file", str(hosts.key), "--env", "OMP_NUM_THREADS=1", "--env", f"STEPS={steps}",
         "--env", f"CKPT={ckpt}", "--env", "CKPT_EVERY=10", "--", "python", str(SCRIPT)],
        cwd=hosts.root, env={**os.environ, "MCCL_FLEET_KEY": FLEET_KEY},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
