"""Attacks on the launch endpoint from the network path (issue 24, item 6): a proxy on loopback
between `mcclctl run`'s Lease and mccld's LaunchServer stands for anyone who can read, inject
into or rewrite the TCP stream. An injected or replayed beat/cancel must not end (or keep alive)
a lease, a hello whose host id was changed must not get a job started, and neither the request
(command line, --env values, cwd) nor the job's output may be readable on the path."""

from __future__ import annotations

import base64
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from mccl_common.errors import AuthError
from mccl_common.launch_protocol import LaunchRequest, Lease
from mccld.host.launcher import LaunchServer

pytestmark = pytest.mark.timeout(60)

KEY = b"launch-attack-submit-key-" + b"s" * 16


class Proxy:
    """Forwards one client connection to ``target`` line by line; ``down`` and ``up`` may rewrite
    what the server and the client send, ``inject`` adds lines to what the client sends;
    ``sent_up`` and ``sent_down`` are what went each way (all a sniffer on the path sees)."""

    def __init__(self, target: int, down: Callable[[bytes], bytes] = lambda line: line,
                 up: Callable[[bytes], bytes] = lambda line: line):
        self._down = down
        self._up_edit = up
        self._target = target
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self.sent_up: list[bytes] = []
        self.sent_down: list[bytes] = []
        self._up: socket.socket | None = None
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._ready = threading.Event()
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        client, _ = self._srv.accept()
        up = socket.create_connection(("127.0.0.1", self._target))
        self._client, self._up = client, up
        self._ready.set()
        for args in ((client, up, self._record), (up, client, self._record_down)):
            t = threading.Thread(target=self._pump, args=args, daemon=True)
            t.start()
            self._threads.append(t)

    def _record(self, line: bytes) -> bytes:
        line = self._up_edit(line)
        self.sent_up.append(line)
        return line

    def _record_down(self, line: bytes) -> bytes:
        line = self._down(line)
        self.sent_down.append(line)
        return line

    def _pump(self, src: socket.socket, dst: socket.socket, edit: Callable[[bytes], bytes]) -> None:
        buf = b""
        try:
            while chunk := src.recv(65536):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    with self._lock:
                        dst.sendall(edit(line) + b"\n")
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def inject(self, line: bytes) -> None:
        assert self._ready.wait(5)
        with self._lock:
            self._up.sendall(line + b"\n")

    def close(self) -> None:
        self._srv.close()
        if self._ready.is_set():
            for s in (self._client, self._up):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for t in self._threads:
            t.join(timeout=5)
        if self._ready.is_set():
            self._client.close()
            self._up.close()


@pytest.fixture
def launch_server(tmp_path):
    code = "import time; print('ready', flush=True); time.sleep(60)"
    srv = LaunchServer(KEY, "hostA", tmp_path, addr="127.0.0.1", port=0, harvest_state=lambda: "idle",
                       command=lambda req: [sys.executable, "-c", code],
                       launch_user="root" if __import__("os").geteuid() == 0 else "").start()
    yield srv
    srv.stop()


def _request(tmp_path: Path) -> LaunchRequest:
    return LaunchRequest.parse({"job": "victim", "rdzv_endpoint": "10.0.0.1:29400", "nnodes": "1",
                                "nproc_per_node": 1, "argv": ["python", "train.py"], "cwd": str(tmp_path)})


def test_injected_or_replayed_beats_and_cancels_are_refused_and_the_job_runs_on(launch_server, tmp_path, caplog):
    """On b865314 a bare {"cancel": 1} from anyone on the path stopped the job at once."""
    proxy = Proxy(launch_server.port)
    lz = Lease(f"127.0.0.1:{proxy.port}", KEY, timeout_s=10.0)
    try:
        lz.open(_request(tmp_path))
        assert lz.read() == ("out", "ready")
        lz.beat()                                       # the client's own beat, number 0
        deadline = time.monotonic() + 5
        while len(proxy.sent_up) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        genuine_beat = proxy.sent_up[-1]
        proxy.inject(b'{"cancel": 1}')                  # the old, unauthenticated cancel
        proxy.inject(b'{"ctl": "cancel", "cseq": 1, "mac": "' + b"0" * 64 + b'"}')   # a forged one
        proxy.inject(b'{"ctl": "cancel", "cseq": 1, "mac": "\xc3\xa9' + b"0" * 62 + b'"}')  # non-ASCII MAC
        proxy.inject(genuine_beat)                      # a replay: its number is used up
        time.sleep(1.5)
        assert launch_server.running() == 1, "an injected control message ended the lease"
        assert any("fails its submit-key authentication or sequence check" in r.getMessage() for r in caplog.records)
        lz.cancel()                                     # the client's own cancel still works
        deadline = time.monotonic() + 20
        while launch_server.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert launch_server.running() == 0
    finally:
        lz.close()
        proxy.close()


def test_a_hello_whose_host_id_was_changed_gets_nothing_started(launch_server, tmp_path):
    """On b865314 the host id in the server's hello was outside every MAC: a path could make
    `mcclctl run` believe it leased another host than the one that ran the job."""
    proxy = Proxy(launch_server.port, down=lambda line: line.replace(b'"host":"hostA"', b'"host":"hostB"'))
    lz = Lease(f"127.0.0.1:{proxy.port}", KEY, timeout_s=10.0)
    try:
        with pytest.raises(AuthError):
            lz.open(_request(tmp_path))
        time.sleep(0.3)
        assert launch_server.running() == 0
    finally:
        lz.close()
        proxy.close()


def test_injected_beats_do_not_keep_alive_a_lease_whose_client_fell_silent(tmp_path):
    """On b865314 anything the client side sent counted as a beat: a host on the path could keep
    a job running for a client that was long gone by sending {"beat": 1} now and then."""
    code = "import time; print('ready', flush=True); time.sleep(60)"
    srv = LaunchServer(KEY, "hostA", tmp_path, addr="127.0.0.1", port=0, harvest_state=lambda: "idle",
                       command=lambda req: [sys.executable, "-c", code], lease_timeout_s=1.5,
                       launch_user="root" if __import__("os").geteuid() == 0 else "").start()
    proxy = Proxy(srv.port)
    lz = Lease(f"127.0.0.1:{proxy.port}", KEY, timeout_s=10.0)
    try:
        lz.open(_request(tmp_path))
        assert lz.read() == ("out", "ready")
        # The client says nothing more; the path keeps "beating" for it.
        deadline = time.monotonic() + 15
        while srv.running() and time.monotonic() < deadline:
            try:
                proxy.inject(b'{"beat": 1}')
                proxy.inject(b'{"ctl": "beat", "cseq": 0, "mac": "' + b"1" * 64 + b'"}')
            except OSError:
                pass                                    # the server ended the lease meanwhile
            time.sleep(0.2)
        assert srv.running() == 0, "forged beats kept the lease of a silent client alive"
    finally:
        lz.close()
        proxy.close()
        srv.stop()


SECRET = "tok-3f9c1e-do-not-leak"
OUT_MARK = "confidential-job-output-51d2"


@pytest.fixture
def echo_server(tmp_path):
    """Its job prints a line with the secret it was given in --env, and exits 0."""
    code = f"import os; print({OUT_MARK!r}, os.environ['SECRET_TOKEN'], flush=True)"
    srv = LaunchServer(KEY, "hostA", tmp_path, addr="127.0.0.1", port=0, harvest_state=lambda: "idle",
                       command=lambda req: [sys.executable, "-c", code],
                       launch_user="root" if __import__("os").geteuid() == 0 else "").start()
    yield srv
    srv.stop()


def _secret_request(tmp_path: Path) -> LaunchRequest:
    return LaunchRequest.parse({"job": "victim", "rdzv_endpoint": "10.0.0.1:29400", "nnodes": "1",
                                "nproc_per_node": 1, "argv": ["python", "train.py", "--arg-secret-8e77"],
                                "cwd": str(tmp_path), "env": {"SECRET_TOKEN": SECRET}})


def _events_until_exit(lz: Lease) -> list[tuple[str, object]]:
    events = []
    while not events or events[-1][0] != "exit":
        event, data = lz.read()
        if event != "beat":
            events.append((event, data))
    return events


def test_env_values_command_line_and_job_output_never_cross_the_path_in_clear(echo_server, tmp_path):
    """Before protocol 3 (AES-256-GCM) the request and every event were JSON in clear under a
    MAC: the sniffer read --env SECRET_TOKEN, the command line, and the job's output."""
    proxy = Proxy(echo_server.port)
    lz = Lease(f"127.0.0.1:{proxy.port}", KEY, timeout_s=10.0)
    try:
        lz.open(_secret_request(tmp_path))
        assert _events_until_exit(lz) == [("out", f"{OUT_MARK} {SECRET}"), ("exit", {"code": 0})]
    finally:
        lz.close()
        proxy.close()
    up, down = b"\n".join(proxy.sent_up), b"\n".join(proxy.sent_down)
    assert up and down
    for what in (SECRET, "--arg-secret-8e77", "train.py", str(tmp_path)):
        assert what.encode() not in up, f"{what!r} crossed the path in clear (client -> host)"
    for what in (SECRET, OUT_MARK):
        assert what.encode() not in down, f"{what!r} crossed the path in clear (host -> client)"


def _flip_box(line: bytes) -> bytes:
    """One bit of the sealed payload flipped, as a path that rewrites the stream would."""
    msg = json.loads(line)
    raw = bytearray(base64.b64decode(msg["box"]))
    raw[len(raw) // 2] ^= 0x10
    msg["box"] = base64.b64encode(bytes(raw)).decode()
    return json.dumps(msg).encode()


def test_a_request_with_a_flipped_ciphertext_bit_starts_nothing(echo_server, tmp_path):
    seen = []

    def up(line: bytes) -> bytes:
        seen.append(line)
        return _flip_box(line) if len(seen) == 1 else line
    proxy = Proxy(echo_server.port, up=up)
    lz = Lease(f"127.0.0.1:{proxy.port}", KEY, timeout_s=10.0)
    try:
        with pytest.raises(AuthError, match="does not open under this host's submit key"):
            lz.open(_secret_request(tmp_path))
        time.sleep(0.3)
        assert echo_server.running() == 0
    finally:
        lz.close()
        proxy.close()


def test_an_event_with_a_flipped_ciphertext_bit_is_rejected_by_the_client(echo_server, tmp_path):
    seen = []

    def down(line: bytes) -> bytes:
        seen.append(line)
        return _flip_box(line) if len(seen) == 3 else line     # hello, started, then the output line
    proxy = Proxy(echo_server.port, down=down)
    lz = Lease(f"127.0.0.1:{proxy.port}", KEY, timeout_s=10.0)
    try:
        lz.open(_secret_request(tmp_path))
        with pytest.raises(AuthError, match=r"peer=127\.0\.0\.1:\d+ failed its authentication") as e:
            lz.read()
        assert SECRET not in str(e.value) and KEY.decode() not in str(e.value)
    finally:
        lz.close()
        proxy.close()


def test_an_unsigned_refusal_injected_mid_lease_is_not_believed(launch_server, tmp_path):
    """Up to protocol 2 the client took an unsigned {"ok": false} at any point of a lease as the
    host's word, so the path could end it with an error text of its choosing."""
    proxy = Proxy(launch_server.port,
                  down=lambda line: (b'{"ok": false, "error": {"kind": "ConfigError", "message": "run evil.sh"}}'
                                     if b'"seq":1' in line else line))
    lz = Lease(f"127.0.0.1:{proxy.port}", KEY, timeout_s=10.0)
    try:
        lz.open(_request(tmp_path))
        with pytest.raises(AuthError, match="failed its authentication"):
            lz.read()
    finally:
        lz.close()
        proxy.close()
