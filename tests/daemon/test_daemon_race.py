"""Two mccld started at the same moment on one runtime dir, with the same host id (issue 11):
exactly one serves, the other stops with an error naming it, and the loser's way out
leaves the winner's socket and token alone, so the winner's clients work."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from support.daemon import daemon_env
from support.daemon import stop_process
from mccl_common.errors import ConfigError
from mccl_common import attach_protocol as protocol
from mccld.attach import local_request
from mccl_common.daemon_settings import load_config
from mccld.daemon import Daemon

TRIALS = 10


def start_two_at_once(env: dict) -> tuple[list[Daemon], list[BaseException]]:
    daemons = [Daemon(load_config(env=env)) for _ in range(2)]
    barrier = threading.Barrier(2)
    started: list[Daemon] = []
    errors: list[BaseException] = []

    def go(d: Daemon) -> None:
        barrier.wait()
        try:
            started.append(d.start())
        except BaseException as e:  # noqa: BLE001 - judged by the caller
            errors.append(e)
    threads = [threading.Thread(target=go, args=(d,)) for d in daemons]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return started, errors


@pytest.mark.timeout(300)
def test_two_daemons_started_at_once_one_serves_and_the_other_leaves_its_files_alone():
    for trial in range(TRIALS):
        rdir = Path(tempfile.mkdtemp(prefix="mccl-race-"))
        started, errors = start_two_at_once(daemon_env(rdir))
        try:
            assert len(started) == 1 and len(errors) == 1, (trial, started, errors)
            err = errors[0]
            assert isinstance(err, ConfigError) and f"pid {os.getpid()}" in str(err), (trial, err)
            token = (rdir / protocol.TOKEN_NAME).read_text().strip()
            assert token == started[0].attach._token, f"trial {trial}: the token on disk is not the winner's"
            status = local_request(rdir, {"type": "status"})["status"]
            assert status["host"] == started[0].host_id
        finally:
            for d in started:
                d.stop()
            for p in rdir.iterdir():
                p.unlink()
            rdir.rmdir()


@pytest.mark.timeout(60)
def test_the_runtime_dir_is_free_again_once_its_daemon_stopped():
    rdir = Path(tempfile.mkdtemp(prefix="mccl-race-"))
    env = daemon_env(rdir)
    try:
        for _ in range(2):
            d = Daemon(load_config(env=env)).start()
            assert local_request(rdir, {"type": "status"})["ok"]
            d.stop()
    finally:
        for p in rdir.iterdir():
            p.unlink()
        rdir.rmdir()


@pytest.mark.timeout(240)
def test_two_mccld_processes_started_at_once_the_loser_exits_naming_the_winner(tmp_path):
    for trial in range(3):
        rdir = tmp_path / f"rt{trial}"
        env = {**os.environ, **daemon_env(rdir)}
        logs = [open(tmp_path / f"mccld-{trial}-{i}.log", "w+") for i in range(2)]
        procs = [subprocess.Popen([sys.executable, "-m", "mccld"], env=env, stderr=log) for log in logs]
        try:
            deadline = time.monotonic() + 60
            while all(p.poll() is None for p in procs):
                assert time.monotonic() < deadline, f"trial {trial}: both mccld kept running"
                time.sleep(0.1)
            lost = next(i for i, p in enumerate(procs) if p.poll() is not None)
            loser, winner = procs[lost], procs[1 - lost]
            logs[lost].seek(0)
            err = logs[lost].read()
            assert loser.returncode == 2 and f"pid {winner.pid} holds" in err, (trial, loser.returncode, err)
            while not (rdir / protocol.TOKEN_NAME).exists():
                assert winner.poll() is None and time.monotonic() < deadline, f"trial {trial}: the winner died"
                time.sleep(0.1)
            assert local_request(rdir, {"type": "status"}, timeout_s=10.0)["ok"]
        finally:
            for p in procs:
                stop_process(p)
            for log in logs:
                log.close()
