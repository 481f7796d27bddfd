"""Device buckets staged in mccld's shared buffers (libmccl/devices/segment_staging.py, issue 27), on
the emulated CUDA driver through a real mccld on loopback: the device's copy lands in memory
mccld reduces in place (no copy into or out of the client's segment), results equal the
in-process engine's, a refused registration falls back with one warning, and nothing stays
registered with the driver once the group is gone, also after a peer died mid-op."""

from __future__ import annotations

import ctypes
import logging
import os

import pytest

from support.collective_suite import DTYPES, MODES, _ops_for
from support.ranks import collect, init_pg, reap, spawn_ranks

N = 40_003                       # odd; 160 KB of float32: above the piece size below, so pipelined
SMALL = 1001                     # not pipelined
ENV = {"MCCL_DAEMON_FAST_BYTES": "0", "MCCL_PIPELINE_BYTES": str(64 << 10)}


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _allreduces(rank: int, world: int, register_error: int = 0) -> dict:
    """Every dtype and op of the collective suite on emulated device tensors (two sizes)."""
    import torch
    import torch.distributed as dist

    from libmccl.devices import device_check as C

    warned = _Count()
    logging.getLogger("libmccl.devices.segment_staging").addHandler(warned)
    init_pg(rank, world)
    dev = C.emulated_cuda()
    emu = dev.emulator
    emu.register_error = register_error
    pg = dist.distributed_c10d._get_default_group()
    results, peak_registered = [], 0
    try:
        for dtype in DTYPES:
            for op in _ops_for(dtype):
                for n in (N, SMALL):
                    t = dev.produce(n, dtype, rank + 3)
                    dist.all_reduce(t, op=op, async_op=True).wait()
                    # Bytes, not tensors: the queue would pass a tensor's storage by descriptor.
                    results.append((str(dtype), str(op), n, dev.read(t).view(torch.uint8).numpy().tobytes()))
                    peak_registered = max(peak_registered, len(emu.registered))
        stats = pg.copy_stats()
        client = pg.communicator.stats()
        staging = pg._segment_staging
        dist.destroy_process_group()
        left = dict(emu.registered)
        slabs = staging.slabs() if staging is not None else 0
    finally:
        dev.close()
        emu.stop()
    return {"results": results, "stats": stats, "zero_copy_ops": client.get("zero_copy_ops"),
            "peak_registered": peak_registered, "registered_after": left, "slabs_after": slabs,
            "warnings": warned.messages, "registers": emu.calls["cuMemHostRegister"]}


def _equal(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (dt, op, n, x), (_, _, _, y) in zip(a, b):
        assert x == y, f"{dt} {op} n={n}: through mccld differs from in-process"


@pytest.fixture(scope="module")
def inprocess(ranks_module):
    with MODES["inprocess"].setup() as env:
        return ranks_module(_allreduces, 2, timeout_s=200, env={**env, **ENV})


@pytest.fixture(scope="module")
def ranks_module():
    from support.ranks import run_ranks
    return run_ranks


@pytest.mark.timeout(300)
def test_device_buckets_are_reduced_in_mccld_shared_buffers(ranks, inprocess) -> None:
    with MODES["daemon"].setup() as env:
        per_rank = ranks(_allreduces, 2, timeout_s=200, env={**env, **ENV})
    for r, got in enumerate(per_rank):
        _equal(got["results"], inprocess[r]["results"])
        s = got["stats"]
        # The device's copies land where mccld reduces: nothing is copied into or out of the segment.
        assert s["copy_host_to_segment_bytes"] == 0 and s["copy_segment_to_host_bytes"] == 0, s
        assert got["zero_copy_ops"] == len(got["results"])
        bucket_bytes = sum(len(x) for _, _, _, x in got["results"])
        assert s["copy_device_to_host_bytes"] == s["copy_host_to_device_bytes"] == bucket_bytes, s
        assert s["copy_device_to_host_count"] == len(got["results"]) and s["copy_device_to_host_untimed"] == 0
        assert s["copy_device_to_host_s"] > 0 and s["copy_host_to_device_s"] > 0
        assert got["peak_registered"] >= 1 and got["warnings"] == []
        # Blocks were reused: a slab per size class, registered once.
        assert got["registers"] == got["peak_registered"] <= 4, got["registers"]
        assert got["registered_after"] == {} and got["slabs_after"] == 0
    for r, ref in enumerate(inprocess):  # in process nothing of this applies
        assert ref["registers"] == 0 and ref["stats"]["copy_host_to_segment_count"] == 0
        assert ref["stats"]["copy_device_to_host_bytes"] == per_rank[r]["stats"]["copy_device_to_host_bytes"]


@pytest.mark.timeout(300)
def test_a_refused_registration_falls_back_with_one_warning(ranks, inprocess) -> None:
    from libmccl.devices.cuda_emulator import CUDA_ERROR_NOT_SUPPORTED

    with MODES["daemon"].setup() as env:
        per_rank = ranks(_allreduces, 2, CUDA_ERROR_NOT_SUPPORTED, timeout_s=200, env={**env, **ENV})
    for r, got in enumerate(per_rank):
        _equal(got["results"], inprocess[r]["results"])
        assert len(got["warnings"]) == 1 and "CUDA_ERROR_NOT_SUPPORTED" in got["warnings"][0], got["warnings"]
        assert got["registers"] == 1  # tried once, then staged as before
        s = got["stats"]
        assert s["copy_host_to_segment_bytes"] == s["copy_device_to_host_bytes"] > 0, s
        assert got["zero_copy_ops"] == 0 and got["registered_after"] == {}


def _dies_mid_op(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from libmccl.devices import device_check as C
    from mccl_common.errors import MCCLError

    init_pg(rank, world, timeout_s=20.0)
    dev = C.emulated_cuda()
    emu = dev.emulator
    pg = dist.distributed_c10d._get_default_group()
    t = dev.produce(N, __import__("torch").float32, rank)
    dist.all_reduce(t, async_op=True).wait()          # both ranks' staging is registered now
    dev.read(t)
    registered = len(emu.registered)
    if rank == 1:
        dev.begin()                                   # the device holds back the bucket's ready
        dist.all_reduce(dev.produce(N, __import__("torch").float32, 1), async_op=True)
        os._exit(3)                                   # mid-op, without a word to anyone
    failed = None
    try:
        dist.all_reduce(dev.produce(N, __import__("torch").float32, 0), async_op=True).wait()
    except MCCLError as exc:
        failed = type(exc).__name__
    dev.release()
    staging = pg._segment_staging
    dist.destroy_process_group()
    out = {"failed": failed, "registered_during": registered, "registered_after": dict(emu.registered),
           "slabs_after": staging.slabs(), "blocks_in_use": staging.in_use()}
    dev.close()
    emu.stop()
    return out


@pytest.mark.timeout(120)
def test_a_rank_dying_mid_op_leaves_nothing_registered() -> None:
    with MODES["daemon"].setup() as env:
        procs, results, _ = spawn_ranks(_dies_mid_op, 2, env={**env, **ENV})
        try:
            out = collect(procs, results, 90.0, expect=1)
        finally:
            reap(procs)
    status, got = out[0]
    assert status == "ok", got
    assert got["failed"] is not None and got["registered_during"] >= 1, got
    assert got["registered_after"] == {} and got["slabs_after"] == 0 and got["blocks_in_use"] == 0, got


# -- the pieces on their own -------------------------------------------------------------------------
@pytest.fixture
def cuda(monkeypatch):
    from libmccl.devices import cuda_ops
    from libmccl.devices.cuda_emulator import Emulator

    emu = Emulator(alloc_waits=False)
    monkeypatch.setattr(cuda_ops, "_load_driver", emu.library)
    yield emu, cuda_ops.CudaOps(0)
    emu.stop()


def test_the_emulated_driver_refuses_what_the_real_one_does(cuda) -> None:
    from mccl_common.errors import MCCLError

    emu, ops = cuda
    mem = (ctypes.c_char * (4 * 4096)).from_buffer(bytearray(5 * 4096))
    base = -(-ctypes.addressof(mem) // 4096) * 4096
    with pytest.raises(MCCLError, match="CUDA_ERROR_INVALID_VALUE"):
        ops.register_host(base + 8, 4096)
    ops.register_host(base, 2 * 4096)
    with pytest.raises(MCCLError, match="ALREADY_REGISTERED"):
        ops.register_host(base + 4096, 4096)
    ops.unregister_host(base)
    with pytest.raises(MCCLError, match="NOT_REGISTERED"):
        ops.unregister_host(base)
    assert emu.registered == {}


class _Buffer:
    def __init__(self, nbytes: int) -> None:
        self._mem = bytearray(nbytes + 4096)
        raw = ctypes.addressof((ctypes.c_char * len(self._mem)).from_buffer(self._mem))
        self.addr, self.nbytes = -(-raw // 4096) * 4096, nbytes
        self.released = False

    def release(self) -> None:
        self.released = True


def test_blocks_are_reused_capped_and_unregistered_once_given_back(cuda) -> None:
    from libmccl.devices.segment_staging import SLAB_BYTES, SegmentStaging

    emu, ops = cuda
    bufs: list[_Buffer] = []

    def alloc(n: int) -> _Buffer:
        bufs.append(_Buffer(n))
        return bufs[-1]

    st = SegmentStaging(alloc, SLAB_BYTES, "MCCL_CUDA_STAGING_BYTES", 0)
    a, blk_a = st.take(ops, 3 << 20)                     # a 4 MiB class: 8 blocks in one slab
    held = [st.take(ops, 4 << 20) for _ in range(7)]
    assert len(bufs) == 1 and len(emu.registered) == 1 and a == bufs[0].addr
    assert st.take(ops, 4 << 20) is None                 # the cap: the device's own pool serves it
    st.give(blk_a)
    assert st.take(ops, 4 << 20)[0] == a                 # reused, nothing new registered
    assert emu.calls["cuMemHostRegister"] == 1
    st.close()
    assert emu.registered and not bufs[0].released       # blocks still in use: kept
    for _, blk in held:
        st.give(blk)
    st.give(blk_a)
    assert emu.registered == {} and bufs[0].released and st.slabs() == 0
