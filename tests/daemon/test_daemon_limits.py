"""mccld's TCP ports under unauthenticated LAN peers (issue 11): connections that dribble bytes
are capped per peer address and per port and dropped at one deadline for their whole
handshake, so an honest request from elsewhere is still answered at once and the daemon's
threads and fds return to where they were."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
import urllib.request

import pytest

from support.daemon import running_daemon, until
from mccld.net import auth
from mccld.daemon import Daemon
from mccl_common.status_protocol import query
from support.ports import free_port

DEADLINE_S = 3.0
PER_PEER = 8
DRIBBLERS = 16
HOSTILE = "127.0.0.2"      # Linux routes all of 127/8 to lo: a second peer address for free


@pytest.fixture
def limited_daemon():
    # Port 0 disables the status and metrics endpoints: give them real ones.
    with running_daemon(MCCL_STATUS_PORT=str(free_port()), MCCL_METRICS_PORT=str(free_port()),
                        MCCL_METRICS_ADDR="127.0.0.1", MCCL_UNAUTH_TIMEOUT=str(DEADLINE_S),
                        MCCL_MAX_UNAUTH_PER_PEER=str(PER_PEER)) as d_env:
        yield d_env


def server(d: Daemon, kind: str):
    if kind == "link":
        return d.links
    return next(s for s in d._servers if type(s).__name__ == kind)


def port_of(d: Daemon, kind: str) -> int:
    return int(d.links.address.rpartition(":")[2]) if kind == "link" else server(d, kind).port


def honest_request(d: Daemon, env: dict, kind: str, port: int) -> None:
    """What a real client of that port does, from 127.0.0.1."""
    if kind == "StatusServer":
        status, _ = query(f"127.0.0.1:{port}", env["MCCL_FLEET_KEY"].encode(), "status", timeout_s=5.0)
        assert status["host"] == d.host_id
    elif kind == "MetricsServer":
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5.0) as r:
            assert b"mccl_uptime_seconds" in r.read()
    else:
        with socket.create_connection(("127.0.0.1", port), timeout=5.0) as s:
            peer_host, _, _ = auth.initiate(s, env["MCCL_FLEET_KEY"].encode(), d.cfg.fleet, "honest-peer",
                                            "127.0.0.1:9", f"127.0.0.1:{port}")
            assert peer_host == d.host_id


def scraped(d: Daemon, series: str) -> float:
    port = server(d, "MetricsServer").port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5.0) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
    raise AssertionError(f"{series} is not exported")


def usage() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), threading.active_count()


def settles_to(baseline: tuple[int, int], within_s: float) -> tuple[int, int]:
    deadline = time.monotonic() + within_s
    while True:
        now = usage()
        if all(n <= b for n, b in zip(now, baseline)) or time.monotonic() >= deadline:
            return now
        time.sleep(0.1)


def closed_by_peer(s: socket.socket) -> bool:
    """True once the daemon closed it (what it sent before, a status hello, is skipped)."""
    try:
        while s.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["StatusServer", "link", "MetricsServer"])
def test_dribbling_peers_are_capped_and_dropped_at_the_deadline(limited_daemon, kind):
    d, env = limited_daemon
    port = port_of(d, kind)
    honest_request(d, env, kind, port)      # warm up: imports, the gates' watchdog threads
    honest_request(d, env, "MetricsServer", server(d, "MetricsServer").port)
    baseline = settles_to(usage(), 5.0)

    socks = []
    for _ in range(DRIBBLERS):
        s = socket.socket()
        s.bind((HOSTILE, 0))
        s.connect(("127.0.0.1", port))
        if kind == "link":
            s.send(struct.pack("!I", 1000))   # a plausible frame length: its body then never comes
        socks.append(s)
    stop = threading.Event()

    def dribble() -> None:
        # One byte per 0.3 s each: a per-recv timeout never fires on these.
        while not stop.wait(0.3):
            for s in socks:
                try:
                    s.send(b"{")
                except OSError:
                    pass
    t = threading.Thread(target=dribble, daemon=True)
    t.start()
    try:
        time.sleep(0.5)
        started = time.monotonic()
        gate = server(d, kind).gate
        honest_request(d, env, kind, port)
        expired_when_answered = gate.expired
        took = time.monotonic() - started
        # Answered while every dribbler it lets in is still held: it did not queue behind them
        # (a wall-clock bound here failed once in CI under load, at well under the deadline).
        assert expired_when_answered == 0, \
            f"an honest request to the {kind} port was answered only after {expired_when_answered} dribblers " \
            f"were dropped at the {DEADLINE_S} s deadline (it took {took:.2f} s)"
        # The honest connection's own slot is given back by its serving thread after the answer
        # was sent (the link port marks it passed once auth.respond returns, the metrics port
        # releases it after finish_request): the client may read the answer first, so reading
        # the count at once saw 9 in 3 of 6 runs. Wait for that release; a dribbler that
        # expires meanwhile (only under heavy load) leaves the gate too, and is counted as such.
        assert until(lambda: gate.unauthenticated() + gate.expired == PER_PEER, 10.0), \
            f"{gate.unauthenticated()} connections held by the {kind} port's gate and {gate.expired} expired, " \
            f"expected the {PER_PEER} dribblers it admitted (the honest connection's slot never came back?)"

        assert gate.refused == DRIBBLERS - PER_PEER, "the per-peer cap did not close the extra connections"
        for s in socks:
            s.settimeout(0.05)
        assert sum(closed_by_peer(s) for s in socks) == DRIBBLERS - PER_PEER

        # The deadline's event is the watchdog's count, not a sleep past it (a late watchdog
        # under load would have failed the check below).
        assert until(lambda: gate.expired == PER_PEER, DEADLINE_S + 30.0), \
            f"only {gate.expired} of the {PER_PEER} dribblers were dropped at the {DEADLINE_S} s deadline"
        for s in socks:
            s.settimeout(5.0)
        assert all(closed_by_peer(s) for s in socks), "a dribbling connection outlived the handshake deadline"
        # The watchdog counts a dribbler expired and shuts its socket; the connection's own
        # serving thread gives its slot back once its read returns, after the client saw the
        # close (ci8 read 5 slots still held at once under load). Wait for those releases.
        assert gate.expired == PER_PEER
        assert until(lambda: gate.unauthenticated() == 0, 10.0), \
            f"{gate.unauthenticated()} of the expired dribblers' slots were never given back"
        assert scraped(d, f'mccl_unauth_connections_closed_total{{port="{gate.name}",reason="over_cap"}}') \
            == DRIBBLERS - PER_PEER
        assert scraped(d, f'mccl_unauth_connections_closed_total{{port="{gate.name}",reason="deadline"}}') \
            == PER_PEER
    finally:
        stop.set()
        t.join()
        for s in socks:
            s.close()
    # Generous: the link port's handshake threads notice their closed sockets on their own
    # schedule, and in CI beside the e2e half 5 s once left two of them running.
    now = settles_to(baseline, 30.0)
    assert all(n <= b for n, b in zip(now, baseline)), \
        f"fds or threads of the daemon stayed above the baseline: (fds, threads) {now} vs {baseline}"


@pytest.mark.timeout(60)
def test_every_daemon_thread_runs_when_its_token_appears_and_first_connections_add_none(tmp_path):
    """The fuzzer and the campaign compare a daemon's threads before and after a run: once
    seen one thread up, because mccld's checker started after its token file (the "mccld is
    up" sign) and each port's gate watchdog at the port's first connection."""
    from mccl_common import attach_protocol as protocol
    from mccl_common.daemon_settings import load_config
    from support.daemon import daemon_env

    env = {**daemon_env(tmp_path), "MCCL_STATUS_PORT": str(free_port()),
           "MCCL_METRICS_PORT": str(free_port()), "MCCL_METRICS_ADDR": "127.0.0.1"}
    d = Daemon(load_config(env=env))
    starter = threading.Thread(target=d.start, name="test-daemon-start")
    starter.start()
    try:
        token = tmp_path / protocol.TOKEN_NAME
        until = time.monotonic() + 30
        while not token.exists():
            assert time.monotonic() < until and starter.is_alive(), "mccld never wrote its token"
            time.sleep(0.001)
        names = {t.name for t in threading.enumerate()}
        assert {"mccld-checker", "mccld-gate-link", "mccld-gate-status", "mccld-gate-metrics"} <= names, names
        starter.join(30)
        before = threading.active_count()
        for kind in ("StatusServer", "link", "MetricsServer"):
            honest_request(d, env, kind, port_of(d, kind))
        # Generous, as above: CI's load once left three threads running past 5 s.
        assert settles_to((len(os.listdir("/proc/self/fd")), before), 30.0)[1] <= before
    finally:
        starter.join(30)
        d.stop()
