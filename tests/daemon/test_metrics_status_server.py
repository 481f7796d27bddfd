"""The authenticated status endpoint: answers, refusals, linktest, timeouts."""

import socket

import pytest

from mccl_common.errors import AuthError, ConfigError, DaemonUnavailableError, ProtocolError
from mccl_common import status_protocol as sp
from mccld.report import status_server as ss
from mccld.net import tcpinfo
from mccld.report.stats import DaemonStats

KEY = b"k" * 32


def provider_for(host: str, address: str):
    def provider():
        return {"host": host, "address": address, "last_error": None,
                "jobs": [{"job": "j1", "ranks": [0, 1], "world": 4}],
                "links": [{"peer": "10.77.0.3:29650", "host": "mac3", "up": True}]}
    return provider


@pytest.fixture
def server():
    stats = DaemonStats()
    stats.set_state("training")
    stats.record_peer_traffic("10.77.0.3:29650", 4000, 3000)
    stats.set_peer_up("10.77.0.3:29650", True)
    stats.record_collective("j1", "allreduce", 1 << 20, 0.01, 4)
    srv = ss.StatusServer(provider_for("mac2", "10.77.0.2:29650"), KEY, addr="127.0.0.1", port=0,
                          stats=stats)
    srv.start()
    yield srv, stats
    srv.stop()


@pytest.mark.timeout(20)
def test_status_links_jobs_answers(server):
    srv, _ = server
    status, hello = ss.query(f"127.0.0.1:{srv.port}", KEY, "status")
    assert hello["version"] == status["version"]
    assert status["host"] == "mac2" and status["state"] == "training"
    assert (status["links_up"], status["links_total"]) == (1, 1)
    (link,) = status["links"]
    assert link["sent_bytes"] == 4000 and link["received_bytes"] == 3000
    assert status["tx_bytes_per_s"] > 0
    (job,) = status["jobs"]
    assert job["ranks"] == [0, 1] and job["collectives"] == 1
    links, _ = ss.query(f"127.0.0.1:{srv.port}", KEY, "links")
    assert links["links"][0]["peer"] == "10.77.0.3:29650" and links["host"] == "mac2"
    jobs, _ = ss.query(f"127.0.0.1:{srv.port}", KEY, "jobs")
    assert jobs["jobs"][0]["job"] == "j1"


@pytest.mark.timeout(20)
def test_wrong_key_is_refused(server):
    srv, _ = server
    with pytest.raises(AuthError, match="refused our fleet key"):
        ss.query(f"127.0.0.1:{srv.port}", b"x" * 32, "status")


@pytest.mark.timeout(20)
def test_replayed_request_is_refused(server):
    srv, _ = server
    # Capture a valid request for one connection's nonce, replay it on another.
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s1:
        conn = sp.Conn(s1, "srv")
        _, cnonce, nonce = sp.send_request(conn, KEY, "status", {})
        body = sp.canon({"method": "status", "args": {}})
        captured = {"body": body, "cnonce": cnonce, "mac": sp.mac(KEY, "req", nonce, cnonce, body)}
        sp.read_reply(conn, KEY, cnonce, nonce)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s2:
        conn = sp.Conn(s2, "srv")
        conn.recv("hello")
        conn.send(captured)
        reply = conn.recv("reply")
    assert reply["ok"] is False and reply["error"]["kind"] == "AuthError"


@pytest.mark.timeout(20)
def test_only_declared_methods_are_answered(server):
    srv, _ = server
    with pytest.raises(ConfigError):
        ss.query(f"127.0.0.1:{srv.port}", KEY, "set_state")
    # A client bypassing the local check still gets a refusal from the server.
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        conn = sp.Conn(s, "srv")
        hello = conn.recv("hello")
        body = sp.canon({"method": "shutdown", "args": {}})
        conn.send({"body": body, "cnonce": "00", "mac": sp.mac(KEY, "req", hello["nonce"], "00", body)})
        with pytest.raises(ProtocolError, match="unknown method"):
            sp.read_reply(conn, KEY, "00", hello["nonce"])


@pytest.mark.timeout(20)
def test_garbage_does_not_kill_the_server(server):
    srv, _ = server
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.recv(4096)
        s.sendall(b"not json\n")
    status, _ = ss.query(f"127.0.0.1:{srv.port}", KEY, "status")
    assert status["host"] == "mac2"


@pytest.mark.timeout(20)
def test_unreachable_and_silent_daemons_fail_within_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DaemonUnavailableError, match="cannot reach"):
        ss.query(f"127.0.0.1:{port}", KEY, "status", timeout_s=2)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts (in the backlog) but never speaks
    try:
        with pytest.raises(DaemonUnavailableError, match="did not answer"):
            ss.query(f"127.0.0.1:{silent.getsockname()[1]}", KEY, "status", timeout_s=1)
    finally:
        silent.close()


@pytest.mark.timeout(30)
def test_linktest_records_the_ceiling_on_the_measuring_daemon():
    stats_a, stats_b = DaemonStats(), DaemonStats()
    a = ss.StatusServer(provider_for("macA", "127.0.0.1:29650"), KEY, "127.0.0.1", 0, stats=stats_a)
    b = ss.StatusServer(provider_for("macB", "127.0.0.2:29650"), KEY, "127.0.0.1", 0, stats=stats_b)
    a.start()
    b.start()
    try:
        result, _ = ss.query(f"127.0.0.1:{a.port}", KEY, "linktest",
                             {"target": f"127.0.0.1:{b.port}", "seconds": 0.5, "streams": 2},
                             timeout_s=15)
        assert result["peer_address"] == "127.0.0.2:29650"  # B's link address, not its status port
        assert result["bytes"] > 0 and result["bits_per_s"] == pytest.approx(
            result["bytes"] * 8 / result["seconds"])
        assert stats_a.snapshot()["peers"]["127.0.0.2:29650"]["ceiling_bits_per_s"] == \
            result["bits_per_s"]
        stored, _ = ss.query(f"127.0.0.1:{a.port}", KEY, "linktest_result")
        assert stored["127.0.0.2:29650"]["bytes"] == result["bytes"]
    finally:
        a.stop()
        b.stop()


@pytest.mark.timeout(20)
def test_linktest_to_a_foreign_fleet_fails_with_auth_error():
    a = ss.StatusServer(provider_for("macA", "127.0.0.1:29650"), KEY, "127.0.0.1", 0,
                        stats=DaemonStats())
    other = ss.StatusServer(provider_for("x", "127.0.0.9:29650"), b"z" * 32, "127.0.0.1", 0)
    a.start()
    other.start()
    try:
        with pytest.raises(AuthError):
            ss.query(f"127.0.0.1:{a.port}", KEY, "linktest",
                     {"target": f"127.0.0.1:{other.port}", "seconds": 0.2}, timeout_s=10)
    finally:
        a.stop()
        other.stop()


@pytest.mark.timeout(10)
def test_ss_parsing_finds_link_sockets_and_retransmits():
    text = (
        "0      0      10.77.0.2:29650 10.77.0.3:41000\n"
        "\t cubic rtt:0.5/0.1 retrans:0/7 bytes_sent:100 bytes_received:50 delivery_rate 9000000bps\n"
        "0      0      10.77.0.2:38000 10.77.0.3:29650\n"
        "\t cubic rtt:0.8/0.1 bytes_sent:10\n"
        "0      0      10.77.0.2:22 10.77.0.3:50000\n"
        "\t cubic rtt:0.1/0.1\n")
    # Control link (accepted + dialled) and engine sockets alike; our status port is not a link.
    socks = tcpinfo.link_sockets("10.77.0.2:29650", "10.77.0.3:29650", text, frozenset({22}))
    assert len(socks) == 2
    summary = tcpinfo.summarize(socks)
    assert summary == {"sockets": 2, "retransmits": 7, "rtt_ms": 0.8}
    assert tcpinfo.link_sockets("10.77.0.2:29650", "10.77.0.9:29650", text) == []
    assert socks[0]["delivery_rate_bits_per_s"] == 9e6
    assert tcpinfo.summarize(None)["retransmits"] is None


@pytest.mark.timeout(10)
def test_ss_sees_real_sockets_on_linux():
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    port = lst.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port), timeout=5)
    acc, _ = lst.accept()
    try:
        cli.sendall(b"x" * 10000)
        acc.recv(10000)
        socks = tcpinfo.link_sockets(f"127.0.0.1:{port}", f"127.0.0.1:{port}")
        if socks is None:
            pytest.skip("ss is not available")
        ours = [s for s in socks if str(port) in (s["local"].rsplit(":", 1)[1], s["peer"].rsplit(":", 1)[1])]
        assert len(ours) == 2 and all("retransmits" in s for s in ours)
    finally:
        for s in (cli, acc, lst):
            s.close()


@pytest.mark.timeout(10)
def test_merge_status_completes_the_daemon_view_from_stats():
    stats = DaemonStats()
    stats.set_state("training")
    stats.record_peer_traffic("10.0.0.2:29650", 100, 200)
    stats.set_peer_up("10.0.0.3:29650", False)
    daemon = {"host": "mac1", "address": "10.0.0.1:29650", "last_error": "",
              "jobs": [{"job": "j", "local_ranks": [0, 1], "world": 4}],
              "links": [{"host_id": "mac2", "addr": "10.0.0.2:29650"}],
              "data_links": [{"host": "mac2", "idle": 1, "leased": 2, "ids": [4, 5, 6], "uses": 9,
                              "dialled": 3, "accepted": 0, "discarded": 1}]}
    out = ss.merge_status(daemon, stats.snapshot(), tcp_text="")
    by_peer = {link["peer"]: link for link in out["links"]}
    assert by_peer["10.0.0.2:29650"]["up"] is True and by_peer["10.0.0.2:29650"]["host"] == "mac2"
    assert by_peer["10.0.0.2:29650"]["sent_bytes"] == 100
    assert by_peer["10.0.0.2:29650"]["sockets"] == 0  # ss ran and found no socket to that peer
    assert by_peer["10.0.0.3:29650"]["up"] is False
    # The data-socket pool shows on the control link to the same host.
    assert by_peer["10.0.0.2:29650"]["data_sockets"] == {"idle": 1, "leased": 2, "dialled": 3, "accepted": 0,
                                                         "discarded": 1}
    assert "data_sockets" not in by_peer["10.0.0.3:29650"]
    assert (out["links_up"], out["links_total"]) == (1, 2)
    assert out["jobs"][0]["ranks"] == [0, 1] and out["state"] == "training"


@pytest.mark.timeout(10)
def test_merge_status_shows_ceiling_only_peers_without_counting_them_as_links():
    stats = DaemonStats()
    stats.set_link_ceiling("10.0.0.9:29650", 9e9)
    out = ss.merge_status({"host": "mac1", "address": "10.0.0.1:29650", "links": []},
                          stats.snapshot(), tcp_text="")
    (link,) = out["links"]
    assert link["peer"] == "10.0.0.9:29650" and link["up"] is None and link["ceiling_bits_per_s"] == 9e9
    assert (out["links_up"], out["links_total"]) == (0, 0)
