"""The device-ordering protocol (libmccl.devices.device_order) through the backend, on the fake
device (libmccl.devices.fake_device): ranks are threads, each a ProcessGroupMCCL with its own
fake device whose stream runs every command after a seeded random pause.

A rank's step is what DDP does on an accelerator: a "backward" kernel writes each bucket
and the bucket's all-reduce is issued right behind it (O1 inside the call); Work.wait()
orders the stream after the result (O2); an "optimizer" kernel then reads every bucket.
The negative controls remove one piece of the protocol each and must fail with the
fake device's named error, not merely with a wrong number.
"""

from __future__ import annotations

import ctypes
import datetime
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from libmccl.devices import device_tensors
from libmccl.torch.backend import ProcessGroupMCCL
from libmccl.devices.device_order import (TICKET_BASE, DeviceOrderError, DeviceRace, ForeignThreadCommit, OrderedOp,
                                  UncommittedCommands)
from mccl_common.errors import AbortedError, ConfigError, MCCLError
from libmccl.devices.fake_device import FakeDevice
from support.engine import run_threads

from support import device_order_mutants as M


WORLD = 2


def _groups(world: int, timeout_s: float = 30.0):
    store = dist.HashStore()
    return run_threads(world, lambda r: ProcessGroupMCCL(dist.PrefixStore("d/", store), r, world,
                                                         datetime.timedelta(seconds=timeout_s)))


@pytest.fixture
def groups():
    made: list = []

    def make(world: int = WORLD, timeout_s: float = 30.0):
        made.extend(_groups(world, timeout_s))
        return made

    yield make
    for pg in made:
        pg.shutdown()


def _device_tensor(fake: FakeDevice, numel: int) -> torch.Tensor:
    addr = fake.alloc(numel * 4)
    return torch.frombuffer((ctypes.c_char * (numel * 4)).from_address(addr), dtype=torch.float32)


def _span(t: torch.Tensor) -> tuple[int, int]:
    return (t.data_ptr(), t.numel() * t.element_size())


def _step(pg, fake: FakeDevice, buckets: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One rank's step; returns what the optimizer kernel read from each bucket."""
    try:
        works = []
        for k, (b, g) in enumerate(zip(buckets, grads)):
            fake.launch(None, lambda b=b, g=g: b.copy_(g), [_span(b)], f"backward writes bucket {k}")
            works.append(pg.allreduce([b]))
        for w in works:
            w.wait()
        read = [torch.empty_like(g) for g in grads]
        for k, b in enumerate(buckets):
            fake.launch(None, lambda k=k, b=b: read[k].copy_(b), [_span(b)], f"optimizer reads bucket {k}")
        fake.commit(None)
        fake.synchronize()
        return read
    except MCCLError:
        fake.synchronize()  # the device's own error (the cause) first, if it saw one
        raise


def _run(pgs, seed: int, sizes: list[int], unified: bool = True, jitter_s: float = 5e-4):
    """One jittered step on every rank; checks the optimizer read the exact sums."""
    grads = [[torch.from_numpy(np.random.default_rng(seed * 7 + r * 101 + k).integers(-1000, 1000, n)
                               .astype(np.float32)) for k, n in enumerate(sizes)] for r in range(len(pgs))]

    def rank_fn(r: int):
        fake = FakeDevice(seed=seed * 13 + r, max_jitter_s=jitter_s, unified=unified)
        device_tensors.install(fake)
        try:
            buckets = [_device_tensor(fake, n) for n in sizes]
            return _step(pgs[r], fake, buckets, grads[r])
        except MCCLError as exc:
            return exc
        finally:
            device_tensors.uninstall(fake)
            fake.close()

    reads = run_threads(len(pgs), rank_fn)
    errors = [e for e in reads if isinstance(e, BaseException)]
    # The device's error is the cause; the peers' errors (lost op, abort) are its echo.
    for e in sorted(errors, key=lambda e: not isinstance(e, DeviceOrderError)):
        raise e
    for k in range(len(sizes)):
        want = sum(grads[r][k] for r in range(len(pgs)))
        for r in range(len(pgs)):
            assert torch.equal(reads[r][k], want), (seed, r, k)


# -- the protocol's pieces --------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_each_op_has_its_own_words_starting_at_the_base() -> None:
    fake = FakeDevice(seed=1)
    try:
        ops = [OrderedOp(fake, fake.alloc(64), 64, f"op {i}") for i in range(3)]
        words = {t.address for op in ops for t in (op.ready, op.done, op.released)}
        assert len(words) == 9
        assert all(t.value == TICKET_BASE for op in ops for t in (op.ready, op.done, op.released))
        for op in ops:
            op.abandon()
    finally:
        fake.close()


def test_poison_passes_a_cyclic_device_wait() -> None:
    """CUDA's GEQ wait compares (int64)(word - target) >= 0: with targets above 2^63 the
    engine's poison (2^64-1) releases it, and the initial value does not."""
    def passes(word: int, target: int) -> bool:
        d = (word - target) % (1 << 64)
        return d < (1 << 63)

    poison = (1 << 64) - 1
    for n in (1, 4096, 1 << 40, (1 << 62)):
        target = TICKET_BASE + n
        assert passes(poison, target) and passes(target, target) and not passes(TICKET_BASE, target)
    assert not passes(poison, 4096)  # why the base: from 0 a poisoned word would hold the GPU forever


@pytest.mark.timeout(30)
def test_ready_is_raised_only_after_the_kernels_before_it() -> None:
    fake = FakeDevice(seed=3, max_jitter_s=0.01)
    try:
        addr = fake.alloc(64)
        ran = []
        fake.launch(None, lambda: ran.append("kernel"), [(addr, 64)], "writes the bucket")
        op = OrderedOp(fake, addr, 64, "test")
        op.launch(None)
        op.ready.wait(op.target, 10.0)
        assert ran == ["kernel"]
        op.done.signal(op.target)  # the engine's part
        op.finish(None)
        op.finish(None)  # once per op
        fake.synchronize()
        assert op.reusable()
    finally:
        fake.close()


@pytest.mark.timeout(30)
def test_a_poisoned_done_releases_the_stream_and_the_cpu(groups) -> None:
    pgs = groups(2, timeout_s=30.0)
    fake = FakeDevice(seed=5)
    device_tensors.install(fake)
    try:
        b = _device_tensor(fake, 1000)
        w = pgs[0].allreduce([b])  # rank 1 never joins: only an abort ends it
        w.get_future()  # O2 queued: the stream now waits for done
        pgs[0].abort()
        with pytest.raises(AbortedError):
            w.wait()
        fake.synchronize(timeout_s=10.0)  # the stream's wait was released by the poison
    finally:
        device_tensors.uninstall(fake)
        fake.close()


@pytest.mark.timeout(60)
def test_wake_fn_wakes_a_waiter_after_a_write_that_cannot() -> None:
    """What a GPU stream write followed by cuLaunchHostFunc(mccl_ticket_wake) does: the
    sleeping waiter returns at once instead of at its next 2 ms look at the word."""
    import statistics
    import threading
    import time

    from libmccl import _core

    wake = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_core.Ticket.WAKE_FN)

    def latency(with_wake: bool) -> float:
        t = _core.Ticket()
        woke: list[float] = []
        th = threading.Thread(target=lambda: (t.wait(1, 10.0), woke.append(time.perf_counter())))
        th.start()
        time.sleep(0.01)  # past its spinning, asleep on the word
        start = time.perf_counter()
        ctypes.c_uint64.from_address(t.address).value = 1  # a write that wakes no one
        if with_wake:
            wake(t.address)
        th.join(5)
        return woke[0] - start

    plain = statistics.median(latency(False) for _ in range(25))
    woken = statistics.median(latency(True) for _ in range(25))
    assert woken < plain, (woken, plain)


@pytest.mark.timeout(60)
def test_cuda_ops_without_a_driver_name_what_is_missing() -> None:
    from libmccl.devices import cuda_ops

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(ConfigError, match=r"\[cuda\] the CUDA driver library \(libcuda.so.1\) was not found"):
            cuda_ops.CudaOps(0)
    else:
        pytest.skip("this host has a CUDA driver: scripts/cuda_check.py covers it")


# -- jittered runs through the engine ---------------------------------------------------------------

@pytest.mark.timeout(240)
def test_seeded_jittered_runs_are_exact(groups) -> None:
    pgs = groups()
    for seed in range(200):
        rnd = random.Random(seed)
        sizes = [rnd.choice([1, 7, 1000, 40_000, 300_000]) for _ in range(rnd.randint(1, 3))]
        _run(pgs, seed, sizes, unified=seed % 2 == 0)


@pytest.mark.timeout(60)
def test_a_group_of_one_leaves_device_tensors_on_their_stream(groups) -> None:
    """World size 1 runs no engine (solo_comm): the all-reduce is the identity, done at
    once, and the tensor's stream still orders the optimizer after the backward."""
    pgs = groups(1)
    for seed in range(3):
        _run(pgs, seed, [1, 1000, 40_000])


# -- negative controls: each missing piece fails with its named error ------------------------------

def _control(groups, monkeypatch, patch, error, sizes=(5000, 5000, 5000), timeout_s=30.0, seeds=range(3)):
    pgs = groups(timeout_s=timeout_s)
    patch(monkeypatch)
    with pytest.raises(error):
        for seed in seeds:
            _run(pgs, seed, list(sizes))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("patch, error, timeout_s", [
    (M.drop_o1, DeviceRace, 30.0), (M.drop_o2, DeviceRace, 30.0), (M.skip_commit, UncommittedCommands, 2.0),
    (M.o2_on_completion_thread, ForeignThreadCommit, 30.0), (M.share_counter, DeviceRace, 30.0)],
    ids=["drop-O1", "drop-O2", "skip-commit", "O2-on-completion-thread", "shared-counter"])
def test_each_broken_protocol_fails_with_its_named_error(groups, monkeypatch, patch, error, timeout_s) -> None:
    pgs = groups(timeout_s=timeout_s)
    patch(monkeypatch)
    with pytest.raises(error):
        for seed in range(3):
            _run(pgs, seed, [5000, 5000, 5000])

# The autouse leak check (conftest._no_leaks) is off for this module: the process groups in this module outlive the check in their fixtures, and a shut-down communicator keeps its progress wake pipe until the object is destroyed (its threads and the helper threads' pipes go at shutdown).
pytestmark = pytest.mark.leaks_ok
