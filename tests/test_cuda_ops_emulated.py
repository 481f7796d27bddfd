"""libmccl.cuda_ops on an emulated CUDA driver, with the real engine: what can be checked of
the CUDA path without a GPU (scripts/cuda_check.py checks the rest on one).

The emulator stands in for libcuda's entry points that CudaOps calls: pinned "host"
memory whose device address is its host address (UVA), and streams run by a worker thread
each, in order. Its cuStreamWaitValue64 compares cyclically, as CUDA documents for GEQ
((int64_t)(*addr - value) >= 0), so the poison of a failed op must release it through
device_order.TICKET_BASE, and nothing here calls a synchronize.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
import types

import numpy as np
import pytest

from libmccl import cuda_ops
from libmccl.device_order import TICKET_BASE, OrderedOp
from libmccl.errors import AbortedError
from test_engine_helpers import DT, SUM, make_options, ranks, run_ranks

PIPE = 16 << 10
_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _val(x):
    return getattr(x, "value", x)


class _Emulator:
    """The few CUDA driver entry points CudaOps uses, each returning CUDA_SUCCESS (0)."""

    def __init__(self) -> None:
        self.blocks: dict[int, ctypes.Array] = {}
        self.freed: list[int] = []
        self.host_fns = 0
        self._streams: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()

    # -- context, device -------------------------------------------------------------------
    def cuInit(self, flags): return 0
    def cuGetErrorName(self, rc, out): out._obj.value = b"CUDA_ERROR_EMULATED"; return 0
    def cuCtxGetCurrent(self, out): out._obj.value = 1; return 0
    def cuCtxSetCurrent(self, ctx): return 0
    def cuDeviceGet(self, out, index): out._obj.value = index; return 0
    def cuDevicePrimaryCtxRetain(self, out, dev): out._obj.value = 1; return 0

    # -- pinned memory ----------------------------------------------------------------------
    def cuMemHostAlloc(self, out, nbytes, flags):
        buf = (ctypes.c_char * nbytes)()
        self.blocks[ctypes.addressof(buf)] = buf
        out._obj.value = ctypes.addressof(buf)
        return 0

    def cuMemHostGetDevicePointer(self, out, host, flags):
        out._obj.value = _val(host)
        return 0

    def cuMemFreeHost(self, host):
        self.freed.append(_val(host))
        return 0

    # -- streams ------------------------------------------------------------------------------
    def _enqueue(self, stream, fn) -> int:
        with self._lock:
            q = self._streams.get(stream)
            if q is None:
                q = self._streams[stream] = queue.Queue()
                threading.Thread(target=self._run, args=(q,), daemon=True).start()
        q.put(fn)
        return 0

    @staticmethod
    def _run(q: queue.Queue) -> None:
        while (fn := q.get()) is not None:
            fn()

    def launch(self, stream, fn) -> None:
        """A kernel: runs on the stream after a pause, so the CPU is ahead of the GPU."""
        self._enqueue(stream, lambda: (time.sleep(0.003), fn()))

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        return self._enqueue(stream, lambda: ctypes.memmove(_val(dst), _val(src), n))

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        return self._enqueue(stream, lambda: ctypes.memmove(_val(dst), _val(src), n))

    def cuStreamWriteValue64(self, stream, addr, value, flags):
        return self._enqueue(stream, lambda: setattr(ctypes.c_uint64.from_address(addr), "value", value))

    def cuStreamWaitValue64(self, stream, addr, value, flags):
        def wait():
            word = ctypes.c_uint64.from_address(addr)
            while (word.value - value) % (1 << 64) >= (1 << 63):  # cyclic GEQ
                time.sleep(1e-4)
        return self._enqueue(stream, wait)

    def cuLaunchHostFunc(self, stream, fn, data):
        def call():
            self.host_fns += 1
            _HOST_FN(fn)(data)
        return self._enqueue(stream, call)

    def stop(self) -> None:
        for q in self._streams.values():
            q.put(None)


@pytest.fixture
def emu(monkeypatch):
    e = _Emulator()
    # Plain functions, like a CDLL's, so CudaOps can set restype/argtypes on them.
    lib = types.SimpleNamespace(**{name: (lambda m: lambda *a: m(*a))(getattr(e, name))
                                   for name in dir(e) if name.startswith("cu")})
    monkeypatch.setattr(cuda_ops, "_load_driver", lambda: lib)
    yield e
    e.stop()


def _allreduce(c, ops, stream, dev: np.ndarray, emu: _Emulator, values: np.ndarray):
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
