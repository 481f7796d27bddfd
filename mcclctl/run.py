"""``mcclctl run -n N [--min A --max B] [--where …] -- python train.py ARGS``.

Find the daemons, fetch their status and capacity, pick harvestable hosts (``select_hosts``,
pure), serve the rendezvous anchor from this host (``Anchor``: ``python -m
libmccl.elastic.rdzv`` in a process of its own, so this CLI stays free of torch), lease every
picked host through its launch endpoint with the submit key, and stream their output with
a host prefix until every torchrun exits. Ctrl-C, SIGTERM or a lost lease ends every lease,
and each mccld stops its job. No hostfile and no MASTER_ADDR: addresses come from the fleet.
"""

from __future__ import annotations

import fnmatch
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from mccl_common.daemon_settings import DEFAULT_SUBMIT_KEY_FILES, read_key_file
from mccl_common.errors import ConfigError, DaemonUnavailableError, MCCLError, PeerLostError
from mccl_common.launch_protocol import BEAT_S, LEASE_TIMEOUT_S, LaunchRequest, Lease, new_run_nonce
from mccl_common.status_protocol import split_addr

from . import formatting as fmt
from .commands import find_fleet_of
from .recruit import Recruiter
from .targets import Fleet, fetch, load_key

ANCHOR_START_S = 15.0       # the anchor's python imports torch before it listens
ELASTIC_RESTARTS = 100     # --max-restarts of an elastic run (--min < --max): one per re-form
CANCEL_WAIT_S = 15.0        # after a cancel, how long the daemons get to confirm (they stop the job)


@dataclass(frozen=True)
class Host:
    """A daemon as ``run`` sees it: where to lease it and what it offers."""
    name: str
    ip: str
    launch_port: int
    state: str
    cores: int
    memory: int
    device: str


# ---- choosing hosts --------------------------------------------------------------------

_WHERE = re.compile(r"^(state|host|device)=(.+)$|^(cores|memory_gib)>=([0-9.]+)$")


def parse_where(terms: list[str]) -> list[tuple[str, Callable[[Host], bool]]]:
    """``--where`` terms: state=idle|leased|busy|draining|any, host=GLOB, device=GLOB, cores>=N,
    memory_gib>=N. All must hold; without a state term a host must be idle."""
    preds = []
    has_state = False
    for term in terms:
        m = _WHERE.match(term.strip())
        if not m:
            raise ConfigError(f"[mcclctl] --where {term!r} is not one of state=S, host=GLOB, device=GLOB, "
                              "cores>=N, memory_gib>=N")
        key, val = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        if key == "state":
            has_state = True
            states = set(val.split("|"))
            if "any" in states:
                continue
            preds.append((term, lambda h, s=frozenset(states): h.state in s))
        elif key in ("host", "device"):
            preds.append((term, lambda h, k=key, g=val: fnmatch.fnmatchcase(getattr(h, "name" if k == "host" else k), g)))
        elif key == "cores":
            preds.append((term, lambda h, n=float(val): h.cores >= n))
        else:
            preds.append((term, lambda h, n=float(val): h.memory >= n * (1 << 30)))
    if not has_state:
        preds.insert(0, ("state=idle", lambda h: h.state == "idle"))
    return preds


def select_hosts(hosts: list[Host], n_min: int, n_max: int, where: list[str]) -> tuple[list[Host], dict[str, str]]:
    """Up to ``n_max`` hosts passing every ``where`` term, most cores first; raises ConfigError
    naming why hosts were left out when fewer than ``n_min`` pass. Also returns those reasons."""
    preds = parse_where(where)
    chosen, left_out = [], {}
    for h in sorted(hosts, key=lambda h: (-h.cores, h.name)):
        failed = next((term for term, ok in preds if not ok(h)), None)
        if failed is not None:
            left_out[h.name] = f"fails {failed} (it is {h.state}, {h.cores} cores, {h.device})"
        elif h.launch_port <= 0:
            left_out[h.name] = "its mccld does not accept launches (no submit key there, or MCCL_LAUNCH_PORT=0)"
        elif len(chosen) < n_max:
            chosen.append(h)
    if len(chosen) < n_min:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(left_out.items())) or "no daemon answered"
        raise ConfigError(f"[mcclctl] {len(chosen)} host(s) can take the job, it needs at least {n_min}: {why}")
    return chosen, left_out


def fleet_hosts(args, key: bytes, fleet: Fleet | None = None) -> tuple[list[Host], list[str]]:
    """Every daemon that answered both its status and its capacity, and the errors of the others."""
    # The local daemon's table: hosts of every subnet, not only mDNS.
    targets = (fleet or find_fleet_of(args, key)).targets
    status = fetch(targets, key, "status", timeout_s=args.timeout)
    capacity = {r.target: r for r in fetch(targets, key, "capacity", timeout_s=args.timeout)}
    hosts, errors = [], []
    for r in status:
        cap = capacity.get(r.target)
        if r.error or cap is None or cap.error:
            errors.append(f"{r.target.host}: {r.error or (cap.error if cap else 'no capacity answer')}")
            continue
        c = cap.result or {}
        hosts.append(Host(name=str(r.result.get("host") or r.target.host),
                          ip=split_addr(r.target.status_addr)[0],
                          launch_port=int(r.result.get("launch_port") or 0),
                          state=str((c.get("harvest") or {}).get("state", "unknown")),
                          cores=int(c.get("cores") or 0), memory=int(c.get("memory_bytes") or 0),
                          device=str(c.get("device") or "?")))
    return hosts, errors


# ---- the anchor ------------------------------------------------------------------------

class Anchor:
    """The rendezvous store, served from this host for the job's life (never harvested: it is
    the submitting host), in a child process that imports torch so this one need not."""

    def __init__(self, port: int, python: str = sys.executable, bind: str = ""):
        self.port = port or _free_port()
        self._bind = bind
        # --parent: the anchor ends with this process, even after a kill -9 of it. --bind: on the
        # address the hosts dial only, not on every network of this host.
        self._proc = subprocess.Popen([python, "-m", "libmccl.elastic.rdzv", "--port", str(self.port),
                                       "--parent", str(os.getpid()), *(["--bind", bind] if bind else [])],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + ANCHOR_START_S
        while True:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace").strip().splitlines()
                raise ConfigError(f"[mcclctl] the rendezvous anchor on port {self.port} exited at start: "
                                  f"{err[-1] if err else 'no message'}; is MCCL installed with torch here?")
            try:
                socket.create_connection((self._bind or "127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ConfigError(f"[mcclctl] the rendezvous anchor did not listen on port {self.port} "
                                      f"within {ANCHOR_START_S:g} s") from None
                time.sleep(0.1)

    def check(self) -> None:
        """Raises PeerLostError if the anchor's process has ended while the job runs: without its
        store the hosts can neither re-form nor close the run."""
        code = self._proc.poll()
        if code is not None:
            raise PeerLostError(f"[mcclctl] the rendezvous anchor (port {self.port}) exited with code {code}; "
                                "likely cause: it was killed or ran out of memory; the hosts could no longer "
                                "re-form or finish the run, so the job is stopped: start it again",
                                peer_addr=f"{self._bind or '127.0.0.1'}:{self.port}")

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5.0)
        self._proc.stderr.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def route_address(to_ip: str) -> str:
    """This host's address on the route to ``to_ip``: the interface the fleet reaches us on."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((to_ip, 9))
            return s.getsockname()[0]
        except OSError as e:
            raise ConfigError(f"[mcclctl] no route from this host to {to_ip} ({e}); run mcclctl on the "
                              "fleet's network or pass --anchor ADDRESS") from None


# ---- running -------------------------------------------------------------------------

class _Stop(Exception):
    """SIGTERM, as KeyboardInterrupt is Ctrl-C."""


def open_lease(h: Host, submit_key: bytes, request: dict) -> Lease:
    """Leases ``h`` and starts the job there; raises MCCLError naming why not."""
    lease = Lease(f"{h.ip}:{h.launch_port}", submit_key)
    try:
        lease.open(LaunchRequest.parse(request))
    except BaseException:
        lease.close()
        raise
    return lease


def run_job(hosts: list[Host], submit_key: bytes, request: dict, out: Callable[[str, str, str], None],
            on_event: Callable[[str, str, Any], None] | None = None,
            elastic: bool = False, recruiter: Recruiter | None = None,
            check: Callable[[], None] | None = None, n_min: int = 1) -> dict[str, int | str]:
    """Leases every host, streams until each exits; returns host -> exit code, or why it is out
    ("left after step N": drained; "lease lost: ..."). A lost lease ends the job everywhere,
    unless ``elastic``: then the others' torchruns re-form without that host. A ``recruiter``
    (elastic runs below their maximum) adds the idle hosts it leases while the job runs;
    ``check`` is called on every turn and ends the job by raising (the anchor died). A host
    handed back to its user (it left, or its mccld removed the job: "reclaimed") that leaves
    fewer than ``n_min`` hosts ends the job everywhere, saying so, rather than leaving the others
    waiting for a world that cannot form."""
    leases: dict[str, Lease] = {}
    results: dict[str, int | str] = {}
    errors: dict[str, BaseException] = {}

    def open_one(h: Host) -> None:
        try:
            leases[h.name] = open_lease(h, submit_key, request)
        except MCCLError as e:
            errors[h.name] = e

    threads = [threading.Thread(target=open_one, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        _cancel(leases)
        name, e = sorted(errors.items())[0]
        raise MCCLError(f"[mcclctl] could not start the job on {name}: {e}; nothing runs now") from None
    if on_event:
        for name in leases:
            on_event(name, "started", None)
    live = dict(leases)
    last_beat = time.monotonic()
    heard = dict.fromkeys(live, last_beat)      # a host's mccld sends at least every BEAT_S

    def lose(name: str, why: str) -> None:
        results[name] = f"lease lost: {why}"
        if not elastic:
            raise DaemonUnavailableError(f"[mcclctl] lost the lease on {name}: {why}")
        out(name, "err", f"[mcclctl] lost this host ({why}); the job goes on without it")
        live.pop(name).close()

    if recruiter is not None:
        recruiter.start()
    try:
        while live:
            if check is not None:
                check()
            if recruiter is not None:
                recruiter.active(set(live))
                for h, lease in recruiter.take():
                    live[h.name] = lease
                    heard[h.name] = time.monotonic()
                    results.pop(h.name, None)
                    out(h.name, "err", "[mcclctl] joined: this host is idle; the job takes it in after its "
                                       "current step")
                    if on_event:
                        on_event(h.name, "started", None)
            ready = [lease for lease in live.values() if lease.buffered()]
            if not ready:
                r, _, _ = select.select(list(live.values()), [], [], 0.5)
                ready = r
            for lease in ready:
                name = next(n for n, x in live.items() if x is lease)
                try:
                    event, data = lease.read()
                except MCCLError as e:
                    lose(name, str(e))
                    continue
                heard[name] = time.monotonic()
                if event in ("out", "err"):
                    out(name, event, str(data))
                elif event == "left":
                    results[name] = f"left after step {(data or {}).get('step')}"
                    _handed_back(name, live, n_min, results[name])
                    out(name, "err", f"[mcclctl] left after step {(data or {}).get('step')} (its user is back); "
                                     "the job goes on without it")
                elif event == "reclaimed":
                    results[name] = "reclaimed by its user"
                    _handed_back(name, live, n_min, results[name])
                    out(name, "err", "[mcclctl] reclaimed: its user is back and the job did not leave within "
                                     "MCCL_RECLAIM_GRACE, so its mccld removed it; the job goes on without this "
                                     "host (a script without libmccl.elastic restarts from its own last checkpoint)")
                    if recruiter is not None:
                        recruiter.avoid(name)
                elif event == "exit":
                    code = int((data or {}).get("code", -1))
                    if name in results:
                        pass        # it left after a drain; this is its torchrun stopping
                    elif code != 0 and elastic and len(live) > 1:
                        # A dead or failing host: the others' torchruns re-form without it.
                        results[name] = f"failed (exit {code})"
                        out(name, "err", f"[mcclctl] this host's torchrun failed (exit {code}); the job goes on "
                                         "without it")
                        if recruiter is not None:
                            recruiter.avoid(name)
                    else:
                        results[name] = code
                        # The job is ending here: a host joining now would find the rendezvous closed.
                        if recruiter is not None:
                            _cancel(dict(recruiter.stop()))
                            recruiter = None
                    lease.close()
                    del live[name]
                if on_event:
                    on_event(name, event, data)
            now = time.monotonic()
            # A cut cable sends nothing, not even a reset: silence is how it shows.
            for name in [n for n in live if now - heard[n] > LEASE_TIMEOUT_S]:
                lose(name, f"no word from its mccld for {now - heard[name]:.0f} s (it sends one every "
                           f"{BEAT_S:g} s); the host or the network to it is down")
            if now - last_beat >= BEAT_S:
                for name, lease in list(live.items()):
                    try:
                        lease.beat()
                    except OSError as e:
                        lose(name, str(e))
                last_beat = now
    except BaseException:
        if recruiter is not None:
            live.update((h.name, lease) for h, lease in recruiter.stop())
        _cancel(live)
        for name in live:
            results.setdefault(name, "cancelled")
        raise
    if recruiter is not None:
        _cancel({h.name: lease for h, lease in recruiter.stop()})
    return results


def _handed_back(name: str, live: dict, n_min: int, why: str) -> None:
    """Raises if the hosts that stay are too few for the job (``--min``)."""
    remaining = len([n for n in live if n != name])
    if remaining < n_min:
        raise MCCLError(f"[mcclctl] {name} was handed back to its user ({why}); {remaining} host(s) remain and the "
                        f"job needs at least {n_min} (--min), so it cannot go on; resubmit it when hosts are idle "
                        "(mcclctl capacity), or with a lower --min. A script that keeps checkpoints resumes from "
                        "its last one")


def _cancel(leases: dict[str, Lease]) -> None:
    """Ends every lease; waits (bounded) for each mccld to close it, which it does once its job stopped."""
    for lease in leases.values():
        try:
            lease.cancel()
        except OSError:
            pass
    deadline = time.monotonic() + CANCEL_WAIT_S
    for lease in leases.values():
        try:
            lease.settimeout(max(0.1, deadline - time.monotonic()))
            while lease.read()[0] != "exit":
                pass
        except (MCCLError, OSError):
            pass        # closed: the job is stopped
        finally:
            lease.close()


def cmd_run(args) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise ConfigError("[mcclctl] run needs a command after --, e.g. mcclctl run -n 2 -- python train.py")
    n_min, n_max = _counts(args)
    key = load_key(args.key_file)
    submit_key = read_key_file(args.submit_key_file or os.environ.get("MCCL_SUBMIT_KEY_FILE", ""),
                               DEFAULT_SUBMIT_KEY_FILES, "MCCL_SUBMIT_KEY_FILE")
    if submit_key is None:
        raise ConfigError("[mcclctl] no submit key: pass --submit-key-file or set MCCL_SUBMIT_KEY_FILE "
                          "(the key the fleet's daemons accept launches with, not the fleet key)")
    fleet = find_fleet_of(args, key)
    hosts, errors = fleet_hosts(args, key, fleet)
    chosen, left_out = select_hosts(hosts, n_min, n_max, args.where or [])
    job = args.job or f"mccl-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    env = dict(_env_pair(e) for e in args.env or [])
    anchor_ip = args.anchor or route_address(chosen[0].ip)
    nnodes = str(n_min) if n_min == n_max else f"{n_min}:{n_max}"
    say = _sayer(args.json)
    for e in errors:
        say("warning", {"message": f"left out, no answer: {e}"})
    anchor = Anchor(args.rdzv_port, bind=anchor_ip)
    say("plan", {"job": job, "fleet": fleet.describe(), "hosts": [h.name for h in chosen], "nnodes": nnodes,
                 "left_out": left_out, "anchor": f"{anchor_ip}:{anchor.port}"})
    stop_on_term = signal.signal(signal.SIGTERM, _raise_stop)
    width = max(len(h.name) for h in chosen)
    try:
        request = {"job": job, "rdzv_endpoint": f"{anchor_ip}:{anchor.port}", "nnodes": nnodes,
                   "nproc_per_node": args.nproc_per_node, "argv": argv, "cwd": args.cwd or os.getcwd(),
                   "env": env,
                   # Elastic: each re-form (a host left or died) is a restart of torchrun's workers.
                   "max_restarts": args.max_restarts if args.max_restarts is not None else
                   (ELASTIC_RESTARTS if n_min < n_max else 0),
                   # A state term chose the hosts on purpose: the daemons must not refuse a busy one.
                   "any_state": any(w.strip().startswith("state=") for w in args.where or []),
                   # Each host derives this run's own key from it and the submit key (launch_protocol.run_key);
                   # recruited hosts get the same request, so the same key.
                   "run_nonce": new_run_nonce()}
        recruiter = None
        if n_min < n_max:
            # Idle hosts found later (also those that left earlier) join the run, up to --max.
            recruiter = Recruiter(lambda: select_hosts(fleet_hosts(args, key)[0], 0, n_max, args.where or [])[0],
                                  lambda h: open_lease(h, submit_key, request), n_max,
                                  every_s=max(0.5, args.recruit_every))
        try:
            results = run_job(chosen, submit_key, request,
                              lambda host, stream, line: _print_line(args.json, width, host, stream, line),
                              elastic=n_min < n_max, recruiter=recruiter, check=anchor.check, n_min=n_min)
        except KeyboardInterrupt:
            say("cancelled", {"message": "interrupted: every host's job was stopped"})
            return 130
        except _Stop:
            say("cancelled", {"message": "SIGTERM: every host's job was stopped"})
            return 143
        except MCCLError as e:
            say("error", {"message": f"{e} (the job was stopped on every host)"})
            return 1
        except BrokenPipeError:
            # Whoever read the output is gone (``mcclctl run ... | head``): the job was stopped
            # like on Ctrl-C. Python would complain again flushing the dead stdout at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            print("mcclctl run: the output was closed: every host's job was stopped", file=sys.stderr)
            return 141
    finally:
        signal.signal(signal.SIGTERM, stop_on_term)
        anchor.stop()
    rc = job_outcome(results)
    say("exit", {"codes": results, "rc": rc})
    return rc


def job_outcome(results: dict[str, int | str]) -> int:
    """The job's exit code: the first host's failure, else 0 if some host finished. Hosts that
    are out (left after a drain, failed or lost while the others went on: strings) did their
    part; the job's result is that of the hosts that stayed to the end."""
    codes = [c for c in results.values() if isinstance(c, int)]
    bad = [c for c in codes if c != 0]
    if bad:
        return bad[0]
    return 0 if codes else 1


def _counts(args) -> tuple[int, int]:
    if args.n is not None and (args.min is not None or args.max is not None):
        raise ConfigError("[mcclctl] give -n N, or --min A --max B, not both")
    if args.n is not None:
        lo = hi = args.n
    else:
        lo = args.min if args.min is not None else 1
        hi = args.max if args.max is not None else lo
    if not 1 <= lo <= hi:
        raise ConfigError(f"[mcclctl] host counts {lo}..{hi} make no sense; need 1 <= MIN <= MAX")
    return lo, hi


def _env_pair(text: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep or not k:
        raise ConfigError(f"[mcclctl] --env {text!r} is not NAME=VALUE")
    return k, v


def _raise_stop(signum, frame) -> None:
    raise _Stop()


def _print_line(as_json: bool, width: int, host: str, stream: str, line: str) -> None:
    if as_json:
        print(fmt.to_json_line({"host": host, "stream": stream, "line": line}), flush=True)
    else:
        print(fmt.host_line(host, width, line), file=sys.stderr if stream == "err" else sys.stdout, flush=True)


def _sayer(as_json: bool) -> Callable[[str, dict], None]:
    def say(kind: str, data: dict) -> None:
        if as_json:
            print(fmt.to_json_line({"event": kind, **data}), flush=True)
        else:
            print(fmt.run_event(kind, data), file=sys.stderr, flush=True)
    return say
