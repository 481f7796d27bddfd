"""mcclctl: pure formatters, doctor checks on fake system trees, and commands end to end
against real status endpoints on loopback."""

import json
import os

import pytest

from mccld.report.stats import DaemonStats, mccl_version
from mccld.report.status_server import StatusServer
from mcclctl import doctor, formatting as fmt, prometheus_sd
from mcclctl.__main__ import main
from mcclctl.targets import Target, from_record

KEY = b"cli-test-fleet-key-" + b"c" * 16   # not hex: key files holding hex are decoded (and must give 32 bytes)


# ---- formatters ------------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_human_units():
    assert fmt.human_bytes(512) == "512 B"
    assert fmt.human_bytes(3 * 1024 ** 3) == "3.0 GiB"
    assert fmt.human_bits_rate(9.41e9) == "9.41 Gbit/s"
    assert fmt.human_bits_rate(2.5e6) == "2.50 Mbit/s"
    assert fmt.human_bits_rate(None) == fmt.NA
    assert fmt.human_duration(59) == "59s"
    assert fmt.human_duration(3 * 3600 + 120) == "3h 2m"
    assert fmt.human_duration(2 * 86400 + 3600) == "2d 1h"
    assert fmt.truncate("a\nlong   message", 8) == "a long …"


@pytest.mark.timeout(10)
def test_status_row_fields_and_version_flag():
    status = {"host": "mac1", "address": "10.0.0.1:29650", "version": "0.0.9", "state": "training",
              "jobs": [{"job": "j", "ranks": [0, 1]}, {"job": "k", "ranks": [2]}],
              "links_up": 2, "links_total": 3, "tx_bytes_per_s": 1.25e9, "rx_bytes_per_s": 0.0,
              "last_error": None, "uptime_s": 3700, "harvest": {"state": "leased", "idle_s": 4000}}
    row = fmt.status_row("mac1", status, None, our_version="0.1.0")
    assert row == ["mac1", "10.0.0.1:29650", "0.0.9 (!)", "training", "leased", "2/3", "2/3",
                   "10.00 Gbit/s", "0 bit/s", "-", "1h 1m"]
    assert fmt.status_row("mac1", {**status, "harvest": None}, None, "0.1.0")[4] == "-"   # an older mccld
    down = fmt.status_row("mac9", None, "DaemonUnavailableError: refused", "0.1.0")
    assert down[0] == "mac9" and down[3] == "unreachable" and "refused" in down[9]
    assert len(down) == len(fmt.STATUS_HEADERS)
    text = fmt.status_table([("mac1", status, None)], "0.1.0", ["mac1 runs mccld 0.0.9"])
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["HOST", "ADDRESS", "VERSION"]
    assert lines[-1] == "warning: mac1 runs mccld 0.0.9"


@pytest.mark.timeout(10)
def test_links_and_jobs_tables():
    links = [{"peer": "10.0.0.2:29650", "host": "mac2", "up": False, "sockets": 2, "sent_bytes": 2048,
              "received_bytes": 0, "tx_bytes_per_s": None, "rx_bytes_per_s": None,
              "ceiling_bits_per_s": 9.4e9, "retransmits": None, "rtt_ms": 0.25}]
    (row,) = fmt.link_rows("mac1", links)
    assert row == ["mac1", "10.0.0.2:29650", "mac2", "DOWN", "2", "-", "2.0 KiB", "0 B", "-", "-",
                   "9.40 Gbit/s", "n/a", "0.25 ms"]
    links[0]["data_sockets"] = {"idle": 2, "leased": 0, "dialled": 2, "accepted": 0, "discarded": 0}
    assert fmt.link_rows("mac1", links)[0][5] == "2/0"
    text = fmt.links_table([("mac1", links, None), ("mac3", None, "AuthError: bad key")])
    assert "unreachable: mac3: AuthError: bad key" in text
    jobs = [{"job": "train", "ranks": [0, 1], "world": 4, "collectives": 10, "bytes": 1 << 20,
             "overlap": {"0": 0.5, "1": 0.7}, "state": "ready", "age_s": 125, "compression": "int8",
             "allreduce_input_bytes": 4 << 20, "allreduce_encoded_bytes": 1 << 20},
            {"job": "old", "state": "ended", "ranks": [], "world": 2, "age_s": 4000, "ended_s_ago": 90,
             "outcome": "ok", "collectives": 3, "bytes": 0},
            {"job": "bad", "state": "ended", "ranks": [], "world": 2, "age_s": 30, "ended_s_ago": 5,
             "outcome": "failed", "collectives": 0, "bytes": 0}]
    # Running jobs first, then the ended ones, each with how it ended and when.
    assert fmt.job_rows("mac1", jobs) == [
        ["mac1", "train", "running", "2m 5s", "0,1", "4", "int8 4.00x", "10", "1.0 MiB", "0.60", "-"],
        ["mac1", "bad", "failed (5s ago)", "30s", "", "2", "-", "0", "0 B", "-", "-"],
        ["mac1", "old", "ended (1m 30s ago)", "1h 6m", "", "2", "-", "3", "0 B", "-", "-"]]
    jobs[0]["balance"] = {"1": {"speed": 6.14, "share": 5}, "0": {"speed": 12.3, "share": 11}}
    assert fmt.job_rows("mac1", jobs)[0][10] == "0:11@12.3 1:5@6.1"
    # The job's compression: off as is, a codec with the ratio it achieved once it sent bytes.
    jobs[0]["allreduce_input_bytes"] = jobs[0]["allreduce_encoded_bytes"] = 0
    assert fmt.job_rows("mac1", jobs)[0][6] == "int8"
    assert fmt.job_rows("mac1", [{**jobs[1], "compression": "off"}])[0][6] == "off"
    assert "COMPRESSION" in fmt.jobs_table([("mac1", jobs, None)]).splitlines()[0]
    assert fmt.jobs_table([]) == "no jobs"


def capacity(host, state, cores=8, per_night=None, nights=0, device="apple-silicon"):
    return {"host": host, "cores": cores, "memory_bytes": 16 << 30, "device": device,
            "harvest": {"state": state, "since": 1000.0, "idle_s": 1800.0, "reason": "no user input for 1800 s",
                        "harvestable_s_per_night": per_night, "nights": nights}, "history": []}


@pytest.mark.timeout(10)
def test_capacity_rows_and_harvestable_totals():
    row = fmt.capacity_row("mac1", capacity("mac1", "idle", per_night=6.5 * 3600, nights=3), None, now=1090.0)
    assert row == ["mac1", "idle", "1m 30s", "30m 0s", "8", "16.0 GiB", "apple-silicon", "6.5", "3",
                   "no user input for 1800 s"]
    fresh = fmt.capacity_row("mac2", capacity("mac2", "busy"), None, now=1000.0)
    assert fresh[7] == "-" and fresh[8] == "0"           # no complete night recorded yet
    assert fmt.capacity_row("mac3", None, "AuthError: bad key", 0.0)[1] == "unreachable"
    caps = [capacity("mac1", "idle"), capacity("mac2", "leased", cores=10), capacity("mac3", "busy"),
            capacity("pc1", "draining", device="cpu-x86_64")]
    assert fmt.harvestable_totals(caps) == {"hosts": ["mac1", "mac2"], "cores": 18, "memory_bytes": 32 << 30,
                                            "devices": {"apple-silicon": 2}}
    text = fmt.capacity_table([(c["host"], c, None) for c in caps] + [("mac9", None, "refused")], now=1000.0)
    assert text.splitlines()[0].split()[:3] == ["HOST", "HARVEST", "FOR"]
    assert text.splitlines()[-1] == ("harvestable now: 2 of 5 hosts, 18 cores, 32.0 GiB memory; "
                                     "devices: 2 x apple-silicon")


@pytest.mark.timeout(10)
def test_doctor_report_counts():
    checks = [doctor.check("a", "ok", "fine"), doctor.check("b", "fail", "bad", "do x"),
              doctor.check("c", "warn", "meh", "do y")]
    text = fmt.doctor_report(checks)
    assert "[FAIL] b: bad\n       fix: do x" in text
    assert text.endswith("3 checks: 1 failed, 1 warnings")


@pytest.mark.timeout(10)
def test_discovery_records_become_targets():
    # The shape mccl_common.discovery.browse_fleet returns.
    rec = {"host_id": "mac1", "fleet": "lab", "addresses": ["10.0.0.1"], "port": 29650, "state": "idle"}
    assert from_record(rec) == Target("mac1", "10.0.0.1:29651", "10.0.0.1:29652")
    assert from_record(rec, 31000, 32000) == Target("mac1", "10.0.0.1:31000", "10.0.0.1:32000")
    t = from_record({"host": "mac2", "address": "10.0.0.2:29650", "status_port": 30001})
    assert t == Target("mac2", "10.0.0.2:30001", "10.0.0.2:29652")
    t = from_record({"host_id": "mac3", "ip": "10.0.0.3", "properties": {"metrics_port": 9999}})
    assert t.metrics_addr == "10.0.0.3:9999" and t.status_addr == "10.0.0.3:29651"


@pytest.mark.timeout(10)
def test_file_sd_groups():
    groups = prometheus_sd.file_sd([Target("b", "10.0.0.2:29651", "10.0.0.2:29652"),
                                    Target("a", "10.0.0.1:29651", "10.0.0.1:29652")], "lab")
    assert groups == [{"targets": ["10.0.0.1:29652"], "labels": {"host": "a", "fleet": "lab"}},
                      {"targets": ["10.0.0.2:29652"], "labels": {"host": "b", "fleet": "lab"}}]


# ---- doctor checks against fake trees --------------------------------------------------

@pytest.mark.timeout(10)
def test_interface_checks_read_sysfs(tmp_path):
    (tmp_path / "en0").mkdir()
    (tmp_path / "en0" / "speed").write_text("1000\n")
    (tmp_path / "en0" / "mtu").write_text("9000\n")
    by_name = {c["name"]: c for c in doctor.interface_checks("en0", "10.0.0.1", tmp_path)}
    assert by_name["link speed"]["status"] == "warn" and "ethtool en0" in by_name["link speed"]["fix"]
    assert by_name["MTU"]["status"] == "ok"


@pytest.mark.timeout(10)
def test_buffer_checks_flag_small_limits(tmp_path):
    core = tmp_path / "net" / "core"
    core.mkdir(parents=True)
    (core / "rmem_max").write_text("212992\n")
    (core / "wmem_max").write_text("8388608\n")
    checks = doctor.buffer_checks(4 << 20, lambda n: doctor.read_sysctl(n, tmp_path))
    by_name = {c["name"]: c for c in checks}
    assert by_name["net.core.rmem_max"]["status"] == "warn"
    assert "sysctl -w net.core.rmem_max=4194304" in by_name["net.core.rmem_max"]["fix"]
    assert by_name["net.core.wmem_max"]["status"] == "ok"


@pytest.mark.timeout(10)
def test_skew_and_key_checks(tmp_path):
    checks = doctor.skew_checks([("mac2", 2.0, 0.01), ("mac3", 0.01, 0.01), ("mac4", None, None)])
    assert [c["status"] for c in checks] == ["warn", "ok"]
    from mccl_common.errors import ConfigError

    def bad():
        raise ConfigError("[config] key file /k has mode 0644; ... run `chmod 600 /k`")
    (c,) = doctor.key_checks(bad, "/k")
    assert c["status"] == "fail" and "0644" in c["detail"]
    key = tmp_path / "fleet.key"
    key.write_text("x" * 32)
    key.chmod(0o600)
    (c,) = doctor.key_checks(lambda: b"x" * 32, str(key))
    assert c["status"] == "ok" and "0600" in c["detail"]


# ---- commands against live status endpoints --------------------------------------------

@pytest.fixture
def fleet_of_two(tmp_path, monkeypatch):
    key_file = tmp_path / "fleet.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    monkeypatch.setenv("MCCL_KEY_FILE", str(key_file))
    monkeypatch.delenv("MCCL_FLEET_KEY", raising=False)
    servers = []
    for i, state in ((1, "training"), (2, "idle")):
        stats = DaemonStats()
        stats.set_state(state)
        stats.set_peer_up(f"127.0.0.{3 - i}:29650", True)

        def provider(i=i):
            return {"host": f"mac{i}", "fleet": "default", "address": f"127.0.0.{i}:29650", "last_error": None,
                    "jobs": [{"job": "j", "ranks": [i], "world": 2}] if i == 1 else []}
        srv = StatusServer(provider, KEY, "127.0.0.1", 0, stats=stats)
        srv.start()
        servers.append((srv, stats))
    yield servers
    for srv, _ in servers:
        srv.stop()


@pytest.mark.timeout(30)
def test_status_command_json_and_table(fleet_of_two, capsys):
    hosts = [a for srv, _ in fleet_of_two for a in ("--host", f"127.0.0.1:{srv.port}")]
    assert main(["status", "--json", *hosts]) == 0
    data = json.loads(capsys.readouterr().out)
    states = {d["status"]["host"]: d["status"]["state"] for d in data["daemons"]}
    assert states == {"mac1": "training", "mac2": "idle"}
    assert data["mcclctl_version"] == mccl_version() and data["warnings"] == []
    assert data["fleet"] == {"name": None, "source": "--host", "daemons": 2, "reported": ["default"],
                             "other_fleets": {}}
    assert main(["status", *hosts]) == 0
    out = capsys.readouterr().out.splitlines()
    # The first line names the fleet shown; ACTIVITY says "ready" for a daemon without a job,
    # so "idle" only ever means the harvest state (the host's user left it).
    assert out[0] == "fleet default: 2 daemons (from --host)"
    assert out[1].split()[3:5] == ["ACTIVITY", "HARVEST"]
    assert out[2].split()[:5] == ["mac1", "127.0.0.1:29650", mccl_version(), "training", "-"]
    assert out[3].split()[3] == "ready"
    assert main(["status", "--fleet", "lab", *hosts]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "fleet lab: 2 daemons (from --host)"
    assert out[1:3] == ["warning: mac1 belongs to fleet default, not lab",
                        "warning: mac2 belongs to fleet default, not lab"]


@pytest.mark.timeout(30)
def test_status_reports_an_unreachable_daemon(fleet_of_two, capsys):
    srv, _ = fleet_of_two[0]
    rc = main(["status", "--host", f"127.0.0.1:{srv.port}", "--host", "127.0.0.1:1", "--timeout", "2"])
    out = capsys.readouterr().out
    assert rc == 1 and "unreachable" in out and "mac1" in out


@pytest.mark.timeout(30)
def test_wrong_key_is_reported(fleet_of_two, capsys, tmp_path):
    other = tmp_path / "other.key"
    other.write_bytes(b"z" * 32)
    other.chmod(0o600)
    srv, _ = fleet_of_two[0]
    assert main(["status", "--json", "--key-file", str(other), "--host", f"127.0.0.1:{srv.port}"]) == 1
    (d,) = json.loads(capsys.readouterr().out)["daemons"]
    assert d["error"].startswith("AuthError")


@pytest.mark.timeout(30)
def test_links_jobs_linktest_commands(fleet_of_two, capsys):
    (a, stats_a), (b, _) = fleet_of_two
    assert main(["jobs", "--json", "--host", f"127.0.0.1:{a.port}"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["jobs"][0]["ranks"] == [1]
    assert main(["linktest", "--json", f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}",
                 "--seconds", "0.3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["peer_address"] == "127.0.0.2:29650" and result["bits_per_s"] > 0
    assert stats_a.snapshot()["peers"]["127.0.0.2:29650"]["ceiling_bits_per_s"] == result["bits_per_s"]
    assert main(["links", "--host", f"127.0.0.1:{a.port}"]) == 0
    out = capsys.readouterr().out
    assert "127.0.0.2:29650" in out and fmt.human_bits_rate(result["bits_per_s"]) in out


@pytest.mark.timeout(30)
def test_prometheus_sd_writes_file(tmp_path, capsys):
    out = tmp_path / "mccl.json"
    assert main(["prometheus-sd", "--host", "10.0.0.1", "--host", "10.0.0.2:29651", "--fleet", "lab",
                 "-o", str(out)]) == 0
    groups = json.loads(out.read_text())
    assert [g["targets"] for g in groups] == [["10.0.0.1:29652"], ["10.0.0.2:29652"]]
    assert oct(os.stat(out).st_mode & 0o777) == "0o644"


@pytest.mark.timeout(20)
def test_port_checks_against_live_endpoints():
    from mccld.report.metrics import MetricsServer
    stats = DaemonStats()
    metrics = MetricsServer(stats, "127.0.0.1", 0)
    metrics.start()
    listener = __import__("socket").socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    free = __import__("socket").socket()
    free.bind(("127.0.0.1", 0))
    free_port = free.getsockname()[1]
    free.close()
    try:
        checks = doctor.port_checks(
            "127.0.0.1", {"link": listener.getsockname()[1], "status": free_port, "metrics": metrics.port},
            [("peerX", "127.0.0.1", free_port)], status_ok="DaemonUnavailableError: refused")
    finally:
        metrics.stop()
        listener.close()
    by_name = {c["name"]: c["status"] for c in checks}
    assert by_name == {"link port": "ok", "status port": "fail", "metrics port": "ok", "peer peerX": "fail"}


@pytest.mark.timeout(30)
def test_status_watch_redraws_until_interrupted(fleet_of_two, capsys, monkeypatch):
    srv, _ = fleet_of_two[0]
    sleeps = []

    def fake_sleep(s):
        sleeps.append(s)
        if len(sleeps) == 2:
            raise KeyboardInterrupt
    import time as real_time
    import types
    # Replace the module's view of `time` only: other threads keep the real sleep.
    monkeypatch.setattr("mcclctl.commands.time", types.SimpleNamespace(strftime=real_time.strftime,
                                                                       sleep=fake_sleep))
    assert main(["status", "--watch", "1.5", "--host", f"127.0.0.1:{srv.port}"]) == 0
    out = capsys.readouterr().out
    assert out.count("every 1.5 s") == 2 and out.count("training") == 2 and sleeps == [1.5, 1.5]


@pytest.mark.timeout(10)
def test_disabled_status_endpoint_is_reported_not_dialled():
    from mcclctl.targets import fetch
    (reply,) = fetch([Target("mac5", "10.0.0.5:0", "10.0.0.5:29652")], KEY, "status")
    assert "MCCL_STATUS_PORT=0" in reply.error


@pytest.mark.timeout(10)
def test_version_mismatch_is_reported_per_daemon():
    from mcclctl.targets import Reply, version_mismatches
    t = Target("mac1", "10.0.0.1:29651", "10.0.0.1:29652")
    assert version_mismatches([Reply(t, result={}, version=mccl_version())]) == []
    (w,) = version_mismatches([Reply(t, result={}, version="0.0.1"), Reply(t, error="down")])
    assert w.startswith("mac1 runs mccld 0.0.1") and mccl_version() in w


@pytest.mark.timeout(30)
def test_capacity_command_json_and_table(fleet_of_two, tmp_path, capsys):
    old, _ = fleet_of_two[0]    # a daemon without a harvest state answers with an error, in its row
    srv = StatusServer(lambda: {"host": "mac5", "address": "127.0.0.5:29650"}, KEY, "127.0.0.1", 0,
                       capacity=lambda: {k: v for k, v in capacity("mac5", "leased").items() if k != "host"})
    srv.start()
    try:
        hosts = ["--host", f"127.0.0.1:{srv.port}", "--host", f"127.0.0.1:{old.port}"]
        assert main(["capacity", "--json", *hosts]) == 1
        data = json.loads(capsys.readouterr().out)
        assert data["harvestable"] == {"hosts": ["mac5"], "cores": 8, "memory_bytes": 16 << 30,
                                       "devices": {"apple-silicon": 1}}
        ok, bad = data["daemons"]
        assert ok["capacity"]["host"] == "mac5" and ok["capacity"]["harvest"]["state"] == "leased"
        assert ok["error"] is None and "no harvest state" in bad["error"]
        assert main(["capacity", *hosts]) == 1
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("fleet ") and out[1].split()[:2] == ["HOST", "HARVEST"]
        assert out[2].split()[:2] == ["mac5", "leased"] and out[3].split()[1] == "unreachable"
        assert out[-1].startswith("harvestable now: 1 of 2 hosts, 8 cores")
    finally:
        srv.stop()


@pytest.mark.timeout(10)
def test_a_draining_host_says_when_it_leaves_why_and_how_long_the_last_hand_back_took():
    cap = capacity("pc1", "draining")
    cap["harvest"].update({"leaves_in_s": 42.4, "reason": "1 job(s) finishing; user input 0 s ago",
                           "last_reclaim": {"seconds": 66.2, "how": "removed", "at": 900.0}})
    assert fmt.capacity_row("pc1", cap, None, now=1000.0)[1] == "draining (leaves in 42 s)"
    text = fmt.capacity_table([("pc1", cap, None)], now=1000.0)
    assert "pc1: draining (leaves in 42 s): 1 job(s) finishing; user input 0 s ago" in text
    assert ("pc1: handed back to its user in 66.2 s (its jobs were removed at MCCL_RECLAIM_GRACE, 1m 40s ago)"
            in text)
    status = {"host": "pc1", "harvest": cap["harvest"]}
    assert fmt.status_row("pc1", status, None, "0.1.0")[4] == "draining (leaves in 42 s)"
    assert "pc1: handed back to its user in 66.2 s" in fmt.status_table([("pc1", status, None)], "0.1.0")
    assert fmt.harvest_state({"state": "leased", "leaves_in_s": None}) == "leased"


@pytest.mark.timeout(10)
def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"mcclctl {mccl_version()}"


@pytest.mark.timeout(30)
def test_wide_output_does_not_cut_long_errors():
    error = "DaemonUnavailableError: " + "x" * 150 + " the end"
    assert "the end" not in fmt.status_table([("mac9", None, error)], "0.1.0")
    assert "the end" in fmt.status_table([("mac9", None, error)], "0.1.0", wide=True)
    assert main(["status", "--wide", "--host", "127.0.0.1:1", "--timeout", "1", "--key-file", "/nonexistent"]) == 2


@pytest.mark.timeout(60)
def test_doctor_checks_the_ports_the_daemon_reports(tmp_path, monkeypatch, capsys):
    """The shell's MCCL_PORT / MCCL_METRICS_PORT point nowhere; the daemon says where it listens."""
    import socket
    from mccld.report.metrics import MetricsServer
    from mccl_common.netif import interface_of
    key_file = tmp_path / "fleet.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    metrics = MetricsServer(DaemonStats(), "127.0.0.1", 0)
    metrics.start()
    link = socket.socket()
    link.bind(("127.0.0.1", 0))
    link.listen(1)
    nowhere = socket.socket()
    nowhere.bind(("127.0.0.1", 0))        # held, never listening: nothing answers there
    ends = {"iface": "", "addr": "127.0.0.1", "link_port": link.getsockname()[1], "metrics_port": metrics.port,
            "metrics_addr": "127.0.0.1", "launch_port": 0, "discovery": "off"}
    srv = StatusServer(lambda: {"host": "me", "fleet": "default", "address": "127.0.0.1:1", "jobs": [],
                                "links": [], "fleet_table": [], "endpoints": {**ends, "status_port": srv.port}},
                       KEY, "127.0.0.1", 0)
    srv.start()
    status_port, metrics_port = srv.port, metrics.port
    for name, value in (("MCCL_LISTEN_ADDR", "127.0.0.1"), ("MCCL_STATUS_PORT", str(srv.port)),
                        ("MCCL_PORT", str(nowhere.getsockname()[1])),
                        ("MCCL_METRICS_PORT", str(nowhere.getsockname()[1])),
                        ("MCCL_KEY_FILE", str(key_file)), ("MCCL_DISCOVERY", "off")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MCCL_FLEET_KEY", raising=False)
    try:
        main(["doctor", "--json"])
        checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    finally:
        srv.stop()
        metrics.stop()
        link.close()
        nowhere.close()
    for name, port in (("link port", ends["link_port"]), ("status port", status_port),
                       ("metrics port", metrics_port)):
        assert checks[name]["status"] == "ok", checks[name]
        assert checks[name]["detail"] == f"127.0.0.1:{port} answers (as the local mccld reports them)"
    # The interface holding the address is named, never left empty.
    assert checks["interface"]["detail"] == f"{interface_of('127.0.0.1')} with address 127.0.0.1"
    assert checks["fleet"]["detail"].startswith("fleet default: 0 daemons")
