"""Fault campaign: ranks loop random collectives; one fault hits a random rank, link or daemon.

Topology: an emulated fleet (tools.fleet: network namespaces on a bridge) of two hosts
with two ranks each. ``--mode inproc`` runs the in-process engine (libmccl._core) between
the hosts' addresses; ``--mode daemon`` attaches every rank to its host's mccld
(libmccl.daemon.client: shared memory, ZeroMQ, the daemons' TCP links). See rank.py for
what a rank does and checks; ranks are forked from this process (numpy and the engine
imported once), which stays single-threaded so forking it is safe.

One trial: fork the ranks, wait until each completed a collective, wait a random delay,
inject one fault (faults.py) into a random rank, link or daemon, then check that

- every survivor raised one of the fault's named MCCL errors, naming the culprit where
  the fault allows (faults.py: ``named``), within the timeout + 3 s (else: ``late``;
  nothing at all within 10 s more: ``hang``);
- every result before (and after) the fault matched its locally computed expectation;
- nothing leaked: every rank exited and was reaped, the trial's /dev/shm/mccl-<job>-*
  segments are gone (``leaks``), the surviving daemons are back to the threads and fds
  they had after their warm-up job, give or take THREAD_SLACK/FD_SLACK (``daemon_growth``).

Daemons live across trials; one a fault killed or stopped is replaced. The trial's seed
fixes everything random in it: ``--seed S --trials 1`` replays trial S.

Usage::

    .venv/bin/python scripts/faults/campaign.py --mode daemon --trials 100 [--seed S] [--json out.json]
    # the full run, on a machine with 16 cores: ten campaigns side by side, one summary
    .venv/bin/python scripts/faults/campaign.py --mode daemon --trials 1000 --shards 10 --json daemon.json

scripts/faults/daemon_kill.py is the mccld SIGKILL trial through torch.distributed itself
(a torch import per rank: slower, but it covers the glue's teardown).

Exit status 0 when every trial passed. One JSON line per failed trial (every trial with
``-v``) and a summary per fault kind on stdout.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# Forking is only safe from a single thread: keep OpenBLAS (loaded with numpy) from starting its pool.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import faults  # noqa: E402
from daemons import HostDaemons  # noqa: E402
from rank import RankSpec, run_rank  # noqa: E402

PLACEMENT = (0, 0, 1, 1)               # rank -> host
TIMEOUT_S = 2.0                        # the group's timeout in every rank
DETECT_SLACK_S = 3.0                   # the brief: a named error within the timeout + 3 s
HANG_AFTER_S = 10.0                    # past the detection deadline: no answer at all is a hang
READY_TIMEOUT_S = 60.0
FAULT_DELAY_S = (0.0, 0.5)             # after every rank completed a collective
REAP_S = 10.0
SEGMENTS_S = 3.0                       # for the daemons to drop a failed job's segments ...
DAEMON_SETTLE_S = 3.0                  # ... and its threads (a failure notice to a peer host may still be on its way)
DAEMON_LATE_S = 15.0                   # how long a grown daemon is watched on, to tell a slow close from a leak
# A daemon's threads and fds move by one or two between jobs (links redialled, pool workers);
# a leak per failed job (3 threads, 8 fds, as the campaign once found) passes these at once.
THREAD_SLACK, FD_SLACK = 2, 4


@dataclass
class Trial:
    seed: int
    mode: str
    kind: str = ""
    victim: int = -1                   # a rank, or a host for host faults
    problems: dict[str, list[str]] = field(default_factory=dict)
    detect_s: float | None = None
    results: dict[int, dict] = field(default_factory=dict)
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)   # where the trial's time went

    def mark(self, phase: str, since: float) -> float:
        now = time.monotonic()
        self.phases[phase] = round(now - since, 2)
        return now

    def problem(self, category: str, what: str) -> None:
        self.problems.setdefault(category, []).append(what)


def _fork_rank(spec: RankSpec) -> int:
    pid = os.fork()
    if pid == 0:
        run_rank(spec)          # never returns
    return pid


def _reap(pids: dict[int, int], deadline: float) -> list[int]:
    """waitpid every child until ``deadline``, then SIGKILL; returns the ranks that had to be killed."""
    left = dict(pids)
    while left and time.monotonic() < deadline:
        for r, pid in list(left.items()):
            if os.waitpid(pid, os.WNOHANG)[0]:
                del left[r]
        time.sleep(0.02)
    for pid in left.values():
        faults.signal_pid(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return sorted(left)


def _segments(job: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"mccl-{job}-*"))


def _names_culprit(res: dict, victims: set[int], hosts: list[str]) -> bool:
    msg = res.get("msg") or ""
    return (res.get("peer_rank") in victims or any(f"rank {v}" in msg for v in victims)
            or any(h in msg or h == res.get("peer_addr") for h in hosts))


def warm_up(daemons: HostDaemons, fleet, base: Path, seed: int) -> None:
    """One clean job through every daemon: a daemon's first job builds what it keeps for
    later ones (links, pools), which must not count as a trial's leak."""
    work = base / f"warm{seed}"
    work.mkdir()
    world = len(PLACEMENT)
    pids = {r: _fork_rank(RankSpec(r, world, "daemon", seed, random.Random(seed).getrandbits(63) | 1,
                                   fleet.hosts[h].ns, fleet.hosts[h].addr, TIMEOUT_S, work, daemons.env(h),
                                   max_ops=3))
            for r, h in enumerate(PLACEMENT)}
    stuck = _reap(pids, time.monotonic() + READY_TIMEOUT_S)
    results = _read_results(work, world)
    shutil.rmtree(work, ignore_errors=True)
    if stuck or any(res.get("cls") for res in results.values()) or len(results) != world:
        raise RuntimeError(f"[campaign] the warm-up job failed (ranks {stuck} stuck): {results}")
    time.sleep(DAEMON_SETTLE_S)
    daemons.baseline = daemons.footprints()


def run_trial(seed: int, mode: str, daemons: HostDaemons | None, fleet, base: Path, keep: Path | None) -> Trial:
    rng = random.Random(seed)
    t = Trial(seed, mode, kind=rng.choice(faults.kinds_for(mode)))
    kind = faults.KINDS[t.kind]
    host_fault = t.kind in ("link_down", "daemon_sigkill", "daemon_sigstop") or (
        t.kind == "socket_reset" and mode == "daemon")
    world = len(PLACEMENT)
    t.victim = rng.randrange(fleet.n_hosts) if host_fault else rng.randrange(world)
    victim_host = t.victim if host_fault else PLACEMENT[t.victim]
    # The mode goes into the id: campaigns of both modes run side by side from the same seeds
    # (test_campaign, the device script), and the leak check looks for the job's segments by it.
    comm_id = (rng.getrandbits(63) | 1) ^ (0x80000000 if mode == "daemon" else 0)
    job = f"{comm_id & 0xFFFFFFFF:08x}"
    delay = rng.uniform(*FAULT_DELAY_S)
    started = time.monotonic()
    work = base / f"t{seed}"
    work.mkdir()
    pids: dict[int, int] = {}
    link_cut = False
    try:
        for r, h in enumerate(PLACEMENT):
            host = fleet.hosts[h]
            pids[r] = _fork_rank(RankSpec(r, world, mode, seed, comm_id, host.ns, host.addr, TIMEOUT_S, work,
                                          daemons.env(h) if daemons else {}))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all((work / f"ready.{r}").exists() for r in range(world)):
            if time.monotonic() > deadline or any((work / f"result.{r}").exists() for r in range(world)):
                t.problem("setup", f"ranks did not all start looping: {_read_results(work, world)}")
                return t
            time.sleep(0.01)
        t.mark("start", started)
        time.sleep(delay)
        t_fault = time.monotonic()
        gone: set[int] = set()         # ranks that cannot answer: killed or stopped
        if t.kind == "rank_sigkill":
            faults.signal_pid(pids[t.victim], signal.SIGKILL)
            gone.add(t.victim)
        elif t.kind == "rank_sigstop":
            faults.signal_pid(pids[t.victim], signal.SIGSTOP)
            gone.add(t.victim)
        elif t.kind == "socket_reset":
            pid = daemons.pid(victim_host) if mode == "daemon" else pids[t.victim]
            if not faults.reset_sockets(fleet.hosts[victim_host].ns, pid):
                t.problem("setup", "the victim held no established TCP connection to reset")
        elif t.kind == "link_down":
            faults.set_link(fleet.hosts[victim_host].ns, up=False)
            link_cut = True
        elif t.kind == "daemon_sigkill":
            faults.signal_pid(daemons.pid(victim_host), signal.SIGKILL)
        elif t.kind == "daemon_sigstop":
            faults.signal_pid(daemons.pid(victim_host), signal.SIGSTOP)
        survivors = [r for r in range(world) if r not in gone]
        detect_deadline = t_fault + TIMEOUT_S + DETECT_SLACK_S
        while time.monotonic() < detect_deadline + HANG_AFTER_S:
            if all((work / f"result.{r}").exists() for r in survivors):
                break
            time.sleep(0.02)
        t.results = _read_results(work, world)
        t.mark("verdict", t_fault)
        if t.kind == "rank_sigstop":
            faults.signal_pid(pids[t.victim], signal.SIGKILL)
        _judge(t, kind, survivors, victim_host, t_fault, detect_deadline, fleet, host_fault)
    finally:
        if link_cut:
            faults.set_link(fleet.hosts[victim_host].ns, up=True)
        mark = time.monotonic()
        stuck = _reap(pids, time.monotonic() + REAP_S)
        mark = t.mark("reap", mark)
        if stuck:
            t.problem("leaks", f"ranks {stuck} had not exited {REAP_S:.0f}s after the verdict")
        if daemons and kind.kills_daemon:
            daemons.replace(victim_host)
            warm_up(daemons, fleet, base, seed)
            mark = t.mark("replace_daemon", mark)
        _check_leaks(t, job, daemons, victim_host if kind.kills_daemon else None)
        t.mark("leak_check", mark)
        for name in _segments(job):
            Path("/dev/shm", name).unlink(missing_ok=True)
        t.seconds = round(time.monotonic() - started, 2)
        if t.problems and keep is not None:
            shutil.copytree(work, keep / f"t{seed}", dirs_exist_ok=True)
            for h in range(fleet.n_hosts) if daemons else ():
                shutil.copy(daemons.log(h), keep / f"t{seed}" / f"mccld-h{h}.log")
        shutil.rmtree(work, ignore_errors=True)
    return t


def _read_results(work: Path, world: int) -> dict[int, dict]:
    out = {}
    for r in range(world):
        f = work / f"result.{r}"
        if f.exists():
            out[r] = json.loads(f.read_text())
    return out


def _judge(t: Trial, kind: faults.FaultKind, survivors: list[int], victim_host: int, t_fault: float,
           detect_deadline: float, fleet, host_fault: bool) -> None:
    victims = {r for r, h in enumerate(PLACEMENT) if h == victim_host} if host_fault else {t.victim}
    hosts = [f"h{victim_host}", fleet.hosts[victim_host].addr]
    named = []
    for r in survivors:
        res = t.results.get(r)
        if res is None:
            t.problem("hangs", f"rank {r} raised nothing within {TIMEOUT_S + DETECT_SLACK_S + HANG_AFTER_S:.0f}s")
            continue
        if res.get("wrong"):
            t.problem("corrupted", f"rank {r}: {res['wrong'][:3]}")
        if res.get("setup"):
            t.problem("setup", f"rank {r}: {res.get('msg')}")
            continue
        allowed = kind.near if PLACEMENT[r] == victim_host else kind.far
        if res.get("cls") not in allowed or not res.get("mccl"):
            t.problem("wrong_errors", f"rank {r} raised {res.get('cls')} ({res.get('msg')}), "
                                      f"expected one of {sorted(allowed)}")
        elif res["t"] < t_fault:
            t.problem("wrong_errors", f"rank {r} raised {res['cls']} {t_fault - res['t']:.2f}s before the fault: "
                                      f"{res.get('msg')}")
        elif res["t"] > detect_deadline:
            t.problem("late", f"rank {r} raised {res['cls']} {res['t'] - t_fault:.2f}s after the fault")
        if res.get("shutdown_error"):
            t.problem("wrong_errors", f"rank {r}: shutdown raised {res['shutdown_error']}")
        named.append(r not in victims and _names_culprit(res, victims, hosts))
    rule = kind.naming(t.mode)
    if rule == "all" and not all(named):
        t.problem("wrong_errors", f"not every survivor named the culprit {sorted(victims)}: "
                                  f"{ {r: t.results[r].get('msg') for r in survivors if r in t.results} }")
    elif rule == "any" and not any(named):
        t.problem("wrong_errors", f"no survivor named the culprit {sorted(victims)}: "
                                  f"{ {r: t.results[r].get('msg') for r in survivors if r in t.results} }")
    times = [t.results[r]["t"] - t_fault for r in survivors if r in t.results and "t" in t.results[r]]
    t.detect_s = round(max(times), 3) if times and len(times) == len(survivors) else None


def _check_leaks(t: Trial, job: str, daemons: HostDaemons | None, replaced: int | None) -> None:
    deadline = time.monotonic() + SEGMENTS_S
    while _segments(job) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _segments(job):
        t.problem("leaks", f"segments left {SEGMENTS_S:.0f}s after the ranks exited: {_segments(job)}")
    if not daemons:
        return
    began = time.monotonic()
    deadline, late = began + DAEMON_SETTLE_S, began + DAEMON_LATE_S
    grown_at_deadline: dict = {}
    while True:
        now = daemons.footprints()
        grown = {h: (b, now[h]) for h, b in daemons.baseline.items() if h != replaced and h in now and
                 (now[h]["threads"] > b["threads"] + THREAD_SLACK or now[h]["fds"] > b["fds"] + FD_SLACK)}
        if grown and not grown_at_deadline and time.monotonic() > deadline:
            grown_at_deadline = grown
        if not grown or time.monotonic() > late:
            break
        time.sleep(0.1)
    # Still grown at the deadline is the failure; watching on tells a slow close (it came
    # back later, and when) from a leak (it never did), which need different fixes.
    for h, (b, n) in grown_at_deadline.items():
        if h in grown:
            try:
                jobs = [{k: j.get(k) for k in ("job", "state", "ranks", "attached")} for j in daemons.jobs(h)]
            except Exception as e:  # noqa: BLE001 - a diagnostic only
                jobs = f"status failed: {e}"
            fate = f"still {grown[h][1]} after {DAEMON_LATE_S:.0f}s; jobs it lists: {jobs}; stacks in its log"
            faults.signal_pid(daemons.pid(h), signal.SIGUSR1)   # mccld dumps every thread's stack
        else:
            fate = f"back after {time.monotonic() - began:.1f}s"
        t.problem("daemon_growth", f"mccld on h{h} grew from {b} to {n} ({fate})")


def _summary(trials: list[Trial], seconds: float, first_seed: int, mode: str) -> dict:
    kinds: dict[str, dict] = {}
    for t in trials:
        k = kinds.setdefault(t.kind, _empty_kind())
        k["trials"] += 1
        k["ok"] += not t.problems
        for c in t.problems:
            k[c] += 1
        if t.detect_s is not None:
            k["detect_s"].append(t.detect_s)
    return _finish_summary(mode, first_seed, seconds, kinds, [t.seed for t in trials if t.problems])


_CATEGORIES = ("hangs", "wrong_errors", "corrupted", "leaks", "daemon_growth", "late", "setup")


def _empty_kind() -> dict:
    return {"trials": 0, "ok": 0, **{c: 0 for c in _CATEGORIES}, "detect_s": []}


def _finish_summary(mode: str, first_seed: int, seconds: float, kinds: dict[str, dict],
                    failed_seeds: list[int]) -> dict:
    """Per kind: counts and every detection time (sorted), their median and maximum; totals."""
    for k in kinds.values():
        d = k["detect_s"] = sorted(k["detect_s"])
        k["detect_p50_s"] = d[len(d) // 2] if d else None
        k["detect_max_s"] = d[-1] if d else None
    total = {c: sum(k[c] for k in kinds.values()) for c in ("trials", "ok") + _CATEGORIES}
    return {"mode": mode, "first_seed": first_seed, "seconds": round(seconds, 1), "total": total,
            "kinds": dict(sorted(kinds.items())), "failed_seeds": sorted(failed_seeds)}


def _printable(summary: dict) -> str:
    """The summary without every detection time (the JSON file keeps them)."""
    kinds = {n: {c: v for c, v in k.items() if c != "detect_s"} for n, k in summary["kinds"].items()}
    return json.dumps({**summary, "kinds": kinds}, indent=1)


def combine(parts: list[dict]) -> dict:
    """Campaigns of one mode run side by side (``--shards``) as one summary."""
    kinds: dict[str, dict] = {}
    for p in parts:
        for name, k in p["kinds"].items():
            into = kinds.setdefault(name, _empty_kind())
            for c in ("trials", "ok") + _CATEGORIES:
                into[c] += k[c]
            into["detect_s"] += k["detect_s"]
    summary = _finish_summary(parts[0]["mode"], min(p["first_seed"] for p in parts),
                              max(p["seconds"] for p in parts), kinds,
                              [s for p in parts for s in p["failed_seeds"]])
    summary["namespaces_left"] = sorted({n for p in parts for n in p.get("namespaces_left", [])})
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("inproc", "daemon"), required=True)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=None, help="first trial's seed (trial i: seed + i); default random")
    ap.add_argument("--json", type=Path, default=None, help="write the summary here too")
    ap.add_argument("--max-seconds", type=float, default=0, help="stop starting trials after this long")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every trial, not only failed ones")
    ap.add_argument("--keep", type=Path, default=None, help="copy failed trials' files (rank logs) here")
    ap.add_argument("--shards", type=int, default=1,
                    help="run the trials as this many campaigns side by side, each on its own fleet "
                         "(trials mostly wait out timeouts: a machine with C cores takes about C of them)")
    args = ap.parse_args(argv)
    if args.shards < 1 or args.trials < 1:
        ap.error("--shards and --trials must be at least 1")
    if args.shards > 1:
        return run_shards(args)
    from tools.fleet import Fleet

    # SIGTERM (a CI timeout) unwinds like Ctrl-C, so the fleet and its daemons are torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    first = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"[campaign] mode={args.mode} trials={args.trials} first seed={first} "
          f"(replay one: --mode {args.mode} --seed S --trials 1)", flush=True)
    base = Path(tempfile.mkdtemp(prefix="mccl-campaign-"))
    trials: list[Trial] = []
    began = time.monotonic()
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    with Fleet(max(PLACEMENT) + 1, rate=None) as fleet:
        daemons = HostDaemons(fleet, base / "daemons") if args.mode == "daemon" else None
        try:
            (base / "trials").mkdir()
            if daemons:
                daemons.start_all()
                warm_up(daemons, fleet, base / "trials", first)
            for i in range(args.trials):
                if args.max_seconds and time.monotonic() - began > args.max_seconds:
                    break
                t = run_trial(first + i, args.mode, daemons, fleet, base / "trials", args.keep)
                trials.append(t)
                if t.problems or args.verbose:
                    print(json.dumps({"seed": t.seed, "kind": t.kind, "victim": t.victim, "ok": not t.problems,
                                      "detect_s": t.detect_s, "seconds": t.seconds, "phases": t.phases,
                                      "problems": t.problems}),
                          flush=True)
        finally:
            if daemons:
                daemons.stop_all()
    leftovers = [ns for ns in _namespaces() if ns.startswith(f"mccl{fleet.id}h")]
    summary = _summary(trials, time.monotonic() - began, first, args.mode)
    summary["namespaces_left"] = leftovers
    print(_printable(summary), flush=True)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    bad = summary["total"]["ok"] != summary["total"]["trials"] or leftovers
    return 1 if bad else 0


def run_shards(args: argparse.Namespace) -> int:
    """``--trials`` split over ``--shards`` child campaigns with consecutive seeds; one summary."""
    first = args.seed if args.seed is not None else random.randrange(1 << 30)
    per = -(-args.trials // args.shards)
    out = Path(tempfile.mkdtemp(prefix="mccl-campaign-shards-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    print(f"[campaign] mode={args.mode} trials={args.trials} in {args.shards} shards, first seed={first}", flush=True)
    children = []
    for i, seed in enumerate(range(first, first + args.trials, per)):
        cmd = [sys.executable, __file__, "--mode", args.mode, "--trials", str(min(per, first + args.trials - seed)),
               "--seed", str(seed), "--json", str(out / f"{i}.json")]
        cmd += (["--keep", str(args.keep)] if args.keep else []) + (["-v"] if args.verbose else [])
        cmd += ["--max-seconds", str(args.max_seconds)] if args.max_seconds else []
        children.append((subprocess.Popen(cmd, stdout=open(out / f"{i}.log", "w"), stderr=subprocess.STDOUT), i))
    # A SIGTERM (a CI timeout) reaches the children too: each tears its fleet down.
    signal.signal(signal.SIGTERM, lambda *_: [c.terminate() for c, _ in children if c.poll() is None])
    parts, broken = [], []
    for child, i in children:
        child.wait()
        log = (out / f"{i}.log").read_text()
        for line in log.splitlines():
            if line.startswith('{"seed"'):
                print(line, flush=True)       # each shard's failed (or, with -v, every) trial
        if (out / f"{i}.json").exists():
            parts.append(json.loads((out / f"{i}.json").read_text()))
        else:
            broken.append(i)
            print(f"[campaign] shard {i} wrote no summary (exit {child.returncode}):\n{log[-4000:]}", flush=True)
    if not parts:
        return 1
    summary = combine(parts)
    summary["shards"] = len(children)
    print(_printable(summary), flush=True)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    bad = broken or summary["total"]["ok"] != summary["total"]["trials"] or summary["namespaces_left"]
    return 1 if bad else 0


def _namespaces() -> list[str]:
    from tools.fleet import list_namespaces
    return list_namespaces()


if __name__ == "__main__":
    sys.exit(main())
