"""mcclctl run's recruiter (mcclctl/recruit.py) with a fake fleet: it leases idle hosts only while
the run is below its maximum, skips hosts the run holds, backs off from a host that refused,
and hands back what it opened but nobody took when stopped."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from mccl_common.errors import MCCLError
from mcclctl.recruit import Recruiter

pytestmark = pytest.mark.timeout(30)


@dataclass(frozen=True)
class H:
    name: str


class FakeLease:
    def __init__(self, host: str):
        self.host = host


def _until(pred, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("not reached")


def test_leases_idle_hosts_up_to_the_maximum_and_backs_off_from_a_refusal():
    opened, lock = [], threading.Lock()

    def open_lease(h):
        with lock:
            opened.append(h.name)
        if h.name == "b":
            raise MCCLError("[launch] b: busy")
        return FakeLease(h.name)

    r = Recruiter(lambda: [H("a"), H("b"), H("c"), H("d")], open_lease, n_max=2, every_s=0.05)
    r.active({"a"})
    r.start()
    try:
        got = _until(r.take)
        assert [(h.name, lease.host) for h, lease in got] == [("c", "c")]   # a is held, b refused
        r.active({"a", "c"})            # the run took c: at its maximum, nothing more is leased
        time.sleep(0.3)
        assert r.take() == []
        r.active({"a"})                 # c left: b is still cooling down, so d
        got = _until(r.take)
        assert [h.name for h, _ in got] in (["c"], ["d"])
        with lock:
            assert opened.count("b") == 1, opened
    finally:
        r.stop()


def test_stop_hands_back_what_nobody_took_and_a_failing_search_is_not_fatal():
    calls = []

    def find():
        calls.append(1)
        if len(calls) == 1:
            raise MCCLError("[mcclctl] no daemon answered")
        return [H("x")]

    opened = []
    r = Recruiter(find, lambda h: opened.append(h.name) or FakeLease(h.name), n_max=1, every_s=0.05).start()
    try:
        _until(lambda: opened)
        time.sleep(0.3)         # opened but not taken: it counts, so x is not leased twice
    finally:
        left = r.stop()
    assert len(calls) == 2 and opened == ["x"]
    assert [h.name for h, _ in left] == ["x"]
    assert r.take() == []
