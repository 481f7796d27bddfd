"""The harvest state of this host: busy -> idle -> leased -> draining -> busy.

- busy: the user is here (or harvesting is not allowed now: outside MCCL_HARVEST_HOURS, on
  battery, or no activity source can tell);
- idle: no user input for MCCL_IDLE_AFTER seconds: the fleet may lease the host;
- leased: idle, and a job runs on the daemon;
- draining: leased, and the user came back (or the harvest window closed): the running
  jobs leave, at a step boundary or removed when MCCL_RECLAIM_GRACE runs out (reclaim.py),
  no new lease; once they are gone, busy.

Hysteresis: entering idle takes MCCL_IDLE_AFTER seconds without input, leaving it takes
fresh input, so the state cannot flap around the threshold; after draining, the host must
again be left alone for MCCL_IDLE_AFTER before it is idle. A locked screen or an empty
console (macOS) shortens the wait to AWAY_AFTER_S: the user left on purpose.

``HarvestPolicy`` is the pure state machine (the caller passes each sample and the time);
``HarvestHistory`` keeps its transitions in a size-capped file of the runtime dir, from
which ``harvestable_per_night`` derives the hours a host is harvestable per night;
``Harvester`` runs them on a thread with an explicit start/stop.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from mccl_common.daemon_settings import DaemonConfig
from mccl_common.status_protocol import HARVESTED_STATES

from .activity import Activity, ActivityMonitor
from .keepawake import KeepAwake, keep_awake
from ..logutil import OnceLogger

log = logging.getLogger(__name__)

JOB_POLL_S = 1.0            # poll at least this often while a job runs: its processes yield within it
AWAY_AFTER_S = 60.0         # screen locked / nobody at the console: idle after this much quiet
HISTORY_NAME = "harvest-history.jsonl"
HISTORY_MAX_BYTES = 64 << 10    # ~1000 transitions, weeks of a normal desk; compacted to half past it
HISTORY_NIGHTS = 7          # nights the harvestable-hours average covers
OFF = "off"                 # history marker: mccld stopped, nothing known until the next record
NIGHT_STARTS_AT_HOUR = 12   # a "night" runs noon to noon, local time, so it is never cut in two


def local_hour(t: float) -> int:
    return time.localtime(t).tm_hour


def in_window(hour: int, window: tuple[int, int] | None) -> bool:
    if window is None:
        return True
    start, end = window
    return start <= hour < end if start < end else hour >= start or hour < end


class HarvestPolicy:
    """The state machine, without threads, I/O or a clock of its own."""

    def __init__(self, idle_after_s: float, window: tuple[int, int] | None = None, require_ac: bool = True,
                 hour_of: Callable[[float], int] = local_hour, now: float = 0.0):
        self.idle_after_s = idle_after_s
        self.window = window
        self.require_ac = require_ac
        self._hour_of = hour_of
        self.state = "busy"
        self.since = now
        self.reason = "starting"

    def harvestable(self, activity: Activity, now: float) -> tuple[bool, str]:
        """May the host be harvested now, and why (or why not)."""
        if activity.idle_s is None:
            return False, ("no activity source answers (no logind session, not a Mac); set "
                           "MCCL_ACTIVITY_FILE to harvest this host")
        if not in_window(self._hour_of(now), self.window):
            return False, f"outside MCCL_HARVEST_HOURS {self.window[0]}-{self.window[1]}"
        if self.require_ac and activity.on_ac is False:
            return False, "on battery (MCCL_HARVEST_REQUIRE_AC)"
        wait = min(self.idle_after_s, AWAY_AFTER_S) if activity.user_away else self.idle_after_s
        if activity.idle_s < wait:
            return False, f"user input {activity.idle_s:.0f} s ago"
        return True, f"no user input for {activity.idle_s:.0f} s"

    def update(self, activity: Activity, jobs: int, now: float) -> str | None:
        """Feed one sample and the number of running jobs; the new state, or None if unchanged."""
        ok, why = self.harvestable(activity, now)
        state = self.state
        if state == "busy":
            new = ("leased" if jobs else "idle") if ok else "busy"
        elif state in ("idle", "leased"):
            # An idle host with jobs is leased even before a sample said so: a job leased at the
            # start of a poll interval and the user back before its end must drain (and be
            # removed by the reclaim deadline), not turn busy and keep the job at full size.
            new = ("leased" if jobs else "idle") if ok else ("draining" if jobs else "busy")
        else:  # draining: only the jobs' end moves it, to busy; a new lease needs a new idle spell
            new = "draining" if jobs else "busy"
        if new == "draining" and state == "draining":
            why = f"{jobs} job(s) finishing; " + why
        self.reason = why
        if new == state:
            return None
        self.state, self.since = new, now
        return new


# ---- history ----------------------------------------------------------------------------

class HarvestHistory:
    """State transitions as JSON lines ({"t": epoch s, "state": ...}), capped at ``max_bytes``:
    past it the file is rewritten with its newer half. ``path`` None keeps them in memory."""

    def __init__(self, path: Path | None, max_bytes: int = HISTORY_MAX_BYTES):
        self._path = path
        self._max = max_bytes
        self._records: list[tuple[float, str]] = []
        self._size = 0
        self._lock = threading.Lock()
        self._once = OnceLogger(log)

    def load(self) -> None:
        if self._path is None:
            return
        try:
            text = self._path.read_text()
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("[harvest] cannot read %s (%s); starting a new history", self._path, e)
            return
        records = []
        for line in text.splitlines():
            try:
                rec = json.loads(line)
                records.append((float(rec["t"]), str(rec["state"])))
            except (ValueError, KeyError, TypeError):
                continue    # a line cut by a crash mid-write: the rest still counts
        with self._lock:
            self._records = records
            self._size = len(text.encode())

    def record(self, t: float, state: str) -> None:
        line = json.dumps({"t": round(t, 3), "state": state}) + "\n"
        with self._lock:
            if self._records and self._records[-1][1] == state:
                return
            self._records.append((t, state))
            self._size += len(line)
            if self._size > self._max:
                keep = self._records[len(self._records) // 2:]
                self._records = keep
                text = "".join(json.dumps({"t": round(t_, 3), "state": s}) + "\n" for t_, s in keep)
                self._size = len(text)
                self._write(text, "w")
            else:
                self._write(line, "a")

    def _write(self, text: str, mode: str) -> None:
        if self._path is None:
            return
        try:
            if mode == "w":
                tmp = self._path.with_suffix(".tmp")
                tmp.write_text(text)
                os.replace(tmp, self._path)
            else:
                with open(self._path, "a") as fh:
                    fh.write(text)
            self._once.forget("write")
        except OSError as e:
            self._once.warn("write", "[harvest] cannot write %s (%s); the history lives in memory only "
                            "until it can", self._path, e)

    def records(self) -> list[tuple[float, str]]:
        with self._lock:
            return list(self._records)


def recent_nights(now: float, n: int = HISTORY_NIGHTS) -> list[tuple[float, float]]:
    """The last ``n`` complete nights before ``now``, newest first: local noon to local noon
    (23 or 25 hours across a DST change)."""
    today = datetime.datetime.fromtimestamp(now).replace(hour=NIGHT_STARTS_AT_HOUR, minute=0, second=0,
                                                           microsecond=0)
    if today.timestamp() > now:
        today -= datetime.timedelta(days=1)
    ends = [today - datetime.timedelta(days=k) for k in range(n + 1)]
    return [(ends[k + 1].timestamp(), ends[k].timestamp()) for k in range(n)]


def harvested_seconds(records: list[tuple[float, str]], start: float, end: float) -> float:
    """Seconds of [start, end) spent in a harvested state; each record lasts until the next."""
    total = 0.0
    for (t, state), nxt in zip(records, records[1:] + [(end, OFF)]):
        if state in HARVESTED_STATES:
            total += max(0.0, min(nxt[0], end) - max(t, start))
    return total


def harvestable_per_night(records: list[tuple[float, str]], nights: Iterable[tuple[float, float]],
                          now: float) -> tuple[float | None, int]:
    """(mean harvested seconds per night, nights averaged) over the nights the history covers
    completely; (None, 0) before the first whole night."""
    if not records:
        return None, 0
    covered = [(s, e) for s, e in nights if s >= records[0][0] and e <= now]
    if not covered:
        return None, 0
    return sum(harvested_seconds(records, s, e) for s, e in covered) / len(covered), len(covered)


# ---- the running part ---------------------------------------------------------------------

class Harvester:
    """Samples activity every MCCL_HARVEST_POLL seconds, runs the policy, records transitions,
    holds the keep-awake assertion while leased or draining, and reports every sample to
    ``on_update(snapshot, changed)``. ``jobs()`` counts the daemon's running jobs."""

    def __init__(self, cfg: DaemonConfig, runtime_dir: Path | None, jobs: Callable[[], int],
                 on_update: Callable[[dict, bool], None], *, monitor: ActivityMonitor | None = None,
                 awake: KeepAwake | None = None, clock: Callable[[], float] = time.time):
        self._cfg = cfg
        self._jobs = jobs
        self._on_update = on_update
        self._monitor = monitor or ActivityMonitor(cfg.activity_file)
        self._awake = awake or keep_awake()
        self._clock = clock
        self._policy = HarvestPolicy(cfg.idle_after_s, cfg.harvest_window(), cfg.harvest_require_ac,
                                     now=clock())
        self.history = HarvestHistory(runtime_dir / HISTORY_NAME if runtime_dir is not None else None)
        self._activity = Activity(None)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poke = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Harvester":
        if self._thread is not None:
            return self
        self._stop.clear()
        self.history.load()
        self.history.record(self._clock(), self._policy.state)
        self.tick()     # the first state is known before start returns: status never says "starting"
        self._thread = threading.Thread(target=self._loop, name="mccld-harvest", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()
        if self._thread is not None:
            self._thread.join(timeout=self._cfg.harvest_poll_s + 5.0)
            if self._thread.is_alive():
                log.warning("[harvest] monitor thread did not stop within %.1f s",
                            self._cfg.harvest_poll_s + 5.0)
            self._thread = None
            self.history.record(self._clock(), OFF)
        self._awake.release()

    def poke(self) -> None:
        """Re-evaluate now (a job started or ended) instead of at the next poll."""
        self._poke.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._poke.wait(self._interval())
            self._poke.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the monitor must survive anything
                log.exception("[harvest] evaluating the harvest state failed")

    def _interval(self) -> float:
        """A host with jobs is sampled often enough that its user gets it back within a second
        of touching it; an idle or busy one no more than MCCL_HARVEST_POLL asks."""
        try:
            jobs = self._jobs()
        except Exception:  # noqa: BLE001 - the count is only a hint for the poll interval
            jobs = 0
        return min(self._cfg.harvest_poll_s, JOB_POLL_S) if jobs else self._cfg.harvest_poll_s

    def tick(self) -> None:
        activity = self._monitor.sample()
        now = self._clock()
        with self._lock:
            self._activity = activity
            before = self._policy.state
            changed = self._policy.update(activity, self._jobs(), now) is not None
            state = self._policy.state
        if changed:
            log.info("[harvest] %s -> %s: %s", before, state, self._policy.reason)
            self.history.record(now, state)
            if state in ("leased", "draining"):
                self._awake.hold()
            else:
                self._awake.release()
        self._on_update(self.snapshot(), changed)

    def snapshot(self) -> dict:
        now = self._clock()
        with self._lock:
            policy, activity = self._policy, self._activity
            out = {"state": policy.state, "since": policy.since, "reason": policy.reason,
                   "idle_after_s": policy.idle_after_s, "hours": self._cfg.harvest_hours or None,
                   "keep_awake": self._awake.held, **activity.as_dict()}
        per_night, nights = harvestable_per_night(self.history.records(), recent_nights(now), now)
        out["harvestable_s_per_night"] = per_night
        out["nights"] = nights
        return out

    def history_records(self) -> list[dict]:
        return [{"t": t, "state": s} for t, s in self.history.records()]

