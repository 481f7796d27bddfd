"""``python -m tools.fleet``: bring an emulated fleet up or down, run commands in it,
or check that this machine can emulate one at all (``selftest``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys

from mccl_common.errors import MCCLError
from .fleet import PREFIX, Fleet, list_links, list_namespaces, parse_rate_bits, teardown, wait_for_output

IPERF_PORT = 5201


def iperf3_pair(fleet: Fleet, src: int, dst: int, seconds: float, port: int = IPERF_PORT) -> dict:
    """Run iperf3 from host src to host dst for ``seconds``; returns iperf3's JSON result."""
    if shutil.which("iperf3") is None:
        raise MCCLError("[fleet] iperf3 is missing; apt-get install iperf3")
    server = fleet.popen(dst, ["iperf3", "-s", "-1", "-p", str(port), "--forceflush"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_output(server, b"listening", f"iperf3 server in host {dst}")
        res = fleet.run(src, ["iperf3", "-c", fleet.hosts[dst].addr, "-p", str(port), "-t", f"{seconds:g}", "-J"],
                        timeout=seconds + 15)
        try:
            doc = json.loads(res.stdout)
        except ValueError:
            doc = {}
        if res.returncode != 0 or "error" in doc or "sum_received" not in doc.get("end", {}):
            raise MCCLError(f"[fleet] iperf3 from host {src} to {fleet.hosts[dst].addr}:{port} failed "
                            f"(rc={res.returncode}): {doc.get('error') or (res.stdout + res.stderr).strip()[-300:]}")
        return doc
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(timeout=5)


_LISTEN = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(64); s.settimeout(float(sys.argv[3]))
print("ready", flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"ok"); c.close()
"""
_CONNECT = """
import socket, sys
bad = []
for addr in sys.argv[2:]:
    try:
        with socket.create_connection((addr, int(sys.argv[1])), timeout=3) as c:
            if c.recv(2) != b"ok": bad.append(addr)
    except OSError:
        bad.append(addr)
print(" ".join(bad))
"""


def unreachable_pairs(fleet: Fleet, port: int = 5300, timeout: float = 20.0) -> list[tuple[int, int]]:
    """TCP-connect from every host to every other one; returns the (src, dst) pairs that failed.

    TCP rather than ping: it needs nothing beyond Python inside the namespaces and checks
    the path the collectives use.
    """
    listeners = [fleet.popen(i, [sys.executable, "-c", _LISTEN, h.addr, str(port), str(timeout)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i, h in enumerate(fleet.hosts)]
    try:
        for i, p in enumerate(listeners):  # bounded: a listener that hangs must not hang the check
            wait_for_output(p, b"ready", f"TCP listener in host {i}")
        bad: list[tuple[int, int]] = []
        for i in range(fleet.n_hosts):
            others = {h.addr: h.index for h in fleet.hosts if h.index != i}
            res = fleet.run(i, [sys.executable, "-c", _CONNECT, str(port), *others], timeout=timeout)
            if res.returncode != 0:
                raise MCCLError(f"[fleet] connectivity probe in host {i} failed: {res.stderr.strip()[-300:]}")
            bad += [(i, others[a]) for a in res.stdout.split()]
        return bad
    finally:
        for p in listeners:
            p.kill()
            p.wait(timeout=5)


def _selftest(n: int, rate: str, seconds: float) -> int:
    with Fleet(n, rate=rate) as fleet:
        fid = fleet.id
        print(f"fleet {fid}: {n} hosts on bridge {fleet.bridge}, rate {rate}")
        for h in fleet.hosts:
            print(f"  host {h.index}: ns={h.ns} addr={h.addr}")
        bad = unreachable_pairs(fleet)
        if bad:
            print(f"FAIL: no TCP connection from/to hosts {bad}")
            return 1
        print(f"tcp: all {n * (n - 1)} host pairs reachable")
        result = iperf3_pair(fleet, 0, 1, seconds)
        bps = result["end"]["sum_received"]["bits_per_second"]
        limit = parse_rate_bits(rate)
        print(f"iperf3 host0 -> host1: {bps / 1e6:.1f} Mbit/s ({bps / limit:.1%} of {rate})")
    left = [ns for ns in list_namespaces() if ns.startswith(f"{PREFIX}{fid}h")]
    left += [ln for ln in list_links() if ln.startswith(f"{PREFIX}{fid}")]
    if left:
        print(f"FAIL: teardown left {left}")
        return 1
    print("teardown: no namespaces, veths or bridge left")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.fleet", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a fleet and leave it up (tear down with 'down')")
    up.add_argument("name", help="fleet id: 1-5 lowercase letters/digits")
    up.add_argument("-n", "--hosts", type=int, default=3)
    up.add_argument("--rate", default="1gbit", help="tc rate per host link, or 'none'")
    down = sub.add_parser("down", help="tear a fleet down (kills its processes)")
    down.add_argument("name")
    ex = sub.add_parser("exec", help="run a command inside one host: exec NAME HOST -- CMD...")
    ex.add_argument("name")
    ex.add_argument("host", type=int)
    ex.add_argument("command", nargs=argparse.REMAINDER)
    st = sub.add_parser("selftest", help="build a 3-host fleet, check connectivity, iperf3, tear down")
    st.add_argument("-n", "--hosts", type=int, default=3)
    st.add_argument("--rate", default="200mbit")
    st.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args(argv)
    # SIGTERM unwinds like an exception, so a fleet being built or tested is torn down.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "up":
            fleet = Fleet(args.hosts, rate=None if args.rate == "none" else args.rate, name=args.name).start()
            fleet.release()
            for h in fleet.hosts:
                print(f"{h.ns} {h.addr}")
            return 0
        if args.cmd == "down":
            teardown(args.name)
            return 0
        if args.cmd == "exec":
            cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not cmd:
                ap.error("exec needs a command after the host index")
            os.execvp("ip", ["ip", "netns", "exec", f"{PREFIX}{args.name}h{args.host}", *cmd])
        return _selftest(args.hosts, args.rate, args.seconds)
    except MCCLError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
