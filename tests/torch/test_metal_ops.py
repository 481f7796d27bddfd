"""MetalOps (libmccl.devices.metal_ops) on Linux, over a fake of the Metal bridge's C ABI
(tests/support/fake_metal_bridge.py): every decision the Objective-C++ bridge does not make —
placement, tickets, events, listeners, the mirror, staging blits, who commits — runs here
through the real backend, ranks as threads. The bridge itself is only built on macOS."""

from __future__ import annotations

import ctypes
import datetime
import logging
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from libmccl import _core
from libmccl.devices import device_tensors, metal_tensors
from libmccl.torch.backend import ProcessGroupMCCL
from libmccl.devices.device_order import TICKET_BASE, ForeignThreadCommit, OrderedOp
from mccl_common.errors import ConfigError
from libmccl.devices.metal_ops import PRIVATE, SHARED, CBridge, MetalDevice, MetalOps
from support.fake_metal_bridge import FakeBridge
from support.engine import run_threads


WORLD = 2


class _Installed:
    """Routes CPU tensors over one fake bridge's buffers through its MetalDevice, as
    metal_tensors does for mps tensors (device_tensors' hook for fakes: ``owns``)."""

    def __init__(self, bridge: FakeBridge, dev: MetalDevice) -> None:
        self.bridge, self.dev = bridge, dev
        self.placed: list[str] = []

    def tensor(self, numel: int, mode: int) -> torch.Tensor:
        handle, host = self.bridge.new_buffer(numel * 4, mode)
        t = torch.frombuffer((ctypes.c_char * (numel * 4)).from_address(host), dtype=torch.float32)
        t._mccl_buffer = handle  # what torch's MPS storage pointer would be
        return t


def _groups(world: int):
    store = dist.HashStore()
    return run_threads(world, lambda r: ProcessGroupMCCL(dist.PrefixStore("m/", store), r, world,
                                                         datetime.timedelta(seconds=20)))


@pytest.fixture
def groups():
    pgs = _groups(WORLD)
    yield pgs
    for pg in pgs:
        pg.shutdown()


@pytest.fixture
def routed(monkeypatch):
    """device_tensors.ordered sends our fake-bridge tensors to MetalDevice.place."""
    owners: dict[int, _Installed] = {}
    real_ordered = device_tensors.ordered

    def ordered(t, name, blocks, on_lost):
        inst = owners.get(t.data_ptr())
        if inst is None:
            return real_ordered(t, name, blocks, on_lost)
        # torch's mps data_ptr is the MTLBuffer id plus the byte offset (0 here)
        ops, addr, note = inst.dev.place(t._mccl_buffer, t._mccl_buffer, t.numel() * 4, name)
        inst.placed.append("in place" if ops.unified else "staged")
        op = OrderedOp(ops, addr, t.numel() * 4, f"{name} on fake mps", blocks)
        device_tensors._ledger(ops).add(op)
        return device_tensors.DeviceSide(op, None, [t], on_lost)

    monkeypatch.setattr(device_tensors, "ordered", ordered)
    monkeypatch.setattr(device_tensors, "on_a_stream", lambda t: t.data_ptr() in owners)
    return owners


def _rank_step(pg, bridge: FakeBridge, inst: _Installed, owners, grads: list[np.ndarray], mode: int,
               late_writes: bool = False) -> list[np.ndarray]:
    """``late_writes``: the GPU runs backward's write of a bucket only once the engine finished
    that bucket's all-reduce (a GPU slower than any engine), so whatever the engine read
    before it was told the truth shows, however the threads are scheduled."""
    buckets = [inst.tensor(len(g), mode) for g in grads]
    for b in buckets:
        owners[b.data_ptr()] = inst
    works: list = []

    def write(k: int, b: torch.Tensor, src: torch.Tensor) -> None:
        if late_writes:
            deadline = time.monotonic() + 30
            while not (len(works) > k and works[k].is_completed()):
                assert time.monotonic() < deadline, "the engine never finished the all-reduce"
                time.sleep(0.001)
        b.copy_(src)

    for k, (b, g) in enumerate(zip(buckets, grads)):
        src = torch.from_numpy(g)
        bridge.kernel(f"backward writes bucket {k}", lambda k=k, b=b, src=src: write(k, b, src))
        works.append(pg.allreduce([b]))  # O1 inside the call
    for w in works:
        w.wait()  # O2 on this thread
    read = [np.empty_like(g) for g in grads]
    for k, b in enumerate(buckets):
        bridge.kernel(f"optimizer reads bucket {k}", lambda k=k, b=b: read[k].__setitem__(slice(None), b.numpy()))
    bridge.commit()
    bridge.synchronize()
    return read


def _run(groups, owners, mode: int, seed: int, sizes=(1000, 70_000, 3), dev_factory=MetalDevice,
         late_writes: bool = False):
    grads = [[np.random.default_rng(seed * 11 + r * 3 + k).integers(-999, 999, n).astype(np.float32)
              for k, n in enumerate(sizes)] for r in range(WORLD)]
    insts: list = [None] * WORLD

    def rank(r: int):
        bridge = FakeBridge(seed=seed * 5 + r)
        insts[r] = _Installed(bridge, dev_factory(bridge))
        try:
            return _rank_step(groups[r], bridge, insts[r], owners, grads[r], mode, late_writes)
        finally:
            bridge.close()

    reads = run_threads(WORLD, rank)
    want = [sum(grads[r][k] for r in range(WORLD)) for k in range(len(sizes))]
    return reads, want, insts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [SHARED, PRIVATE], ids=["shared-in-place", "private-staged"])
def test_all_reduce_of_gpu_written_buckets_is_exact(groups, routed, mode) -> None:
    for seed in range(3):
        reads, want, insts = _run(groups, routed, mode, seed)
        for r in range(WORLD):
            for k, w in enumerate(want):
                assert np.array_equal(reads[r][k], w), (seed, r, k)
        assert set(insts[0].placed) == {"in place" if mode == SHARED else "staged"}


@pytest.mark.timeout(60)
def test_without_the_gpu_side_signal_the_engine_reads_before_backward_wrote(groups, routed) -> None:
    """Negative control: a signal that raises the ticket on the CPU at once, instead of from
    the GPU once the kernels before it ran, lets the engine reduce stale bytes. The GPU here
    writes only after the engine finished (late_writes; with the real signal the engine would
    wait for that very write): with the eager one each rank ends with its own gradient, not the sum
    (it failed by chance when the fake GPU's write won the race, CI 7 Dec)."""
    class EagerSignal(MetalOps):
        def signal(self, stream, ticket, value):
            ticket.signal(value)

    class EagerDevice(MetalDevice):
        def __init__(self, bridge):
            super().__init__(bridge)
            self.in_place = EagerSignal(bridge, unified=True)

    reads, want, _ = _run(groups, routed, SHARED, seed=7, sizes=(50_000,), dev_factory=EagerDevice,
                          late_writes=True)
    for r in range(WORLD):
        assert not np.array_equal(reads[r][0], want[0]), r


@pytest.mark.timeout(30)
def test_only_torchs_thread_may_encode_or_commit() -> None:
    bridge = FakeBridge()
    ops = MetalOps(bridge, unified=True)
    t = ops.new_ticket()
    errors = []

    def other():
        try:
            ops.signal(None, t, TICKET_BASE + 1)
        except ForeignThreadCommit as exc:
            errors.append(exc)

    import threading
    th = threading.Thread(target=other)
    th.start()
    th.join(10)
    bridge.close()
    assert errors and "not torch's" in str(errors[0])


@pytest.mark.timeout(30)
def test_a_poisoned_ticket_releases_the_gpu_wait_through_the_mirror() -> None:
    bridge = FakeBridge(max_jitter_s=0)
    ops = MetalOps(bridge, unified=True)
    done = ops.new_ticket()
    ran = []
    ops.wait(None, done, TICKET_BASE + 4096)
    bridge.kernel("after the wait", lambda: ran.append(1))
    ops.commit(None)
    done.poison()  # the engine failed: no GPU wait may stay pending
    bridge.synchronize()
    bridge.close()
    assert ran == [1]


@pytest.mark.timeout(30)
def test_each_ticket_has_its_own_event_and_events_are_freed_after_retiring() -> None:
    bridge = FakeBridge()
    ops = MetalOps(bridge, unified=True)
    tickets = [ops.new_ticket() for _ in range(80)]
    events = {ops._event(t) for t in tickets}
    assert len(events) == 80 and all(t.value == TICKET_BASE for t in tickets)
    for t in tickets:
        ops.retire_ticket(t)
    # The last few stay allocated a while: a listener block may still be waking their words.
    assert 0 < bridge.freed_events < 80
    bridge.close()


@pytest.mark.timeout(30)
def test_placement_in_place_for_shared_storage_staged_for_private(caplog) -> None:
    bridge = FakeBridge()
    dev = MetalDevice(bridge)
    shared, host = bridge.new_buffer(4096, SHARED)
    ops, addr, note = dev.place(shared, shared + 256, 1024, "allreduce")
    assert ops is dev.in_place and addr == host + 256 and note is None
    private, _ = bridge.new_buffer(4096, PRIVATE)
    ops, addr, note = dev.place(private, private + 512, 1024, "allreduce")
    assert ops is dev.staged and addr == private + 512 and "private" in note and "stage through blits" in note
    assert dev.place(private, private, 8, "allreduce")[2] is None  # said once
    with pytest.raises(ConfigError, match="do not fit the tensor's MTLBuffer of 4096 bytes"):
        dev.place(shared, shared + 4000, 1024, "allreduce")
    bridge.close()


@pytest.mark.timeout(30)
def test_a_missing_bridge_is_a_config_error_naming_it_and_the_fallback(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        CBridge(str(tmp_path / "libmccl_metal.dylib"), "/nowhere/libtorch_cpu.dylib")
    msg = str(info.value)
    assert "cannot load the Metal bridge" in msg and "MCCL_UNIFIED_COLLECTIVE=0" in msg


@pytest.mark.timeout(30)
def test_unified_collective_setting(monkeypatch) -> None:
    for raw, want in (("auto", "auto"), ("1", "1"), ("true", "1"), ("0", "0"), ("off", "0")):
        monkeypatch.setenv("MCCL_UNIFIED_COLLECTIVE", raw)
        assert metal_tensors.mode() == want
    monkeypatch.setenv("MCCL_UNIFIED_COLLECTIVE", "maybe")
    with pytest.raises(ConfigError, match="not one of auto, 1, 0"):
        metal_tensors.mode()
    # Off macOS the bridge never loads: auto falls back to staging, 1 names what is missing.
    metal_tensors.reset_for_tests()
    monkeypatch.setenv("MCCL_UNIFIED_COLLECTIVE", "1")
    with pytest.raises(ConfigError, match="MPS unavailable"):
        metal_tensors.device()
    metal_tensors.reset_for_tests()

# The autouse leak check (conftest._no_leaks) is off for this module: the process groups in this module outlive the check in their fixtures, and a shut-down communicator keeps its progress wake pipe until the object is destroyed (its threads and the helper threads' pipes go at shutdown).
pytestmark = pytest.mark.leaks_ok


class _PageBuffer:
    """Page-aligned host memory standing in for a shared buffer mccld maps (segment_staging)."""

    def __init__(self, nbytes: int) -> None:
        import mmap

        self._map = mmap.mmap(-1, nbytes)
        self.addr, self.nbytes, self.released = ctypes.addressof(ctypes.c_char.from_buffer(self._map)), nbytes, False

    def release(self) -> None:
        self.released = True


@pytest.mark.timeout(30)
def test_private_buckets_blit_straight_into_mccld_shared_memory() -> None:
    """Through mccld (issue 27): the staging blit of a private-storage bucket writes into a
    shared buffer wrapped as an MTLBuffer (newBufferWithBytesNoCopy), where mccld reduces,
    and the result is blitted back from there; the wrap goes when the buffer is released."""
    from libmccl.devices.segment_staging import SegmentStaging

    bridge = FakeBridge(seed=5)
    dev = MetalDevice(bridge)
    ops, bufs = dev.staged, []
    staging = SegmentStaging(lambda n: bufs.append(_PageBuffer(n)) or bufs[-1], 64 << 20, "MCCL_CUDA_STAGING_BYTES", 0)
    n = 70_000
    handle, host = bridge.new_buffer(n * 4, PRIVATE)
    ops.register_source(handle, handle, 0)
    grad = np.frombuffer((ctypes.c_char * (n * 4)).from_address(host), dtype=np.float32)
    values = np.arange(n, dtype=np.float32)
    bridge.kernel("backward", lambda: grad.__setitem__(slice(None), values))
    op = OrderedOp(ops, handle, n * 4, "all_reduce on fake mps", staging)
    assert len(bufs) == 1 and bufs[0].addr <= op.buffer < bufs[0].addr + bufs[0].nbytes
    op.launch(None)
    op.ready.wait(op.target, 10.0, "[test] ready")
    block = np.frombuffer((ctypes.c_char * (n * 4)).from_address(op.buffer), dtype=np.float32)
    assert np.array_equal(block, values)       # the blit landed in the shared buffer itself
    block *= 2                                  # what mccld's reduction writes there
    op.done.signal(op.target)
    op.finish(None)
    op.released.wait(TICKET_BASE + 1, 10.0, "[test] released")
    assert np.array_equal(grad, values * 2)     # and came back from there
    op.retire()
    assert ops._sources == {} and ops.copies.snapshot()["copy_device_to_host_bytes"] == n * 4
    staging.close()
    assert bufs[0].released and ops._wrapped == {}
    with pytest.raises(ConfigError, match="page-aligned"):
        ops.register_host(bufs[0].addr + 64, 4096)
    with pytest.raises(NotImplementedError):
        dev.in_place.register_host(bufs[0].addr, 4096)
    bridge.close()
