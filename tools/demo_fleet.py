"""``python -m tools.demo_fleet`` (what ``make demo`` runs): MCCL on a fleet of three emulated hosts.

The one-host demo (tools/demo.py) cannot show what MCCL is for: daemons that find each other,
links between hosts, and a job that lives on borrowed machines and survives their owners
coming back. So, as root, this demo builds three hosts out of network namespaces
(tools/fleet.py: one switch, 1 Gbit/s ports), starts an mccld on each with its own host id,
runtime directory and activity file (untouched for two hours: the hosts are idle), shows
them finding each other over mDNS (``mcclctl status``), then submits
``examples/elastic_train.py`` from host 0 with ``mcclctl run --min 2 --max 3``. While it
trains it shows the daemons' state, links, TX/RX and exporter figures; then host 2's user
"comes back" (its activity file is touched), its mccld drains it, the job saves, host 2 leaves
and the other two resume from the same step and finish. Last it shows capacity, stops
everything and checks that no namespace or shared-memory segment is left.

Host 2 is the one drained, never host 0: host 0 submitted the job and serves its rendezvous
anchor, as a user's own machine would. Every wait is bounded; the demo exits 1 naming what
did not happen. Without root (or without ``ip``/``tc``, or where namespaces are refused) it
says why and runs the one-host demo instead.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mccl_common.errors import MCCLError

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
HOSTS = 3
LEAVER = 2                  # the host whose user comes back; never 0, which serves the anchor
CTL_TIMEOUT_S = 30.0        # one mcclctl call
DISCOVER_S = 45.0           # three daemons up and seeing each other
JOB_START_S = 60.0          # torch imports in seven processes on a small machine
LEAVE_S = 30.0              # activity file touched -> "left after step"
STOP_S = 15.0               # mccld's SIGTERM to exit


class DemoFailed(Exception):
    """Something the demo claims did not happen; the message says what."""


def fleet_unavailable() -> str | None:
    """Why this machine cannot emulate the fleet, in one phrase; None when it can try."""
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform}): the emulated fleet is built from Linux network namespaces"
    if os.geteuid() != 0:
        return f"not root (uid {os.geteuid()}): the emulated fleet needs network namespaces, veths and tc"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"no '{missing[0]}' command: the emulated fleet needs iproute2 (apt-get install iproute2)"
    return None


def say(text: str = "") -> None:
    print(text, flush=True)


# ---- the job's output, abbreviated ------------------------------------------------------

_STEP = re.compile(r"^\[(\S+)\s*\] step (\d+) loss [0-9.]+ world (\d+)$")


class JobOutput:
    """Reads ``mcclctl run``'s merged output on a thread; ``pump`` prints the lines worth
    reading (every few steps, world changes, joins, leaves, mcclctl's own lines) and records
    what the demo checks. Everything goes to ``log`` too."""

    def __init__(self, proc: subprocess.Popen, log: Path, steps: int):
        self.proc, self.log_path, self.steps = proc, log, steps
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.last_step = -1
        self.step_seq: list[int] = []
        self.world = 0
        self.worlds: list[int] = []
        self.left: str | None = None
        self.resumed: str | None = None
        self.finished: str | None = None
        self.fatal: str | None = None
        self.eof = False
        self.hidden = 0
        self._log = open(log, "w")
        self._thread = threading.Thread(target=self._read, name="demo-job-output", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def pump(self, until, timeout: float, what: str) -> None:
        """Handle lines until ``until()`` holds; DemoFailed naming ``what`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not until():
            if self.fatal:
                raise DemoFailed(self.fatal)
            if self.eof:
                raise DemoFailed(f"the job ended (exit code {self.proc.poll()}) before {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise DemoFailed(f"{what} did not happen within {timeout:.0f} s")
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                self.eof = True
                continue
            self._handle(line)

    def drain(self) -> None:
        """Handle whatever is queued now, without waiting."""
        while not self.eof:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return
            if line is None:
                self.eof = True
            else:
                self._handle(line)

    def _handle(self, line: str) -> None:
        self._log.write(line + "\n")
        m = _STEP.match(line)
        if m:
            step, world = int(m.group(2)), int(m.group(3))
            changed = world != self.world
            self.last_step, self.world = step, world
            self.step_seq.append(step)
            if changed:
                self.worlds.append(world)
            if changed or step % 5 == 0 or step == self.steps - 1:
                say(f"  {line}")
            else:
                self.hidden += 1
            return
        if re.search(r"world \d+ on \S+: (resumed|fresh)", line):
            if "resumed" in line and self.resumed is None:
                self.resumed = line
            say(f"  {line}")
        elif "[mcclctl]" in line or line.startswith("mcclctl run:") or line.startswith("mcclctl:"):
            plan = re.match(r"mcclctl run: job \S+ on (\d+) host", line)
            if plan and int(plan.group(1)) < HOSTS:
                self.fatal = (f"mcclctl run found {plan.group(1)} of the {HOSTS} hosts over mDNS: {line}; "
                              "the machine may be too busy to answer in time, run the demo again")
            if "left after step" in line and self.left is None:
                self.left = line
            if "mcclctl run: finished" in line:
                self.finished = line
            say(f"  {line}")
        else:
            self.hidden += 1        # torchrun's and torch's own logging

    def close(self) -> None:
        self._log.close()
        self._thread.join(timeout=5.0)

    def tail(self, n: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


# ---- the demo ---------------------------------------------------------------------------

class FleetDemo:
    def __init__(self, fleet, work: Path, steps: int, step_time: float):
        self.fleet, self.work, self.steps, self.step_time = fleet, work, steps, step_time
        self.fleet_key, self.submit_key = work / "fleet.key", work / "submit.key"
        self.activity = [work / f"activity-host{i}" for i in range(HOSTS)]
        self.daemons: list[subprocess.Popen] = []
        self.ctl_env = {"MCCL_KEY_FILE": str(self.fleet_key), "MCCL_FLEET": f"demo{fleet.id}",
                        "MCCL_IFACE": "eth0", "MCCL_SUBMIT_KEY_FILE": str(self.submit_key)}

    def start_daemons(self) -> None:
        for path in (self.fleet_key, self.submit_key):
            path.write_text(os.urandom(32).hex())
            path.chmod(0o600)
        idle_since = time.time() - 7200
        for i in range(HOSTS):
            self.activity[i].touch()
            os.utime(self.activity[i], (idle_since, idle_since))
            env = dict(self.ctl_env, MCCL_HOST_ID=f"host{i}", MCCL_RUNTIME_DIR=str(self.work / f"run-host{i}"),
                       MCCL_ACTIVITY_FILE=str(self.activity[i]), MCCL_IDLE_AFTER="60",
                       MCCL_HARVEST_POLL="0.25", MCCL_CLIENT_CHECK_INTERVAL="0.1", MCCL_MDNS_TTL="10",
                       # mccld runs as root here (namespaces) and starts jobs as root only when
                       # told; the venv's python may also live where only root can run it.
                       MCCL_LAUNCH_USER="root")
            with open(self.work / f"mccld-host{i}.log", "w") as log:
                self.daemons.append(self.fleet.popen(i, [PY, "-m", "mccld"], env=env, stdout=log,
                                                     stderr=subprocess.STDOUT))

    def ctl(self, *args: str, host: int = 0) -> subprocess.CompletedProcess:
        try:
            return self.fleet.run(host, [PY, "-m", "mcclctl", *args], timeout=CTL_TIMEOUT_S, env=self.ctl_env)
        except subprocess.TimeoutExpired:
            raise DemoFailed(f"'mcclctl {' '.join(args)}' did not answer within {CTL_TIMEOUT_S:.0f} s") from None

    def status_json(self) -> dict:
        r = self.ctl("status", "--json", "--discover-timeout", "2")
        return json.loads(r.stdout) if r.returncode in (0, 1) and r.stdout.strip() else {"daemons": []}

    def show(self, title: str, *commands: tuple[str, ...], figures: bool = False) -> None:
        """Run the mcclctl commands side by side, then print them in order: each spends most of
        its time listening for mDNS, which overlaps well. The exporters are scraped after them,
        so their figures are not older than the tables above them."""
        with ThreadPoolExecutor(len(commands)) as pool:
            runs = [pool.submit(self.ctl, *cmd) for cmd in commands]
        for cmd, run in zip(commands, runs):
            r = run.result()
            say(f"\n[demo] $ mcclctl {' '.join(cmd)}   ({title}; run on host0)")
            say(r.stdout.rstrip() or r.stderr.rstrip())
        if figures:
            self.print_figures(title, self.metrics())

    def wait_for_fleet(self) -> None:
        from mcclctl.formatting import fleet_line, status_table
        from mccl_common import __version__

        deadline = time.monotonic() + DISCOVER_S
        want = {f"host{i}": "idle" for i in range(HOSTS)}
        seen: dict[str, str] = {}
        while seen != want:
            for i, d in enumerate(self.daemons):
                if d.poll() is not None:
                    raise DemoFailed(f"mccld on host{i} exited with {d.returncode}:\n{self.daemon_log(i)}")
            if time.monotonic() > deadline:
                raise DemoFailed(f"the three daemons did not find each other over mDNS within {DISCOVER_S:.0f} s "
                                 f"(host0 sees {seen or 'none'})")
            status = self.status_json()
            seen = {d["host"]: (d.get("status") or {}).get("state", "unreachable") for d in status["daemons"]}
        say(f"[demo] host0 found all {HOSTS} daemons over mDNS")
        # The table `mcclctl status` prints, from the answer just polled: one mDNS wait less.
        say("\n[demo] $ mcclctl status   (before the job; run on host0)")
        say(fleet_line(status.get("fleet") or {}))
        say(status_table([(d["host"], d["status"], d["error"]) for d in status["daemons"]], __version__,
                         status.get("warnings", [])))

    def metrics(self) -> dict[str, list]:
        """Each host's exporter, scraped from inside host0 (the fleet's subnet exists only there)."""
        addrs = [h.addr for h in self.fleet.hosts]
        r = self.fleet.run(0, [PY, "-m", "tools.demo_fleet", "--scrape", *addrs], timeout=CTL_TIMEOUT_S,
                           cwd=str(REPO))
        if r.returncode != 0:
            raise DemoFailed(f"scraping the exporters failed: {r.stderr.strip()[-500:]}")
        return json.loads(r.stdout)

    def print_figures(self, title: str, scraped: dict[str, list]) -> None:
        say(f"\n[demo] the exporters' figures ({title}; http://<host>:29652/metrics):")
        say(f"  {'HOST':<6} {'SENT TO PEERS':>13} {'RECEIVED':>10} {'COLLECTIVES':>11} {'MEAN':>8} "
            f"{'ALLREDUCE BUS BW':>16}  JOB WORLDS")
        for host, samples in zip((f"host{i}" for i in range(HOSTS)), scraped.values()):
            def total(name: str, **labels: str) -> float:
                return sum(v for n, lab, v in samples if n == name and labels.items() <= lab.items())
            n = total("mccl_collective_duration_seconds_count")
            mean = total("mccl_collective_duration_seconds_sum") / n * 1e3 if n else 0.0
            worlds = sorted((int(v) for name, _, v in samples if name == "mccl_job_world_size"), reverse=True)
            busbw = total("mccl_busbw_bytes_per_second", op="allreduce") * 8 / 1e6
            say(f"  {host:<6} {_kib(total('mccl_peer_sent_bytes_total')):>13} "
                f"{_kib(total('mccl_peer_received_bytes_total')):>10} {n:>11.0f} {mean:>6.2f}ms "
                f"{busbw:>9.1f} Mbit/s  {', '.join(map(str, worlds)) or '-'}")

    def daemon_log(self, i: int) -> str:
        return (self.work / f"mccld-host{i}.log").read_text(errors="replace")[-2000:]

    def submit(self) -> subprocess.Popen:
        argv = ["mcclctl", "run", "--min", "2", "--max", str(HOSTS),
                "--env", "OMP_NUM_THREADS=1", "--env", "MCCL_DAEMON=1",
                # Each re-form's round stays open this long for more hosts; three start together.
                "--env", "MCCL_RDZV_LAST_CALL=2", "--",
                "python", "examples/elastic_train.py", "--steps", str(self.steps),
                # 48 splits over three hosts and over two: the same global batch before and after.
                "--global-batch", "48", "--ckpt", str(self.work / "ckpt"), "--every", "10",
                "--step-time", str(self.step_time)]
        say(f"\n[demo] $ {' '.join(argv)}   (on host0)")
        say("[demo] each rank hands its collectives to its host's mccld (MCCL_DAEMON=1), so gradients cross "
            "the daemons' links; the checkpoint folder is shared (the namespaces share one filesystem)")
        say("[demo] on the wire: the daemons' links open only with the fleet key, every engine frame is "
            "sealed with AES-256-GCM (MCCL_WIRE_SECURITY=aead, the default), the job's rendezvous values carry "
            "MACs under a key of this run's own, and its command line and output travel encrypted "
            "(docs/security.md)")
        say("[demo] jobs run as root (MCCL_LAUNCH_USER=root): the mcclds run as root to use namespaces, and "
            "the venv's Python may live where other users cannot run it (here: under /root)")
        return self.fleet.popen(0, [PY, "-m", *argv], env=self.ctl_env, cwd=str(REPO), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def train_and_shrink(self) -> None:
        proc = self.submit()
        out = JobOutput(proc, self.work / "job.log", self.steps)
        try:
            out.pump(lambda: out.world == HOSTS and out.last_step >= 0, JOB_START_S, f"training on {HOSTS} hosts")
            self.show("while the job trains", ("status",), ("links",), figures=True)
            out.drain()
            if out.world != HOSTS:
                raise DemoFailed(f"the job runs on {out.world} hosts before anyone came back")
            if out.eof or out.last_step > self.steps - 5:
                raise DemoFailed(f"the job reached step {out.last_step} of {self.steps} while the demo showed it; "
                                 "give it more --steps or a longer --step-time")
            # A quarter of the run on three hosts before one leaves, so the output shows both worlds.
            out.pump(lambda: out.last_step >= self.steps // 4, JOB_START_S, f"step {self.steps // 4}")
            os.utime(self.activity[LEAVER])
            touched = time.monotonic()
            say(f"\n[demo] host{LEAVER}'s user is back: its activity file was just touched\n")
            out.pump(lambda: out.left is not None, LEAVE_S, f"host{LEAVER} leaving")
            left_after = time.monotonic() - touched
            out.pump(lambda: out.resumed is not None and out.world == HOSTS - 1, JOB_START_S,
                     f"the job resuming on {HOSTS - 1} hosts")
            out.pump(lambda: out.eof, JOB_START_S + self.steps * self.step_time, "the job's end")
            try:
                rc = proc.wait(timeout=CTL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise DemoFailed("mcclctl run did not exit after its output ended") from None
            if f"[host{LEAVER}" not in (out.left or ""):
                raise DemoFailed(f"the host that left is not host{LEAVER}: {out.left}")
            if rc != 0 or out.finished is None:
                raise DemoFailed(f"mcclctl run exited with {rc}; the job did not finish")
            if out.step_seq != list(range(self.steps)) or out.worlds[-1] != HOSTS - 1:
                raise DemoFailed(f"the job's steps were not 0..{self.steps - 1} once each, ending on {HOSTS - 1} "
                                 f"hosts: steps {out.step_seq}, worlds {out.worlds}")
            say(f"\n[demo] the job shrank from {HOSTS} to {HOSTS - 1} hosts: host{LEAVER} left "
                f"{left_after:.1f} s after its user came back, the others resumed from the same step "
                f"and finished (mcclctl run exit 0); {out.hidden} lines of per-step and torchrun output not shown")
        except BaseException:
            out.drain()
            say(f"[demo] the job's last output:\n{out.tail()}")
            raise
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)     # mcclctl ends every lease on SIGTERM
                try:
                    proc.wait(timeout=CTL_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=STOP_S)
            out.close()             # the reader sees EOF once mcclctl is gone
            proc.stdout.close()

    def stop_daemons(self) -> None:
        for d in self.daemons:
            if d.poll() is None:
                d.send_signal(signal.SIGTERM)
        for i, d in enumerate(self.daemons):
            try:
                d.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                raise DemoFailed(f"mccld on host{i} did not stop within {STOP_S:.0f} s of SIGTERM") from None


def _kib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def run_fleet_demo(steps: int, step_time: float, rate: str, fleet_only: bool = False) -> int:
    from tools.demo import orphaned_segments
    from tools.fleet import Fleet, list_links, list_namespaces

    started = time.monotonic()
    segments_before = orphaned_segments()
    # SIGTERM (a test's timeout, a CI runner) unwinds like Ctrl-C, so the namespaces come down.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    fleet = Fleet(HOSTS, rate=rate)
    try:
        fleet.start()
    except MCCLError as e:
        return _fallback(f"network namespaces are refused here ({e})", fleet_only)
    work = Path(tempfile.mkdtemp(prefix="mccl-fleet-demo-"))
    demo = FleetDemo(fleet, work, steps, step_time)
    failure = None
    try:
        say(f"[demo] {HOSTS} emulated hosts (network namespaces {fleet.hosts[0].ns}..{fleet.hosts[-1].ns}) "
            f"on one switch, {rate} per port: " + ", ".join(f"host{h.index} {h.addr}" for h in fleet.hosts))
        say("[demo] starting one mccld per host; no user input for 2 h on any of them, so all are "
            "idle and may be harvested")
        demo.start_daemons()
        demo.wait_for_fleet()
        say("[demo] no links yet: an mccld opens links to the hosts a job spans, when it starts")
        demo.train_and_shrink()
        demo.show("after the job", ("status",), ("capacity",), figures=True)
        demo.stop_daemons()
    except (DemoFailed, MCCLError) as e:
        failure = str(e)
    finally:
        fleet.stop()
        if failure:
            for i in range(len(demo.daemons)):
                say(f"[demo] mccld log of host{i} (end):\n{demo.daemon_log(i)}")
        shutil.rmtree(work, ignore_errors=True)
    left_ns = [ns for ns in list_namespaces() if ns.startswith(f"mccl{fleet.id}h")]
    left_links = [link for link in list_links() if link.startswith(f"mccl{fleet.id}")]
    leaked = sorted(orphaned_segments() - segments_before)
    say(f"[demo] daemons stopped, fleet torn down; namespaces left: {len(left_ns)}, "
        f"links left: {len(left_links)}, shared-memory segments left: {len(leaked)}")
    if not failure and (left_ns or left_links or leaked):
        failure = f"left behind: {left_ns + left_links + leaked}"
    if failure:
        print(f"[demo] FAILED: {failure}", file=sys.stderr, flush=True)
        return 1
    say(f"[demo] OK: {HOSTS} hosts found each other, trained together, one left when its user came back, "
        f"the job finished on {HOSTS - 1} ({time.monotonic() - started:.0f} s)")
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _fallback(why: str, fleet_only: bool = False) -> int:
    if fleet_only:
        print(f"[demo] FAILED: {why}", file=sys.stderr, flush=True)
        return 1
    say(f"[demo] {why}; running the one-host demo instead")
    from tools.demo import main as one_host_demo
    return one_host_demo(["--with-daemon"])


_FIGURES = ("mccl_peer_", "mccl_collective_duration_seconds_", "mccl_busbw_bytes_per_second", "mccl_job_world_size")


def scrape(addrs: list[str]) -> int:
    """``--scrape``: the samples the demo shows from each address's exporter, as JSON (run inside host0)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list] = {}
    for addr in addrs:
        with urllib.request.urlopen(f"http://{addr}:29652/metrics", timeout=10) as r:
            text = r.read().decode()
        out[addr] = [[s.name, s.labels, s.value] for family in text_string_to_metric_families(text)
                     for s in family.samples if s.name.startswith(_FIGURES)]
    print(json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.demo_fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--step-time", type=float, default=0.3, help="extra seconds per step (default 0.3)")
    p.add_argument("--rate", default="1gbit", help="line rate of each emulated port (default 1gbit)")
    p.add_argument("--fleet-only", action="store_true", help="fail instead of falling back to the one-host demo")
    p.add_argument("--scrape", nargs="+", metavar="ADDR", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.scrape:
        return scrape(ns.scrape)
    if ns.steps < 12:
        p.error("--steps must be at least 12: the job trains on three hosts, then on two")
    why = fleet_unavailable()
    if why:
        return _fallback(why, ns.fleet_only)
    return run_fleet_demo(ns.steps, ns.step_time, ns.rate, ns.fleet_only)


if __name__ == "__main__":
    sys.exit(main())
