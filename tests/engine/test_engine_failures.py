"""Engine failure paths with ranks as threads: mismatches, handshake refusal, timeouts,
abort, and that shutdown/abort leave no threads or file descriptors behind."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import (AbortedError, AuthError, CollectiveMismatch, CollectiveTimeout, ConfigError,
                                MCCLError, PeerLostError, ProtocolError)
from support import link_peer
from support.engine import (DT, MAX, SUM, build, fd_count, job_secret, make_options, ptr, ranks, run_ranks,
                            run_threads, thread_count)

pytestmark = pytest.mark.timeout(60)


def expect(c, op_id, cls, timeout=20.0):
    with pytest.raises(cls) as info:
        c.wait(op_id, timeout)
    return info.value


@pytest.mark.parametrize("counts", [(1024, 2048), (100_000, 100_001), (10, 50_000)])
def test_size_mismatch_fails_both_sides_without_overrun(counts):
    with ranks(2) as comms:
        def body(r, c):
            n = counts[r]
            guard = np.full(n + 4096, 7.0, np.float32)  # tail beyond the tensor is a guard zone
            buf = guard[:n]
            buf[:] = 1.0
            err = expect(c, c.allreduce(ptr(buf), n, DT[buf.dtype], SUM), CollectiveMismatch)
            assert (guard[n:] == 7.0).all(), "the engine wrote past the buffer"
            # the communicator is failed: later ops fail with the same error
            later = expect(c, c.barrier(), CollectiveMismatch)
            assert str(later) == str(err)
            return err

        errs = run_ranks(comms, body)
    for r, e in enumerate(errs):
        assert "size mismatch" in str(e) and "every rank must pass tensors of the same size" in str(e)
        assert e.peer_rank == 1 - r or "reported by" in str(e)


def test_op_and_root_mismatch():
    with ranks(3) as comms:
        def body(r, c):
            a = np.zeros(100, np.float32)
            op = c.broadcast(ptr(a), a.nbytes, 0) if r == 2 else c.allreduce(ptr(a), 100, DT[a.dtype], SUM)
            return expect(c, op, CollectiveMismatch)

        errs = run_ranks(comms, body)
    assert any("collective mismatch" in str(e) for e in errs)
    with ranks(2) as comms:
        def body2(r, c):
            a = np.zeros(100, np.uint8)
            # Both think they are the root: each only sends, so the op itself may finish
            # before the disagreement shows; it surfaces no later than the next op.
            first = c.broadcast(ptr(a), a.nbytes, r)
            nxt = c.barrier()
            try:
                c.wait(first, 20)
            except CollectiveMismatch as e:
                return e
            return expect(c, nxt, CollectiveMismatch)

        assert all("root mismatch" in str(e) for e in run_ranks(comms, body2))


@pytest.mark.parametrize("what", ["dtype", "reduce-op"])
def test_dtype_and_reduce_op_mismatch_name_both_sides(what):
    """The transport carries the signature as opaque bytes; the communicator's rules
    decode both sides' and say what differs in the user's words."""
    with ranks(2) as comms:
        def body(r, c):
            if what == "dtype":
                a = np.zeros(64, np.float32 if r == 0 else np.int32)  # same byte size
                op = c.allreduce(ptr(a), 64, DT[a.dtype], SUM)
            else:
                a = np.zeros(64, np.float32)
                op = c.allreduce(ptr(a), 64, DT[a.dtype], SUM if r == 0 else MAX)
            return expect(c, op, CollectiveMismatch)

        errs = run_ranks(comms, body)
    want = {"dtype": ("float32", "int32"), "reduce-op": ("sum", "max")}[what]
    for e in errs:
        text = str(e).lower()
        assert f"{what} mismatch" in text and all(w in text for w in want), e
        assert text.startswith("[allreduce]"), e


def test_p2p_size_mismatch():
    with ranks(2) as comms:
        def body(r, c):
            a = np.zeros(100 if r == 0 else 50, np.uint8)
            if r == 1:
                return expect(c, c.recv(ptr(a), a.nbytes, 0, 3), CollectiveMismatch)
            # A send completes once written; the receiver's verdict reaches the sender as
            # an ABORT and fails its next operation.
            c.wait(c.send(ptr(a), a.nbytes, 1, 3), 10)
            return expect(c, c.barrier(), CollectiveMismatch)

        errs = run_ranks(comms, body)
    assert "it sent 100 bytes" in str(errs[1])


def test_handshake_comm_id_mismatch():
    t0 = time.monotonic()
    with pytest.raises(ProtocolError) as info:
        build(2, comm_ids=[1, 2], opts=make_options(connect_timeout_s=10.0))
    assert "communicator id mismatch" in str(info.value)
    assert "stale process" in str(info.value)
    assert time.monotonic() - t0 < 5.0


def test_world_size_mismatch():
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(2)]
    addrs = [x.address for x in listeners]
    opts = make_options(connect_timeout_s=10.0)

    def make(r):
        try:
            return _core.Communicator(r, 2, 5, listeners[r], addrs + (["127.0.0.1:1"] if r == 0 else []), opts,
                                      secret=job_secret())
        except MCCLError as e:
            return e

    out = run_threads(2, make)
    assert isinstance(out[0], ConfigError)  # 3 addresses for a world of 2: refused locally
    assert isinstance(out[1], MCCLError)


def test_connect_timeout_names_missing_rank():
    lst = _core.Listener("127.0.0.1", 0)
    dead = _core.Listener("127.0.0.1", 0)
    addr = dead.address
    dead.close()  # nobody listens there
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        _core.Communicator(0, 2, 9, lst, [lst.address, addr], make_options(connect_timeout_s=1.0), secret=job_secret())
    assert time.monotonic() - t0 < 4.0
    assert "rank 1" in str(info.value) and info.value.peer_rank == 1


def test_timeout_when_a_rank_never_calls():
    with ranks(2, opts=make_options(timeout_s=1.0)) as comms:
        t0 = time.monotonic()
        a = np.zeros(1000, np.float32)
        err = expect(comms[0], comms[0].allreduce(ptr(a), 1000, DT[a.dtype], SUM), CollectiveTimeout)
        elapsed = time.monotonic() - t0
        assert 0.9 < elapsed < 5.0
        assert "rank 1" in str(err) and err.peer_rank == 1
        # rank 1 hears about it (ABORT) and fails its next op with the same kind
        b = np.zeros(1000, np.float32)
        err1 = expect(comms[1], comms[1].allreduce(ptr(b), 1000, DT[b.dtype], SUM), CollectiveTimeout)
        assert "reported by rank 0" in str(err1)


def test_p2p_timeout():
    with ranks(2, opts=make_options(timeout_s=1.0)) as comms:
        a = np.zeros(10, np.uint8)
        err = expect(comms[0], comms[0].recv(ptr(a), 10, 1, 0), CollectiveTimeout)
        assert err.peer_rank == 1


def test_abort_fails_pending_and_tells_peers():
    with ranks(3) as comms:
        a = np.zeros(10, np.float32)
        pending = comms[0].allreduce(ptr(a), 10, DT[a.dtype], SUM)  # peers never join
        time.sleep(0.1)
        comms[0].abort("test abort")
        expect(comms[0], pending, AbortedError, 5.0)
        with pytest.raises(AbortedError):
            comms[0].barrier()  # refused at once: the communicator is gone
        for c in comms[1:]:
            b = np.zeros(10, np.float32)
            e = expect(c, c.allreduce(ptr(b), 10, DT[b.dtype], SUM), AbortedError, 5.0)
            assert "test abort" in str(e) and e.peer_rank == 0
        comms[0].abort()  # idempotent
        comms[0].shutdown()


def test_peer_lost_when_peer_closes_mid_op():
    # A peer whose communicator disappears without BYE (its links reset) looks lost.
    comms = build(3)
    try:
        a = [np.zeros(1 << 20, np.float32) for _ in range(3)]
        ops = [comms[r].allreduce(ptr(a[r]), a[r].size, DT[a[r].dtype], SUM) for r in (0, 1)]
        time.sleep(0.2)
        comms[2].abort("simulated crash")
        for r in (0, 1):
            e = expect(comms[r], ops[r], MCCLError, 10.0)
            assert isinstance(e, (AbortedError, PeerLostError)) and e.peer_rank == 2
    finally:
        run_threads(3, lambda r: comms[r].shutdown(2.0))


def test_bad_arguments_are_refused_synchronously():
    with ranks(2) as comms:
        c = comms[0]
        a = np.zeros(4, np.float32)
        with pytest.raises(ConfigError):
            c.allreduce(ptr(a), 4, 99, SUM)
        with pytest.raises(ConfigError):
            c.allreduce(ptr(a), 4, DT[a.dtype], int(_core.ReduceOp.BAND))
        with pytest.raises(ConfigError):
            c.broadcast(ptr(a), 16, 5)
        with pytest.raises(ConfigError):
            c.send(ptr(a), 16, 0, 0)  # to itself
        with pytest.raises(ConfigError):
            c.recv(0, 16, 1, 0)  # null buffer
        with pytest.raises(ConfigError):
            c.wait(12345, 1.0)
        # nothing was enqueued: the communicator still works
        run_ranks(comms, lambda r, cc: cc.wait(cc.barrier(), 10))


@pytest.mark.parametrize("how", ["shutdown", "abort"])
def test_no_leaked_threads_or_fds(how):
    gc.collect()
    threads0, fds0 = thread_count(), fd_count()
    for _ in range(2):
        comms = build(3)
        run_ranks(comms, lambda r, c: c.wait(c.barrier(), 10))
        if how == "shutdown":
            run_threads(3, lambda r: comms[r].shutdown(5.0))
        else:
            run_threads(3, lambda r: comms[r].abort("leak test"))
        del comms
        gc.collect()
    deadline = time.monotonic() + 5
    while (thread_count(), fd_count()) != (threads0, fds0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert thread_count() == threads0
    assert fd_count() == fds0


def test_callback_batches_and_errors_delivered():
    batches = [[] for _ in range(2)]
    finished = [threading.Event() for _ in range(2)]

    def deliver(b, i):
        if not batches[i]:
            # Hold the completion thread until every op of the rank finished (wait() does not
            # need it): what finished meanwhile must come in one call, not one call per op.
            # Without the hold, a loaded box's completion thread kept up op by op. The engine
            # queues an op's completion before wait() can return for it, so none is late.
            finished[i].wait(10)
        batches[i].append(list(b))
    cbs = [lambda b, i=i: deliver(b, i) for i in range(2)]
    with ranks(2, on_complete=cbs) as comms:
        def body(r, c):
            bufs = [np.full(16, r, np.float32) for _ in range(50)]
            ids = [c.allreduce(ptr(b), 16, DT[b.dtype], SUM) for b in bufs]
            for i in ids:
                c.wait(i, 10)
            finished[r].set()
            return ids

        ids = run_ranks(comms, body)
        deadline = time.monotonic() + 10
        while sum(len(b) for r in range(2) for b in batches[r]) < 100 and time.monotonic() < deadline:
            time.sleep(0.01)
    for r in range(2):
        got = [op for b in batches[r] for op in b]
        assert [g[0] for g in got] == ids[r]
        assert all(g[1] is None and g[2] == -1 for g in got)
        assert len(batches[r]) <= 2, [len(b) for b in batches[r]]  # the held one, then the rest at once


def test_fast_rank_shutting_down_does_not_fail_slower_ones():
    # The end of every training script: the first rank to finish the last all-reduce
    # closes its links while the others still read its final frames.
    for _ in range(3):
        comms = build(4, opts=make_options(sockets_per_peer=3))

        def body(r, c):
            a = np.ones(3 << 20, np.float32)
            c.wait(c.allreduce(ptr(a), a.size, DT[a.dtype], SUM), 30)
            c.shutdown(5.0)
            return float(a[0])

        assert run_ranks(comms, body) == [4.0] * 4


def _fake_peer(listener_sock):
    """Accepts rank 0's dial as a hand-written 'rank 1' that holds the job key (support/link_peer.py)."""
    conn, _ = listener_sock.accept()
    fields = link_peer.accept(conn, job_secret())
    magic, version, comm_id, frm, to, world, idx, k = fields[:8]
    assert (frm, to, world, k) == (0, 1, 2, 1)
    return conn


def test_malformed_frame_fails_naming_the_peer():
    """A peer that proved the key and then writes nonsense: with sealed frames (the default)
    the header's own tag fails before any field of it is believed."""
    import socket
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    lst = _core.Listener("127.0.0.1", 0)
    addrs = [lst.address, "127.0.0.1:%d" % srv.getsockname()[1]]
    box = {}
    t = __import__("threading").Thread(target=lambda: box.setdefault("conn", _fake_peer(srv)))
    t.start()
    comm = _core.Communicator(0, 2, 77, lst, addrs, make_options(sockets_per_peer=1), None, secret=job_secret())
    t.join(10)
    try:
        box["conn"].sendall(b"GARBAGE!" * 11)  # 88 bytes: a header's and its tag's worth of nonsense
        a = np.zeros(4, np.float32)
        err = expect(comm, comm.allreduce(ptr(a), 4, DT[a.dtype], SUM), AuthError, 10)
        assert "failed authentication" in str(err) and "rank 1" in str(err) and err.peer_rank == 1
    finally:
        comm.shutdown(2.0)
        box["conn"].close()
        srv.close()


def test_ranks_with_different_segment_options_are_refused():
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(2)]
    addrs = [x.address for x in listeners]
    opts = [make_options(connect_timeout_s=10.0, segment_bytes=s) for s in (0, 1 << 20)]

    def make(r):
        try:
            return _core.Communicator(r, 2, 5, listeners[r], addrs, opts[r], secret=job_secret())
        except MCCLError as e:
            return e

    out = run_threads(2, make)
    for e in out:
        assert isinstance(e, ConfigError) and "MCCL_SEGMENT_BYTES" in str(e), e


def test_ranks_with_different_small_allreduce_thresholds_are_refused():
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(2)]
    addrs = [x.address for x in listeners]
    opts = [make_options(connect_timeout_s=10.0, small_allreduce_bytes=s) for s in (65536, 4096)]

    def make(r):
        try:
            return _core.Communicator(r, 2, 6, listeners[r], addrs, opts[r], secret=job_secret())
        except MCCLError as e:
            return e

    out = run_threads(2, make)
    for e in out:
        assert isinstance(e, ConfigError) and "MCCL_SMALL_ALLREDUCE_BYTES" in str(e), e
        assert "65536" in str(e) and "4096" in str(e), e


@pytest.fixture
def ctrl_c():
    """Ctrl-C raising KeyboardInterrupt, as in a terminal. A process started with SIGINT
    ignored (a background job of a non-interactive shell, as a CI runner may start it) keeps
    it ignored, and then no wait can be interrupted however it polls."""
    import signal
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_wait_is_interruptible_and_times_out_in_caller(ctrl_c):
    import os
    import signal
    import threading
    with ranks(2) as comms:
        a = np.zeros(4, np.float32)
        op = comms[0].allreduce(ptr(a), 4, DT[a.dtype], SUM)  # rank 1 never joins
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            comms[0].wait(op, 30)
        # Not a latency bound: only that the wait did not run to its 30 s (a 2 s bound here
        # had 1.7 s of slack for a loaded machine's scheduling).
        assert time.monotonic() - t0 < 15.0
        with pytest.raises(CollectiveTimeout, match=r"^\[engine\] Timed out after 0\.2 s"):
            comms[0].wait(op, 0.2)
        comms[0].abort("test over")
        comms[1].abort("test over")


def test_building_the_mesh_is_interruptible(ctrl_c):
    import os
    import signal
    import threading
    lst = _core.Listener("127.0.0.1", 0)
    silent = _core.Listener("127.0.0.1", 0)  # its kernel accepts our dial, nobody answers
    threads0 = thread_count()
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        _core.Communicator(0, 2, 1, lst, [lst.address, silent.address], make_options(connect_timeout_s=30.0),
                           secret=job_secret())
    assert time.monotonic() - t0 < 15.0   # interrupted, not run to the 30 s connect timeout
    assert thread_count() <= threads0  # the builder thread is gone (others may end too)


def test_ring_timeout_names_the_stalled_rank_and_step():
    # 6 s, not 1 or 3: after the barrier a rank beside three busy processes once started the op
    # over a second after its neighbour, which then rightly named it instead of rank 2; with 3 s
    # it happened again in a busy fresh-clone suite (ci25, rank 1 named rank 0).
    with ranks(3, opts=make_options(timeout_s=6.0)) as comms:
        def body(r, c):
            # Start together: on a loaded machine a thread can begin seconds late, and a rank
            # whose neighbour has sent nothing by its deadline rightly names that neighbour.
            c.wait(c.barrier(), 30)
            if r == 2:
                time.sleep(12.0)  # never calls the all-reduce
                return None
            a = np.ones(1 << 20, np.float32)  # ring path
            return expect(c, c.allreduce(ptr(a), a.size, DT[a.dtype], SUM), CollectiveTimeout)

        errs = run_ranks(comms, body)[:2]
    for e in errs:
        assert e.peer_rank == 2, e
        assert "reduce-scatter step 1 of 2, piece 1 of" in str(e), e


def test_a_late_starting_neighbour_is_not_blamed_for_the_stalled_rank():
    """Rank 1 waits on rank 0, which begins the op 0.6 s later than rank 1 (a loaded
    machine) and then waits on rank 2, which never calls. Rank 1's deadline passes first,
    with only weak evidence against rank 0; it must wait for rank 0's own deadline and
    verdict, not blame it after a fixed grace shorter than the lag."""
    with ranks(3, opts=make_options(timeout_s=1.0)) as comms:
        def body(r, c):
            if r == 2:
                time.sleep(2.5)  # never calls the all-reduce
                return None
            if r == 0:
                time.sleep(0.6)
            a = np.ones(1 << 20, np.float32)  # ring path
            return expect(c, c.allreduce(ptr(a), a.size, DT[a.dtype], SUM), CollectiveTimeout)

        errs = run_ranks(comms, body)[:2]
    for e in errs:
        assert e.peer_rank == 2, e
