"""`mcclctl status` over a synthetic fleet of N status endpoints on loopback, new path against
the old one in the same run.

The fleet: N real mccld StatusServers (mccld/report/status_server.py, fleet-key authenticated) spread
over a few worker processes, each answering as a daemon with its own host id; ``--dead`` of the
N are ports where nothing listens (refused at once) and ``--hung`` are sockets that accept and
never answer (a hung daemon, or a black-holed host once connected). One more server plays this
host's mccld: its fleet table (what gossip gives it) lists all N.

- old: what `mcclctl status` did before gossip: listen for mDNS for --discover-timeout (3 s by
  default; it finds no synthetic host, so the old path is also given the targets for free), then
  the old fetch (32 threads, --timeout per request, one ThreadPoolExecutor joined at the end).
- new: mcclctl.targets.discover (the local daemon's table over the status protocol) + the new
  fetch (MAX_PARALLEL threads, one deadline), in-process, and `python -m mcclctl status --json`
  end to end (interpreter start included).

    python -m tools.bench.status_fleet --hosts 200 --dead 5 --hung 5 --timeout 1.5
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KEY_HEX = "5a" * 32
BASELINE_REV = "760a1f1"        # main before this change: mcclctl/targets.py's old fetch


def serve(count: int, base: int) -> None:
    """A worker: ``count`` status servers answering as hosts base.., ports on stdout, then wait."""
    from mccld.report.status_server import StatusServer
    key = bytes.fromhex(KEY_HEX)
    servers = []
    for i in range(base, base + count):
        status = {"host": f"h{i:03d}", "fleet": "bench", "address": "", "version": "0.1.0", "proto": 1,
                  "attached": 0, "jobs": [], "links": [], "data_links": [], "fleet_table": [],
                  "last_error": None, "launch_port": 0, "launched": []}
        srv = StatusServer(lambda s=status: s, key, "127.0.0.1", 0)
        srv.start()
        servers.append(srv)
    print(json.dumps([s.port for s in servers]), flush=True)
    sys.stdin.read()      # until the parent closes our stdin
    for s in servers:
        s.stop()


def _rows(addrs: list[tuple[str, int]]) -> list[dict]:
    return [{"host_id": f"h{i:03d}", "addresses": [a], "port": 29650, "status_port": p, "metrics_port": 0,
             "source": "gossip"} for i, (a, p) in enumerate(addrs)]


def _old_targets_module():
    """mcclctl/targets.py as it was before this change, from git, for the same-run baseline."""
    src = subprocess.run(["git", "show", f"{BASELINE_REV}:mcclctl/targets.py"], capture_output=True, text=True,
                         check=True).stdout
    with tempfile.TemporaryDirectory(prefix="mccl-bench-") as tmp:
        path = Path(tmp) / "old_targets.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("old_targets", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["old_targets"] = mod      # dataclasses look their module up
        spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=200)
    ap.add_argument("--dead", type=int, default=5, help="of --hosts: nothing listens")
    ap.add_argument("--hung", type=int, default=5, help="of --hosts: accept, never answer")
    ap.add_argument("--workers", type=int, default=4, help="processes serving the live endpoints")
    ap.add_argument("--timeout", type=float, default=1.5, help="per-host deadline (mcclctl --timeout)")
    ap.add_argument("--discover-timeout", type=float, default=3.0, help="the old path's mDNS listening")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--serve", type=int, nargs=2, metavar=("COUNT", "BASE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(*args.serve)
        return 0

    live = args.hosts - args.dead - args.hung
    workers, addrs = [], []
    hung_socks = []
    try:
        per = -(-live // args.workers)
        for w in range(args.workers):
            n = min(per, live - w * per)
            if n <= 0:
                break
            p = subprocess.Popen([sys.executable, "-m", "tools.bench.status_fleet", "--serve", str(n), str(w * per)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            workers.append(p)
        for p in workers:
            addrs += [("127.0.0.1", port) for port in json.loads(p.stdout.readline())]
        for _ in range(args.dead):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            addrs.append(("127.0.0.1", s.getsockname()[1]))
            s.close()                      # nothing listens there now
        for _ in range(args.hung):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(64)                   # connects complete in the backlog; nobody answers
            hung_socks.append(s)
            addrs.append(("127.0.0.1", s.getsockname()[1]))
        return _measure(args, addrs)
    finally:
        for p in workers:
            try:
                p.stdin.close()
                p.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
                p.wait(5)
        for s in hung_socks:
            s.close()


def _measure(args, addrs: list[tuple[str, int]]) -> int:
    from mccld.report.status_server import StatusServer
    from mcclctl import targets as new
    from mccl_common.discovery import browse_fleet
    key = bytes.fromhex(KEY_HEX)
    rows = _rows(addrs)
    local = StatusServer(lambda: {"host": "local", "address": "", "fleet_table": rows, "jobs": [], "links": []},
                         key, "127.0.0.1", 0)
    local.start()
    old = _old_targets_module()
    env = {**os.environ, "MCCL_LISTEN_ADDR": "127.0.0.1", "MCCL_STATUS_PORT": str(local.port),
           "MCCL_FLEET_KEY": KEY_HEX, "MCCL_FLEET": "bench"}
    os.environ.update({k: env[k] for k in ("MCCL_LISTEN_ADDR", "MCCL_STATUS_PORT", "MCCL_FLEET_KEY", "MCCL_FLEET")})
    results = []
    try:
        for _ in range(args.repeat):
            t0 = time.monotonic()
            browse_fleet(args.discover_timeout, fleet="bench")
            targets = [old.from_record(r) for r in rows]     # the old path given the hosts for free
            t1 = time.monotonic()
            old_replies = old.fetch(targets, key, "status", timeout_s=args.timeout)
            t2 = time.monotonic()
            found = new.discover(args.discover_timeout, key)
            t3 = time.monotonic()
            new_replies = new.fetch(found, key, "status", timeout_s=args.timeout)
            t4 = time.monotonic()
            cli = subprocess.run([sys.executable, "-m", "mcclctl", "status", "--json", "--timeout", str(args.timeout)],
                                 env=env, capture_output=True, text=True, timeout=120)
            t5 = time.monotonic()
            daemons = json.loads(cli.stdout)["daemons"]
            results.append({
                "old_discover_s": t1 - t0, "old_fetch_s": t2 - t1, "old_total_s": t2 - t0,
                "old_answered": sum(r.error is None for r in old_replies),
                "new_discover_s": t3 - t2, "new_fetch_s": t4 - t3, "new_total_s": t4 - t2,
                "new_answered": sum(r.error is None for r in new_replies), "new_listed": len(found),
                "cli_s": t5 - t4, "cli_listed": len(daemons), "cli_answered": sum(d["error"] is None for d in daemons)})
    finally:
        local.stop()
    print(json.dumps({"hosts": args.hosts, "dead": args.dead, "hung": args.hung, "timeout_s": args.timeout,
                      "runs": results}, indent=1))
    for key_ in ("old_total_s", "new_total_s", "cli_s"):
        vals = sorted(r[key_] for r in results)
        print(f"{key_}: median {vals[len(vals) // 2]:.2f} s (min {vals[0]:.2f}, max {vals[-1]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
