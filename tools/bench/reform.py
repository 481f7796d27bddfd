"""How long an elastic job takes to re-form when a host leaves, against the host count
(issue 13: "re-forming a 4-host job takes <= 10 s; report how it grows with the host count";
"the host is out within one step plus 5 s of its activity").

    python -m tools.bench.reform --hosts 4,8,12,16 --json reform.json --plot reform.png

For each N, and each of ``--repeats`` trials, on a fresh set of N emulated hosts:

1. N mcclds, one per host, each with its own MCCL_HOST_ID, MCCL_RUNTIME_DIR and
   MCCL_ACTIVITY_FILE (its mtime two hours back: the hosts are idle), MCCL_IDLE_AFTER=60,
   MCCL_HARVEST_POLL=0.25 and one submit key. Hosts are network namespaces (tools/fleet.py,
   unshaped links, plus one more namespace that submits: the anchor is not a harvested host)
   when this runs as root with ``ip``; else loopback with distinct ports (``--mode``).
2. ``mcclctl run --min N-1 --max N --host ... -- python examples/elastic_train.py`` with a short
   step (``--step-time``), checkpoints only when a host leaves (``--every`` large), a global
   batch that N and N-1 ranks both split, OMP_NUM_THREADS=1.
3. Once the job trains in a world of N (``--warm-steps`` step lines with "world N"), the last
   host's activity file is touched (its user is back). From the time each line of
   ``mcclctl run --json`` reaches this process:
     leave   = touch -> "[mcclctl] left after step S" (the issue's "out within one step + 5 s");
     reform  = "left" -> the first step line of the world of N-1 (step S+1);
     resumed = "left" -> "world N-1 on ...: resumed after step S";
     gap     = the last step line of the world of N -> the first of the world of N-1.
   The steps must run once each: S+1 follows S, none repeated or skipped.
4. With ``--kill`` (default on), after a few steps in the world of N-1 one remaining host's
   training process gets SIGKILL (a crash, not a drain): torchrun restarts it, the others
   fail with PeerLostError and restart too, and the world re-forms from the last checkpoint
   (the one the leave wrote). kill_reform = SIGKILL -> the first step line after it; the
   replayed steps are those run since that checkpoint.
5. SIGINT to mcclctl (its Ctrl-C: every mccld stops its job), then every mccld is stopped,
   any process still carrying this trial's marker variable is killed, the namespaces are
   deleted and /dev/shm segments this trial created are removed; what had to be cleaned is
   recorded in the trial (``leftovers``).

Each wait is bounded; a trial that fails is recorded with its reason and the output tail, and
the next trial starts. Trials run round-robin over N (every N once, then again), the JSON is
rewritten after each, and ``--budget-s`` stops starting trials, so a run cut short keeps a
measurement of every N. The re-form times are fitted with ``reform = a + b * N`` (least squares
over every trial) and extrapolated to ``--extrapolate`` hosts (100).

Times are those of lines as mcclctl forwards them: mccld polls a job's output every 0.2 s,
so each is late by up to about 0.2 s ("left" and the first step after an in-place re-form often
come in the same batch: ``gap`` is then the figure to read). The example re-forms in place
(ElasticState(keep_workers=True)); ``--restart-workers`` makes it restart its workers instead,
as a script without keep_workers does. A re-form by restart includes the rendezvous' last call
(MCCL_RDZV_LAST_CALL, 2 s by default: with --max N a round of N-1 waits that long for an Nth),
which ``--last-call`` changes for the job; so does the re-form after the SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
MARK = "MCCL_REFORM_TRIAL"          # in every process a trial starts (mcclds pass it to their jobs)
STATUS_PORT, LAUNCH_PORT = 29650, 29653

STEP_RE = re.compile(r"^step (\d+) loss ([0-9.]+) world (\d+)$")
WORLD_RE = re.compile(r"^world (\d+) on (\S+): (?:resumed after step (\d+)|fresh start), from step (\d+)")
LEFT_RE = re.compile(r"^\[mcclctl\] left after step (-?\d+)")
ELASTIC_RE = re.compile(r"^\[elastic\] rank \d+: (?:this host leaves|a host leaves) after step (\d+)")


class TrialError(Exception):
    pass


# ---- where the hosts are ------------------------------------------------------------------

class Hosts:
    """N emulated hosts plus one submitting host: namespaces (tools.fleet) or loopback."""

    def __init__(self, n: int, mode: str):
        self.n, self.mode = n, mode
        self.fleet = None
        if mode == "netns":
            from tools.fleet import Fleet
            self.fleet = Fleet(n + 1, rate=None).start()     # host n submits (mcclctl, the anchor)

    def addr(self, i: int) -> str:
        return self.fleet.hosts[i].addr if self.fleet else "127.0.0.1"

    def popen(self, i: int, argv: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
        """Runs argv on host i (i == n: the submitting host); env on top of ours; own session."""
        if self.fleet:
            return self.fleet.popen(i, argv, env=env, **kw)
        return subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True, **kw)

    def stop(self) -> None:
        if self.fleet:
            self.fleet.stop()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def choose_mode(mode: str) -> str:
    if mode != "auto":
        return mode
    return "netns" if os.geteuid() == 0 and shutil.which("ip") and sys.platform.startswith("linux") else "loopback"


# ---- mcclctl's output, time-stamped --------------------------------------------------------

class Lines:
    """Reads ``mcclctl run --json`` on a thread; each line with the monotonic time it came."""

    def __init__(self, stream, log_path: Path, t0: float):
        self.items: list[tuple[float, str, str, str]] = []      # (t, host, stream|event, text)
        self.cond = threading.Condition()
        self.done = False
        self._log = open(log_path, "w")
        self._t0 = t0
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        try:
            for raw in stream:
                t = time.monotonic()
                raw = raw.rstrip("\n")
                try:
                    d = json.loads(raw)
                except ValueError:
                    d = {"host": "", "stream": "raw", "line": raw}
                if not isinstance(d, dict):
                    d = {"host": "", "stream": "raw", "line": raw}
                if "event" in d:
                    item = (t, "", "event:" + str(d["event"]), json.dumps(d, sort_keys=True))
                else:
                    item = (t, str(d.get("host", "")), str(d.get("stream", "")), str(d.get("line", "")))
                self._log.write(f"{t - self._t0:9.3f} [{item[1]}] {item[2]}: {item[3]}\n")
                self._log.flush()
                with self.cond:
                    self.items.append(item)
                    self.cond.notify_all()
        except (OSError, ValueError):
            pass
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()
            self._log.close()

    def wait_for(self, pred: Callable[[int, tuple], bool], start: int, timeout_s: float, what: str) -> int:
        """Index of the first line at or after ``start`` with pred(i, line); raises after timeout_s."""
        deadline = time.monotonic() + timeout_s
        i = start
        with self.cond:
            while True:
                while i < len(self.items):
                    if pred(i, self.items[i]):
                        return i
                    i += 1
                if self.done:
                    raise TrialError(f"mcclctl run ended before {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TrialError(f"{what}: not within {timeout_s:.0f} s")
                self.cond.wait(min(left, 0.5))

    def tail(self, n: int = 25) -> list[str]:
        with self.cond:
            return [f"[{h}] {s}: {x}" for _, h, s, x in self.items[-n:]]

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def _step(item) -> tuple[int, int] | None:
    m = STEP_RE.match(item[3]) if item[2] == "out" else None
    return (int(m.group(1)), int(m.group(3))) if m else None


# ---- processes a trial leaves ------------------------------------------------------------

def marked_pids(tag: str) -> list[int]:
    """Pids of processes whose environment carries MARK=tag (this trial's)."""
    needle = f"{MARK}={tag}".encode()
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(d))
        except OSError:
            continue
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [a.decode(errors="replace").partition("=") for a in f.read().split(b"\0") if a]
        return {k: v for k, _, v in pairs}
    except OSError:
        return {}


def worker_pids(tag: str, host_id: str) -> list[int]:
    """The training processes (not torchrun) of this trial on host ``host_id``."""
    out = []
    for pid in marked_pids(tag):
        cmd = _cmdline(pid)
        if any(a.endswith("elastic_train.py") for a in cmd) and "torch.distributed.run" not in cmd \
                and _environ(pid).get("MCCL_HOST_ID") == host_id:
            out.append(pid)
    return out


def _shm() -> set[str]:
    try:
        return {p for p in os.listdir("/dev/shm") if p.startswith("mccl")}
    except OSError:
        return set()


def _stop(p: subprocess.Popen, sig: int, wait_s: float) -> bool:
    """Signal p, wait; SIGKILL its group if it outlives wait_s. True when it stopped by itself."""
    if p.poll() is not None:
        return True
    try:
        p.send_signal(sig)
    except ProcessLookupError:
        return True
    try:
        p.wait(wait_s)
        return True
    except subprocess.TimeoutExpired:
        for kill in (lambda: os.killpg(p.pid, signal.SIGKILL), lambda: os.kill(p.pid, signal.SIGKILL)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass
        return False


# ---- one trial ---------------------------------------------------------------------------

def global_batch(n: int) -> int:
    """The smallest multiple of lcm(N, N-1) that is at least 64: both worlds split it evenly."""
    lcm = n * (n - 1) // math.gcd(n, n - 1) if n > 1 else 1
    return lcm * max(1, math.ceil(64 / lcm))


def run_trial(n: int, rep: int, args, log_dir: Path) -> dict:
    tag = f"{os.getpid()}-{n}-{rep}-{secrets.token_hex(3)}"
    rec: dict = {"hosts": n, "repeat": rep, "mode": args.mode, "ok": False, "tag": tag,
                 "load_before": round(os.getloadavg()[0], 2)}     # a shared machine shows here
    tlog = log_dir / f"n{n}-r{rep}"
    tlog.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mcclrf-"))      # short: Unix socket paths live under it
    shm_before = _shm()
    hosts: Hosts | None = None
    daemons: list[subprocess.Popen] = []
    run: subprocess.Popen | None = None
    lines: Lines | None = None
    leftovers: list[str] = []
    t0 = time.monotonic()
    # Host ids are unique per trial: on loopback every mccld announces itself on the same mDNS
    # network as anybody else's (a test's "h1" next to ours makes one of them exit).
    suffix = "" if args.mode == "netns" else "-" + tag.rsplit("-", 1)[1][:4]

    def hid(i: int) -> str:
        return f"h{i}{suffix}"
    try:
        hosts = Hosts(n, args.mode)
        rec["setup_s"] = {}
        fleet_key, submit_key = work / "fleet.key", work / "submit.key"
        for path in (fleet_key, submit_key):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
        old = time.time() - 7200
        status_addrs, activity = [], []
        base = {MARK: tag, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                "OMP_NUM_THREADS": "1"}
        for i in range(n):
            act = work / f"activity-h{i}"
            act.touch()
            os.utime(act, (old, old))           # nobody touched this host for two hours: idle
            activity.append(act)
            status = STATUS_PORT if args.mode == "netns" else _free_port()
            launch = LAUNCH_PORT if args.mode == "netns" else _free_port()
            env = {**base, "MCCL_HOST_ID": hid(i), "MCCL_RUNTIME_DIR": str(work / f"h{i}"),
                   "MCCL_KEY_FILE": str(fleet_key), "MCCL_FLEET_KEY": "", "MCCL_FLEET": f"rf{tag}",
                   "MCCL_LISTEN_ADDR": hosts.addr(i), "MCCL_PORT": "0", "MCCL_STATUS_PORT": str(status),
                   "MCCL_METRICS_PORT": "0", "MCCL_LAUNCH_PORT": str(launch),
                   "MCCL_SUBMIT_KEY_FILE": str(submit_key), "MCCL_ACTIVITY_FILE": str(act),
                   "MCCL_IDLE_AFTER": "60", "MCCL_HARVEST_POLL": "0.25",
                   "MCCL_LAUNCH_USER": "root" if os.geteuid() == 0 else ""}
            with open(tlog / f"mccld-h{i}.log", "wb") as f:
                daemons.append(hosts.popen(i, [PY, "-m", "tools.bench.daemons", "--log-level", "WARNING"],
                                           env, stdout=f, stderr=subprocess.STDOUT))
            status_addrs.append(f"{hosts.addr(i)}:{status}")
        deadline = time.monotonic() + 60 + 2 * n
        for i, p in enumerate(daemons):
            while not (work / f"h{i}" / "token").exists():
                if p.poll() is not None:
                    raise TrialError(f"mccld h{i} exited with {p.returncode} at start: "
                                     f"{_tail(tlog / f'mccld-h{i}.log')}")
                if time.monotonic() > deadline:
                    raise TrialError(f"mccld h{i} not serving within {deadline - t0:.0f} s: "
                                     f"{_tail(tlog / f'mccld-h{i}.log')}")
                time.sleep(0.1)
        rec["setup_s"]["daemons"] = round(time.monotonic() - t0, 2)
        ctl_env = {**base, "MCCL_KEY_FILE": str(fleet_key), "MCCL_FLEET_KEY": ""}
        host_args = [a for h in status_addrs for a in ("--host", h)]
        _wait_idle(hosts, n, ctl_env, host_args, 30.0 + n)
        rec["setup_s"]["idle"] = round(time.monotonic() - t0, 2)

        # ---- the job -------------------------------------------------------------------
        job_env = ["--env", "OMP_NUM_THREADS=1"]
        if args.breakdown:
            job_env += ["--env", "LOGLEVEL=INFO"]       # torchrun's own milestones, for the breakdown
        if args.last_call is not None:
            job_env += ["--env", f"MCCL_RDZV_LAST_CALL={args.last_call:g}"]
        cmd = [PY, "-m", "mcclctl", "run", "--json", "--min", str(n - 1), "--max", str(n), *host_args,
               "--submit-key-file", str(submit_key), "--cwd", str(REPO), *job_env, "--",
               "python", str(REPO / "examples" / "elastic_train.py"), "--steps", "1000000",
               "--ckpt", str(work / "ckpt"), "--every", str(args.every), "--step-time", f"{args.step_time:g}",
               "--global-batch", str(global_batch(n)), *(["--restart-workers"] if args.restart_workers else [])]
        rec["command"] = " ".join(cmd[1:])
        t_run = time.monotonic()
        with open(tlog / "mcclctl.err", "wb") as err:
            run = hosts.popen(n, cmd, ctl_env, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
        lines = Lines(run.stdout, tlog / "mcclctl.out", t0)
        items = lines.items

        # 1. every host trains: --warm-steps step lines of world N
        seen = [0]

        def full_world(i, it):
            s = _step(it)
            if s and s[1] == n:
                seen[0] += 1
            return seen[0] >= args.warm_steps
        i_full = lines.wait_for(full_world, 0, 90 + 6 * n, f"{args.warm_steps} steps in a world of {n}")
        first_full = next(j for j in range(i_full + 1) if (_step(items[j]) or (0, 0))[1] == n)
        rec["start_s"] = round(items[first_full][0] - t_run, 2)
        # rounds that formed with fewer hosts first (a host late to the first rendezvous)
        rec["rounds_before_full"] = sum(1 for _, _, s, x in items[:first_full]
                                        if s == "out" and WORLD_RE.match(x) and int(WORLD_RE.match(x).group(1)) != n)

        # 2. the last host's user comes back
        leaver = hid(n - 1)
        os.utime(activity[n - 1], None)
        t_touch = time.monotonic()
        i_touch = len(items)
        i_left = lines.wait_for(lambda i, it: it[1] == leaver and bool(LEFT_RE.match(it[3])), i_touch,
                                30, f"{leaver} leaving after its activity")
        t_left = items[i_left][0]
        left_step = int(LEFT_RE.match(items[i_left][3]).group(1))
        rec["left_step"] = left_step
        rec["leave_s"] = round(t_left - t_touch, 3)
        el = [it for it in items[i_touch:i_left + 1] if it[2] == "out" and ELASTIC_RE.match(it[3])]
        if el:
            rec["saved_s"] = round(el[0][0] - t_touch, 3)     # touch -> the first rank's "leaves after step"

        # 3. the world of N-1 resumes
        i_new = lines.wait_for(lambda i, it: (_step(it) or (0, 0))[1] == n - 1, i_touch, 90 + 4 * n,
                               f"a step in the re-formed world of {n - 1}")
        t_new = items[i_new][0]
        rec["reform_s"] = round(t_new - t_left, 3)
        rec["touch_to_step_s"] = round(t_new - t_touch, 3)
        before = [(j, _step(it)) for j, it in enumerate(items[:i_new]) if _step(it)]
        last_full = before[-1]
        rec["gap_s"] = round(t_new - items[last_full[0]][0], 3)
        resumed = [(it[0], WORLD_RE.match(it[3])) for it in items[i_touch:i_new] if it[2] == "out"]
        resumed = [(t, m) for t, m in resumed if m and int(m.group(1)) == n - 1]
        if resumed:
            rec["resumed_s"] = round(resumed[-1][0] - t_left, 3)
            rec["resumed_after"] = int(resumed[-1][1].group(3)) if resumed[-1][1].group(3) else None
        if args.breakdown:
            rec["milestones_s"] = _milestones(items, i_touch, i_new, t_left, [hid(i) for i in range(n - 1)], 75)
        # the steps: each once, in order, across the leave
        full_steps = [s for _, (s, w) in before[[j for j, _ in before].index(first_full):] if w == n]
        first_new = _step(items[i_new])[0]
        rec["steps_in_full_world"] = len(full_steps)
        problems = []
        if full_steps != list(range(full_steps[0], full_steps[0] + len(full_steps))):
            problems.append(f"world-{n} steps not consecutive: {full_steps}")
        if full_steps[-1] != left_step:
            problems.append(f"the last step of world {n} was {full_steps[-1]}, the host left after {left_step}")
        if first_new != left_step + 1:
            problems.append(f"the world of {n - 1} began at step {first_new}, not {left_step + 1}")
        i_more = lines.wait_for(lambda i, it: (_step(it) or (0, 0))[1] == n - 1 and _step(it)[0] >= first_new + 4,
                                i_new, 30, f"5 steps in the world of {n - 1}")
        new_steps = [_step(it)[0] for it in items[i_new:i_more + 1] if _step(it)]
        if new_steps != list(range(first_new, first_new + len(new_steps))):
            problems.append(f"world-{n - 1} steps not consecutive: {new_steps}")
        rec["step_problems"] = problems

        # 4. a crash: SIGKILL one remaining host's training process
        if args.kill:
            victim = hid(0)
            pids = worker_pids(tag, victim)
            if not pids:
                raise TrialError(f"no training process of this trial found on {victim} to kill")
            i_kill = len(items)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            t_kill = time.monotonic()
            rec["kill"] = {"host": victim, "pids": len(pids)}
            i_back = lines.wait_for(lambda i, it: it[2] == "out" and bool(WORLD_RE.match(it[3])), i_kill,
                                    90 + 4 * n, "the world re-formed after the SIGKILL")
            m = WORLD_RE.match(items[i_back][3])
            i_kstep = lines.wait_for(lambda i, it: _step(it) is not None, i_back, 60,
                                     "a step after the SIGKILL re-form")
            ran = [_step(it)[0] for it in items[i_touch:i_kill] if _step(it)]
            last_run = max(ran) if ran else None
            kstep, kworld = _step(items[i_kstep])
            rec["kill"].update({
                "reform_s": round(items[i_kstep][0] - t_kill, 3),
                "resumed_s": round(items[i_back][0] - t_kill, 3),
                "world": kworld, "resumed_after": int(m.group(3)) if m.group(3) else None,
                "first_step": kstep, "last_step_before": last_run,
                "replayed_steps": (last_run - kstep + 1) if last_run is not None else None})
            if args.breakdown:
                rec["kill"]["milestones_s"] = _milestones(items, i_kill, i_kstep, t_kill,
                                                          [hid(i) for i in range(n - 1)], None)
            if m.group(3) is None or kstep != int(m.group(3)) + 1:
                problems.append(f"after the SIGKILL the world resumed at step {kstep}, "
                                f"not after the last checkpoint ({m.group(3)})")
        rec["ok"] = True
    except TrialError as e:
        rec["error"] = str(e)
    except Exception as e:          # a bug here must not leave a fleet behind: record, clean, go on
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if lines is not None and not rec["ok"]:
            rec["output_tail"] = lines.tail()
        if run is not None:
            # mcclctl's Ctrl-C: every lease is cancelled, every mccld stops its job.
            if not _stop(run, signal.SIGINT, 45.0):
                leftovers.append("mcclctl run ignored SIGINT for 45 s (killed)")
            rec["mcclctl_rc"] = run.returncode
            if lines is not None:
                lines.join(5.0)
        for i, p in enumerate(daemons):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for i, p in enumerate(daemons):
            if not _stop(p, signal.SIGTERM, 20.0):
                leftovers.append(f"mccld h{i} ignored SIGTERM for 20 s (killed)")
        for pid in marked_pids(tag):
            leftovers.append(f"pid {pid} still running: {' '.join(_cmdline(pid))[:160]}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if hosts is not None:
            try:
                hosts.stop()
            except Exception as e:
                leftovers.append(f"fleet teardown: {e}")
        time.sleep(0.2)
        for name in sorted(_shm() - shm_before):
            leftovers.append(f"/dev/shm/{name}")
            try:
                os.unlink(f"/dev/shm/{name}")
            except OSError:
                pass
        rec["leftovers"] = leftovers
        rec["wall_s"] = round(time.monotonic() - t0, 1)
        shutil.rmtree(work, ignore_errors=True)
    return rec


EXITED_RE = re.compile(r"failed \(exitcode: (-?\d+)\)")
RDZV_DONE = "Rendezvous complete for workers"


def _milestones(items: list, start: int, end: int, t_ref: float, hosts: list[str], code: int | None) -> dict:
    """From torchrun's own log lines (LOGLEVEL=INFO) between items[start] and items[end]: when the
    last of ``hosts`` saw its worker exit (with ``code``, any if None), when the last one finished
    the rendezvous round, when rank 0 resumed and stepped; seconds after t_ref, cumulative."""
    exited: dict[str, float] = {}
    rdzv: dict[str, float] = {}
    resumed = None
    for t, host, stream, text in items[start:end + 1]:
        m = EXITED_RE.search(text) if stream == "err" else None
        if m and host in hosts and (code is None or int(m.group(1)) == code):
            exited.setdefault(host, t)
        if stream == "err" and RDZV_DONE in text and host in hosts:
            rdzv.setdefault(host, t)
        if stream == "out" and WORLD_RE.match(text):
            resumed = t
    out = {"hosts_seen_exit": len(exited), "hosts_seen_rdzv": len(rdzv)}
    if exited:
        out["workers_exited"] = round(max(exited.values()) - t_ref, 3)
    if rdzv:
        out["rendezvous_done"] = round(max(rdzv.values()) - t_ref, 3)
    if resumed is not None:
        out["resumed"] = round(resumed - t_ref, 3)
    out["first_step"] = round(items[end][0] - t_ref, 3)
    return out


def _wait_idle(hosts: Hosts, n: int, env: dict, host_args: list[str], timeout_s: float) -> None:
    """Until every mccld says its host is idle (mcclctl run leases idle hosts only)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        p = hosts.popen(n, [PY, "-m", "mcclctl", "capacity", "--json", *host_args], env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            _stop(p, signal.SIGKILL, 5)
            last = "mcclctl capacity did not answer in 20 s"
            continue
        try:
            states = [((d.get("capacity") or {}).get("harvest") or {}).get("state") for d in json.loads(out)["daemons"]]
        except (ValueError, KeyError, TypeError):
            states, last = [], (out + err).strip()[-300:]
        if len(states) == n and all(s == "idle" for s in states):
            return
        last = last if not states else f"states {states}"
        time.sleep(0.5)
    raise TrialError(f"the {n} hosts were not all idle within {timeout_s:.0f} s: {last}")


def _tail(path: Path, n: int = 4) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])[-600:]
    except OSError:
        return "(no log)"


# ---- summary and fit -------------------------------------------------------------------

def linear_fit(xs: list[float], ys: list[float]) -> dict | None:
    """Least squares y = a + b x; None with fewer than two distinct x."""
    if len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return {"a": round(a, 4), "b": round(b, 5), "r2": round(1 - ss_res / ss_tot, 4) if ss_tot > 0 else 1.0,
            "points": len(xs)}


def summarize(trials: list[dict], extrapolate: int) -> dict:
    ok = [t for t in trials if t.get("ok")]
    per_n = {}
    for n in sorted({t["hosts"] for t in trials}):
        mine = [t for t in ok if t["hosts"] == n]
        row = {"trials": len([t for t in trials if t["hosts"] == n]), "ok": len(mine)}
        for key in ("leave_s", "reform_s", "resumed_s", "gap_s", "touch_to_step_s", "start_s"):
            vals = [t[key] for t in mine if t.get(key) is not None]
            if vals:
                row[key] = {"median": round(statistics.median(vals), 3), "max": round(max(vals), 3),
                            "min": round(min(vals), 3)}
        kills = [t["kill"]["reform_s"] for t in mine if (t.get("kill") or {}).get("reform_s") is not None]
        if kills:
            row["kill_reform_s"] = {"median": round(statistics.median(kills), 3), "max": round(max(kills), 3),
                                    "min": round(min(kills), 3)}
        for src, dst in (("milestones_s", "milestones_median_s"), ("kill", "kill_milestones_median_s")):
            ms = [(t.get(src) or {}) if src == "milestones_s" else ((t.get("kill") or {}).get("milestones_s") or {})
                  for t in mine]
            keys = ("workers_exited", "rendezvous_done", "resumed", "first_step")
            med = {k: round(statistics.median([m[k] for m in ms if k in m]), 3) for k in keys
                   if any(k in m for m in ms)}
            if med:
                row[dst] = med
        row["step_problems"] = sum(len(t.get("step_problems") or []) for t in mine)
        row["leftovers"] = sum(len(t.get("leftovers") or []) for t in trials if t["hosts"] == n)
        per_n[str(n)] = row
    fits = {}
    for key, label in (("reform_s", "reform"), ("leave_s", "leave"), ("gap_s", "gap")):
        pts = [(t["hosts"], t[key]) for t in ok if t.get(key) is not None]
        fit = linear_fit([float(x) for x, _ in pts], [y for _, y in pts])
        if fit:
            fit["model"] = f"{label}_s = a + b * N, least squares over every trial"
            fit[f"at_{extrapolate}"] = round(fit["a"] + fit["b"] * extrapolate, 2)
            fits[key] = fit
    kp = [(t["hosts"], t["kill"]["reform_s"]) for t in ok if (t.get("kill") or {}).get("reform_s") is not None]
    kfit = linear_fit([float(x) for x, _ in kp], [y for _, y in kp])
    if kfit:
        kfit["model"] = "kill_reform_s = a + b * N, least squares over every trial"
        kfit[f"at_{extrapolate}"] = round(kfit["a"] + kfit["b"] * extrapolate, 2)
        fits["kill_reform_s"] = kfit
    return {"per_hosts": per_n, "fits": fits}


def report(doc: dict) -> str:
    meta, summ = doc["meta"], doc["summary"]
    how = "by restarting the workers" if meta.get("restart_workers") else "in place (keep_workers)"
    out = [f"re-form after a drain {how}, {meta['mode']}, step {meta['step_time']} s, last call "
           f"{meta['last_call'] if meta['last_call'] is not None else 'default (2 s)'}, "
           f"{meta['repeats']} trial(s) per N; seconds, median (max)"]
    out.append(f"{'N':>3} {'ok':>5} {'leave':>13} {'reform':>13} {'resumed':>13} {'gap':>13} "
               f"{'kill->step':>13} {'start':>13} {'step err':>8} {'leftover':>8}")

    def cell(row, key):
        v = row.get(key)
        return f"{v['median']:6.2f} ({v['max']:5.2f})" if v else f"{'-':>13}"
    for n, row in summ["per_hosts"].items():
        out.append(f"{n:>3} {row['ok']:>2}/{row['trials']:<2} {cell(row, 'leave_s')} {cell(row, 'reform_s')} "
                   f"{cell(row, 'resumed_s')} {cell(row, 'gap_s')} {cell(row, 'kill_reform_s')} "
                   f"{cell(row, 'start_s')} {row['step_problems']:>8} {row['leftovers']:>8}")
    for n, row in summ["per_hosts"].items():
        for key, what, ref in (("milestones_median_s", "drain", "left"),
                               ("kill_milestones_median_s", "kill", "SIGKILL")):
            m = row.get(key)
            if m:
                out.append(f"N={n} {what}, after {ref} (median): " + ", ".join(f"{k} {v:.2f}" for k, v in m.items()))
    for key, fit in summ["fits"].items():
        at = next(k for k in fit if k.startswith("at_"))
        out.append(f"fit {key}: {fit['a']:.3f} + {fit['b']:.4f} * N (r2 {fit['r2']}, {fit['points']} trials) "
                   f"-> {fit[at]:.2f} s at N={at[3:]}")
    if meta.get("warning"):
        out.append("WARNING: " + meta["warning"])
    for t in doc["trials"]:
        if not t.get("ok"):
            out.append(f"N={t['hosts']} trial {t['repeat']} FAILED: {t.get('error')}")
        for p in t.get("step_problems") or []:
            out.append(f"N={t['hosts']} trial {t['repeat']}: {p}")
        for p in t.get("leftovers") or []:
            out.append(f"N={t['hosts']} trial {t['repeat']} left: {p}")
    return "\n".join(out)


def plot(doc: dict, path: str, extrapolate: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [t for t in doc["trials"] if t.get("ok")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, color, label in (("reform_s", "#d62728", "re-form: left -> first step of N-1"),
                              ("leave_s", "#1f77b4", "leave: activity -> left"),
                              ("kill", "#2ca02c", "SIGKILL -> first step (from checkpoint)")):
        pts = [(t["hosts"], t["kill"]["reform_s"] if key == "kill" else t.get(key)) for t in ok
               if (t.get("kill") if key == "kill" else t.get(key)) is not None]
        if not pts:
            continue
        ax.scatter([x for x, _ in pts], [y for _, y in pts], color=color, label=label, s=18)
        fit = doc["summary"]["fits"].get("kill_reform_s" if key == "kill" else key)
        if fit:
            xs = [1, extrapolate]
            ax.plot(xs, [fit["a"] + fit["b"] * x for x in xs], color=color, ls="--", lw=1,
                    label=f"  fit {fit['a']:.2f} + {fit['b']:.3f} N -> {fit['a'] + fit['b'] * extrapolate:.1f} s "
                          f"at {extrapolate}")
    ax.axhline(10, color="grey", lw=0.8, ls=":")
    ax.text(extrapolate, 10, "10 s target (4 hosts)", ha="right", va="bottom", fontsize=8, color="grey")
    ax.set_xlabel("hosts N (one rank each)")
    ax.set_ylabel("seconds")
    ax.set_xlim(0, extrapolate + 2)
    ax.set_ylim(bottom=0)
    m = doc["meta"]
    ax.set_title(f"MCCL elastic re-form vs hosts ({m['mode']}, {m.get('machine', '')})", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main ------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.reform", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="4,8,12,16", help="comma list of host counts N (>= 2)")
    ap.add_argument("--repeats", type=int, default=2, help="trials per N (round robin over N)")
    ap.add_argument("--mode", choices=("auto", "netns", "loopback"), default="auto",
                    help="auto: network namespaces as root with ip, else loopback")
    ap.add_argument("--step-time", type=float, default=0.1, help="elastic_train.py --step-time")
    ap.add_argument("--every", type=int, default=100000, help="periodic checkpoint (large: only the leave saves)")
    ap.add_argument("--warm-steps", type=int, default=5, help="steps in the world of N before the touch")
    ap.add_argument("--last-call", type=float, default=None, help="MCCL_RDZV_LAST_CALL for the job (default: 2 s)")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                    help="no LOGLEVEL=INFO for torchrun (its milestones split the re-form into parts)")
    ap.add_argument("--no-kill", dest="kill", action="store_false", help="skip the SIGKILL re-form")
    ap.add_argument("--restart-workers", action="store_true",
                    help="the job re-forms by restarting its workers (elastic_train.py --restart-workers)")
    ap.add_argument("--budget-s", type=float, default=0, help="start no trial after this many seconds (0: none)")
    ap.add_argument("--extrapolate", type=int, default=100)
    ap.add_argument("--json", help="results file (rewritten after every trial)")
    ap.add_argument("--plot", help="PNG of the times against N")
    ap.add_argument("--log-dir", help="keep each trial's mcclctl output and mccld logs here")
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.hosts.split(",") if x.strip()]
    if not ns or min(ns) < 2:
        ap.error("--hosts needs counts of at least 2 (one host leaves, one stays)")
    args.mode = choose_mode(args.mode)
    if args.mode == "netns":
        from tools.fleet import check_prerequisites
        check_prerequisites()
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="mccl-reform-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    meta = {"mode": args.mode, "hosts": ns, "repeats": args.repeats, "step_time": args.step_time,
            "restart_workers": args.restart_workers,
            "every": args.every, "last_call": args.last_call, "kill": args.kill, "cores": os.cpu_count(),
            "machine": f"{os.cpu_count()} cores", "python": sys.version.split()[0],
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "harvest_poll_s": 0.25, "idle_after_s": 60,
            "leaver": "the last host (h{N-1})", "killed": "h0's training process", "log_dir": str(log_dir)}
    try:
        git = ["git", "-C", str(REPO)]
        meta["git_head"] = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True, timeout=10).stdout.strip()
        meta["git_modified"] = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                                              capture_output=True, text=True, timeout=10).stdout.split("\n")
        meta["git_modified"] = [x.strip() for x in meta["git_modified"] if x.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import torch
        meta["torch"] = torch.__version__
    except ImportError:
        pass
    doc = {"meta": meta, "trials": [], "summary": {}}
    t_start = time.monotonic()
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    for rep in range(args.repeats):
        for n in ns:
            if stop["flag"] or (args.budget_s and time.monotonic() - t_start > args.budget_s):
                doc["meta"]["cut_short"] = f"budget of {args.budget_s:g} s reached before N={n} trial {rep}"
                break
            print(f"[reform] N={n} trial {rep} ...", file=sys.stderr, flush=True)
            rec = run_trial(n, rep, args, log_dir)
            doc["trials"].append(rec)
            keys = ("leave_s", "reform_s", "resumed_s", "gap_s")
            print(f"[reform] N={n} trial {rep}: " + (", ".join(f"{k} {rec.get(k)}" for k in keys) +
                  (f", kill {rec['kill'].get('reform_s')}" if rec.get("kill") else "")
                  if rec["ok"] else f"FAILED: {rec.get('error')}") +
                  f" ({rec['wall_s']} s{'; leftovers ' + str(rec['leftovers']) if rec['leftovers'] else ''})",
                  file=sys.stderr, flush=True)
            doc["summary"] = summarize(doc["trials"], args.extrapolate)
            doc["meta"]["elapsed_s"] = round(time.monotonic() - t_start, 1)
            if args.json:
                tmp = args.json + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(doc, f, indent=1)
                os.replace(tmp, args.json)
        else:
            continue
        break
    doc["summary"] = summarize(doc["trials"], args.extrapolate)
    if max(ns) > (os.cpu_count() or 1):
        # Each emulated host's worker (and at a re-form, its torch import) wants a core of its own.
        doc["meta"]["warning"] = (f"up to {max(ns)} hosts on {os.cpu_count()} cores: the emulated hosts share CPUs, so "
                                  "the times grow with N by that sharing too; the fit and its extrapolation measure "
                                  "this machine, not a fleet of one machine per host")
    text = report(doc)
    print(text, flush=True)
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    if args.plot and any(t.get("ok") for t in doc["trials"]):
        try:
            plot(doc, args.plot, args.extrapolate)
        except ImportError:
            print("[reform] no matplotlib: no plot", file=sys.stderr)
    return 0 if doc["trials"] and all(t.get("ok") for t in doc["trials"]) else 1


if __name__ == "__main__":
    sys.exit(main())
