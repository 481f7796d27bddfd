"""mcclctl run's lease loop (run_job) with fake leases: a host whose mccld goes silent (a cut
cable sends no reset) is lost after LEASE_TIMEOUT_S: the job ends everywhere, or, in an
elastic run, goes on without it; a host that fails in an elastic run is out, not fatal."""

from __future__ import annotations

import socket
import threading

import pytest

import mcclctl.run as run
from mccl_common.errors import DaemonUnavailableError

pytestmark = pytest.mark.timeout(30)


class FakeLease:
    """A lease whose host speaks when the test says: one byte on a socketpair per event."""

    def __init__(self) -> None:
        self._mine, self._theirs = socket.socketpair()
        self._events: list = []
        self._lock = threading.Lock()
        self.cancelled = self.closed = False

    def say(self, event: str, data=None) -> None:
        with self._lock:
            self._events.append((event, data))
        self._theirs.send(b"x")

    def read(self):
        self._mine.recv(1)
        with self._lock:
            return self._events.pop(0)

    def fileno(self) -> int:
        return self._mine.fileno()

    def buffered(self) -> bool:
        return False

    def beat(self) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled = True
        self.say("exit", {"code": -15})

    def settimeout(self, seconds: float) -> None:
        self._mine.settimeout(seconds)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._mine.close()
            self._theirs.close()


def _hosts(*names):
    return [run.Host(n, "127.0.0.1", 1, "idle", 2, 1 << 30, "cpu") for n in names]


@pytest.fixture
def leases(monkeypatch):
    made: dict[str, FakeLease] = {}

    def open_lease(h, key, request):
        made[h.name] = FakeLease()
        return made[h.name]
    monkeypatch.setattr(run, "open_lease", open_lease)
    monkeypatch.setattr(run, "LEASE_TIMEOUT_S", 0.6)
    monkeypatch.setattr(run, "BEAT_S", 0.2)
    yield made
    for lease in made.values():
        lease.close()


def test_a_silent_host_ends_a_fixed_size_job_everywhere(leases):
    lines = []
    with pytest.raises(DaemonUnavailableError, match=r"lost the lease on h2: no word from its mccld for 1 s"):
        run.run_job(_hosts("h1", "h2"), b"k", {}, lambda h, s, line: lines.append((h, line)),
                    check=lambda: leases["h1"].say("out", "step"))     # h1 talks, h2 is silent
    assert leases["h1"].cancelled and leases["h2"].cancelled          # every host's job is stopped


def test_an_elastic_job_goes_on_without_a_silent_or_failed_host(leases):
    lines, turns = [], [0]

    def talk():
        turns[0] += 1
        if turns[0] == 1:
            leases["h3"].say("exit", {"code": 1})                  # h3's torchrun failed
        elif turns[0] < 8:
            leases["h1"].say("out", "step")                        # h2 stays silent
        elif turns[0] == 8:
            leases["h1"].say("exit", {"code": 0})
    results = run.run_job(_hosts("h1", "h2", "h3"), b"k", {}, lambda h, s, line: lines.append((h, line)),
                          elastic=True, check=talk)
    assert results["h1"] == 0 and results["h3"] == "failed (exit 1)", results
    assert results["h2"].startswith("lease lost: no word from its mccld"), results
    assert run.job_outcome(results) == 0
    assert any(h == "h2" and "the job goes on without it" in line for h, line in lines), lines


def test_a_reclaimed_host_leaves_an_elastic_job_that_goes_on_without_it(leases):
    lines, turns = [], [0]

    def talk():
        turns[0] += 1
        if turns[0] == 1:
            leases["h3"].say("reclaimed", {"host": "h3", "why": "its user is back"})
            leases["h3"].say("exit", {"code": -15})                # its torchrun stopping: not a failure
        elif turns[0] == 3:
            leases["h1"].say("exit", {"code": 0})
            leases["h2"].say("exit", {"code": 0})
    results = run.run_job(_hosts("h1", "h2", "h3"), b"k", {}, lambda h, s, line: lines.append((h, line)),
                          elastic=True, check=talk, n_min=2)
    assert results == {"h1": 0, "h2": 0, "h3": "reclaimed by its user"}, results
    assert run.job_outcome(results) == 0
    assert any(h == "h3" and "[mcclctl] reclaimed" in line for h, line in lines), lines


@pytest.mark.parametrize("event, data", [("reclaimed", {"host": "h2"}), ("left", {"step": 7})])
def test_a_host_handed_back_below_min_ends_the_job_everywhere_saying_why(leases, event, data):
    with pytest.raises(run.MCCLError, match=r"h2 was handed back to its user .*1 host\(s\) remain and the job "
                                            r"needs at least 2 \(--min\)"):
        run.run_job(_hosts("h1", "h2"), b"k", {}, lambda h, s, line: None,
                    elastic=False, check=lambda: leases["h2"].say(event, data), n_min=2)
    assert leases["h1"].cancelled and leases["h2"].cancelled
