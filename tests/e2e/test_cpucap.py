"""tools/cpucap.py, the emulator's slow hosts (issue 37 item 3): a cgroup's CPU quota holds a
busy process back (the kernel's throttle counter says so), idle priority is set, bad caps are
refused, and removing a group hands its processes back. Root only (it creates cgroups)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from mccl_common.errors import ConfigError

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creating a cgroup needs root")
pytestmark = [needs_root, pytest.mark.timeout(60)]


def _group(name: str):
    from tools.cpucap import CpuGroup

    try:
        return CpuGroup(name)
    except ConfigError as e:
        pytest.skip(str(e))


def _busy() -> subprocess.Popen:
    # One process, no children: a cgroup takes the process it is given, not what it forked before.
    return subprocess.Popen(["sh", "-c", "while :; do :; done"])


def _wait_throttled(g, above: float, deadline_s: float = 30.0) -> float:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        held = g.throttled_s()
        if held > above:
            return held
        time.sleep(0.05)
    return g.throttled_s()


def test_a_capped_group_is_throttled_and_removing_it_hands_its_processes_back():
    g = _group(f"mccl-bench-test-{os.getpid()}")
    p = _busy()
    try:
        g.set(0.1, idle=False)
        g.add(p.pid)
        assert str(p.pid) in (g.path / "cgroup.procs").read_text().split()
        # A busy loop allowed 1 ms of every 10 ms is held back as soon as it spins: an event
        # the kernel counts, whatever else the machine is doing.
        assert _wait_throttled(g, 0.0) > 0.0
        g.set(None, idle=True)
        idle = g.path / "cpu.idle"
        if idle.exists():
            assert idle.read_text().strip() == "1"
    finally:
        g.remove()
        p.kill()
        p.wait()
    assert not g.path.exists()


def test_a_cap_below_the_kernels_floor_is_refused_naming_it():
    g = _group(f"mccl-bench-test-{os.getpid()}-floor")
    try:
        with pytest.raises(ConfigError, match="below the kernel's floor"):
            g.set(0.05, idle=False)
    finally:
        g.remove()


def test_caps_start_at_their_step_when_the_rank_reports_it(tmp_path):
    from tools.cpucap import Cap, CpuCaps

    caps = CpuCaps({1: Cap(cores=0.1, at=5)}, str(tmp_path), tag=f"mccl-bench-test-{os.getpid()}-caps")
    p = _busy()
    try:
        caps.add(0, os.getpid())            # host 0 is not capped: nothing happens
        caps.add(1, p.pid)
        caps.start()
        g = caps.groups[1]
        before = g.throttled_s()
        open(caps.marker(1), "w").close()   # what the rank of host 1 does at step 5
        assert _wait_throttled(g, before) > before
        caps.reset()                        # the next variant starts uncapped until its step 5
        assert not os.path.exists(caps.marker(1))
    finally:
        caps.close()
        p.kill()
        p.wait()
    assert not caps.groups[1].path.exists()
