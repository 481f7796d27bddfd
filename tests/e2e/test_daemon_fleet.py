"""Daemons on an emulated fleet (network namespaces, real mDNS, real TCP links).

Needs root and iproute2 (tools.fleet); skipped otherwise. Every daemon and rank is
started through the Fleet, whose teardown kills whatever is left in its namespaces.
Run directly (``python tests/e2e/test_daemon_fleet.py FN RANK WORLD``) it is the rank
program the tests start inside the namespaces.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mccl_common import PROTO_VERSION
from support.daemon import job_segments
from support.pipelined import PIPE_ENV
from support.fleet import KEY, skip_unless_fleet
from support.fleet import DaemonFleet as _DaemonFleet


class DaemonFleet(_DaemonFleet):
    RANK_SCRIPT = Path(__file__).resolve()      # its __main__ runs PROGRAMS[fn] (end of file)


# -- tests ---------------------------------------------------------------------------------
@pytest.mark.fleet
@pytest.mark.timeout(120)
def test_daemons_discover_each_other_and_refuse_a_wrong_key():
    skip_unless_fleet()
    from mccl_common.errors import AuthError
    from mccld.attach import local_request
    with DaemonFleet(3, keys=[KEY, KEY, "another-key-" + "z" * 20]) as df:
        deadline = time.monotonic() + 30
        while True:
            tables = [sorted(e["host_id"] for e in df.status(i)["fleet_table"]) for i in range(3)]
            if all(t == ["h0", "h1", "h2"] for t in tables):
                break
            assert time.monotonic() < deadline, f"fleet tables never converged: {tables}"
            time.sleep(0.5)
        entry = next(e for e in df.status(0)["fleet_table"] if e["host_id"] == "h1")
        assert entry["fleet"] == "dtest" and entry["addresses"] == [df.fleet.hosts[1].addr]
        assert entry["cores"] > 0 and entry["state"] == "idle" and entry["proto"] == PROTO_VERSION
        # browse_fleet (what mcclctl calls) from a fresh process on host 0
        # Once (of many runs) this process was killed at the 30 s limit without a word: if it
        # hangs again, its threads' stacks say where.
        code = ("import faulthandler; faulthandler.dump_traceback_later(25); "
                "import json; from mccl_common.discovery import browse_fleet; "
                "print(json.dumps(browse_fleet(3.0, fleet='dtest', interfaces=['%s'])))" % df.fleet.hosts[0].addr)
        res = df.fleet.run(0, [sys.executable, "-c", code], timeout=30)
        assert res.returncode == 0, res.stderr
        seen = json.loads(res.stdout.strip().splitlines()[-1])
        assert sorted(e["host_id"] for e in seen) == ["h0", "h1", "h2"]
        assert all(e["port"] == 29650 and e["status_port"] == 0 for e in seen)

        ok = local_request(df.dir / "h0", {"type": "probe", "addr": f"{df.fleet.hosts[1].addr}:29650"})
        assert ok["host_id"] == "h1"
        for _ in range(2):  # the repeat must not log another WARNING
            with pytest.raises(AuthError, match="failed fleet-key authentication"):
                local_request(df.dir / "h2", {"type": "probe", "addr": f"{df.fleet.hosts[0].addr}:29650"})
        assert [p["host"] for p in df.status(0)["links"]] == ["h1"]
        time.sleep(0.5)
        h0_log = df.log(0)
        warnings = [line for line in h0_log.splitlines() if "WARNING" in line and "10.77" in line]
        assert len(warnings) == 1, h0_log
        # A host that dies without a goodbye leaves every table after its TTL.
        df.daemons[1].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while "h1" in [e["host_id"] for e in df.status(0)["fleet_table"]]:
            assert time.monotonic() < deadline, "a SIGKILLed daemon never expired from the fleet table"
            time.sleep(0.5)


@pytest.mark.fleet
@pytest.mark.timeout(240)
def test_two_hosts_two_ranks_each_every_collective():
    skip_unless_fleet()
    with DaemonFleet(2) as df:
        links_up = []
        for placement in ([0, 1, 1, 0], [1, 0, 0, 1]):    # interleaved ranks; two jobs in a row
            out = df.ranks("collectives", placement, timeout_s=200)
            for r, (code, text) in out.items():
                assert code == 0 and text.endswith("ok"), f"rank {r}:\n{text}\n--- all ---\n{out}"
            links_up.append(df.log(0).count("link up"))
        assert [p["host"] for p in df.status(0)["links"]] == ["h1"]
        assert links_up[1] == links_up[0], "the second job dialled new links instead of reusing them"
    assert not job_segments(0x5eed)


@pytest.mark.fleet
@pytest.mark.timeout(300)
def test_ddp_daemon_mode_matches_in_process():
    skip_unless_fleet()
    with DaemonFleet(2) as df:
        results = {}
        # Reference: the same 4 ranks with the in-process engine, all on host 0.
        for mode, placement in (("1", [0, 0, 1, 1]), ("0", [0, 0, 0, 0])):
            out = df.ranks("ddp", placement, extra_env={"MCCL_DAEMON": mode}, timeout_s=120)
            for r, (code, text) in out.items():
                assert code == 0, f"MCCL_DAEMON={mode} rank {r}:\n{text}\n--- h0 ---\n{df.log(0)[-3000:]}"
            params = [json.loads(text.splitlines()[-1]) for _, (_code, text) in sorted(out.items())]
            assert all(p == params[0] for p in params), f"MCCL_DAEMON={mode}: ranks diverged"
            results[mode] = params[0]
        assert results["1"] == results["0"]
        jobs_seen = df.log(0).count("ready: 4 rank(s), 2 here, 2 host(s)")
        assert jobs_seen >= 1, "the daemon never ran the DDP job"


@pytest.mark.fleet
@pytest.mark.timeout(120)
def test_a_host_whose_ranks_join_late_still_sets_up_a_job_with_a_short_timeout():
    """Setting up waits at least 5 s for a peer host's data sockets, not the 2 s collective
    timeout (a CI campaign run failed 2 of 100 trials' setup that way under load)."""
    skip_unless_fleet()
    with DaemonFleet(2) as df:
        out = df.ranks("late_host", [0, 0, 1, 1], timeout_s=60)
        for r, (code, text) in out.items():
            assert code == 0 and text.splitlines()[-1] == "ok", f"rank {r}:\n{text}\n--- h0 ---\n{df.log(0)[-3000:]}"


@pytest.mark.fleet
@pytest.mark.timeout(180)
def test_rank_killed_on_one_host_fails_the_other_host_with_peer_lost():
    skip_unless_fleet()
    with DaemonFleet(2) as df:
        out = df.ranks("one_dies", [0, 0, 1, 1], timeout_s=120)
        assert out[3][0] == -signal.SIGKILL
        _verdicts(out, (0, 1, 2), "PeerLostError")
        assert "rank 3" in out[0][1] or "peer host" in out[0][1], out[0][1]
    assert not job_segments(0xdead03)


@pytest.mark.fleet
@pytest.mark.timeout(300)
def test_pipelined_allreduce_across_hosts_with_random_delays():
    """Tiny pipeline pieces: one rank per host (the engine on the client's region, AVG by the
    engine), two per host (local reduction, then the ring), and uneven hosts (AVG divided by
    the daemons)."""
    skip_unless_fleet()
    with DaemonFleet(2, extra_env=PIPE_ENV) as df:
        for placement in ([0, 1], [0, 0, 1, 1], [0, 1, 1]):
            out = df.ranks("pipelined", placement, timeout_s=200)
            for r, (code, text) in out.items():
                assert code == 0 and text.endswith("ok"), f"{placement} rank {r}:\n{text}\n--- h0 ---\n{df.log(0)[-3000:]}"


def _verdicts(out: dict[int, tuple[int, str]], ranks: tuple[int, ...], expect: str) -> list[str]:
    """Each rank's last line, once checked that it exited cleanly reporting ``expect``."""
    lines = []
    for r in ranks:
        code, text = out[r]
        last = text.splitlines()[-1] if text else ""
        assert code == 0 and last.startswith(expect) and "Traceback" not in text, f"rank {r}:\n{text}"
        lines.append(last)
    return lines


STALL_TIMEOUT_S = 4.0


@pytest.mark.fleet
@pytest.mark.timeout(180)
def test_sigstopped_rank_times_out_the_others_and_the_daemons_serve_a_new_job():
    """A stopped client is alive (its pid exists), so its daemon cannot call it lost: the
    others get CollectiveTimeout naming it after the job timeout. Its segments stay
    mapped until it dies, then go."""
    skip_unless_fleet()
    with DaemonFleet(2) as df:
        procs = df.start_ranks("stalls", [0, 0, 1, 1])
        out = df.finish(procs[:3], timeout_s=90)
        for last in _verdicts(out, (0, 1, 2), "CollectiveTimeout peer=3 after"):
            assert float(last.split()[3]) < STALL_TIMEOUT_S + 3.0, f"too late: {last}"
            assert "local rank(s) [3] did not submit" in last, last
        stopped = procs[3]
        assert _state(stopped.pid) == "T", "rank 3 did not stop itself"
        assert [n for n in job_segments(0xdead04) if n.split("-")[2] == "3"], \
            "the stopped rank's segment vanished early"
        # A new job on both daemons while the stopped rank still holds its place in the old one.
        again = df.ranks("collectives", [0, 1, 1, 0], timeout_s=120)
        for r, (code, text) in again.items():
            assert code == 0 and text.endswith("ok"), f"new job, rank {r}:\n{text}"
        os.killpg(stopped.pid, signal.SIGKILL)
        stopped.wait(10)
        deadline = time.monotonic() + 10
        while job_segments(0xdead04):
            assert time.monotonic() < deadline, "the killed rank's segments were never freed"
            time.sleep(0.1)
        # The segments go when the dead rank is forgotten; the job closes after that, on its
        # own thread (looking once, right after the segments went, once caught it listed).
        deadline = time.monotonic() + 10
        while [j for j in df.status(1)["jobs"] if j["job"] == "00dead04"]:
            assert time.monotonic() < deadline, f"a failed job still listed: {df.status(1)['jobs']}"
            time.sleep(0.1)


@pytest.mark.fleet
@pytest.mark.timeout(120)
def test_a_cut_link_times_out_the_far_hosts_ranks_naming_the_cut_host():
    """No FIN, no RST: h1's cable is pulled mid-loop. The ranks on h0 waited on h1 and must
    say so: the cut host by name, with its ranks (the campaign once saw them get the daemon's
    bare 'Timed out waiting for op #N' instead, and the engine's host index as 'rank 1')."""
    skip_unless_fleet()
    with DaemonFleet(2) as df:
        procs = df.start_ranks("loops", [0, 0, 1, 1], {"MCCL_TEST_MARKERS": str(df.dir)})
        deadline = time.monotonic() + 60
        while len(list(df.dir.glob("looping.*"))) < 4:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the ranks never looped"
            time.sleep(0.05)
        subprocess.run(["ip", "-n", df.fleet.hosts[1].ns, "link", "set", "eth0", "down"], check=True, timeout=10)
        out = df.finish(procs, timeout_s=60)
    for last in _verdicts(out, (0, 1), "CollectiveTimeout peer=2 after"):
        # The engine waits a quarter timeout more when the cut came mid-op (the cut host had
        # sent in it: weak evidence), then mccld up to 2 s for a peer's verdict.
        assert float(last.split()[3]) < STALL_TIMEOUT_S * 1.25 + 3.0, f"too late: {last}"
        assert "host h1, ranks [2, 3]" in last and df.fleet.hosts[1].addr in last, last


@pytest.mark.fleet
@pytest.mark.timeout(120)
def test_recv_from_another_host_that_never_sends_times_out_naming_the_peer():
    skip_unless_fleet()
    with DaemonFleet(2) as df:
        out = df.ranks("recv_stalls", [0, 0, 1, 1], timeout_s=60)
    for last in _verdicts(out, (0, 1, 2, 3), "CollectiveTimeout peer=0 after"):
        assert "rank 3's recv from rank 0 (tag 11" in last, last
    assert float(last.split()[3]) < STALL_TIMEOUT_S + 3.0, last


@pytest.mark.fleet
@pytest.mark.timeout(120)
def test_any_source_recv_matched_on_its_host_does_not_time_out_the_job_later():
    """An any-source recv matched by a send from its own host, then the job idle: the
    daemon's deadline-free mailbox receive must not time out the job, nor hold up its close."""
    skip_unless_fleet()
    with DaemonFleet(2) as df:
        out = df.ranks("any_source_local", [0, 0, 1, 1], timeout_s=60)
    _verdicts(out, (0, 1, 2, 3), "ok")


def _state(pid: int) -> str:
    deadline = time.monotonic() + 30
    while True:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T" or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


# -- rank programs (run inside the namespaces) --------------------------------------------------
def _collectives(rank: int, world: int) -> str:
    from support import daemon as t
    return t.rank_all_collectives(rank, world)


def _ddp(rank: int, world: int) -> str:
    """A few DDP steps (bucketed all-reduces, initial broadcast); prints the final parameters."""
    import datetime
    import torch
    import torch.distributed as dist
    import libmccl
    libmccl.register()
    torch.manual_seed(0)
    dist.init_process_group("mccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if rank != 0:  # DDP must broadcast rank 0's initial weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(rank))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(5):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    dist.barrier()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    dist.destroy_process_group()
    return json.dumps([round(float(v), 5) for v in flat])


def _one_dies(rank: int, world: int) -> str:
    import numpy as np
    from support import daemon as t
    from mccl_common.errors import MCCLError
    comm, _store = t.connect(rank, world, comm_id=0xdead03, timeout_s=40)
    a = np.ones(4096, dtype=np.float32)
    comm.wait(comm.allreduce(a.ctypes.data, a.size, 0, 0), 20)
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        for _ in range(3):
            comm.wait(comm.allreduce(a.ctypes.data, a.size, 0, 0), 30)
    except MCCLError as e:
        print(str(e))
        return f"{type(e).__name__} after {time.monotonic() - started:.2f}s"
    return "no error"


def _stalls(rank: int, world: int) -> str:
    """Training steps; rank 3 stops itself (SIGSTOP) after two of them."""
    import numpy as np
    from support import daemon as t
    from mccl_common.errors import MCCLError
    from support.p2p import verdict
    comm, _store = t.connect(rank, world, comm_id=0xdead04, timeout_s=STALL_TIMEOUT_S)
    grads = np.ones(1 << 16, dtype=np.float32)
    for step in range(20):
        if rank == 3 and step == 2:
            os.kill(os.getpid(), signal.SIGSTOP)
        started = time.monotonic()
        try:
            comm.wait(comm.allreduce(grads.ctypes.data, grads.size, 0, 0), 60)
        except MCCLError as e:
            return verdict(e, started)
    return "no error"


def _loops(rank: int, world: int) -> str:
    """All-reduces until one fails (the test cuts a link); a marker file once looping."""
    import numpy as np
    from support import daemon as t
    from mccl_common.errors import MCCLError
    from support.p2p import verdict
    comm, _store = t.connect(rank, world, comm_id=0xdead07, timeout_s=STALL_TIMEOUT_S)
    grads = np.ones(1 << 16, dtype=np.float32)
    for step in range(100_000):
        started = time.monotonic()
        try:
            comm.wait(comm.allreduce(grads.ctypes.data, grads.size, 0, 0), 60)
        except MCCLError as e:
            return verdict(e, started)
        if step == 1:
            Path(os.environ["MCCL_TEST_MARKERS"], f"looping.{rank}").touch()
    return "no error"


def _recv_stalls(rank: int, world: int) -> str:
    """Rank 3 waits for a message rank 0 (another host) never sends."""
    from support import daemon as t
    from support.p2p import recv_never_matched
    comm, _store = t.connect(rank, world, comm_id=0xdead05, timeout_s=STALL_TIMEOUT_S)
    return recv_never_matched(comm, rank, 3, 0, STALL_TIMEOUT_S)


def _any_source_local(rank: int, world: int) -> str:
    import numpy as np
    from support import daemon as t
    comm, _store = t.connect(rank, world, comm_id=0xdead06, timeout_s=STALL_TIMEOUT_S)
    box = np.zeros(1, dtype=np.int64)
    if rank == 0:
        comm.wait(comm.recv(box.ctypes.data, 8, -1, 1), 30)
        assert box[0] == 1
    elif rank == 1:
        time.sleep(2.0)                  # rank 0's any-source recv waits at its daemon by now
        box[0] = 1
        comm.wait(comm.send(box.ctypes.data, 8, 0, 1), 30)
    time.sleep(2.5 * STALL_TIMEOUT_S)    # no p2p at all for longer than the job timeout
    x = np.ones(4, dtype=np.float32)
    comm.wait(comm.allreduce(x.ctypes.data, 4, 0, 0), 30)
    assert (x == world).all()
    comm.shutdown(10)
    return "ok"


def _pipelined(rank: int, world: int) -> str:
    from support import pipelined as t
    return t.rank_pipelined(rank, world)


LATE_JOIN_S = 3.5   # host h1's ranks join this long after h0's: past the job's 2 s timeout


def _late_host(rank: int, world: int) -> str:
    """A 2 s job whose second host's ranks reach their mccld 3.5 s after the first's (a loaded
    machine, a slow import), past the store's rendezvous."""
    import numpy as np
    from support import daemon as t
    from libmccl.daemon.attach import Attachment
    if rank >= 2:
        call = Attachment.call

        def late_call(self, msg, timeout_s, *args, **kwargs):
            if msg.get("type") == "join":
                time.sleep(LATE_JOIN_S)
            return call(self, msg, timeout_s, *args, **kwargs)
        Attachment.call = late_call
    comm, _store = t.connect(rank, world, comm_id=0xdead0a, timeout_s=2.0)
    a = np.full(1 << 16, rank + 1, dtype=np.float32)
    comm.wait(comm.allreduce(a.ctypes.data, a.size, 0, 0), 20)
    assert (a == sum(range(1, world + 1))).all(), a[:4]
    comm.shutdown(10)
    return "ok"


PROGRAMS = {"late_host": _late_host, "collectives": _collectives, "pipelined": _pipelined, "ddp": _ddp, "one_dies": _one_dies, "stalls": _stalls,
            "recv_stalls": _recv_stalls, "any_source_local": _any_source_local, "loops": _loops}

if __name__ == "__main__":
    fn, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(PROGRAMS[fn](rank, world), flush=True)
