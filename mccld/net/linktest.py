"""Link test: TCP goodput from this daemon to another, recorded as the link's ceiling.

The measuring daemon streams incompressible bytes on a few sockets to the other
daemon's status endpoint, which sinks them (``serve_sink``) once the request has
authenticated, then reports how many bytes arrived. Goodput is what arrived over the
time until the last sink reported, so data still in socket buffers is not counted.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from mccl_common.errors import AuthError, MCCLError, ProtocolError
from mccl_common.status_protocol import (IO_TIMEOUT_S, SINK, Conn, canon, connect, mac, mac_ok, read_reply,
                                         send_request, signed_reply, split_addr)

MAX_SECONDS = 30.0
MAX_STREAMS = 16
_CHUNK = 1 << 20


def serve_sink(conn: Conn, key: bytes, nonce: str, cnonce: str, seconds: float, info: dict) -> None:
    """The far end of a link test, on an authenticated connection: count bytes until EOF."""
    seconds = min(seconds, MAX_SECONDS)
    conn.send(signed_reply(key, cnonce, nonce, info, None))
    received = len(conn.take_buffered())
    buf = bytearray(_CHUNK)
    deadline = time.monotonic() + seconds + IO_TIMEOUT_S
    while True:
        if time.monotonic() > deadline:
            raise ProtocolError(f"[linktest] sender peer={conn.peer} kept streaming past its "
                                f"{seconds:.1f} s; closing")
        n = conn.sock.recv_into(buf)
        if n == 0:
            break
        received += n
    body = canon({"received": received})
    conn.send({"ok": True, "body": body, "mac": mac(key, "sink", cnonce, nonce, body)})


def measure_goodput(target: str, key: bytes, seconds: float, streams: int) -> dict:
    """Stream bytes to ``target``'s status endpoint for ``seconds`` on ``streams`` sockets.

    Goodput = bytes the sink reports it received / time until the last sink reported,
    so data still sitting in socket buffers when the clock stops is not counted early.
    """
    host, port = split_addr(target)
    peer = f"{host}:{port}"
    conns: list[tuple[Conn, str, str]] = []
    sink_info: dict = {}
    try:
        for _ in range(streams):
            sock = connect(target, IO_TIMEOUT_S)
            sock.settimeout(IO_TIMEOUT_S)
            conn = Conn(sock, peer)
            _, cnonce, nonce = send_request(conn, key, SINK, {"seconds": seconds})
            conns.append((conn, cnonce, nonce))
            sink_info = read_reply(conn, key, cnonce, nonce)
        failures: list[BaseException] = []
        start = time.monotonic()
        end = start + seconds

        def pump(conn: Conn) -> None:
            payload = memoryview(os.urandom(_CHUNK))  # incompressible, like real gradients
            try:
                while time.monotonic() < end:
                    conn.sock.send(payload)
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError as e:
                failures.append(e)

        threads = [threading.Thread(target=pump, args=(c,), daemon=True) for c, _, _ in conns]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=seconds + IO_TIMEOUT_S)
        if failures or any(t.is_alive() for t in threads):
            raise MCCLError(f"[linktest] stream to peer={peer} failed: "
                            f"{failures[0] if failures else 'send stalled'}; the peer daemon stopped "
                            f"or the link dropped")
        received = 0
        for conn, cnonce, nonce in conns:
            reply = conn.recv("linktest result")
            body = reply.get("body")
            if not isinstance(body, str) or not mac_ok(key, reply.get("mac"), "sink", cnonce, nonce, body):
                raise AuthError(f"[linktest] result from peer={peer} is not signed with the "
                                f"fleet key", peer_addr=peer)
            received += int(json.loads(body)["received"])
        elapsed = time.monotonic() - start
    except socket.timeout:
        raise MCCLError(f"[linktest] Timed out on the link to peer={peer}; the link is stalled or the "
                        f"peer daemon is overloaded", peer_addr=peer) from None
    finally:
        for conn, _, _ in conns:
            conn.sock.close()
    if received == 0:
        raise MCCLError(f"[linktest] to peer={peer} delivered no bytes in {elapsed:.1f} s; "
                        f"the link is down", peer_addr=peer)
    return {"target": peer, "peer_address": sink_info.get("address") or peer,
            "peer_host": sink_info.get("host"), "bytes": received, "seconds": elapsed,
            "streams": streams, "bits_per_s": received * 8.0 / elapsed, "time": time.time()}
