"""The launch endpoint: ``mcclctl run`` leases this host and starts one torchrun here.

One TCP connection is one lease (``mccl_common.launch_protocol``). The request must open
(AES-256-GCM) under keys derived from the submit key (not the fleet key); it is validated once
(``LaunchRequest.parse``) and refused, with nothing started, if the host is not harvestable
(unless the request asks for any state), too many jobs run, or mccld runs as root and
MCCL_LAUNCH_USER names no user jobs may run as (launch_identity.py: never one that can read
mccld's keys). The job runs as that user, with an allow-listed environment, in a session of its
own; its output goes back line by line, encrypted, and
the lease ends with its exit code. A client that cancels, disconnects or stays silent for
LEASE_TIMEOUT_S ends the lease: the job's process group gets SIGTERM (torchrun passes it to
its workers), then SIGKILL after STOP_GRACE_S.

Draining (the host's user is back): ``drain`` creates each job's MCCL_DRAIN_FILE; a job that
uses libmccl.elastic saves at its next step boundary and its ranks here exit; once they wrote
the ".left" file the lease reports "left" and torchrun is stopped, leaving the run to the
other hosts (docs/elastic.md). A job that has not left when MCCL_RECLAIM_GRACE runs out is
removed (``reclaim_after``, reclaim.py); while the user is here the jobs run at background
priority (``background``).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import pwd
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from mccl_common.errors import ConfigError, MCCLError, ProtocolError
from mccl_common.launch_protocol import (BEAT_S, DRAIN_ENV, LEASE_TIMEOUT_S, LEFT_SUFFIX, MAX_LINE_CHARS,
                                         MAX_REQUEST_LINE, PROTO, RUN_KEY_ENV, Channel, LaunchRequest,
                                         accept_request, run_key)
from mccl_common.status_protocol import IO_TIMEOUT_S, MAX_PREAUTH_LINE, Conn, HARVESTED_STATES

from . import job_unit, launch_identity
from ..net.gate import REWARN_S, Gate, Ticket
from ..logutil import OnceLogger
from .priority import Background
from .proctree import JobTree
from .reclaim import Removal

log = logging.getLogger(__name__)

MAX_LAUNCHES = 4          # jobs one host runs at once through this endpoint
STOP_GRACE_S = 10.0       # SIGTERM to SIGKILL: torchrun needs a moment to stop its workers
_POLL_S = 0.2


def torchrun_command(req: LaunchRequest, python: str = sys.executable) -> list[str]:
    """The command that runs ``req`` here: torchrun with the mccl rendezvous, its anchor served
    elsewhere (is_host=0), then the user's program. ``python script.py`` and ``python -m mod``
    run in mccld's interpreter (the one MCCL is installed in); anything else as given."""
    cmd = [python, "-m", "torch.distributed.run", "--rdzv-backend", "mccl",
           "--rdzv-endpoint", req.rdzv_endpoint, "--rdzv-id", req.job, "--rdzv-conf", "is_host=0",
           "--nnodes", req.nnodes, "--nproc-per-node", str(req.nproc_per_node),
           "--max-restarts", str(req.max_restarts)]
    argv = list(req.argv)
    if Path(argv[0]).name in ("python", "python3") and len(argv) > 1:
        argv = argv[1:]
        if argv[0] == "-m" and len(argv) > 1:
            return cmd + ["--module", *argv[1:]]
        if not argv[0].startswith("-"):
            return cmd + argv
        argv = [req.argv[0]] + argv     # interpreter options: run the command as given
    return cmd + ["--no-python", *argv]


class LaunchServer:
    """``start``/``stop``; ``running()`` counts the leases whose job runs (the harvester's "leased").
    ``command`` turns a request into the argv to start (torchrun's; tests start something
    smaller), ``lease_timeout_s`` is how long a silent client keeps its lease."""

    def __init__(self, key: bytes, host_id: str, runtime_dir: Path, addr: str = "0.0.0.0", port: int = 29653,
                 launch_user: str = "", harvest_state: Callable[[], str] | None = None,
                 on_change: Callable[[], None] | None = None, gate: Gate | None = None,
                 command: Callable[[LaunchRequest], list[str]] = torchrun_command,
                 lease_timeout_s: float = LEASE_TIMEOUT_S, secret_files: tuple[Path, ...] = (),
                 via: str = "direct"):
        if not key:
            raise ConfigError("[launch] no submit key; set MCCL_SUBMIT_KEY_FILE (a key that is not the fleet key)")
        self._key = key
        self._host_id = host_id
        self._runtime_dir = runtime_dir
        self._addr = addr
        self._port = port
        self._user = launch_user
        self._secret_files = secret_files   # mccld's key files: no job may run as a user who can read them
        self._harvest_state = harvest_state
        self._on_change = on_change or (lambda: None)
        self._gate = gate or Gate.from_config("launch")
        self._command = command
        self._lease_timeout_s = lease_timeout_s
        # "systemd": each job a transient unit of its own, outside mccld's sandbox (job_unit.py).
        self._via = via
        self._leases = itertools.count(1)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._jobs: dict[str, subprocess.Popen] = {}    # lease id -> its torchrun (or its systemd-run)
        self._units: dict[str, str] = {}                # lease id -> its job's unit (via systemd)
        self._drain_files: dict[str, Path] = {}         # lease id -> the file that tells its job to leave
        self._conns: set[threading.Thread] = set()
        self._once = OnceLogger(log, rewarn_s=REWARN_S)   # keyed by peer address, not connection
        self._reclaim_due: dict[str, float] = {}        # drain file -> monotonic deadline of its job
        self._background = Background()
        self.removed = 0                                # jobs removed at their reclaim deadline

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1] if self._sock else self._port

    @property
    def gate(self) -> Gate:
        return self._gate

    def running(self) -> int:
        with self._lock:
            return len(self._jobs)

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    def drain(self) -> int:
        """The host's user is back: tell every running job to leave at its next step boundary
        (libmccl.elastic sees the file, saves, and this host's ranks exit); returns how many.
        A job that never checks runs on until it ends."""
        with self._lock:
            files = list(self._drain_files.values())
        for f in files:
            try:
                f.touch()
            except OSError as e:
                log.warning("[launch] cannot create drain file %s: %s", f, e)
        if files:
            log.warning("[launch] draining: %d job(s) told to leave this host at their next step", len(files))
        return len(files)

    def background(self) -> int:
        """The host's user is here: every job's processes to background priority; how many."""
        with self._lock:
            trees = [self._tree(lease, p) for lease, p in self._jobs.items() if p.poll() is None]
        return self._background.lower([pid for tree in trees for pid in tree.scan()])

    def _tree(self, lease: str, proc: subprocess.Popen):
        """The job's processes: its unit's cgroup (via systemd), else the tree under its torchrun."""
        unit = self._units.get(lease)
        return job_unit.UnitTree(unit, job_unit.user_manager()) if unit else JobTree(proc.pid)

    def reclaim_after(self, grace_s: float) -> int:
        """Every running job that has not left ``grace_s`` from now is removed (its lease
        ends); returns how many got the deadline."""
        deadline = time.monotonic() + grace_s
        with self._lock:
            files = [str(f) for f in self._drain_files.values()]
            for f in files:
                self._reclaim_due.setdefault(f, deadline)
        return len(files)

    def _reclaim_check(self, drain_file: Path, job: "_Job", send, name: str, announced: bool) -> bool:
        """Called on every turn of a lease's pump: past the job's reclaim deadline, starts its
        removal (and tells the client, unless the job already said it left); True once it is
        being removed."""
        if job.removal is not None:
            job.removal.tick()
            return True
        with self._lock:
            due = self._reclaim_due.get(str(drain_file))
        if due is None or time.monotonic() < due:
            return False
        log.warning("[launch] job %s did not leave within MCCL_RECLAIM_GRACE: removing it from this host", name)
        job.removal = Removal(job_unit.UnitTree(job.unit, job_unit.user_manager()) if job.unit
                              else JobTree(job.proc.pid))
        with self._lock:
            self.removed += 1
        if not announced:
            send("reclaimed", {"host": self._host_id, "why": "its user is back and the job did not leave at a "
                               "step boundary within MCCL_RECLAIM_GRACE"})
        return True

    def start(self) -> "LaunchServer":
        if self._sock is not None:
            return self
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._addr, self._port))
        except OSError as e:
            sock.close()
            raise ConfigError(f"[launch] cannot listen on {self._addr}:{self._port}: {e.strerror}; another mccld "
                              "holds the port or the address is not local; stop it or set MCCL_LAUNCH_PORT") from e
        sock.listen(16)
        sock.settimeout(0.5)    # the accept loop wakes to notice stop()
        self._sock = sock
        self._stop.clear()
        self._gate.start()
        self._thread = threading.Thread(target=self._accept_loop, name="mccld-launch", daemon=True)
        self._thread.start()
        log.info("launch endpoint listening on %s:%d (jobs run as %s)", self._addr, self.port,
                 self._user or pwd.getpwuid(os.geteuid()).pw_name)
        return self

    def stop(self, timeout_s: float = STOP_GRACE_S + 5.0) -> None:
        """Ends every lease (their jobs are stopped) and the endpoint."""
        if self._sock is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        with self._lock:
            conns = list(self._conns)
        deadline = time.monotonic() + timeout_s
        for t in conns:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        self._sock.close()
        self._gate.close()
        self._sock = self._thread = None

    # ---- serving ---------------------------------------------------------------------

    def _accept_loop(self) -> None:
        def track(t: threading.Thread) -> None:
            with self._lock:
                self._conns.add(t)
        self._gate.accept_loop(self._sock, self._stop, self._serve, "mccld-launch-conn", started=track)

    def _serve(self, sock: socket.socket, peer: str, ticket: Ticket) -> None:
        try:
            sock.settimeout(IO_TIMEOUT_S)
            conn = Conn(sock, peer)
            nonce = os.urandom(16).hex()
            conn.send({"mccl_launch": PROTO, "nonce": nonce, "host": self._host_id})
            got = accept_request(self._key, conn.recv("launch request", limit=MAX_REQUEST_LINE), nonce,
                                 self._host_id)
            if got is None:
                self._once.warn(peer.rpartition(":")[0], "[launch] refused a launch request from peer=%s: it does "
                                "not open under the submit key (another key, or altered on the path); nothing "
                                "was started", peer)
                conn.send({"ok": False, "error": {"kind": "AuthError", "message": (
                    "[launch] the request does not open under this host's submit key; use this fleet's "
                    "submit key (MCCL_SUBMIT_KEY_FILE)")}})
                return
            ticket.passed()
            chan, body = got
            self._lease(conn, peer, body, chan)
        except ConnectionError as e:
            log.debug("launch connection from peer=%s closed early: %s", peer, e)
        except (OSError, ProtocolError) as e:
            self._once.warn(peer.rpartition(":")[0], "[launch] connection from peer=%s failed: %s", peer, e)
        except Exception:
            self._once.warn(f"bug:{peer.rpartition(':')[0]}", "[launch] unexpected failure serving peer=%s",
                            peer, exc_info=True)
        finally:
            ticket.release()
            sock.close()
            with self._lock:
                self._conns.discard(threading.current_thread())

    def _refusal(self, req_body: str) -> tuple[LaunchRequest | None, MCCLError | None]:
        try:
            req = LaunchRequest.parse(json.loads(req_body))
        except (ValueError, RecursionError) as e:
            return None, ProtocolError(f"[launch] bad request: not JSON ({e})")
        except ProtocolError as e:
            return None, e
        try:
            pw = launch_identity.launch_user(self._user, self._secret_files, self._host_id)
        except ConfigError as e:
            return req, e
        me = os.geteuid()
        if me != 0 and pw.pw_uid != me:
            # Only root switches users: a service-account mccld (and its own systemd manager) starts
            # jobs as itself, whatever MCCL_LAUNCH_USER says.
            return req, ConfigError(f"[launch] {self._host_id}: mccld runs as uid {me}, not root, so it can start "
                                    f"jobs only as itself, not as {pw.pw_name} (MCCL_LAUNCH_USER); set "
                                    f"MCCL_LAUNCH_USER to mccld's own user, or run mccld as root")
        if not Path(req.cwd).is_dir():
            return req, ConfigError(f"[launch] working directory {req.cwd} does not exist on {self._host_id}; "
                                    "give every host the same checkout path, or pass --cwd")
        state = self._harvest_state() if self._harvest_state else None
        if state is not None and state not in HARVESTED_STATES and not req.any_state:
            return req, MCCLError(f"[launch] {self._host_id} is {state}, not harvestable: its user is at it "
                                  "(or outside its harvest hours); pick another host, or --where state=any")
        with self._lock:
            if len(self._jobs) >= MAX_LAUNCHES:
                return req, MCCLError(f"[launch] {self._host_id} already runs {MAX_LAUNCHES} jobs; "
                                      "wait for one to end")
        return req, None

    def _lease(self, conn: Conn, peer: str, body: str, chan: Channel) -> None:
        def send(event: str, data) -> None:
            conn.send(chan.seal_event(event, data))

        req, err = self._refusal(body)
        if err is not None:
            log.warning("[launch] refused %s from peer=%s: %s", req.job if req else "a request", peer, err)
            send("refused", {"kind": type(err).__name__, "message": str(err)})
            return
        lease_id = f"{req.job}@{peer}"
        drain_file = self._runtime_dir / f"drain-{req.job}-{os.getpid()}-{threading.get_ident()}"
        _remove(drain_file)
        unit = job_unit.unit_name(req.job, next(self._leases)) if self._via == "systemd" else None
        try:
            job = _Job(self._spawn(req, drain_file, unit), unit)
        except (OSError, subprocess.SubprocessError, KeyError) as e:
            shutil.rmtree(_job_dir(drain_file), ignore_errors=True)
            msg = f"[launch] {self._host_id} could not start the job: {e}"
            log.warning("%s", msg)
            send("refused", {"kind": "MCCLError", "message": msg})
            return
        with self._lock:
            self._jobs[lease_id] = job.proc
            if unit:
                self._units[lease_id] = unit
            self._drain_files[lease_id] = drain_file
        self._on_change()
        log.info("[launch] job %s for peer=%s started (pid %d): %s", req.job, peer, job.proc.pid,
                 " ".join(req.argv))
        try:
            send("started", {"host": self._host_id, "pid": job.proc.pid})
            code = self._pump(conn, job, send, req.job, peer, drain_file, chan)
        finally:
            job.stop()
            with self._lock:
                self._jobs.pop(lease_id, None)
                self._units.pop(lease_id, None)
                self._drain_files.pop(lease_id, None)
                self._reclaim_due.pop(str(drain_file), None)
            _remove(drain_file)
            _remove(Path(str(drain_file) + LEFT_SUFFIX))
            shutil.rmtree(_job_dir(drain_file), ignore_errors=True)
            self._on_change()
        if code is not None:
            log.info("[launch] job %s for peer=%s exited with %d", req.job, peer, code)
            send("exit", {"code": code})

    def _spawn(self, req: LaunchRequest, drain_file: Path, unit: str | None = None) -> subprocess.Popen:
        """Start the job: mccld's child in a session of its own, or (``unit``) a transient systemd
        unit of its own, outside mccld's sandbox, whose systemd-run is our child (job_unit.py)."""
        pw = launch_identity.launch_user(self._user, self._secret_files, self._host_id)
        env = launch_identity.job_environment(os.environ, dict(req.env), pw, {
            "MCCL_HOST_ID": self._host_id, "MCCL_RUNTIME_DIR": str(self._runtime_dir),
            DRAIN_ENV: str(drain_file), "PYTHONUNBUFFERED": "1"})
        kwargs = {}
        if pw.pw_uid != os.geteuid():
            kwargs = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": os.getgrouplist(pw.pw_name, pw.pw_gid)}
        job_dir = _job_dir(drain_file)
        if req.run_nonce or unit:
            self._make_job_dir(job_dir, kwargs.get("user"), kwargs.get("group"))
        if req.run_nonce:
            env[RUN_KEY_ENV] = str(self._write_run_key(req, job_dir, kwargs.get("user"), kwargs.get("group")))
        if unit is None:
            return subprocess.Popen(self._command(req), cwd=req.cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    **kwargs)
        env_file = job_unit.write_env(job_dir, env, kwargs.get("user"), kwargs.get("group"))
        cmd = job_unit.systemd_run_command(unit, self._command(req), req.cwd, env_file,
                                           user=job_unit.user_manager(), uid=pw.pw_uid, gid=pw.pw_gid,
                                           groups=os.getgrouplist(pw.pw_name, pw.pw_gid), stop_grace_s=STOP_GRACE_S)
        log.info("[launch] job %s runs as unit %s (outside mccld's sandbox)", req.job, unit)
        # systemd-run itself runs as mccld, in mccld's sandbox; the job it asks for does not.
        return subprocess.Popen(cmd, env=job_unit.manager_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)

    @staticmethod
    def _make_job_dir(job_dir: Path, uid: int | None, gid: int | None) -> None:
        """The lease's private directory (its run key, its environment file), the job user's own."""
        shutil.rmtree(job_dir, ignore_errors=True)     # a stale one of a killed mccld
        os.mkdir(job_dir, 0o700)
        if uid is not None:
            os.chown(job_dir, uid, gid if gid is not None else -1)

    def _write_run_key(self, req: LaunchRequest, job_dir: Path, uid: int | None, gid: int | None) -> Path:
        """The run key (launch_protocol.run_key) in a file only the job's user can read, in a
        directory of the job's own; the job finds it through MCCL_JOB_KEY_FILE. Every host of
        the run derives the same key from the request, so it never crosses the network."""
        path = job_dir / "run.key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(run_key(self._key, req.job, req.run_nonce).hex() + "\n")
        if uid is not None:
            os.chown(path, uid, gid if gid is not None else -1)
        return path

    def _pump(self, conn: Conn, job: "_Job", send, name: str, peer: str, drain_file: Path,
              chan: Channel) -> int | None:
        """Streams output until the job exits (its code) or the lease ends (None). Once this
        host's ranks have saved and left (the drain's ".left" file), torchrun is stopped: its
        rendezvous handler takes the host out of the run, so the others re-form at once."""
        proc, lines, readers = job.proc, job.lines, job.readers
        left = Path(str(drain_file) + LEFT_SUFFIX)
        told_left = False
        last_heard = last_sent = time.monotonic()
        exited = 0.0
        sock = conn.sock
        try:
            while True:
                while True:
                    try:
                        stream, line = lines.get_nowait()
                    except queue.Empty:
                        break
                    if told_left:
                        # torchrun's own shutdown noise (a SIGTERM traceback) once the host left
                        # on purpose: the user saw "left"; mccld's log keeps it.
                        log.debug("[launch] job %s after leaving: %s", name, line)
                        continue
                    send(stream, line)
                    last_sent = time.monotonic()
                if not told_left and left.exists():
                    told_left = True
                    try:
                        step = int(left.read_text() or -1)
                    except (OSError, ValueError):
                        step = -1
                    log.warning("[launch] job %s left this host after step %d; stopping its torchrun", name, step)
                    send("left", {"step": step})
                    # torchrun alone: it stops its workers itself (one may still be closing its
                    # process group), and its rendezvous handler leaves the run at exit.
                    try:
                        proc.send_signal(signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                if self._reclaim_check(drain_file, job, send, name, told_left):
                    told_left = True
                if proc.poll() is not None and lines.empty():
                    exited = exited or time.monotonic()
                    # Something outside the session may hold the pipes open: the exit counts anyway.
                    if not any(t.is_alive() for t in readers) or time.monotonic() - exited > 2.0:
                        return proc.returncode
                if self._stop.is_set():
                    log.warning("[launch] mccld is stopping: ending job %s of peer=%s", name, peer)
                    return None
                readable, _, _ = select.select([sock], [], [], _POLL_S)
                now = time.monotonic()
                if readable or conn.pending():
                    ctl = self._control(conn, chan, peer, name)    # raises ConnectionError on EOF
                    if ctl is not None:
                        last_heard = now
                    if ctl == "cancel":
                        log.info("[launch] peer=%s cancelled job %s", peer, name)
                        return None
                # Checked whether or not something came: injected junk must not stand in for beats.
                if now - last_heard > self._lease_timeout_s:
                    log.warning("[launch] peer=%s silent for %.0f s: lease of job %s lost, stopping it",
                                peer, now - last_heard, name)
                    return None
                if now - last_sent >= BEAT_S:
                    send("beat", None)
                    last_sent = now
        except (ConnectionError, OSError) as e:
            log.warning("[launch] lease of job %s lost (peer=%s: %s); stopping it", name, peer, e)
            return None

    def _control(self, conn: Conn, chan: Channel, peer: str, name: str) -> str | None:
        """The client's next beat or cancel; None (logged, once per peer a minute) for a message
        that fails to open or is out of sequence: injected or replayed by someone on the path, it
        neither ends the job nor keeps a lease alive whose client is gone."""
        msg = conn.recv("lease message", limit=MAX_PREAUTH_LINE)
        ctl = chan.open_control(msg)
        if ctl is None:
            self._once.warn(f"ctl:{peer.rpartition(':')[0]}", "[launch] ignored a lease message for job %s from "
                            "peer=%s: it fails its submit-key authentication or sequence check (injected or "
                            "replayed on the path, or an mcclctl of another release)", name, peer)
        return ctl


class _Job:
    """A started torchrun, the threads reading its output, and its one-time stop."""

    def __init__(self, proc: subprocess.Popen, unit: str | None = None):
        self.proc = proc
        self.unit = unit          # its systemd unit, when it runs as one (proc is then its systemd-run)
        self.lines: queue.Queue = queue.Queue(maxsize=1024)  # full: the job's pipe stalls, not our memory
        self.closed = threading.Event()
        self.readers = [threading.Thread(target=_read_lines, args=(stream, name, self.lines, self.closed),
                                         daemon=True,
                                         name=f"mccld-launch-{name}")
                        for stream, name in ((proc.stdout, "out"), (proc.stderr, "err"))]
        for t in self.readers:
            t.start()
        self._stopped = False
        self.removal: Removal | None = None     # set once the reclaim deadline ends the job

    def stop(self) -> None:
        """SIGTERM to the job's whole session, SIGKILL after the grace; reaps it. Idempotent:
        once reaped, its group id may belong to someone else."""
        if self._stopped:
            return
        self._stopped = True
        proc = self.proc
        if self.unit is not None:
            # Its processes are not ours: the unit's stop signals its whole cgroup, SIGKILL after
            # the grace; then systemd-run, waiting on it, exits with it.
            job_unit.stop(self.unit, job_unit.user_manager())
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        # Workers torchrun left behind (it was killed, or they ignore SIGTERM) share its session.
        _signal_group(proc.pid, signal.SIGKILL)
        if self.removal is not None:
            self.removal.finish()   # workers in sessions of their own: the host is free of the job
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            log.error("[launch] job pid %d survives SIGKILL (uninterruptible I/O?)", proc.pid)
        self.closed.set()    # readers blocked on a full queue give up their line
        for t in self.readers:
            t.join(timeout=5.0)
        # A reader still blocked means something outside the session holds the pipe: closing
        # under it would block on the reader's lock, so leave that stream to the GC.
        for t, stream in zip(self.readers, (proc.stdout, proc.stderr)):
            if not t.is_alive() and stream is not None:
                stream.close()


def _job_dir(drain_file: Path) -> Path:
    """The lease's private directory (its run key), next to its drain file."""
    return drain_file.with_name(drain_file.name + ".job")


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.debug("cannot remove %s: %s", path, e)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _read_lines(stream, name: str, out: queue.Queue, closed: threading.Event) -> None:
    try:
        for raw in iter(lambda: stream.readline(MAX_LINE_CHARS + 1), b""):
            text = raw.decode("utf-8", "replace").rstrip("\n")
            while not closed.is_set():
                try:
                    out.put((name, text), timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if closed.is_set():
                return
    except (OSError, ValueError):
        pass    # the stream was closed under us: the lease ended


__all__ = ["LaunchServer", "torchrun_command"]
