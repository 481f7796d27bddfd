"""Attacker tests: another local user (a forked child that dropped to uid 12345) tries to stand
up a fake mccld, squat the runtime dir, or attach to a daemon that is not theirs."""

from __future__ import annotations

import contextlib
import grp
import os
import select
import threading
import time
import shutil
import tempfile
from pathlib import Path

import pytest
import zmq

from mccl_common import attach_protocol as protocol
from mccl_common.daemon_settings import load_config, runtime_dir
from mccl_common.errors import ConfigError
from support.daemon import running_daemon
from support.localuser import ATTACKER_UID, VICTIM_UID, as_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays other local users with setuid: needs root")


@contextlib.contextmanager
def _scratch():
    """A directory every uid can traverse (pytest's tmp_path is root's 0700)."""
    base = Path(tempfile.mkdtemp(prefix="mccl-lu-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _victim_env(monkeypatch) -> None:
    # The macOS default: no MCCL_RUNTIME_DIR, no XDG_RUNTIME_DIR, so /tmp/mccl-<uid>.
    monkeypatch.delenv("MCCL_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)


@pytest.mark.timeout(60)
def test_client_refuses_a_runtime_dir_another_user_created_first(monkeypatch):
    _victim_env(monkeypatch)
    squatted = Path(f"/tmp/mccl-{VICTIM_UID}")
    shutil.rmtree(squatted, ignore_errors=True)
    try:
        as_user(ATTACKER_UID, ATTACKER_UID, lambda: squatted.mkdir(mode=0o777))
        assert squatted.stat().st_uid == ATTACKER_UID

        def victim():
            return str(runtime_dir(load_config(env={}), create=False))
        out = as_user(VICTIM_UID, VICTIM_UID, victim)
        assert out[0] == "raised", f"the victim's client accepted {out[1]} that uid {ATTACKER_UID} created"
        assert out[1].startswith("ConfigError") and str(squatted) in out[1] and f"uid {ATTACKER_UID}" in out[1]
    finally:
        shutil.rmtree(squatted, ignore_errors=True)


@pytest.mark.timeout(60)
def test_client_refuses_a_runtime_dir_that_is_a_symlink(monkeypatch):
    _victim_env(monkeypatch)
    link = Path(f"/tmp/mccl-{VICTIM_UID}")
    shutil.rmtree(link, ignore_errors=True)
    with _scratch() as base:
        target = base / "theirs"
        target.mkdir(mode=0o700)
        os.chown(target, VICTIM_UID, VICTIM_UID)   # even a directory the victim owns: the link is the attacker's
        try:
            as_user(ATTACKER_UID, ATTACKER_UID, lambda: link.symlink_to(target))
            out = as_user(VICTIM_UID, VICTIM_UID, lambda: str(runtime_dir(load_config(env={}), create=False)))
            assert out[0] == "raised" and out[1].startswith("ConfigError"), out
            assert "symlink" in out[1] and str(link) in out[1] and f"uid {ATTACKER_UID}" in out[1]
        finally:
            link.unlink(missing_ok=True)


@pytest.mark.timeout(30)
def test_mccld_refuses_a_runtime_dir_that_is_a_symlink():
    with _scratch() as base:
        target = base / "real"
        target.mkdir(mode=0o700)            # ours: following the link would look fine
        link = base / "rt"
        link.symlink_to(target)
        with pytest.raises(ConfigError, match=rf"runtime dir {link} is a symlink \(owned by root \(uid 0\)\)"):
            runtime_dir(load_config(env={"MCCL_RUNTIME_DIR": str(link)}), create=True)


@pytest.mark.timeout(30)
def test_mccld_refuses_a_runtime_dir_another_user_created():
    with _scratch() as base:
        rdir = base / "rt"
        rdir.mkdir(mode=0o777)
        os.chown(rdir, ATTACKER_UID, ATTACKER_UID)
        with pytest.raises(ConfigError, match=rf"runtime dir {rdir} belongs to uid {ATTACKER_UID}"):
            runtime_dir(load_config(env={"MCCL_RUNTIME_DIR": str(rdir)}), create=True)


@pytest.mark.timeout(60)
def test_client_refuses_a_fake_daemon_of_another_user_before_sending_anything():
    with _scratch() as base:
        rdir = base / "rt"
        rdir.mkdir()
        rdir.chmod(0o777)   # open to the other user for a moment (the umask would take it back)
        r_ready, w_ready = os.pipe()
        r_stop, w_stop = os.pipe()

        def fake_daemon():
            # Listen where the victim's mccld would, record whatever arrives.
            ctx = zmq.Context()
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(protocol.endpoint(rdir))
            (rdir / protocol.SOCKET_NAME).chmod(0o777)
            (rdir / protocol.TOKEN_NAME).write_text("fake-token")
            os.write(w_ready, b"x")
            got = []
            poller = zmq.Poller()
            poller.register(router, zmq.POLLIN)
            poller.register(r_stop, zmq.POLLIN)
            while True:
                events = dict(poller.poll(30000))
                if router in events:
                    frames = router.recv_multipart()
                    got.append(frames[-1][:200])
                    router.send_multipart([frames[0], protocol.encode(
                        {"type": "reply", "req": 1, "ok": True, "host_id": "h", "link_addr": "127.0.0.1:1"})])
                    continue
                break
            router.close(0)
            ctx.term()
            return got

        result = {}
        t = threading.Thread(target=lambda: result.setdefault("got", as_user(ATTACKER_UID, ATTACKER_UID,
                                                                             fake_daemon)))
        t.start()
        try:
            assert select.select([r_ready], [], [], 30)[0], f"the fake daemon did not start: {result}"
            os.read(r_ready, 1)
            # The directory then looks like the victim's own (as after they fixed its mode): the
            # socket in it is still the other user's.
            os.chown(rdir, VICTIM_UID, VICTIM_UID)
            rdir.chmod(0o700)
            os.chown(rdir / protocol.TOKEN_NAME, VICTIM_UID, VICTIM_UID)

            def victim():
                from libmccl.daemon.attach import Attachment
                os.environ["MCCL_RUNTIME_DIR"] = str(rdir)
                att = Attachment(rdir, 0, 1, 5.0)
                try:
                    att.connect()
                    return "connected"
                finally:
                    att.close()
            out = as_user(VICTIM_UID, VICTIM_UID, victim)
        finally:
            os.write(w_stop, b"x")
            t.join(60)
            for fd in (r_ready, w_ready, r_stop, w_stop):
                os.close(fd)
        assert out[0] == "raised" and out[1].startswith("AuthError"), out
        assert f"runs as uid {ATTACKER_UID}" in out[1] and "impersonating mccld" in out[1], out
        assert result["got"] == ("ok", []), f"the client sent the fake daemon {result['got']}"


def _loosen(rdir: Path) -> None:
    # What a wrong mode (or a filesystem without modes) would allow: the daemon must not rely on it.
    rdir.chmod(0o755)
    (rdir / protocol.SOCKET_NAME).chmod(0o666)
    (rdir / protocol.TOKEN_NAME).chmod(0o644)


def _raw_hello(rdir: Path):
    def client():
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(protocol.endpoint(rdir))
        try:
            token = (rdir / protocol.TOKEN_NAME).read_text().strip()
            s.send(protocol.encode({"type": "hello", "token": token, "pid": os.getpid(), "req": 1}))
            if not s.poll(10000):
                return None
            return protocol.decode_reply(s.recv())
        finally:
            s.close(0)
            ctx.term()
    return client


@pytest.mark.timeout(60)
def test_mccld_refuses_a_client_of_another_user_not_in_the_attach_group():
    with running_daemon() as (d, env):
        rdir = Path(env["MCCL_RUNTIME_DIR"])
        _loosen(rdir)
        out = as_user(ATTACKER_UID, ATTACKER_UID, _raw_hello(rdir))
        assert out[0] == "ok", out
        reply = out[1]
        assert reply is not None and not reply["ok"], f"mccld served uid {ATTACKER_UID}: {reply}"
        assert reply["error"]["kind"] == "AuthError" and f"uid {ATTACKER_UID}" in reply["error"]["message"]
        # ... and keeps serving its own user.
        from mccld.attach import local_request
        assert local_request(rdir, {"type": "status"})["ok"]


@pytest.mark.timeout(60)
def test_mccld_serves_a_member_of_the_attach_group():
    group = grp.getgrgid(65534) if 65534 in [g.gr_gid for g in grp.getgrall()] else None
    if group is None:
        pytest.skip("no group 65534 on this host")
    with running_daemon(MCCL_ATTACH_GROUP=group.gr_name) as (d, env):
        rdir = Path(env["MCCL_RUNTIME_DIR"])
        out = as_user(ATTACKER_UID, group.gr_gid, _raw_hello(rdir))
        assert out[0] == "ok" and out[1] is not None and out[1]["ok"], out


def _shrink(q) -> str:
    """The client shrinks its own small-op queue under mccld's native thread, by whatever handle
    it has: the /dev/shm name (named segments), else its descriptor."""
    path = Path(f"/dev/shm/{q.name}")
    if path.exists():
        os.truncate(path, 0)
        return "truncated"
    try:
        os.ftruncate(q.fd, 0)
    except PermissionError:
        return "sealed"
    return "truncated"


@pytest.mark.timeout(120)
def test_a_client_shrinking_its_queue_under_mccld_cannot_kill_it(mccld_proc):
    from support.daemon import RawClient, one_rank_job
    proc, rdir, host = mccld_proc

    def attacker():
        # In a child of its own: a client touching its own shrunk queue dies of SIGBUS too, and
        # what matters here is mccld. The child exits without closing anything, as a crash would.
        from libmccl import _core
        from mccl_common import shm
        c = RawClient(rdir)
        q = _core.FastQueue(shm.segment_name("5b00", 0, os.getpid(), 0), 4096, 0, lambda op_id, err: None)
        link = c.hello()["link_addr"]
        if hasattr(q, "fd"):
            from mccl_common import fd_handover
            fd_handover.hand_over(rdir, q.name, q.fd, os.geteuid())
        joined = c.call({"type": "join", "job": "5b00", "rank": 0, "size": 1, "timeout_s": 30.0,
                         "opts": {"fast_queue": q.name, "fast_bytes": 4096},
                         "hosts": [{"host_id": host, "link_addr": link, "ranks": [0]}]})
        assert joined["ok"], joined
        time.sleep(1.0)                 # the job's dispatcher maps the queue and waits on it
        return _shrink(q)

    try:
        out = as_user(os.geteuid(), os.getegid(), attacker)
    except RuntimeError:
        out = ("ok", "truncated (and died of it)")
    assert out[0] == "ok", out
    time.sleep(3.0)                     # mccld finds its client gone and fails the job
    assert proc.poll() is None, f"mccld died (exit {proc.returncode}) after its client {out[1]} its queue"
    assert out[1] == "sealed", "the client could shrink memory mccld maps"
    c2 = RawClient(rdir)                # ... and mccld serves the next client
    try:
        seg = one_rank_job(c2, host, "5b01")
        seg.close()
    finally:
        c2.close()
    assert proc.poll() is None


@pytest.mark.timeout(60)
def test_mccld_refuses_memory_its_client_could_shrink(daemon):
    from mccl_common import fd_handover, shm
    from mccl_common.errors import ProtocolError
    d, env = daemon
    rdir = Path(env["MCCL_RUNTIME_DIR"])
    name = shm.segment_name("5b02", 0, os.getpid(), 1)
    fd = os.memfd_create(name)               # no seals: its owner can truncate it at will
    try:
        os.ftruncate(fd, shm.HEADER_BYTES + 4096)
        with pytest.raises(ProtocolError, match=rf"segment {name} is not sealed against shrinking"):
            fd_handover.hand_over(rdir, name, fd, os.geteuid())
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_a_segment_handed_over_by_one_process_cannot_be_registered_by_another(raw):
    from mccl_common import fd_handover, shm
    d, c = raw
    rdir = c.rdir
    name = shm.segment_name("5b03", 0, os.getpid(), 1)   # in the registering client's name

    def other_process():
        seg = shm.Segment(name, 4096)
        fd_handover.hand_over(rdir, name, seg.handover_fd, os.geteuid())
        seg.close()
        return os.getpid()
    out = as_user(os.geteuid(), os.getegid(), other_process)
    assert out[0] == "ok", out
    link = c.hello()["link_addr"]
    assert c.call({"type": "join", "job": "5b03", "rank": 0, "size": 1, "timeout_s": 30.0, "opts": {},
                   "hosts": [{"host_id": d.host_id, "link_addr": link, "ranks": [0]}]})["ok"]
    reply = c.call({"type": "register", "job": "5b03", "rank": 0, "segment": name, "nbytes": 4096})
    assert not reply["ok"] and reply["error"]["kind"] == "AuthError", reply
    assert f"handed over by pid {out[1]}" in reply["error"]["message"], reply


@pytest.mark.timeout(60)
def test_segments_are_private_to_the_client_and_mccld():
    from mccl_common import shm
    seg = shm.Segment(shm.segment_name("5b04", 0, os.getpid(), 1), 4096)
    try:
        assert not Path(f"/dev/shm/{seg.name}").exists(), "a segment any process could open by name"
        with pytest.raises(PermissionError):
            os.ftruncate(seg.handover_fd, 0)      # sealed: not even its creator can shrink it
    finally:
        seg.close()


@pytest.mark.timeout(60)
def test_a_refused_client_is_told_why_at_once():
    with running_daemon() as (d, env):
        rdir = Path(env["MCCL_RUNTIME_DIR"])
        _loosen(rdir)

        def client():
            from libmccl.daemon.attach import Attachment
            os.environ["MCCL_RUNTIME_DIR"] = str(rdir)
            att = Attachment(rdir, 0, 1, 30.0)
            started = time.monotonic()
            try:
                att.connect()
                return "connected"
            except Exception as e:   # noqa: BLE001 - reported to the parent
                return f"{type(e).__name__} after {time.monotonic() - started:.1f}s: {e}"
            finally:
                att.close()
        out = as_user(ATTACKER_UID, ATTACKER_UID, client)
        # Told why: an AuthError is the daemon's answer; the hello's own 5 s timeout would have
        # raised DaemonUnavailableError ("it did not answer hello"). A < 4 s bound stood here.
        assert out[0] == "ok" and out[1].startswith("AuthError"), out


@pytest.mark.timeout(60)
def test_one_users_unregistered_hand_overs_are_capped(daemon, monkeypatch):
    from mccl_common import fd_handover, shm
    from mccl_common.errors import ProtocolError
    from mccld import fd_inbox
    monkeypatch.setattr(fd_inbox, "MAX_HELD_PER_USER", 2)
    d, env = daemon
    rdir = Path(env["MCCL_RUNTIME_DIR"])
    segs = [shm.Segment(shm.segment_name("5b05", 0, os.getpid(), g), 4096) for g in (1, 2, 3)]
    try:
        for seg in segs[:2]:
            fd_handover.hand_over(rdir, seg.name, seg.handover_fd, os.geteuid())
        with pytest.raises(ProtocolError, match="already handed over 2 segments it did not register"):
            fd_handover.hand_over(rdir, segs[2].name, segs[2].handover_fd, os.geteuid())
    finally:
        for seg in segs:
            seg.close()
