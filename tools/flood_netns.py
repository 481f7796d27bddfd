"""Issue 34's flood at host scale: set-up time of an 8-rank engine job whose ranks are hosts of
an emulated fleet (one network namespace each), with and without an attacker on 8 other hosts
of the same switch that holds 200 idle connections on every rank's listener (25 from each
attacker host) and dials again each one a rank closes, alternating rounds in one run.

    sudo .venv/bin/python -m tools.flood_netns [--rounds 3] [--ranks 8] [--flood 200] [--sources 8]
    sudo .venv/bin/python -m tools.flood_netns --rate 10gbit      # links shaped as the studio's

Each round starts fresh processes: every rank opens its listener and publishes its address;
once all are known the attackers (if any) connect and report that they hold their share; then
the ranks build their communicator (the timed set-up), run an all-reduce and exchange with
every other rank (links opened on demand under the same flood). A round's set-up time is the
slowest rank's. Prints one line per round and the medians. Not a test: timings are wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_POLL_S = 0.005
_WAIT_S = 60.0


def _wait_for(paths: list[Path], what: str, procs: list[subprocess.Popen] | None = None) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not all(p.exists() for p in paths):
        for p in procs or ():
            if p.poll() is not None and p.returncode != 0:
                raise RuntimeError(f"[flood_netns] a process exited {p.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"[flood_netns] {what} did not appear within {_WAIT_S:g}s")
        time.sleep(_POLL_S)


def _publish(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def _rank(d: Path, r: int, n: int, addr: str) -> None:
    import logging

    from libmccl import _core

    from .flood_setup import job

    logging.getLogger("libmccl.engine").setLevel(logging.ERROR)
    listener = _core.Listener(addr, 0)
    _publish(d / f"addr.{r}", listener.address)
    paths = [d / f"addr.{q}" for q in range(n)]
    _wait_for(paths, "the ranks' addresses")
    addrs = [p.read_text() for p in paths]
    opts = _core.Options()
    opts.timeout_s, opts.connect_timeout_s = 60.0, 30.0
    opts.wire_security = _core.WireSecurity.aead
    secret = (d / "secret").read_bytes()
    cid = int((d / "cid").read_text())
    _wait_for([d / "go"], "the go file")
    t0 = time.monotonic()
    c = _core.Communicator(r, n, cid, listener, addrs, opts, secret=secret)
    setup_s = time.monotonic() - t0
    t1 = time.monotonic()
    job(c, r, n)
    job_s = time.monotonic() - t1
    _publish(d / f"result.{r}", json.dumps({"setup_s": setup_s, "job_s": job_s}))
    _wait_for([d / "done"], "the end of the round")   # links stay up until every rank finished
    c.shutdown(5.0)


def _torch_rank(d: Path, r: int, n: int, master: str) -> None:
    """A rank through its host's mccld (MCCL_DAEMON=1): set-up is init_process_group and a first
    all-reduce (the daemons link then, through their flooded ports); the job every pair."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    _wait_for([d / "go"], "the go file")
    t0 = time.monotonic()
    dist.init_process_group("mccl", init_method=f"tcp://{master}", rank=r, world_size=n,
                            timeout=timedelta(seconds=60))
    x = torch.full((1 << 16,), float(r + 1))
    dist.all_reduce(x)
    assert x[0].item() == n * (n + 1) / 2
    setup_s = time.monotonic() - t0
    t1 = time.monotonic()
    outs = {q: torch.full((256,), r, dtype=torch.int32) for q in range(n) if q != r}
    ins = {q: torch.zeros(256, dtype=torch.int32) for q in range(n) if q != r}
    reqs = [dist.isend(outs[q], q) for q in outs] + [dist.irecv(ins[q], q) for q in ins]
    for req in reqs:
        req.wait()
    assert all((ins[q] == q).all() for q in ins)
    job_s = time.monotonic() - t1
    _publish(d / f"result.{r}", json.dumps({"setup_s": setup_s, "job_s": job_s}))
    _wait_for([d / "done"], "the end of the round")
    dist.destroy_process_group()


def _listening_ports(fleet, host: int, pid: int) -> list[int]:  # noqa: ANN001 - tools.fleet.Fleet
    """The TCP ports process `pid` (an mccld) listens on in host's namespace: its link port
    (control links and data sockets), status and metrics ports."""
    out = fleet.run(host, ["ss", "-Htlnp"], timeout=10).stdout
    return sorted({int(line.split()[3].rpartition(":")[2]) for line in out.splitlines() if f"pid={pid}," in line})


def _attack(d: Path, j: int, n: int, per_port: int) -> None:
    from .flood_setup import Flood

    targets = []
    for q in range(n):
        for line in (d / f"addr.{q}").read_text().split():
            host, _, port = line.rpartition(":")
            targets.append((host, int(port)))
    flood = Flood(targets, per_port, None)
    _publish(d / f"holding.{j}", str(sum(len(s) for s in flood.held.values())))
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    while not stop[0] and not (d / "done").exists():
        time.sleep(0.05)
    _publish(d / f"attack.{j}", json.dumps({"dials": flood.dials, "closed_by_ranks": flood.closed_by_rank}))
    flood.stop()


def one_round(fleet, n: int, sources: int, per_port: int, daemons=None) -> dict:  # noqa: ANN001
    """One round on `fleet` (tools.fleet.Fleet): ranks on its first n hosts, attackers on the
    next `sources`; with `daemons` (tools.bench.daemons.HostDaemons on the first n hosts) the
    ranks are torch processes through their host's mccld and the attackers flood its ports."""
    py = [sys.executable, "-m", "tools.flood_netns"]
    with tempfile.TemporaryDirectory(prefix="mccl-flood-") as tmp:
        d = Path(tmp)
        (d / "secret").write_bytes(os.urandom(32))
        os.chmod(d / "secret", 0o600)
        (d / "cid").write_text(str(int.from_bytes(os.urandom(7), "big")))
        if daemons is None:
            ranks = [fleet.popen(r, py + ["_rank", tmp, str(r), str(n), fleet.hosts[r].addr]) for r in range(n)]
        else:
            for h in range(n):
                ports = _listening_ports(fleet, h, daemons.procs[h].pid)
                _publish(d / f"addr.{h}", " ".join(f"{fleet.hosts[h].addr}:{p}" for p in ports))
            master = f"{fleet.hosts[0].addr}:{29500 + int.from_bytes(os.urandom(2), 'big') % 1000}"
            ranks = [daemons.popen(r, py + ["_torch_rank", tmp, str(r), str(n), master],
                                   env={"MCCL_JOB_KEY_FILE": daemons.key_file}) for r in range(n)]
        attackers: list[subprocess.Popen] = []
        try:
            _wait_for([d / f"addr.{q}" for q in range(n)], "the ranks' addresses", ranks)
            if per_port:
                share = max(1, per_port // sources)
                attackers = [fleet.popen(n + j, py + ["_attack", tmp, str(j), str(n), str(share)])
                             for j in range(sources)]
                _wait_for([d / f"holding.{j}" for j in range(sources)], "the attackers' connections", attackers)
            _publish(d / "go", "")
            _wait_for([d / f"result.{r}" for r in range(n)], "every rank's result", ranks)
            results = [json.loads((d / f"result.{r}").read_text()) for r in range(n)]
            _publish(d / "done", "")
            for p in ranks + attackers:
                p.wait(30)
            if any(p.returncode != 0 for p in ranks):
                raise RuntimeError(f"[flood_netns] rank exit codes {[p.returncode for p in ranks]}")
            attacks = [json.loads((d / f"attack.{j}").read_text()) for j in range(len(attackers))]
            return {"setup_s": max(x["setup_s"] for x in results), "job_s": max(x["job_s"] for x in results),
                    "flood_dials": sum(a["dials"] for a in attacks),
                    "closed_by_ranks": sum(a["closed_by_ranks"] for a in attacks)}
        finally:
            for p in ranks + attackers:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)


class _FirstHosts:
    """The first n hosts of a fleet, as tools.bench.daemons.HostDaemons wants a launcher."""

    def __init__(self, fleet, n: int) -> None:  # noqa: ANN001
        self.fleet, self.n = fleet, n

    def addr(self, i: int) -> str:
        return self.fleet.hosts[i].addr

    def popen(self, i: int, argv, env=None, **kw) -> subprocess.Popen:  # noqa: ANN001
        return self.fleet.popen(i, argv, env=env, **kw)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        _, _, d, r, n, addr = sys.argv
        return _rank(Path(d), int(r), int(n), addr)
    if len(sys.argv) > 1 and sys.argv[1] == "_torch_rank":
        _, _, d, r, n, master = sys.argv
        return _torch_rank(Path(d), int(r), int(n), master)
    if len(sys.argv) > 1 and sys.argv[1] == "_attack":
        _, _, d, j, n, per = sys.argv
        return _attack(Path(d), int(j), int(n), int(per))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--flood", type=int, default=200, help="idle connections held per listening port, in all")
    ap.add_argument("--sources", type=int, default=8, help="attacker hosts (each holds flood/sources a port)")
    ap.add_argument("--rate", default=None, help="link rate per host (tc syntax); default unshaped")
    ap.add_argument("--daemon", action="store_true",
                    help="ranks are torch processes through one mccld per host; the attackers flood mccld's "
                         "ports (link, status, metrics) instead of the ranks' listeners")
    args = ap.parse_args()
    from .fleet import Fleet

    got: dict[str, list[dict]] = {"none": [], "flood": []}
    with Fleet(args.ranks + args.sources, rate=args.rate) as fleet, \
            tempfile.TemporaryDirectory(prefix="mccl-flood-run-") as run_dir:
        daemons = None
        if args.daemon:
            from .bench.daemons import HostDaemons

            daemons = HostDaemons(_FirstHosts(fleet, args.ranks), run_dir).start()
        try:
            for i in range(args.rounds):
                for kind in ("none", "flood"):
                    r = one_round(fleet, args.ranks, args.sources, args.flood if kind == "flood" else 0, daemons)
                    got[kind].append(r)
                    print(f"round {i} {kind:5s} set-up {r['setup_s']:.3f} s  job (every pair) "
                          f"{r['job_s']:.3f} s  attacker dials {r['flood_dials']}  closed by the ranks "
                          f"{r['closed_by_ranks']}", flush=True)
        finally:
            if daemons is not None:
                left = daemons.stop()
                if left:
                    print(f"cleaned after the daemons: {left}")
    med = {k: statistics.median(x["setup_s"] for x in v) for k, v in got.items()}
    for kind, rs in got.items():
        print(f"median {kind:5s} set-up {med[kind]:.3f} s  job {statistics.median(x['job_s'] for x in rs):.3f} s")
    where = "through one mccld per host, its ports flooded" if args.daemon else "in-process, the ranks' listeners flooded"
    print(f"set-up time grows by {med['flood'] - med['none']:+.3f} s under a flood of {args.flood} connections per "
          f"port from {args.sources} attacker hosts ({args.ranks} ranks, each a host, {where})")


if __name__ == "__main__":
    main()
