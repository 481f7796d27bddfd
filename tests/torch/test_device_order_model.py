"""Every interleaving of the ordering protocol for 1 to 3 buckets, on the fake device in
manual mode (its stream runs one command when told to).

Three actors, each a deterministic sequential program:
- the caller (PyTorch's thread): per bucket, a backward kernel that writes the bucket and
  the collective's O1 (``OrderedOp.launch``); then per bucket Work.wait(): O2
  (``OrderedOp.finish``) and the CPU's wait for the engine; then an optimizer kernel per
  bucket that copies the result out, and a commit;
- the stream: the committed commands, in order; a wait runs only once its ticket allows;
- the engine (its own thread, as the real one): per bucket, once ``ready`` covers it, reads
  the bucket (an access the fake device checks against queued device work), writes the
  all-reduced result (2x: a world of two identical ranks), then raises ``done``.

Because each actor is deterministic, a global state is its three program counters, and
the checks (the fake device's race and thread guards, the final values) depend only on
the state and the step taken. Exploring every reachable state and every step from it
therefore covers every interleaving. The same search finds each negative control's
named error.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable

import pytest

from support import device_order_mutants as M

from libmccl.devices.device_order import DeviceOrderError, DeviceRace, ForeignThreadCommit, OrderedOp, UncommittedCommands
from libmccl.devices.fake_device import FakeDevice

N = 4  # float32 elements per bucket: the values matter, not the size


class _World:
    """One replayable run: the fake device, the buckets and the three actors' programs."""

    def __init__(self, buckets: int, unified: bool, engine_finishes: bool = False) -> None:
        self.dev = FakeDevice(manual=True, unified=unified)
        self.mem = [self.dev.alloc(4 * N) for _ in range(buckets)]
        self.out = [(ctypes.c_float * N)() for _ in range(buckets)]
        self.ops: list[OrderedOp] = []
        self.engine_finishes = engine_finishes
        self.caller = self._caller_program(buckets)
        self.engine = self._engine_program(buckets)
        self.pc = [0, 0, 0]  # caller, stream, engine

    def _floats(self, addr: int) -> ctypes.Array:
        return (ctypes.c_float * N).from_address(addr)

    def _caller_program(self, buckets: int) -> list[Callable[[], bool]]:
        prog: list[Callable[[], bool]] = []
        for k in range(buckets):
            def issue(k=k) -> bool:
                span = [(self.mem[k], 4 * N)]
                self.dev.launch(None, lambda: self._floats(self.mem[k]).__setitem__(slice(0, N), [k + 1.0] * N),
                                span, f"backward writes bucket {k}")
                op = OrderedOp(self.dev, self.mem[k], 4 * N, f"bucket {k}")
                self.ops.append(op)
                op.launch(None)
                return True
            prog.append(issue)
        for k in range(buckets):
            if not self.engine_finishes:
                prog.append(lambda k=k: (self.ops[k].finish(None), True)[1])
            # Work.wait() returns once the engine is done with the op (and raises its error)
            prog.append(lambda k=k: self.ops[k].done.value >= self.ops[k].target)
        for k in range(buckets):
            def consume(k=k) -> bool:
                src = self.mem[k]
                self.dev.launch(None, lambda: ctypes.memmove(self.out[k], src, 4 * N), [(src, 4 * N)],
                                f"optimizer reads bucket {k}")
                self.dev.commit(None)
                return True
            prog.append(consume)
        return prog

    def _engine_program(self, buckets: int) -> list[Callable[[], bool]]:
        prog: list[Callable[[], bool]] = []
        for k in range(buckets):
            def reduce(k=k) -> bool:
                if k >= len(self.ops) or self.ops[k].ready.value < self.ops[k].target:
                    return False
                op = self.ops[k]
                self.dev.cpu_access(op.buffer, op.nbytes, f"the engine on bucket {k}")
                buf = self._floats(op.buffer)
                buf[:] = [2 * v for v in buf]
                return True

            def done(k=k) -> bool:
                op = self.ops[k]
                op.done.signal(op.target)
                if self.engine_finishes:  # the bug: O2 encoded by the engine's thread
                    op.finish(None)
                return True
            prog += [reduce, done]
        return prog

    def step(self, actor: int) -> bool:
        """Runs one step of an actor; False if it cannot move now."""
        if actor == 1:
            ran = self.dev.run_next()
        else:
            prog = self.caller if actor == 0 else self.engine
            if self.pc[actor] >= len(prog):
                return False
            if actor == 0:
                ran = prog[self.pc[0]]()
            else:  # on a thread of its own, like the engine, so the thread guard sees it
                box: list = []

                def body() -> None:
                    try:
                        box.append(prog[self.pc[2]]())
                    except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
                        box.append(exc)
                th = threading.Thread(target=body)
                th.start()
                th.join(10)
                if isinstance(box[0], BaseException):
                    raise box[0]
                ran = box[0]
        if ran:
            self.pc[actor] += 1
        return ran

    def finished(self) -> bool:
        return self.pc[0] == len(self.caller) and self.pc[2] == len(self.engine) and not self.dev._queued


def _replay(path: list[int], buckets: int, unified: bool, **kw) -> _World:
    w = _World(buckets, unified, **kw)
    for a in path:
        assert w.step(a)
    return w


def explore(buckets: int, unified: bool, **kw) -> int:
    """Visits every reachable state and takes every step from it; raises the first
    protocol error found. Returns the number of states."""
    seen = {(0, 0, 0)}
    frontier: list[list[int]] = [[]]
    while frontier:
        path = frontier.pop()
        moved = False
        for actor in (0, 1, 2):
            w = _replay(path, buckets, unified, **kw)
            if not w.step(actor):
                continue
            moved = True
            if tuple(w.pc) not in seen:
                seen.add(tuple(w.pc))
                frontier.append(path + [actor])
        if not moved:
            _check_end(_replay(path, buckets, unified, **kw), buckets)
    return len(seen)


def _check_end(w: _World, buckets: int) -> None:
    if not w.finished():
        w.dev.synchronize()  # names encoded commands that were never committed
        raise DeviceOrderError(f"deadlock at {w.pc}")
    for k in range(buckets):
        assert list(w.out[k]) == [2.0 * (k + 1)] * N, (k, list(w.out[k]))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("unified", [True, False], ids=["unified", "staged"])
@pytest.mark.parametrize("buckets", [1, 2, 3])
def test_every_interleaving_is_race_free_and_exact(buckets: int, unified: bool) -> None:
    states = explore(buckets, unified)
    assert states > 10 * buckets  # the search did branch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("patch, error", [(M.drop_o1, DeviceRace), (M.drop_o2, DeviceRace),
                                          (M.skip_commit, UncommittedCommands), (M.share_counter, DeviceRace)],
                         ids=["drop-O1", "drop-O2", "skip-commit", "shared-counter"])
def test_each_broken_protocol_is_found(patch, error, monkeypatch) -> None:
    patch(monkeypatch)
    with pytest.raises(error):
        explore(2, unified=True)


@pytest.mark.timeout(120)
def test_o2_from_the_engine_thread_is_found() -> None:
    with pytest.raises(ForeignThreadCommit):
        explore(2, unified=True, engine_finishes=True)
