"""libmccl.devices.cuda_ops on an emulated CUDA driver, with the real engine: what can be checked of
the CUDA path without a GPU (scripts/cuda_check.py checks the rest on one).

The emulator (libmccl.devices.cuda_emulator) stands in for libcuda's entry points that CudaOps
calls. Its cuStreamWaitValue64 compares cyclically, as CUDA documents for GEQ
((int64_t)(*addr - value) >= 0), so the poison of a failed op must release it through
device_order.TICKET_BASE.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from libmccl.devices import cuda_ops
from libmccl.devices.cuda_emulator import Emulator
from libmccl.devices.device_order import TICKET_BASE, OrderedOp
from mccl_common.errors import AbortedError
from support.engine import DT, SUM, make_options, ranks, run_ranks

PIPE = 16 << 10


@pytest.fixture
def emu(monkeypatch):
    e = Emulator(alloc_waits=False)  # both ranks (threads) share it, unlike processes on a GPU
    monkeypatch.setattr(cuda_ops, "_load_driver", e.library)
    yield e
    e.stop()


def _allreduce(c, ops, stream, dev: np.ndarray, emu: Emulator, values: np.ndarray):
    """One staged, ticketed all-reduce of ``dev`` (the emulated device memory)."""
    emu.launch(stream, lambda: dev.__setitem__(slice(None), values))  # the kernel writing the bucket
    op = OrderedOp(ops, dev.ctypes.data, dev.nbytes, "test all-reduce")
    op_id = c.allreduce(op.buffer, dev.size, DT[dev.dtype], SUM, ready=op.ready, done=op.done, base=TICKET_BASE)
    op.launch(stream)
    op.finish(stream)
    return op, op_id


@pytest.mark.timeout(60)
def test_staged_allreduce_is_exact_and_recycles_words_and_staging(emu) -> None:
    n = 100_003
    with ranks(2, opts=make_options(pipeline_bytes=PIPE)) as comms:
        def body(r, c):
            ops = cuda_ops.CudaOps(0)
            stream, dev = 100 + r, np.zeros(n, dtype=np.float32)
            words, staging = set(), set()
            for step in range(4):
                values = np.full(n, float(10 * step + r + 1), dtype=np.float32)
                op, op_id = _allreduce(c, ops, stream, dev, emu, values)
                c.wait(op_id, 30.0)
                op.released.wait(TICKET_BASE + 1, 10.0, "[test] copy back")
                assert np.array_equal(dev, np.full(n, float(20 * step + 3), dtype=np.float32)), step
                words |= {t.address for t in (op.ready, op.done, op.released)}
                staging.add(op.buffer)
                assert op.reusable()
                op.retire()
            return words, staging

        (w0, s0), (w1, s1) = run_ranks(comms, body)
    assert len(w0) == 3 and len(s0) == 1  # every step reused the same three words and one block
    deadline = time.monotonic() + 5.0  # the last wake may still be queued behind its write
    while emu.host_fns < 2 * 4 * 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert emu.host_fns == 2 * 4 * 2  # each stream write (ready, released) woke its waiters


@pytest.mark.timeout(60)
def test_a_failed_op_releases_the_device_wait_through_the_cyclic_compare(emu) -> None:
    n = 50_000
    with ranks(2, opts=make_options(pipeline_bytes=PIPE, timeout_s=30.0)) as comms:
        def body(r, c):
            ops = cuda_ops.CudaOps(0)
            dev = np.zeros(n, dtype=np.float32)
            if r == 0:
                op = OrderedOp(ops, dev.ctypes.data, dev.nbytes, "test all-reduce")
                op_id = c.allreduce(op.buffer, n, DT[dev.dtype], SUM, ready=op.ready, done=op.done, base=TICKET_BASE)
                op.abandon()  # the producer failed before O1
            else:
                op, op_id = _allreduce(c, ops, 201, dev, emu, np.ones(n, dtype=np.float32))
            with pytest.raises(AbortedError):
                c.wait(op_id, 30.0)
            assert op.done.poisoned
            if r == 1:  # its stream's wait for done passed on the poison: the copy back and released ran
                op.released.wait(TICKET_BASE + 1, 10.0, "[test] released after poison")

        t0 = time.monotonic()
        run_ranks(comms, body)
        assert time.monotonic() - t0 < 20.0
