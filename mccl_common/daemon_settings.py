"""Settings of the daemon, declared once each (env var, default, unit, help).

``load_config(path)`` reads an optional TOML file whose keys are the field names,
then the environment on top (the environment wins, so a one-off override needs no
file edit).
"""

from __future__ import annotations

import grp
import os
import secrets
import stat
import sys
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from . import key_file_trust, localtrust
from .attach_protocol import SOCKET_NAME
from .errors import ConfigError
from .settings import _require, closest_name, load, register, setting

DEFAULT_KEY_FILES = ("/etc/mccl/fleet.key", "~/.config/mccl/fleet.key")
DEFAULT_SUBMIT_KEY_FILES = ("/etc/mccl/submit.key", "~/.config/mccl/submit.key")
# Where the packaged service (packaging/) runs its daemon. A client with no MCCL_RUNTIME_DIR
# falls back to it, so a user in the attach group needs no setting to reach that daemon.
# macOS clears /var/run at boot and only root may create in it, so the LaunchDaemon's
# unprivileged user keeps its directory under /usr/local/var instead.
SERVICE_RUNTIME_DIR = "/usr/local/var/run/mccl" if sys.platform == "darwin" else "/run/mccl"


@register
@dataclass(frozen=True)
class DaemonConfig:
    """Settings of mccld (and of the MCCL_DAEMON=1 client, which needs the runtime dir)."""

    fleet: str = setting(
        "MCCL_FLEET", "default", "name",
        "fleet name; daemons only link with daemons of the same fleet")
    fleet_key: str = setting(
        "MCCL_FLEET_KEY", "", "secret",
        "shared fleet key for link authentication (prefer MCCL_KEY_FILE)")
    key_file: str = setting(
        "MCCL_KEY_FILE", "", "path",
        "file holding the fleet key, mode 0600; empty: /etc/mccl/fleet.key or ~/.config/mccl/fleet.key")
    iface: str = setting(
        "MCCL_IFACE", "", "interface",
        "interface the daemon listens and advertises on; empty: the first wired interface")
    listen_addr: str = setting(
        "MCCL_LISTEN_ADDR", "", "address",
        "IPv4 address to listen and advertise on; overrides MCCL_IFACE")
    port: int = setting(
        "MCCL_PORT", 29650, "port",
        "TCP port of the authenticated daemon-to-daemon links")
    status_port: int = setting(
        "MCCL_STATUS_PORT", 29651, "port",
        "authenticated read-only status endpoint; 0 disables it")
    launch_port: int = setting(
        "MCCL_LAUNCH_PORT", 29653, "port",
        "endpoint where `mcclctl run` leases this host and starts its torchrun (needs MCCL_SUBMIT_KEY_FILE); "
        "0 disables it")
    submit_key_file: str = setting(
        "MCCL_SUBMIT_KEY_FILE", "", "path",
        "file holding the submit key (mode 0600, not the fleet key) that `mcclctl run` must prove to start "
        "jobs here; empty: /etc/mccl/submit.key or ~/.config/mccl/submit.key; none: launching is off")
    launch_user: str = setting(
        "MCCL_LAUNCH_USER", "", "user",
        "user the jobs `mcclctl run` starts run as, never one that can read mccld's key files; empty: none "
        "(mccld's own user could read its keys): name mccld's own user, or root, here to accept that (e.g. in "
        "a container)")
    launch_via: str = setting(
        "MCCL_LAUNCH_VIA", "auto", "auto|direct|systemd",
        "how launched jobs start: systemd runs each as a transient unit of its own (systemd-run), outside "
        "mccld's service sandbox, so it can write its working directory and home; direct runs it as mccld's "
        "child; auto: systemd when mccld runs as a systemd service, else direct")
    launch_python: str = setting(
        "MCCL_LAUNCH_PYTHON", "", "path",
        "interpreter (with torch and MCCL) that launched jobs' torchrun and `python` commands run in; empty: "
        "mccld's own (the service's venv has no torch: packaging/linux/install.sh --job-python sets it)")
    metrics_port: int = setting(
        "MCCL_METRICS_PORT", 29652, "port",
        "Prometheus /metrics port; 0 disables it")
    metrics_addr: str = setting(
        "MCCL_METRICS_ADDR", "", "address",
        "address the Prometheus /metrics endpoint (unauthenticated HTTP) binds; empty: the fleet interface's "
        "address, the one the links use (0.0.0.0: every interface)")
    metrics_presence: bool = setting(
        "MCCL_METRICS_PRESENCE", False, "bool",
        "also export the figures that tell when this host's user is at it or away (mccl_host_idle_seconds, "
        "mccl_harvestable_seconds_per_night); off: anyone who reaches /metrics would learn when the host is "
        "unattended")
    runtime_dir: str = setting(
        "MCCL_RUNTIME_DIR", "", "path",
        "directory (mode 0700, 0750 with MCCL_ATTACH_GROUP) of the attach socket; empty: /run/mccl, "
        "$XDG_RUNTIME_DIR/mccl or /tmp/mccl-<uid>; a client whose own directory holds no daemon also "
        "tries the service's (/run/mccl, macOS /usr/local/var/run/mccl)")
    attach_group: str = setting(
        "MCCL_ATTACH_GROUP", "", "group",
        "group whose members' processes may attach to this daemon (runtime dir 0750, token 0640 and "
        "socket 0660 in that group; segments are handed over by descriptor, never shared with it); empty: "
        "only this user "
        "(docs/service.md)")
    allow_wifi: bool = setting(
        "MCCL_ALLOW_WIFI", False, "bool",
        "allow a Wi-Fi interface for links (slow and jittery; off by default)")
    host_id: str = setting(
        "MCCL_HOST_ID", "", "name",
        "identity of this host in the fleet; empty: derived from hostname and machine id")
    mdns_ttl_s: int = setting(
        "MCCL_MDNS_TTL", 60, "seconds",
        "TTL of the mDNS records; a host that vanishes without goodbye expires after it")
    discovery: str = setting(
        "MCCL_DISCOVERY", "mdns", "mdns|off",
        "mdns: announce this daemon and find the fleet's daemons by multicast DNS (beside MCCL_PEERS and "
        "gossip); off: no multicast at all, for a daemon on loopback or a network that drops multicast "
        "(mcclctl then reads the fleet from this host's mccld, the MCCL_PEERS seeds, or --host)")
    peers: str = setting(
        "MCCL_PEERS", "", "list",
        "seed daemons beside mDNS, comma-separated host[:port] (port: their MCCL_PORT, default this one's); a DNS "
        "name may resolve to several addresses. Daemons reached through a seed gossip their fleet tables over the "
        "authenticated links, so every daemon learns the whole fleet across subnets and VLANs (docs/discovery.md)")
    gossip_interval_s: float = setting(
        "MCCL_GOSSIP_INTERVAL", 2.0, "seconds",
        "how often a daemon sends its fleet-table digest to a few random peers (and retries unreachable seeds, "
        "with backoff)")
    gossip_ttl_s: float = setting(
        "MCCL_GOSSIP_TTL", 30.0, "seconds",
        "a gossiped fleet entry whose owner has not refreshed it for this long is dropped (a host that died)")
    topology_probes: int = setting(
        "MCCL_TOPOLOGY_PROBES", 48, "count",
        "without MCCL_TOPOLOGY: how many other daemons this one measures RTTs to, so the switches can be "
        "inferred (every pair up to this many + 1 hosts, a fixed sample beyond; `mcclctl links --topology`)")
    topology_interval_s: float = setting(
        "MCCL_TOPOLOGY_INTERVAL", 300.0, "seconds",
        "without MCCL_TOPOLOGY: how often the peers' RTT rows are gathered again once the fleet settled "
        "(RTTs are measured again whenever daemons join or leave)")
    link_timeout_s: float = setting(
        "MCCL_LINK_TIMEOUT", 10.0, "seconds",
        "time to connect and authenticate a daemon-to-daemon link")
    unauth_timeout_s: float = setting(
        "MCCL_UNAUTH_TIMEOUT", 5.0, "seconds",
        "deadline for a connection to the link, status or metrics port to finish its handshake and request, "
        "as a whole (a per-read timeout would let a peer dribbling bytes hold it forever)")
    max_unauth_connections: int = setting(
        "MCCL_MAX_UNAUTH_CONNECTIONS", 32, "count",
        "concurrent connections not yet authenticated per port (link, status, metrics); past it the busiest address's oldest is closed to make room")
    max_unauth_per_peer: int = setting(
        "MCCL_MAX_UNAUTH_PER_PEER", 8, "count",
        "concurrent connections not yet authenticated from one peer address per port; past it that address's oldest is closed to make room")
    unauth_reserved: int = setting(
        "MCCL_UNAUTH_RESERVED", 16, "count",
        "of MCCL_MAX_UNAUTH_CONNECTIONS, slots only addresses that authenticated on that port before may use "
        "(fleet daemons, your mcclctl), so a few hostile addresses cannot take every slot; strangers always keep "
        "at least one")
    max_attached_per_process: int = setting(
        "MCCL_MAX_ATTACHED_PER_PROCESS", 256, "count",
        "attach connections one process may hold (one per communicator); past it the longest idle one is dropped")
    client_check_s: float = setting(
        "MCCL_CLIENT_CHECK_INTERVAL", 0.25, "seconds",
        "how often the daemon checks that its attached processes are still alive")
    idle_after_s: float = setting(
        "MCCL_IDLE_AFTER", 900.0, "seconds",
        "harvesting: this long without user input makes the host idle, so jobs may lease it; any input ends it "
        "(docs/harvesting.md)")
    harvest_hours: str = setting(
        "MCCL_HARVEST_HOURS", "", "hours",
        "harvesting: local hours in which an idle host may be harvested, START-END on the 24 h clock "
        "(22-7 wraps midnight); empty: any hour")
    harvest_require_ac: bool = setting(
        "MCCL_HARVEST_REQUIRE_AC", True, "bool",
        "harvesting: a laptop on battery is never idle (where the power source is detectable)")
    activity_file: str = setting(
        "MCCL_ACTIVITY_FILE", "", "path",
        "harvesting: a file whose modification time counts as user input, besides the OS's own idle time "
        "(touch it from a login hook or a script); empty: none")
    harvest_poll_s: float = setting(
        "MCCL_HARVEST_POLL", 5.0, "seconds",
        "harvesting: how often the daemon samples user activity and re-evaluates the harvest state; at most every "
        "1 s while a job runs here, so its processes yield within a second of the user's return")
    reclaim_grace_s: float = setting(
        "MCCL_RECLAIM_GRACE", 60.0, "seconds",
        "harvesting: once the host's user is back, a job still running here after this long is removed "
        "(SIGTERM, SIGKILL 5 s later) and the host handed back; libmccl.elastic jobs leave at their next "
        "step long before")

    def harvest_window(self) -> tuple[int, int] | None:
        """MCCL_HARVEST_HOURS as (start hour, end hour), end exclusive; None: any hour."""
        text = self.harvest_hours.strip()
        if not text:
            return None
        start, sep, end = text.partition("-")
        try:
            window = (int(start), int(end))
        except ValueError:
            window = None
        if not sep or window is None or not all(0 <= h <= 23 for h in window) or window[0] == window[1]:
            raise ConfigError(f"[config] MCCL_HARVEST_HOURS={self.harvest_hours!r} is not START-END with two "
                              "different hours 0-23 (e.g. 22-7 for 22:00 to 07:00); fix or unset it")
        return window

    def validate(self) -> None:
        for env, port in (("MCCL_PORT", self.port), ("MCCL_STATUS_PORT", self.status_port),
                          ("MCCL_METRICS_PORT", self.metrics_port), ("MCCL_LAUNCH_PORT", self.launch_port)):
            _require(0 <= port <= 65535, env, port, "must be a TCP port (0-65535)")
        _require(self.launch_via in ("auto", "direct", "systemd"), "MCCL_LAUNCH_VIA", self.launch_via,
                 "must be auto, direct or systemd")
        _require(self.discovery in ("mdns", "off"), "MCCL_DISCOVERY", self.discovery, "must be mdns or off")
        _require(self.mdns_ttl_s >= 1, "MCCL_MDNS_TTL", self.mdns_ttl_s, "must be at least 1")
        _require(self.gossip_interval_s >= 0.1, "MCCL_GOSSIP_INTERVAL", self.gossip_interval_s,
                 "must be at least 0.1")
        _require(self.gossip_ttl_s >= 3 * self.gossip_interval_s, "MCCL_GOSSIP_TTL", self.gossip_ttl_s,
                 "must be at least 3 gossip intervals (MCCL_GOSSIP_INTERVAL), or live hosts expire between rounds")
        self.seeds()
        _require(self.link_timeout_s > 0, "MCCL_LINK_TIMEOUT", self.link_timeout_s, "must be positive")
        _require(1 <= self.topology_probes <= 1024, "MCCL_TOPOLOGY_PROBES", self.topology_probes,
                 "must be between 1 and 1024")
        _require(self.topology_interval_s >= 10, "MCCL_TOPOLOGY_INTERVAL", self.topology_interval_s,
                 "must be at least 10 seconds")
        _require(self.unauth_timeout_s > 0, "MCCL_UNAUTH_TIMEOUT", self.unauth_timeout_s, "must be positive")
        for env, n in (("MCCL_MAX_UNAUTH_CONNECTIONS", self.max_unauth_connections),
                       ("MCCL_MAX_UNAUTH_PER_PEER", self.max_unauth_per_peer)):
            _require(n >= 1, env, n, "must be at least 1")
        _require(self.unauth_reserved >= 0, "MCCL_UNAUTH_RESERVED", self.unauth_reserved, "must be at least 0")
        _require(self.max_attached_per_process >= 1, "MCCL_MAX_ATTACHED_PER_PROCESS",
                 self.max_attached_per_process, "must be at least 1")
        _require(self.client_check_s > 0, "MCCL_CLIENT_CHECK_INTERVAL", self.client_check_s,
                 "must be positive")
        _require(self.idle_after_s > 0, "MCCL_IDLE_AFTER", self.idle_after_s, "must be positive")
        _require(self.harvest_poll_s > 0, "MCCL_HARVEST_POLL", self.harvest_poll_s, "must be positive")
        _require(self.reclaim_grace_s >= 0, "MCCL_RECLAIM_GRACE", self.reclaim_grace_s, "must not be negative")
        self.harvest_window()
        _require(bool(self.fleet) and all(c.isalnum() or c in "-_." for c in self.fleet),
                 "MCCL_FLEET", self.fleet, "use letters, digits, '-', '_' or '.'")

    def seeds(self) -> list[tuple[str, int]]:
        """MCCL_PEERS as (host or address, link port) pairs; ConfigError naming the first bad entry."""
        from .gossip_protocol import parse_peers
        return parse_peers(self.peers, self.port or 29650)

    def read_key(self) -> bytes:
        """The fleet key; a key file readable by others is refused (the key is the fleet's only secret)."""
        if self.fleet_key:
            # Same decoding and floor as a key file (and as jobkey.find_job_key): a short key
            # in the environment would make every link MAC of the fleet guessable.
            return key_material(self.fleet_key.encode(), "MCCL_FLEET_KEY",
                                "mccld keygen /etc/mccl/fleet.key, then MCCL_KEY_FILE")
        key = read_key_file(self.key_file, DEFAULT_KEY_FILES, "MCCL_KEY_FILE")
        if key is None:
            raise ConfigError("[config] no fleet key: set MCCL_KEY_FILE (mode 0600) or MCCL_FLEET_KEY; "
                              "create one with `mccld keygen /etc/mccl/fleet.key` and copy it to every host")
        return key

    def read_submit_key(self) -> bytes | None:
        """The key that lets `mcclctl run` start jobs here; None: launching is off. It must not be
        the fleet key: every host holds that one, and a host must not start jobs on its peers."""
        key = read_key_file(self.submit_key_file, DEFAULT_SUBMIT_KEY_FILES, "MCCL_SUBMIT_KEY_FILE")
        if key is not None and key == self.read_key():
            raise ConfigError("[config] the submit key equals the fleet key; every host holds the fleet key, so "
                              "any of them could start jobs on the others: make a separate one with "
                              "`mccld keygen /etc/mccl/submit.key` for the hosts that submit")
        return key


def key_paths(cfg: DaemonConfig) -> tuple[Path, ...]:
    """The key files this daemon reads (fleet and submit key), those that exist: what a job it
    launches must not be able to read (mccld/host/launch_identity.py)."""
    found = []
    for explicit, defaults in ((cfg.key_file, DEFAULT_KEY_FILES), (cfg.submit_key_file, DEFAULT_SUBMIT_KEY_FILES)):
        for raw in [explicit] if explicit else defaults:
            path = Path(raw).expanduser()
            if path.exists():
                found.append(path)
                break
    return tuple(found)


def read_key_file(explicit: str, defaults: tuple[str, ...], env: str,
                  extra_owners: tuple[int, ...] = ()) -> bytes | None:
    """A key from ``explicit`` (must exist) or the first of ``defaults`` that exists and this
    user can read; None if none exists. A file others could read or swap (mode, ACL, the
    folders above it: mccl_common/key_file_trust.py), or a short key, is refused. A default this user may not read (the service's own /etc/mccl, mode 0750) is
    skipped for the next one, and named if no other is found."""
    candidates = [explicit] if explicit else list(defaults)
    denied: list[Path] = []
    for raw in candidates:
        path = Path(raw).expanduser()
        try:
            if not path.exists():
                if explicit:
                    raise ConfigError(f"[config] {env}={raw!r} does not exist; "
                                      f"create it with `mccld keygen {raw}` and copy it where it is needed")
                continue
            key_file_trust.check(path, extra_owners)
            raw_key = path.read_bytes()
        except PermissionError:
            if explicit:
                raise ConfigError(f"[config] {env}={raw!r} cannot be read by this user (uid {os.getuid()}); "
                                  f"use a copy of the key that this user owns, mode 0600") from None
            denied.append(path)
            continue
        return key_material(raw_key, f"key file {path}", f"mccld keygen {path}")
    if denied:
        raise ConfigError(f"[config] the key file {denied[0]} exists but this user (uid {os.getuid()}) may not "
                          f"read it (it is the service's); copy the key to a file this user owns, mode 0600, "
                          f"and set {env} to it")
    return None


MIN_KEY_BYTES = 32


def key_material(raw: bytes, where: str, fix: str) -> bytes:
    """The secret a key file or variable holds: hex text (what ``mccld keygen`` writes) is
    decoded, anything else taken as bytes; fewer than 32 bytes of it is refused, since every
    link and store MAC of the fleet is only as strong as this."""
    text = raw.strip()
    try:
        key = bytes.fromhex(text.decode("ascii")) if len(text) % 2 == 0 else text
    except (UnicodeDecodeError, ValueError):
        key = text
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"[config] {where} holds a key of {len(key)} bytes; use at least {MIN_KEY_BYTES} "
                          f"random bytes (`{fix}` writes a good one)")
    return key


def load_config(path: str | None = None, env: dict | None = None) -> DaemonConfig:
    """Settings from an optional TOML file (keys = field names), then MCCL_* variables."""
    overrides: dict = {}
    if path:
        import tomllib
        try:
            with open(path, "rb") as fh:
                overrides = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"[config] cannot read config file {path}: {e}; fix the file or drop --config")
        known = set(DaemonConfig.__dataclass_fields__)
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"[config] unknown key(s) {unknown} in {path} ({_toml_hints(unknown, known)}); "
                              f"valid keys: {sorted(known)}")
    return load(DaemonConfig, env=env, overrides=overrides)


def _toml_hints(unknown: list[str], known: set[str]) -> str:
    """For each unknown key of mccld.toml, the field it most likely means: the keys are field
    names, so a variable's name (MCCL_PORT) is answered with its field (port)."""
    by_env = {f.metadata["env"]: f.name for f in dataclasses.fields(DaemonConfig)}
    hints = []
    for key in unknown:
        upper = key.upper() if key.upper().startswith("MCCL_") else "MCCL_" + key.upper()
        env = upper if upper in by_env else closest_name(upper, set(by_env))
        guess = by_env[env] if env else closest_name(key, known)
        hints.append(f"{key}: did you mean {guess}?" if guess else f"{key}: no such setting")
    return "; ".join(hints)


def attach_gid(cfg: DaemonConfig) -> int | None:
    """The gid of MCCL_ATTACH_GROUP; None when the daemon serves its own user only."""
    if not cfg.attach_group:
        return None
    try:
        return grp.getgrnam(cfg.attach_group).gr_gid
    except KeyError:
        raise ConfigError(f"[config] MCCL_ATTACH_GROUP={cfg.attach_group!r} names no group on this host; "
                          "create it (the packaging/ install scripts do) or unset it") from None


def runtime_dir(cfg: DaemonConfig, create: bool) -> Path:
    """Directory of the attach socket: private to this user (0700), or with MCCL_ATTACH_GROUP
    searchable by that group (0750) so its members can reach the socket and read the token.
    Checked before use on both sides (mccl_common/localtrust.py): a symlink, or a directory another
    user made (in /tmp anyone can take the name first), is a ConfigError naming it and its owner."""
    path = _default_runtime_dir(cfg)
    if not create:
        service = Path(SERVICE_RUNTIME_DIR)
        if not cfg.runtime_dir and not (path / SOCKET_NAME).exists() and (service / SOCKET_NAME).exists():
            path = service
        try:
            localtrust.check_runtime_dir(path, runtime_dir_owners(cfg, path))
        except FileNotFoundError:
            pass   # no daemon here: the client reports that when it finds no token
        return path
    gid = attach_gid(cfg)
    mode = 0o700 if gid is None else 0o750
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        pass       # a symlink to nowhere, or a file: check_runtime_dir names it
    localtrust.check_runtime_dir(path, {os.geteuid()}, check_mode=False)
    st = path.lstat()
    if gid is not None and st.st_gid != gid:
        try:
            os.chown(path, -1, gid, follow_symlinks=False)
        except PermissionError:
            raise ConfigError(f"[config] cannot give runtime dir {path} to group {cfg.attach_group!r}: this "
                              "user is not a member of it; add it, or unset MCCL_ATTACH_GROUP") from None
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode, follow_symlinks=False)
    return path


def _default_runtime_dir(cfg: DaemonConfig) -> Path:
    if cfg.runtime_dir:
        return Path(cfg.runtime_dir)
    if os.geteuid() == 0 and Path("/run").is_dir():
        return Path("/run/mccl")
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "mccl"
    return Path(f"/tmp/mccl-{os.getuid()}")


def runtime_dir_owners(cfg: DaemonConfig, path: Path) -> set[int]:
    """The users a client accepts as owner of ``path``, and so as its daemon's user."""
    return localtrust.daemon_owners(path, bool(cfg.runtime_dir), Path(SERVICE_RUNTIME_DIR))


def write_key_file(path: str) -> Path:
    """Write a fresh random fleet key with mode 0600 (``mccld keygen``)."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32) + "\n")
    return target
