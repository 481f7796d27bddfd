"""Sealed frames on the engine's links (integrity/aead.h, transport/pair.h; issue 24).

On sockets the caller connected, with keys per socket and direction and
``Options.wire_security`` aead or mac: every collective and p2p runs as on bare frames
(records of 64 KiB read by the receive threads or the progress thread, written by the
send thread or inline, reduced as they arrive), and a clean shutdown leaves the sockets
reusable by the next job under new keys. An attacker between two ranks (support/mitm.py)
who flips a ciphertext bit, replays or drops a record or injects an ABORT frame fails the
op with AuthError naming the peer, and a reduce-receive shows no byte of the tampered
record; in aead mode the payload does not cross the wire in clear. Ranks are threads.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import AuthError, ConfigError, MCCLError

from support import link_peer
from support.borrowed import K, Mesh
from support.engine import AVG, DT, SUM, make_options, ptr, run_ranks, run_threads
from support.mitm import KIND_ABORT, KIND_COLLECTIVE, KIND_P2P, RECORD, TAG, Frame, Mitm, abort_payload, header

W = _core.WireSecurity
SEALED = [W.aead, W.mac]


def build(n: int, fds, secret: bytes | None, mode=W.aead, comm_id: int | None = None, **kw) -> list:
    """Communicators on the caller's sockets; each socket's frame keys come from the keyed
    handshake on `secret` (None: bare frames), fresh for every build."""
    cid = comm_id if comm_id is not None else random.getrandbits(63)
    opts = make_options(sockets_per_peer=K, connect_timeout_s=kw.pop("connect_timeout_s", 10.0),
                        wire_security=mode, **kw)
    addrs = [f"127.0.0.1:{1000 + r}" for r in range(n)]
    return run_threads(n, lambda r: _core.Communicator(r, n, cid, fds(r), addrs, opts, secret=secret))


def new_secret() -> bytes:
    return os.urandom(32)


def shutdown(comms, timeout: float = 5.0) -> list:
    return run_threads(len(comms), lambda r: comms[r].shutdown(timeout))


# ---------------------------------------------------------------- every op, both modes


def every_op(comms) -> None:
    n = len(comms)

    def body(r, c):
        for count in (1, 3, RECORD // 4 + 1, 3 * RECORD // 4 - 5, (3 << 20) // 4 + 7):
            for op in (SUM, AVG):
                a = np.arange(count, dtype=np.float32) % 97 + r
                c.wait(c.allreduce(ptr(a), count, DT[a.dtype], op), 30)
                want = sum(np.arange(count, dtype=np.float32) % 97 + q for q in range(n))
                np.testing.assert_allclose(a, want / n if op == AVG else want, rtol=1e-6)
        count = 100_003                    # a block is not a whole number of records
        send = np.arange(n * count, dtype=np.float64) * (r + 1)
        out = np.zeros(count, dtype=np.float64)
        c.wait(c.reduce_scatter(ptr(send), ptr(out), count, DT[send.dtype], SUM), 30)
        full = np.arange(n * count, dtype=np.float64) * sum(range(1, n + 1))
        np.testing.assert_array_equal(out, full[r * count:(r + 1) * count])
        for nbytes in (1, 70_001, 5 << 20):
            mine = np.full(nbytes, r + 1, dtype=np.uint8)
            got = np.zeros(n * nbytes, dtype=np.uint8)
            c.wait(c.allgather(ptr(mine), ptr(got), nbytes), 30)
            np.testing.assert_array_equal(got, np.repeat(np.arange(1, n + 1, dtype=np.uint8), nbytes))
            b = np.arange(nbytes, dtype=np.uint8) if r == 1 else np.zeros(nbytes, dtype=np.uint8)
            c.wait(c.broadcast(ptr(b), nbytes, 1), 30)
            np.testing.assert_array_equal(b, np.arange(nbytes, dtype=np.uint8))
        for nbytes in (0, 1, RECORD, RECORD + 1, 3 << 20):
            x = (np.arange(nbytes, dtype=np.uint8) + r).astype(np.uint8)
            got = np.zeros(nbytes, dtype=np.uint8)
            left = (r - 1) % n
            s = c.send(ptr(x), nbytes, (r + 1) % n, 9)
            c.wait(c.recv(ptr(got), nbytes, left, 9), 30)
            c.wait(s, 30)
            np.testing.assert_array_equal(got, (np.arange(nbytes, dtype=np.uint8) + left).astype(np.uint8))
        c.wait(c.barrier(), 30)
    run_ranks(comms, body, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", SEALED, ids=["aead", "mac"])
@pytest.mark.parametrize("threads", [(True, 2), (False, 0)], ids=["helper-threads", "progress-thread-only"])
def test_every_op_is_correct_on_sealed_frames_then_a_second_job_reuses_the_sockets(mode, threads):
    send_thread, recv_threads = threads
    with Mesh(3) as mesh:
        comms = build(3, mesh.fds, new_secret(), mode, send_thread=send_thread, recv_threads=recv_threads)
        every_op(comms)
        # Both ends read each other's sealed BYE: the sockets serve the next job, new keys.
        assert shutdown(comms) == [True] * 3
        comms = build(3, mesh.fds, new_secret(), mode, send_thread=send_thread, recv_threads=recv_threads)
        a = [np.full(1 << 20, r + 1, dtype=np.float32) for r in range(3)]
        run_ranks(comms, lambda r, c: c.wait(c.allreduce(ptr(a[r]), a[r].size, DT[a[r].dtype], SUM), 30))
        assert all(np.all(x == 6) for x in a)
        assert shutdown(comms) == [True] * 3


def test_a_short_secret_is_refused():
    with Mesh(2) as mesh:
        opts = make_options(sockets_per_peer=K, connect_timeout_s=1.0, wire_security=W.aead)
        with pytest.raises(ConfigError, match="32"):
            _core.Communicator(0, 2, 1, mesh.fds(0), ["a:1", "b:1"], opts, secret=b"x" * 8)


# ---------------------------------------------------------------- attacker on the path

N_ELEMS = 1 << 20   # 4 MB of float32: stripes of 2 MB, 32 records each
OWN, PEER = 2.0, 1.0


def attacked_allreduce(mode, attack, sealed: bool = True, **kw):
    """Rank 0 (all 1.0) and rank 1 (all 2.0) all-reduce through a Mitm running `attack`;
    returns (each rank's outcome: True or its error, rank 1's buffer afterwards, the Mitm)."""
    cid = random.getrandbits(63)
    mitm = Mitm(sealed, attack)
    # The ring, whatever the cost model would take: its records land in reduce-receives, and
    # rank 0 finishes only with rank 1's all-gather data, so it must hear of rank 1's failure
    # (after one recursive-doubling exchange rank 0 would be done, with authentic data).
    kw.setdefault("algo", "allreduce=ring")
    try:
        comms = build(2, mitm.fds, new_secret() if sealed else None, mode, comm_id=cid, timeout_s=20.0, **kw)
        bufs = [np.full(N_ELEMS, PEER, dtype=np.float32), np.full(N_ELEMS, OWN, dtype=np.float32)]

        def body(r, c):
            try:
                c.wait(c.allreduce(ptr(bufs[r]), N_ELEMS, DT[bufs[r].dtype], SUM), 25)
            except MCCLError as e:
                return e
            return bool(np.all(bufs[r] == OWN + PEER))
        outcome = run_ranks(comms, body)
        shutdown(comms, 1.0)
    finally:
        mitm.close()
    return outcome, bufs[1], mitm


def on_first_big_frame(change):
    """An attack that applies `change` to the first collective frame of at least 3 records.
    The frame is held back a while first, so rank 1 has posted its receive: the records then
    land in a reduce-receive (reduced as they arrive), not in an unexpected-message buffer."""
    done = []

    def attack(i: int, f: Frame) -> bytes:
        if not done and f.kind == KIND_COLLECTIVE and f.length >= 3 * RECORD:
            done.append(i)
            time.sleep(0.5)
            return change(f)
        return f.wire()
    return attack


def flip(f: Frame) -> bytes:
    recs = list(f.records)
    if f.htag:
        ct, tag = recs[1]
        b = bytearray(ct)
        b[100] ^= 0x40
        recs[1] = (bytes(b), tag)
    else:   # bare: one record, flip inside its second 64 KiB
        b = bytearray(recs[0][0])
        b[RECORD + 100] ^= 0x40
        recs[0] = (bytes(b), b"")
    return Frame(f.header, f.htag, recs).wire()


def replay(f: Frame) -> bytes:
    recs = list(f.records)
    recs[1] = recs[0]            # record 0 again where record 1 belongs
    return Frame(f.header, f.htag, recs).wire()


def drop(f: Frame) -> bytes:
    recs = list(f.records)
    del recs[1]
    return Frame(f.header, f.htag, recs).wire()


def assert_auth_failure(outcome, rank1_buf) -> None:
    assert isinstance(outcome[1], AuthError), outcome
    msg = str(outcome[1])
    assert "failed authentication" in msg and "peer=127.0.0.1:1000 (rank 0)" in msg, msg
    assert outcome[1].peer_rank == 0
    # Rank 0 learns it from rank 1's ABORT (or its own link failing), never a silent success.
    assert isinstance(outcome[0], MCCLError), outcome
    # Only verified records were reduced in: every element is rank 1's own or the right sum.
    assert np.isin(rank1_buf, [OWN, OWN + PEER]).all(), np.unique(rank1_buf)[:10]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", SEALED, ids=["aead", "mac"])
@pytest.mark.parametrize("change", [flip, replay, drop], ids=["flip-bit", "replay-record", "drop-record"])
def test_attacker_altering_records_fails_the_op_with_auth_error(mode, change):
    outcome, buf, _ = attacked_allreduce(mode, on_first_big_frame(change))
    assert_auth_failure(outcome, buf)


@pytest.mark.timeout(120)
def test_attacker_altering_records_on_the_progress_thread_path():
    # No helper threads: the progress thread reads, opens and reduces every record.
    outcome, buf, _ = attacked_allreduce(W.aead, on_first_big_frame(flip), send_thread=False, recv_threads=0)
    assert_auth_failure(outcome, buf)


@pytest.mark.timeout(120)
def test_bare_frames_let_the_same_flip_through_silently():
    # The control: without wire security the flipped bit lands in rank 1's sum unnoticed.
    outcome, buf, _ = attacked_allreduce(W.off, on_first_big_frame(flip), sealed=False)
    assert outcome[1] is False or outcome[0] is False, outcome
    assert not np.isin(buf, [OWN, OWN + PEER]).all()


# Copy-receives (a p2p recv here; also a broadcast's or all-gather's blocks) land records
# in the caller's buffer: a forged record must leave no byte there (issue 34).
SENT, BEFORE = 0x11, 0xEE       # a flipped bit in SENT gives neither
P2P_BYTES = 4 << 20             # stripes of 2 MB: frames of 32 records


def attacked_recv(mode, threads):
    """Rank 0 sends P2P_BYTES of SENT to rank 1, whose receive buffer holds BEFORE; the
    attacker flips a bit of record 1 of the first p2p frame once rank 1's recv is posted.
    Returns (rank 1's error or True, rank 1's buffer afterwards)."""
    send_thread, recv_threads = threads
    done = []

    def attack(i: int, f: Frame) -> bytes:
        if not done and f.kind == KIND_P2P and f.length >= 3 * RECORD:
            done.append(i)
            time.sleep(0.5)
            return flip(f)
        return f.wire()
    mitm = Mitm(True, attack)
    got = np.full(P2P_BYTES, BEFORE, dtype=np.uint8)
    try:
        comms = build(2, mitm.fds, new_secret(), mode, timeout_s=20.0, send_thread=send_thread,
                      recv_threads=recv_threads)

        def body(r, c):
            try:
                if r == 0:
                    x = np.full(P2P_BYTES, SENT, dtype=np.uint8)
                    c.wait(c.send(ptr(x), x.nbytes, 1, 3), 25)
                else:
                    c.wait(c.recv(ptr(got), got.nbytes, 0, 3), 25)
            except MCCLError as e:
                return e
            return True
        outcome = run_ranks(comms, body)
        shutdown(comms, 1.0)
    finally:
        mitm.close()
    assert done, "the attacker saw no p2p frame to alter"
    return outcome[1], got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", SEALED, ids=["aead", "mac"])
@pytest.mark.parametrize("threads", [(True, 2), (False, 0)], ids=["helper-threads", "progress-thread-only"])
def test_a_forged_record_of_a_copy_receive_leaves_no_byte_in_the_buffer(mode, threads):
    err, got = attacked_recv(mode, threads)
    assert isinstance(err, AuthError), err
    assert err.peer_rank == 0
    # Each byte holds what it held before or what rank 0 sent; none the forged byte.
    values = np.unique(got)
    assert set(values.tolist()) <= {SENT, BEFORE}, values[:10]
    # The records after the forged one never landed either (the frame stopped at it).
    assert (got == BEFORE).any()
    assert "no byte that failed its tag was written to the destination" in str(err), str(err)


@pytest.mark.timeout(30)
def test_the_attacker_relays_a_hello_whose_nonce_ends_like_a_frame_at_once():
    # A random nonce ends in the frame magic's first byte once in 256 hellos; the relay once
    # held that byte back for the frame it might begin, and the handshake timed out.
    hello = link_peer.hello(1, 0, 1, 2, nonce=os.urandom(31) + b"M")
    with Mitm(True) as mitm:
        a, b = mitm.ends[0]
        a.sendall(hello)
        b.settimeout(5)
        assert link_peer.recv_exact(b, len(hello)) == hello


def inject_abort(cid_of, sealed: bool):
    """An attack that puts a forged ABORT frame in front of the first frame."""
    def attack(i: int, f: Frame) -> bytes:
        if i:
            return f.wire()
        payload = abort_payload("forged by the attacker")
        h = header(KIND_ABORT, cid_of(f), len(payload))
        forged = Frame(h, os.urandom(TAG), [(payload, os.urandom(TAG))]) if sealed else Frame(h, b"", [(payload, b"")])
        return forged.wire() + f.wire()
    return attack


def comm_id_of(f: Frame) -> int:
    return int.from_bytes(f.header[8:16], "little")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", SEALED, ids=["aead", "mac"])
def test_injected_abort_frame_is_rejected_as_auth_error(mode):
    outcome, buf, _ = attacked_allreduce(mode, inject_abort(comm_id_of, True))
    assert_auth_failure(outcome, buf)
    assert "forged by the attacker" not in str(outcome[1])


@pytest.mark.timeout(120)
def test_bare_frames_obey_an_injected_abort():
    # The control: without wire security the forged ABORT is believed.
    outcome, _, _ = attacked_allreduce(W.off, inject_abort(comm_id_of, False), sealed=False)
    assert "forged by the attacker" in str(outcome[1]), outcome


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [W.aead, W.mac, W.off], ids=["aead", "mac", "off"])
def test_payload_crosses_the_wire_in_clear_only_without_aead(mode):
    rng = np.random.default_rng(7)
    pattern = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    mitm = Mitm(mode != W.off)
    try:
        comms = build(2, mitm.fds, new_secret() if mode != W.off else None, mode)

        def body(r, c):
            x = pattern.copy()
            if r == 0:
                c.wait(c.send(ptr(x), x.nbytes, 1, 5), 20)
            else:
                got = np.zeros_like(x)
                c.wait(c.recv(ptr(got), got.nbytes, 0, 5), 20)
                np.testing.assert_array_equal(got, pattern)
        run_ranks(comms, body)
        assert shutdown(comms) == [True, True]
    finally:
        mitm.close()
    wire = bytes(mitm.captured)
    # The p2p message is one frame on one socket; socket 0 carries it or its half.
    assert len(wire) > 0
    probes = [pattern[o:o + 32].tobytes() for o in range(0, pattern.size - 32, 4099)]
    seen = sum(p in wire for p in probes)
    if mode == W.aead:
        assert seen == 0
    else:
        assert seen > 0
