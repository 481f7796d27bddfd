"""Ranks as processes: start ``fn(rank, world, *args)`` in processes of their own (as torchrun
would), collect their results, and reap every child whatever happens; free ports; a
command run in its own session with a hard timeout.

The ranks fork from multiprocessing's forkserver, a clean process that imported torch once
(``_PRELOAD``). A spawned rank cost 2.5 s of CPU before its first line, importing torch again,
and the suite starts about a thousand of them: on a 2-core CI machine that was most of its
30 minutes. Each rank still gets this process's environment and working directory as they
are when it starts (``_entry``), as a spawned one did; only what torch and numpy read while
importing comes from the server's start (the session's first test: ``start_rank_server``)."""

from __future__ import annotations

import datetime
import os
import queue
import signal
import subprocess
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from .ports import free_port  # noqa: F401 - the tests take it from here too


def init_pg(rank: int, world: int, timeout_s: float = 60.0, backend: str = "mccl", port: int | None = None) -> None:
    """init_process_group from the env the harness set (MASTER_ADDR/PORT).

    Pass a fresh ``port`` to initialise again in the same process: torch's env://
    store re-binding the previous port races its own clients."""
    import torch.distributed as dist

    if port is not None:
        os.environ["MASTER_PORT"] = str(port)

    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


_PRELOAD = ["torch", "torch.distributed", "numpy"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)   # read when the server starts, once per process
    return ctx


def start_rank_server() -> None:
    """Starts the forkserver now (the leak check's warm-up: it lives as long as this process)."""
    from multiprocessing import forkserver

    _context()
    forkserver.ensure_running()


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, env: dict, results: Any,
           parent_env: dict, cwd: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, "error", traceback.format_exc()))


class RankFailure(AssertionError):
    pass


def spawn_ranks(fn: Callable[..., Any], world: int, *args: Any, env: dict | None = None) -> tuple[list, Any, int]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = []
    parent_env, cwd = dict(os.environ), os.getcwd()
    for rank in range(world):
        p = ctx.Process(target=_entry, args=(fn, rank, world, port, args, env or {}, results, parent_env, cwd),
                        daemon=True)
        p.start()
        procs.append(p)
    return procs, results, port


def reap(procs: list) -> None:
    """SIGKILL and join every process still alive."""
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.join(5)


def collect(procs: list, results: Any, timeout_s: float, expect: int | None = None) -> dict[int, tuple[str, Any]]:
    """Results of ``expect`` ranks (default: all), failing the test past ``timeout_s``."""
    expect = len(procs) if expect is None else expect
    deadline = time.monotonic() + timeout_s
    out: dict[int, tuple[str, Any]] = {}
    while len(out) < expect:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RankFailure(f"only ranks {sorted(out)} reported within {timeout_s}s; "
                              f"alive: {[i for i, p in enumerate(procs) if p.is_alive()]}")
        try:
            rank, status, value = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                codes = [p.exitcode for p in procs]
                raise RankFailure(f"ranks exited without reporting (exit codes {codes}); got {sorted(out)}") from None
            continue
        out[rank] = (status, value)
    return out


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120.0,
              env: dict | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` rank processes; return their results.

    ``fn`` must be a module-level function. Any rank's exception fails the test with
    that rank's traceback.
    """
    procs, results, _ = spawn_ranks(fn, world, *args, env=env)
    try:
        out = collect(procs, results, timeout_s)
    finally:
        reap(procs)
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(out.items()) if s != "ok"]
    if errors:
        raise RankFailure("\n".join(errors))
    return [out[r][1] for r in range(world)]


def run_command(cmd: list[str], timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session; on timeout kill the whole session (torchrun's
    workers included) and fail."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RankFailure(f"{cmd} ran past {timeout_s}s:\n{out[-2000:]}\n{err[-2000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a finished run
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
