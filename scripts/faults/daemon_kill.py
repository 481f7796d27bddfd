"""Fault trials: mccld is SIGKILLed while its local ranks loop random collectives.

Each trial starts a private mccld (own MCCL_RUNTIME_DIR, MCCL_HOST_ID and fleet name),
``--world`` ranks that init the ``mccl`` process group with MCCL_DAEMON=1 and loop random
collectives of random sizes (checking every all_reduce result), and SIGKILLs the daemon
at a random time once every rank completed a collective. A trial passes when every rank

- raised DaemonUnavailableError (and no wrong result came before it),
- tore its process group down and exited 0 (no signal death, no hang),
- left no shared-memory segment behind.

Usage::

    .venv/bin/python scripts/faults/daemon_kill.py --trials 50 [--seed 1] [--cores DIR]

``--cores DIR`` lets ranks dump core (RLIMIT_CORE) and keeps a failed trial's files
(rank stderr with faulthandler's Python stacks, gdb backtraces of cores) under DIR.
Exit status: 0 when every trial passed, 1 otherwise; one JSON line per trial on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_READY_TIMEOUT_S = 90.0       # four torch imports on a loaded 2-core machine
_DAEMON_START_S = 30.0
_GROUP_TIMEOUT_S = 20.0       # the process group's timeout inside the ranks
# A rank must notice the daemon's death (heartbeat: ~3 s), fail and exit within this.
_EXIT_AFTER_KILL_S = 30.0
_KILL_WINDOW_S = (0.0, 1.5)   # random delay after every rank is looping


@dataclass
class Trial:
    index: int
    seed: int
    teardown: str
    kill_after_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    ranks: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


# -- the rank (a child process) ----------------------------------------------------------

def _rank_main(rank: int, world: int, seed: int, teardown: str, ready: Path) -> int:
    import faulthandler
    faulthandler.enable(all_threads=True)   # a SIGABRT/SIGSEGV prints every thread's stack
    import datetime
    import torch
    import torch.distributed as dist
    import libmccl  # noqa: F401 - registers the backend
    torch.set_num_threads(1)
    out = {"rank": rank, "ops": 0, "error": None, "message": "", "wrong": 0, "teardown_error": None}
    try:
        dist.init_process_group("mccl", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=_GROUP_TIMEOUT_S))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out.update(error=type(e).__name__, message=f"init: {e}")
        print(json.dumps(out), flush=True)
        return 0
    rng = random.Random(seed)             # the same sequence on every rank: same collectives
    try:
        while True:
            _one_op(rng, rank, world, out, torch, dist)
            if out["ops"] == 1:
                ready.write_text("1")
    except Exception as e:  # noqa: BLE001 - the daemon's death is expected to land here
        out.update(error=type(e).__name__, message=str(e)[:300])
    try:
        if teardown == "destroy":
            dist.destroy_process_group()
        # "exit": leave the group to interpreter exit, as a script that dies of the error does
    except Exception as e:  # noqa: BLE001
        out["teardown_error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(out), flush=True)
    return 0


def _one_op(rng: random.Random, rank: int, world: int, out: dict, torch, dist) -> None:
    n = int(2 ** rng.uniform(0, 20))       # 1 element .. 4 MB of float32, log-uniform
    kind = rng.choice(("all_reduce", "all_reduce", "broadcast", "all_gather", "reduce_scatter",
                       "all_to_all", "barrier", "async_batch"))
    if kind == "all_reduce":
        t = torch.full((n,), float(rank + 1))
        dist.all_reduce(t)
        if not bool((t == world * (world + 1) / 2).all()):
            out["wrong"] += 1
    elif kind == "broadcast":
        t = torch.full((n,), float(rank))
        dist.broadcast(t, src=rng.randrange(world))
    elif kind == "all_gather":
        t = torch.full((n,), float(rank))
        dist.all_gather_into_tensor(torch.empty(n * world), t)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * world))
    elif kind == "all_to_all":
        dist.all_to_all_single(torch.empty(n * world), torch.ones(n * world))
    elif kind == "barrier":
        dist.barrier()
    else:
        ts = [torch.full((max(1, n // 8),), float(rank + 1)) for _ in range(rng.randint(2, 6))]
        for w in [dist.all_reduce(t, async_op=True) for t in ts]:
            w.wait()
        if not all(bool((t == world * (world + 1) / 2).all()) for t in ts):
            out["wrong"] += 1
    out["ops"] += 1


# -- the harness ------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _segments_of(pids: list[int]) -> list[str]:
    owned = {str(p) for p in pids}
    return sorted(p.name for p in Path("/dev/shm").glob("mccl-*") if p.name.split("-")[3:4] and
                  p.name.split("-")[3] in owned)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _backtrace(core: Path) -> str:
    if shutil.which("gdb") is None:
        return "(no gdb)"
    try:
        r = subprocess.run(["gdb", "-batch", "-nx", "-ex", "thread apply all bt 30", sys.executable, str(core)],
                           capture_output=True, text=True, timeout=120)
        return r.stdout[-20000:]
    except subprocess.TimeoutExpired:
        return "(gdb timed out)"


def run_trial(index: int, seed: int, world: int, cores: Path | None) -> Trial:
    rng = random.Random(seed)
    trial = Trial(index, seed, teardown=rng.choice(("destroy", "exit")))
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="mccl-fault-"))
    rdir = work / "rt"
    env = {**os.environ,
           "MCCL_RUNTIME_DIR": str(rdir), "MCCL_HOST_ID": f"fk{os.getpid()}t{index}",
           "MCCL_FLEET": f"faults-{os.getpid()}", "MCCL_FLEET_KEY": "fault-campaign-key-0123456789-abcdefghijkl",
           "MCCL_LISTEN_ADDR": "127.0.0.1", "MCCL_PORT": "0", "MCCL_STATUS_PORT": "0", "MCCL_METRICS_PORT": "0",
           "MCCL_CLIENT_CHECK_INTERVAL": "0.1", "MCCL_DAEMON": "1", "PYTHONPATH": str(ROOT),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world),
           "PYTHONFAULTHANDLER": "1"}
    def allow_core() -> None:
        if cores is not None:
            resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    daemon = subprocess.Popen([sys.executable, "-m", "mccld", "--log-level", "WARNING"], env=env, cwd=work,
                              stdout=subprocess.DEVNULL, stderr=open(work / "mccld.err", "w"))
    ranks: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + _DAEMON_START_S
        while not (rdir / "token").exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                trial.problems.append(f"mccld did not start: {(work / 'mccld.err').read_text()[-500:]}")
                return trial
            time.sleep(0.05)
        for r in range(world):
            ranks.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", str(r), str(world), str(seed), trial.teardown,
                 str(work / f"ready{r}")], env={**env, "RANK": str(r)}, cwd=work, preexec_fn=allow_core,
                stdout=open(work / f"rank{r}.out", "w"), stderr=open(work / f"rank{r}.err", "w")))
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not all((work / f"ready{r}").exists() for r in range(world)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in ranks):
                trial.problems.append("ranks did not all start looping "
                                      f"(exit codes {[p.poll() for p in ranks]})")
                break
            time.sleep(0.05)
        trial.kill_after_s = round(rng.uniform(*_KILL_WINDOW_S), 3)
        time.sleep(trial.kill_after_s)
        daemon.kill()
        daemon.wait(10)
        deadline = time.monotonic() + _EXIT_AFTER_KILL_S
        for r, p in enumerate(ranks):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                trial.problems.append(f"rank {r} hung: still alive {_EXIT_AFTER_KILL_S:.0f}s after the kill")
        _check_ranks(trial, work, ranks)
        left = _segments_of([p.pid for p in ranks])
        if left:
            trial.problems.append(f"segments left behind: {left}")
        return trial
    finally:
        for p in ranks:
            _kill(p)
        _kill(daemon)
        for name in _segments_of([p.pid for p in ranks]):   # ours: owned by our dead ranks
            Path("/dev/shm", name).unlink(missing_ok=True)
        trial.seconds = round(time.monotonic() - started, 2)
        if trial.problems and cores is not None:
            _keep(trial, work, cores)
        shutil.rmtree(work, ignore_errors=True)


def _check_ranks(trial: Trial, work: Path, ranks: list[subprocess.Popen]) -> None:
    for r, p in enumerate(ranks):
        rc = p.poll()
        lines = (work / f"rank{r}.out").read_text().strip().splitlines()
        res = json.loads(lines[-1]) if lines else {}
        trial.ranks.append({"rank": r, "rc": rc, **{k: res.get(k) for k in ("ops", "error", "teardown_error")}})
        if rc is not None and rc < 0:
            trial.problems.append(f"rank {r} died of {signal.Signals(-rc).name}")
        elif rc not in (None, 0):
            trial.problems.append(f"rank {r} exited {rc}: {(work / f'rank{r}.err').read_text()[-300:]}")
        if rc == 0 and res.get("error") != "DaemonUnavailableError":
            trial.problems.append(f"rank {r} raised {res.get('error')} ({res.get('message')}), "
                                  "expected DaemonUnavailableError")
        if res.get("wrong"):
            trial.problems.append(f"rank {r}: {res['wrong']} wrong all_reduce result(s) before the kill")
        if res.get("teardown_error"):
            trial.problems.append(f"rank {r} teardown raised {res['teardown_error']}")


def _keep(trial: Trial, work: Path, cores: Path) -> None:
    dest = cores / f"trial{trial.index}-seed{trial.seed}"
    dest.mkdir(parents=True, exist_ok=True)
    for f in work.iterdir():
        if f.is_file() and f.name.startswith("core"):
            (dest / f"{f.name}.bt.txt").write_text(_backtrace(f))
        elif f.is_file():
            shutil.copy(f, dest / f.name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seed", type=int, default=None, help="first trial's seed (default: random)")
    ap.add_argument("--cores", type=Path, default=None, help="enable core dumps; keep failed trials here")
    ap.add_argument("--max-seconds", type=float, default=0, help="stop starting trials after this long")
    args = ap.parse_args(argv)
    first = args.seed if args.seed is not None else random.randrange(1 << 30)
    began = time.monotonic()
    failed = done = 0
    for i in range(args.trials):
        if args.max_seconds and time.monotonic() - began > args.max_seconds:
            break
        t = run_trial(i, first + i, args.world, args.cores)
        done += 1
        failed += not t.ok
        print(json.dumps({"trial": i, "seed": t.seed, "ok": t.ok, "teardown": t.teardown,
                          "kill_after_s": t.kill_after_s, "seconds": t.seconds, "problems": t.problems,
                          "ranks": t.ranks}), flush=True)
    print(json.dumps({"trials": done, "failed": failed, "first_seed": first,
                      "seconds": round(time.monotonic() - began, 1)}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        r, w, s, td, ready = sys.argv[2:7]
        sys.exit(_rank_main(int(r), int(w), int(s), td, Path(ready)))
    sys.exit(main())
