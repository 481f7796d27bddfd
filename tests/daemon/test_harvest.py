"""The harvest state: the policy as a pure state machine on injected times, the activity
sources on captured tool output, the bounded history and its nights, the keep-awake
assertion, and one in-process mccld whose MCCL_ACTIVITY_FILE drives status and exporter."""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mccl_common.daemon_settings import load_config
from mccl_common.errors import ConfigError
from mccl_common.status_protocol import query
from mccld.host.activity import (Activity, ActivityMonitor, linux_on_ac, parse_console, parse_hid_idle_s,
                            parse_logind_idle_s, parse_loginctl_sessions, parse_pmset_ac)
from mccld.host.harvest import (AWAY_AFTER_S, OFF, Harvester, HarvestHistory, HarvestPolicy, harvestable_per_night,
                           harvested_seconds, recent_nights)
from mccld.host.keepawake import Caffeinate, NoKeepAwake
from support.daemon import one_rank_job, running_daemon, RawClient
from support.prometheus import free_port

H = 3600.0


def utc_hour(t: float) -> int:
    return int(t // H) % 24


def here(idle_s, **kw) -> Activity:
    return Activity(idle_s, ("activity-file",), **kw)


# ---- the policy --------------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_policy_walks_busy_idle_leased_draining_busy():
    p = HarvestPolicy(idle_after_s=900, hour_of=utc_hour, now=0)
    assert p.update(here(899), jobs=0, now=899) is None and p.state == "busy"
    assert p.update(here(900), jobs=0, now=900) == "idle" and p.since == 900
    assert p.update(here(1000), jobs=1, now=1000) == "leased"
    assert p.update(here(1100), jobs=0, now=1100) == "idle"        # the job ended, the user is still away
    assert p.update(here(1200), jobs=2, now=1200) == "leased"
    assert p.update(here(3), jobs=2, now=1300) == "draining"         # the user is back: jobs finish
    assert p.update(here(5000), jobs=1, now=1400) is None            # away again: still draining
    assert p.state == "draining" and "1 job(s) finishing" in p.reason
    assert p.update(here(0), jobs=0, now=1500) == "busy"
    # Hysteresis: after draining, a whole MCCL_IDLE_AFTER of quiet again before idle.
    assert p.update(here(899), jobs=0, now=2399) is None
    assert p.update(here(900), jobs=0, now=2400) == "idle"
    assert p.update(here(0.5), jobs=0, now=2401) == "busy" and p.reason == "user input 0 s ago"


@pytest.mark.timeout(10)
def test_policy_a_job_leased_between_two_samples_drains_when_the_user_is_back():
    p = HarvestPolicy(idle_after_s=900)
    assert p.update(here(1000), jobs=0, now=1000) == "idle"
    # The lease started after that sample; the next one already sees the user (issue 25: a
    # user back during the job's start-up got "busy", and the job ran on at full size).
    assert p.update(here(0.5), jobs=1, now=1001) == "draining"
    assert p.update(here(0.5), jobs=0, now=1010) == "busy"


def test_policy_busy_host_with_a_job_goes_straight_to_leased_and_back_to_busy_without_jobs():
    p = HarvestPolicy(idle_after_s=60, hour_of=utc_hour)
    assert p.update(here(10), jobs=1, now=10) is None                # the user's own job: busy
    assert p.update(here(61), jobs=1, now=61) == "leased"
    assert p.update(here(1), jobs=0, now=70) == "busy"               # leased, user back, no job: busy


@pytest.mark.timeout(10)
def test_policy_hours_battery_unknown_and_locked_screen():
    night = HarvestPolicy(idle_after_s=60, window=(22, 7), hour_of=utc_hour)
    assert night.update(here(1e4), jobs=0, now=21 * H) is None and "MCCL_HARVEST_HOURS 22-7" in night.reason
    assert night.update(here(1e4), jobs=0, now=23 * H) == "idle"
    assert night.update(here(1e4), jobs=0, now=30 * H) is None       # 06:00 next day: still inside
    assert night.update(here(1e4), jobs=1, now=30.5 * H) == "leased"
    assert night.update(here(1e4), jobs=1, now=31 * H) == "draining"  # 07:00: window closed, job runs on

    battery = HarvestPolicy(idle_after_s=60, hour_of=utc_hour)
    assert battery.update(here(1e4, on_ac=False), jobs=0, now=1) is None and "battery" in battery.reason
    assert battery.update(here(1e4, on_ac=None), jobs=0, now=2) == "idle"     # a desktop: no battery
    lax = HarvestPolicy(idle_after_s=60, require_ac=False, hour_of=utc_hour)
    assert lax.update(here(1e4, on_ac=False), jobs=0, now=1) == "idle"

    unknown = HarvestPolicy(idle_after_s=60, hour_of=utc_hour)
    assert unknown.update(Activity(None), jobs=0, now=1e6) is None and "MCCL_ACTIVITY_FILE" in unknown.reason

    locked = HarvestPolicy(idle_after_s=900, hour_of=utc_hour)
    mac = Activity(AWAY_AFTER_S, ("ioreg-hid", "ioreg-console"), console_user="ann", screen_locked=True)
    assert locked.update(mac, jobs=0, now=100) == "idle"
    login_window = Activity(AWAY_AFTER_S, ("ioreg-hid", "ioreg-console"), console_user=None)
    assert login_window.user_away and not Activity(AWAY_AFTER_S, ("ioreg-hid",)).user_away


@pytest.mark.timeout(10)
def test_harvest_hours_setting_is_validated():
    env = {"MCCL_FLEET_KEY": "k" * 32}
    assert load_config(env={**env, "MCCL_HARVEST_HOURS": "22-7"}).harvest_window() == (22, 7)
    assert load_config(env=env).harvest_window() is None
    for bad in ("22", "5-5", "1-24", "a-b"):
        with pytest.raises(ConfigError, match="MCCL_HARVEST_HOURS"):
            load_config(env={**env, "MCCL_HARVEST_HOURS": bad})
    with pytest.raises(ConfigError, match="MCCL_IDLE_AFTER"):
        load_config(env={**env, "MCCL_IDLE_AFTER": "0"})


# ---- the activity sources ------------------------------------------------------------------

IOREG_HID = '''+-o IOHIDSystem  <class IOHIDSystem, id 0x100000477, registered, matched, active, busy 0>
    {
      "HIDIdleTime" = 1250000000
      "HIDParameters" = {"HIDKeyRepeat"=83333333}
    }
'''
IOREG_ROOT = '''+-o Root  <class IORegistryEntry, id 0x100000100, retain 31>
    {
      "IOKitBuildVersion" = "Darwin Kernel Version 23.4.0"
      "IOConsoleLocked" = Yes
      "IOConsoleUsers" = ({"kCGSSessionUserIDKey"=501,"kCGSSessionOnConsoleKey"=Yes,"kCGSSessionUserNameKey"="ann","CGSSessionScreenIsLocked"=Yes,"kCGSessionLoginDoneKey"=Yes},{"kCGSSessionOnConsoleKey"=No,"kCGSSessionUserNameKey"="bob"})
    }
'''
PMSET_AC = "Now drawing from 'AC Power'\n -InternalBattery-0 (id=123)\t100%; charged; 0:00 remaining present: true\n"


@pytest.mark.timeout(10)
def test_macos_parsers_on_captured_output():
    assert parse_hid_idle_s(IOREG_HID) == 1.25
    assert parse_hid_idle_s(IOREG_HID + IOREG_HID.replace("1250000000", "400000000")) == 0.4
    assert parse_hid_idle_s("nothing here") is None
    assert parse_console(IOREG_ROOT) == ("ann", True)
    assert parse_console(IOREG_ROOT.replace('"kCGSSessionOnConsoleKey"=Yes', '"kCGSSessionOnConsoleKey"=No')) \
        == (None, None)
    assert parse_pmset_ac(PMSET_AC) is True
    assert parse_pmset_ac(PMSET_AC.replace("AC Power", "Battery Power")) is False
    assert parse_pmset_ac("") is None


@pytest.mark.timeout(10)
def test_logind_parsers_count_local_user_sessions_only():
    assert parse_loginctl_sessions("  3 1000 ann seat0 tty2\nc1 1001 bob\n\n") == ["3", "c1"]
    now = 1_000_000.0
    text = ("IdleHint=yes\nIdleSinceHint=%d\nRemote=no\nClass=user\n\n"
            "IdleHint=no\nIdleSinceHint=0\nRemote=yes\nClass=user\n\n"
            "IdleHint=no\nIdleSinceHint=0\nRemote=no\nClass=greeter\n") % int((now - 300) * 1e6)
    assert parse_logind_idle_s(text, now) == pytest.approx(300)
    assert parse_logind_idle_s(text.replace("Remote=no\nClass=user", "Remote=no\nClass=user\nIdleHint=no", 1),
                               now) == 0.0
    assert parse_logind_idle_s("", now) is None


@pytest.mark.timeout(10)
def test_linux_power_supply(tmp_path):
    assert linux_on_ac(tmp_path / "missing") is None
    (tmp_path / "BAT0").mkdir()
    (tmp_path / "BAT0" / "type").write_text("Battery\n")
    assert linux_on_ac(tmp_path) is False
    (tmp_path / "AC").mkdir()
    (tmp_path / "AC" / "type").write_text("Mains\n")
    (tmp_path / "AC" / "online").write_text("1\n")
    assert linux_on_ac(tmp_path) is True


@pytest.mark.timeout(10)
def test_monitor_combines_sources_and_backs_off_a_missing_logind(tmp_path, caplog):
    now = [1000.0]
    outputs = {"ioreg-c": IOREG_HID, "ioreg-n": IOREG_ROOT, "pmset": PMSET_AC}
    mac = ActivityMonitor("", platform="darwin", clock=lambda: now[0],
                          run=lambda argv: outputs[argv[0] + ("-" + argv[1][1] if argv[0] == "ioreg" else "")])
    a = mac.sample()
    assert (a.idle_s, a.console_user, a.screen_locked, a.on_ac) == (1.25, "ann", True, True)
    assert a.sources == ("ioreg-hid", "ioreg-console") and a.user_away
    # An activity file not written yet counts as no input since the monitor started.
    t = [5.0]
    fresh = ActivityMonitor(str(tmp_path / "not-yet"), platform="none", clock=lambda: t[0])
    t[0] += 42
    assert fresh.sample() == Activity(42.0, ("activity-file",))

    calls = []

    def no_logind(argv):
        calls.append(argv)
        raise OSError("Failed to connect to bus: Host is down")
    act = tmp_path / "act"
    act.touch()
    os.utime(act, (900.0, 900.0))
    linux = ActivityMonitor(str(act), platform="linux", clock=lambda: now[0], run=no_logind,
                            power_supply_dir=str(tmp_path / "none"))
    assert linux.sample() == Activity(100.0, ("activity-file",), on_ac=None)
    now[0] += 30
    assert linux.sample().idle_s == 130.0 and len(calls) == 1     # not asked again within LOGIND_RETRY_S
    assert not [r for r in caplog.records if r.levelname == "WARNING"]   # absent logind is no error

    failing = ActivityMonitor("", platform="darwin", clock=lambda: now[0],
                              run=lambda argv: (_ for _ in ()).throw(OSError("ioreg: not found")))
    for _ in range(3):
        assert failing.sample().idle_s is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    # Each of the three probes (HID, console, power) warns once, then logs at DEBUG.
    assert len(warnings) == 3 and sum("pmset failed" in w for w in warnings) == 1


# ---- history and nights ------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_history_survives_a_restart_skips_torn_lines_and_stays_capped(tmp_path):
    path = tmp_path / "h.jsonl"
    h = HarvestHistory(path, max_bytes=2000)
    h.record(1.0, "busy")
    h.record(2.0, "busy")           # no transition, no record
    h.record(3.0, "idle")
    with open(path, "a") as fh:
        fh.write('{"t": 4.0, "sta')  # a crash mid-line
    again = HarvestHistory(path, max_bytes=2000)
    again.load()
    assert again.records() == [(1.0, "busy"), (3.0, "idle")]
    for i in range(200):
        again.record(10.0 + i, "idle" if i % 2 else "busy")
        assert path.stat().st_size <= 2000
    kept = again.records()
    assert kept[-1] == (209.0, "idle") and len(kept) < 100
    reread = HarvestHistory(path)
    reread.load()
    assert reread.records() == kept


@pytest.mark.timeout(10)
def test_harvestable_hours_per_night():
    nights = [(2 * 24 * H, 3 * 24 * H), (1 * 24 * H, 2 * 24 * H), (0, 24 * H)]   # newest first
    records = [(0.5 * 24 * H, "busy"), (1 * 24 * H + 10 * H, "idle"), (1 * 24 * H + 12 * H, "leased"),
               (1 * 24 * H + 16 * H, "draining"), (1 * 24 * H + 17 * H, "busy"),
               (2 * 24 * H + 20 * H, "idle"), (2 * 24 * H + 22 * H, OFF)]
    assert harvested_seconds(records, 24 * H, 48 * H) == 6 * H       # idle 2 h + leased 4 h
    assert harvested_seconds(records, 48 * H, 72 * H) == 2 * H       # idle until mccld stopped
    # The first night starts before the history does: only the two covered nights count.
    assert harvestable_per_night(records, nights, now=80 * H) == (4 * H, 2)
    assert harvestable_per_night(records, nights, now=60 * H) == (6 * H, 1)   # the last is not over
    assert harvestable_per_night([], nights, now=80 * H) == (None, 0)
    now = time.time()
    spans = recent_nights(now, 3)
    assert len(spans) == 3 and spans[0][1] <= now < spans[0][1] + 25 * H
    for start, end in spans:
        assert 23 * H <= end - start <= 25 * H and time.localtime(end).tm_hour == 12


# ---- keep-awake and the harvester's lifecycle ------------------------------------------------

@pytest.mark.timeout(20)
def test_keep_awake_holds_a_process_only_while_held():
    awake = Caffeinate(["sleep", "30"])     # stands in for caffeinate, which only a Mac has
    awake.hold()
    proc = awake._proc
    awake.hold()
    assert awake.held and awake._proc is proc
    awake.release()
    assert not awake.held and proc.returncode is not None
    linux = NoKeepAwake()
    linux.hold()
    assert linux.held
    linux.release()
    assert not linux.held


class FakeMonitor:
    def __init__(self, idle_s):
        self.idle_s = idle_s

    def sample(self) -> Activity:
        return here(self.idle_s)


class FakeAwake(NoKeepAwake):
    pass


@pytest.mark.timeout(20)
def test_harvester_records_transitions_holds_awake_while_leased_and_stops(tmp_path):
    cfg = load_config(env={"MCCL_FLEET_KEY": "k" * 32, "MCCL_IDLE_AFTER": "60", "MCCL_HARVEST_POLL": "30"})
    clock = [1000.0]
    jobs = [0]
    updates = []
    monitor, awake = FakeMonitor(5.0), FakeAwake()
    hv = Harvester(cfg, tmp_path, lambda: jobs[0], lambda snap, changed: updates.append((snap["state"], changed)),
                   monitor=monitor, awake=awake, clock=lambda: clock[0]).start()
    try:
        assert updates == [("busy", False)]
        monitor.idle_s, clock[0] = 100.0, 1100.0
        hv.tick()
        jobs[0] = 1
        hv.tick()
        assert hv.snapshot()["state"] == "leased" and awake.held
        monitor.idle_s = 1.0
        hv.tick()
        assert hv.snapshot()["state"] == "draining" and awake.held
        jobs[0] = 0
        hv.tick()
        assert not awake.held
    finally:
        hv.stop()
    assert [u for u in updates if u[1]] == [("idle", True), ("leased", True), ("draining", True), ("busy", True)]
    states = [r["state"] for r in hv.history_records()]
    assert states == ["busy", "idle", "leased", "draining", "busy", OFF]
    assert (tmp_path / "harvest-history.jsonl").read_text().count("\n") == 6


# ---- one daemon, driven by its activity file ---------------------------------------------------

def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def wait_for(what, fn, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_daemon_activity_file_drives_status_exporter_and_capacity(tmp_path):
    act = tmp_path / "activity"
    act.touch()
    os.utime(act, (time.time() - 3600, time.time() - 3600))
    status_port, metrics_port = free_port(), free_port()
    with running_daemon(MCCL_ACTIVITY_FILE=str(act), MCCL_IDLE_AFTER="600", MCCL_HARVEST_POLL="0.1",
                        MCCL_STATUS_PORT=str(status_port), MCCL_METRICS_PORT=str(metrics_port),
                        MCCL_METRICS_PRESENCE="1") as (d, env):
        key = env["MCCL_FLEET_KEY"].encode()

        def harvest() -> dict:   # "capacity": what "status" says, without the link section's `ss` run
            return query(f"127.0.0.1:{status_port}", key, "capacity")[0]["harvest"]
        first = query(f"127.0.0.1:{status_port}", key, "status")[0]["harvest"]
        assert first["state"] == "idle" and first["idle_s"] >= 3600 and first["sources"][-1] == "activity-file"
        assert scrape(metrics_port)[("mccl_harvest_state", (("state", "idle"),))] == 1.0
        assert scrape(metrics_port)[("mccl_host_idle_seconds", ())] >= 3600

        client = RawClient(Path(env["MCCL_RUNTIME_DIR"]))
        try:
            seg = one_rank_job(client, d.host_id, "ab12")
            wait_for("leased", lambda: harvest()["state"] == "leased")
            act.touch()     # the user is back
            wait_for("draining", lambda: harvest()["state"] == "draining")
            assert scrape(metrics_port)[("mccl_harvest_state", (("state", "draining"),))] == 1.0
            assert client.call({"type": "leave", "job": "ab12", "rank": 0})["ok"]
            seg.close()
            seg.unlink()
            wait_for("busy", lambda: harvest()["state"] == "busy")
        finally:
            client.close()
        assert query(f"127.0.0.1:{status_port}", key, "status")[0]["harvest"]["state"] == "busy"
        metrics = scrape(metrics_port)
        assert metrics[("mccl_harvest_state", (("state", "busy"),))] == 1.0
        assert metrics[("mccl_host_idle_seconds", ())] < 600
        cap = query(f"127.0.0.1:{status_port}", key, "capacity")[0]
        assert cap["host"] == d.host_id and cap["cores"] == os.cpu_count() and cap["memory_bytes"] > 0
        assert [h["state"] for h in cap["history"]] == ["busy", "idle", "leased", "draining", "busy"]


@pytest.mark.timeout(10)
def test_exporter_renders_the_harvest_snapshot():
    from prometheus_client.exposition import generate_latest
    from mccld.report.metrics import make_registry
    from mccld.report.stats import DaemonStats
    stats = DaemonStats()
    bare = generate_latest(make_registry(stats)).decode()
    assert "mccl_host_cpu_cores" in bare and "mccl_harvest_state" not in bare   # no monitor, no state
    with pytest.raises(ValueError, match="harvest state"):
        stats.set_harvest({"state": "asleep"})
    stats.set_harvest({"state": "leased", "idle_s": None, "harvestable_s_per_night": 7200.0, "nights": 2})
    samples = {(s.name, tuple(s.labels.items())): s.value
               for fam in text_string_to_metric_families(generate_latest(make_registry(stats, presence=True)).decode())
               for s in fam.samples}
    assert [samples[("mccl_harvest_state", (("state", s),))] for s in ("busy", "idle", "leased", "draining")] \
        == [0, 0, 1, 0]
    assert samples[("mccl_harvestable_seconds_per_night", ())] == 7200.0
    assert samples[("mccl_harvest_nights", ())] == 2
    assert ("mccl_host_idle_seconds", ()) not in samples      # unknown idle time: no sample, not 0
    assert samples[("mccl_host_memory_bytes", ())] > 0
