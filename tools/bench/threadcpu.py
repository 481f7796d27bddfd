"""Where the CPU goes, per thread: samples /proc while a benchmark runs.

    python -m tools.bench.threadcpu --seconds 20 [--json out.json]
    python -m tools.bench.threadcpu --match ... -- python -m tools.bench --hosts 8 ...

Every process whose command line matches ``--match`` is read at the start and the end of
the interval (or of the command given after ``--``), and the CPU seconds (user + system)
each of its threads used in between are reported, grouped by the process's role and the
thread's name (engine threads are named: mccl-worker, mccl-complete, mccl-send,
mccl-recv, mccl-fast-*; Python's own threads carry the process's name). Threads that
started and ended inside the interval are not seen: sample while the work is steady.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict

_HZ = os.sysconf("SC_CLK_TCK")


def _role(cmd: str) -> str:
    if "mccld" in cmd or "tools.bench.daemons" in cmd:     # the benchmark starts mccld through the latter
        return "mccld"
    if "tools.bench.worker" in cmd or "worker.py" in cmd:
        return "rank"
    if "iperf3" in cmd:
        return "iperf3"
    return cmd.split()[0].rsplit("/", 1)[-1] if cmd else "?"


def sample(pattern: re.Pattern) -> dict[tuple[int, int], tuple[str, str, float]]:
    """{(pid, tid): (role, thread name, CPU seconds so far)} of the matching processes."""
    out = {}
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            if not pattern.search(cmd):
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = open(f"/proc/{pid}/task/{tid}/stat").read()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                out[(int(pid), int(tid))] = (_role(cmd), name, (int(fields[11]) + int(fields[12])) / _HZ)
        except (OSError, ValueError):
            continue        # gone in between
    return out


def machine_busy_s() -> tuple[float, int]:
    """(CPU seconds the whole machine spent not idle, cores): the kernel's network work
    (softirq for veth and tbf) lands here, not in any process's figure."""
    with open("/proc/stat") as f:
        lines = f.read().splitlines()
    total = [int(x) for x in lines[0].split()[1:]]
    idle = total[3] + (total[4] if len(total) > 4 else 0)       # idle + iowait
    cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return (sum(total[:8]) - idle) / _HZ, cores


def diff(a: dict, b: dict, seconds: float) -> dict:
    by_thread: dict[tuple[str, str], float] = defaultdict(float)
    by_role: dict[str, float] = defaultdict(float)
    procs: dict[str, set[int]] = defaultdict(set)
    for key, (role, name, cpu) in b.items():
        # A thread absent at the start began inside the interval: its whole count is ours.
        used = cpu - a[key][2] if key in a else cpu
        by_thread[(role, name)] += used
        by_role[role] += used
        procs[role].add(key[0])
    return {"seconds": round(seconds, 2),
            "roles": {r: {"processes": len(procs[r]), "cpu_s": round(v, 2), "cores": round(v / seconds, 2)}
                      for r, v in sorted(by_role.items(), key=lambda kv: -kv[1])},
            "threads": [{"role": r, "thread": n, "cpu_s": round(v, 2), "cores": round(v / seconds, 2)}
                        for (r, n), v in sorted(by_thread.items(), key=lambda kv: -kv[1]) if v >= 0.01]}


def format_report(rep: dict) -> str:
    m = rep["machine"]
    lines = [f"CPU over {rep['seconds']} s (cores = CPU seconds / wall seconds); "
             f"the whole machine: {m['busy_cores']} of {m['cores']} cores busy",
             f"{'role':10s} {'procs':>5s} {'cpu_s':>8s} {'cores':>6s}"]
    for role, r in rep["roles"].items():
        lines.append(f"{role:10s} {r['processes']:5d} {r['cpu_s']:8.2f} {r['cores']:6.2f}")
    lines.append(f"\n{'role':10s} {'thread':18s} {'cpu_s':>8s} {'cores':>6s}")
    for t in rep["threads"][:40]:
        lines.append(f"{t['role']:10s} {t['thread']:18s} {t['cpu_s']:8.2f} {t['cores']:6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m tools.bench.threadcpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--match", default=r"mccld|tools\.bench\.(worker|daemons)", help="regex on the command line")
    ap.add_argument("--seconds", type=float, default=10.0, help="interval, when no command is given")
    ap.add_argument("--delay", type=float, default=0.0, help="with a command: start sampling this long after it")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args(argv)
    pattern = re.compile(args.match)
    rc = 0
    if cmd:
        proc = subprocess.Popen(cmd)
        time.sleep(args.delay)
        t0, a, m0 = time.monotonic(), sample(pattern), machine_busy_s()
        # Sample just before the command ends too, while its processes still exist.
        last = a
        while proc.poll() is None:
            time.sleep(0.5)
            now = sample(pattern)
            if now:
                last = {**last, **now}
        rc = proc.returncode
        b, seconds, m1 = last, time.monotonic() - t0, machine_busy_s()
    else:
        t0, a, m0 = time.monotonic(), sample(pattern), machine_busy_s()
        time.sleep(args.seconds)
        b, seconds, m1 = sample(pattern), time.monotonic() - t0, machine_busy_s()
    rep = diff(a, b, seconds)
    rep["machine"] = {"cores": m1[1], "busy_cores": round((m1[0] - m0[0]) / seconds, 2)}
    print(format_report(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
