"""Built-in ring bandwidth probe, for hosts without iperf3.

``python -m tools.bench.probe LISTEN_ADDR LISTEN_PORT RIGHT_ADDR RIGHT_PORT SECONDS``:
accepts one connection from the left neighbour and receives, while sending to the right
neighbour for SECONDS. Prints one JSON line: bytes received, the receive window, and
this process's CPU seconds. Large sendall/recv_into calls release the GIL, so one
Python process keeps a link busy at 10 Gbit/s scale.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

CHUNK = 4 << 20
CONNECT_TIMEOUT_S = 20.0


def _receive(listener: socket.socket, result: dict, seconds: float) -> None:
    listener.settimeout(CONNECT_TIMEOUT_S + seconds)
    conn, _ = listener.accept()
    conn.settimeout(seconds + 10)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total, first, last = 0, None, None
    with conn:
        while True:
            n = conn.recv_into(view)
            if n == 0:
                break
            last = time.perf_counter()
            if first is None:
                # The window starts at the first byte, so connection set-up is not counted.
                first, n = last, 0
            total += n
    result.update(bytes=total, seconds=(last - first) if first and last else 0.0)


def main() -> int:
    laddr, lport, raddr, rport, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((laddr, lport))
    listener.listen(1)
    c0 = os.times()
    result: dict = {}
    rx = threading.Thread(target=_receive, args=(listener, result, seconds), daemon=True)
    rx.start()
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            out = socket.create_connection((raddr, rport), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = memoryview(bytearray(CHUNK))
    with out:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            out.sendall(payload)
        out.shutdown(socket.SHUT_WR)
    rx.join(timeout=seconds + 30)
    if rx.is_alive() or "bytes" not in result:
        print(json.dumps({"error": "receive side did not finish"}))
        return 1
    c1 = os.times()
    result["cpu_s"] = (c1.user - c0.user) + (c1.system - c0.system)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
