"""Every MCCL_* setting, declared once.

Each field of a settings dataclass below *is* the declaration: its environment
variable, default, unit and help text live in the field's metadata, next to the
default. ``load(Cls)`` reads the environment (and, for the daemon, an optional TOML
file) into a frozen instance. ``python -m mccl_common.settings_table`` prints the table that the
README carries.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

from .errors import ConfigError

T = TypeVar("T")

log = logging.getLogger(__name__)

_SIZE_SUFFIX = {"": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
                "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def setting(env: str, default: Any, unit: str, help: str) -> Any:
    """Declare one setting: a dataclass field that knows its environment variable."""
    return field(default=default, metadata={"env": env, "unit": unit, "help": help})


def _parse(raw: str, typ: Any, unit: str, env: str) -> Any:
    text = raw.strip()
    try:
        if typ in (bool, "bool"):
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(text)
        if typ in (int, "int"):
            if unit == "bytes":
                m = re.fullmatch(r"(\d+)\s*([A-Za-z]*)", text)
                if not m or m.group(2).upper() not in _SIZE_SUFFIX:
                    raise ValueError(text)
                return int(m.group(1)) * _SIZE_SUFFIX[m.group(2).upper()]
            return int(text, 0)
        if typ in (float, "float"):
            return float(text)
        return text
    except ValueError:
        kind = getattr(typ, "__name__", str(typ))
        raise ConfigError(
            f"[config] {env}={raw!r} is not a valid {kind} ({unit}); "
            f"fix or unset {env} (see the settings table in README.md)") from None


def load(cls: type[T], env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None) -> T:
    """Build a frozen settings object from the environment, then ``overrides`` (e.g. TOML)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        name = f.metadata["env"]
        if overrides and f.name in overrides:
            values[f.name] = overrides[f.name]
        if name in env:
            values[f.name] = _parse(env[name], f.type, f.metadata["unit"], name)
    obj = cls(**values)
    check = getattr(obj, "validate", None)
    if check is not None:
        check()
    return obj


def _require(ok: bool, env: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"[config] {env}={value!r} is out of range: {why}; fix or unset {env}")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the in-process engine (libmccl)."""

    sockets_per_peer: int = setting(
        "MCCL_SOCKETS_PER_PEER", 2, "sockets",
        "TCP sockets of a link to a ring neighbour; large messages are striped across them. Links to other "
        "peers (the collectives' other partners, and peers linked on first use) have one socket")
    socket_buffer_bytes: int = setting(
        "MCCL_SOCKET_BUFFER_BYTES", 4 << 20, "bytes",
        "SO_SNDBUF/SO_RCVBUF asked for on every link socket (the kernel may cap it)")
    segment_bytes: int = setting(
        "MCCL_SEGMENT_BYTES", 0, "bytes",
        "pipeline segment of the ring algorithms; 0 picks one from the message size")
    small_allreduce_bytes: int = setting(
        "MCCL_SMALL_ALLREDUCE_BYTES", 64 << 10, "bytes",
        "the most bytes the one-step algorithms may put on a rank's link, (world size - 1) x the buffer: "
        "MCCL_ALGO=auto considers the one-round all-reduce and the broadcast straight from the root only "
        "within it (and at 4 ranks or fewer); views over some ranks (hierarchical algorithms) use them "
        "within it instead of the ring and the chain")
    algo: str = setting(
        "MCCL_ALGO", "auto", "auto|algorithm|op=algorithm,...",
        "which algorithm runs each collective: auto lets the engine's alpha-beta cost model choose by world "
        "size and message size (docs/tuning.md); one name pins every op that has it (ring, rd, rabenseifner, "
        "oneround, halving, chain, fanout, binomial, scatter_allgather); op=name pairs pin ops one by one, e.g. "
        "allreduce=rabenseifner,allgather=ring (ops: allreduce, allgather, reduce_scatter, broadcast). Every "
        "rank must use the same value")
    alpha_us: float = setting(
        "MCCL_ALPHA_US", 0.0, "microseconds",
        "the cost model's latency of one step between two ranks; 0 measures it when a communicator starts "
        "(and every rank takes the largest measurement). Set it, and MCCL_BETA_GBPS, for benchmarks whose "
        "choices must not vary from run to run; every rank must use the same value")
    beta_gbps: float = setting(
        "MCCL_BETA_GBPS", 0.0, "Gbit/s",
        "the cost model's link speed (10 for 10 GbE); 0 measures it when a communicator starts, as "
        "MCCL_ALPHA_US; every rank must use the same value")
    compression: str = setting(
        "MCCL_COMPRESSION", "off", "off|bf16|fp16|int8",
        "SUM/AVG all-reduces and reduce-scatters of at least MCCL_COMPRESSION_MIN_BYTES travel compressed: "
        "bf16/fp16 round float32 to 16 bits, int8 sends one byte per element and a scale per 64 (float32, "
        "bfloat16, float16); each contribution is encoded once and summed in float32, and every rank ends with "
        "the same bits (docs/compression.md gives the errors). Other dtypes and ops stay exact. With MCCL_DAEMON=1 "
        "mccld compresses what crosses hosts (a host's ranks are summed exactly first); every rank must use "
        "the same value")
    compression_min_bytes: int = setting(
        "MCCL_COMPRESSION_MIN_BYTES", 64 << 10, "bytes",
        "MCCL_COMPRESSION: smaller ops (metrics, loss sums) stay exact; every rank must use the same value")
    compression_error_feedback: bool = setting(
        "MCCL_COMPRESSION_ERROR_FEEDBACK", True, "bool",
        "MCCL_COMPRESSION: what the codec dropped of a buffer's contribution is added to the same buffer's next "
        "compressed op (kept per buffer address and size, as DDP's buckets are; a rebuilt bucket starts "
        "afresh), so over steps nothing is lost; costs 4 bytes of memory per compressed element")
    compression_threads: int = setting(
        "MCCL_COMPRESSION_THREADS", 1, "threads",
        "MCCL_COMPRESSION: threads that share a compressed op's encoding and decoding, the communicator's "
        "worker included (1: the worker alone); more take the codec off the op's critical path where cores "
        "are idle (docs/compression.md). The results are the same bits whatever the count; 1 to 64")
    compression_feedback_max_bytes: int = setting(
        "MCCL_COMPRESSION_FEEDBACK_MAX_BYTES", 16 << 30, "bytes",
        "MCCL_COMPRESSION_ERROR_FEEDBACK: residuals a communicator keeps at most (0: no cap); past it the least "
        "recently used buffers lose theirs (logged once). mccld applies its own value to every job it "
        "hosts, so no job grows the daemon without bound")
    pipeline_bytes: int = setting(
        "MCCL_PIPELINE_BYTES", 2 << 20, "bytes",
        "smallest piece of an all-reduce handed over by segment tickets (mccld's shared-memory path, "
        "accelerator buckets): the engine starts a piece once its input is ready and announces it once "
        "final; large ops use pieces of up to N MB at N ranks (at most 1/16 of the buffer)")
    topology: str = setting(
        "MCCL_TOPOLOGY", "", "path",
        "file naming each host's switch, lines `SWITCH: HOST HOST ...` (hosts by MCCL_HOST_ID, host name or "
        "IP; docs/topology.md): all-reduces of MCCL_HIERARCHY_MIN_BYTES and up then run within each switch, "
        "then across switches, then within each again. Empty: one switch in-process; through mccld the "
        "daemons' topology (theirs, or inferred from RTTs: `mcclctl links --topology`)")
    hierarchy_min_bytes: int = setting(
        "MCCL_HIERARCHY_MIN_BYTES", 1 << 20, "bytes",
        "smallest all-reduce run switch by switch when the hosts span two or more switches (MCCL_TOPOLOGY); "
        "every rank must use the same value")
    hierarchy: str = setting(
        "MCCL_HIERARCHY", "ring", "ring|tree",
        "how those all-reduces cross switches: ring = one ring visiting the switches in turn (one pass, each "
        "uplink crossed once each way: never slower than the flat ring, faster wherever rank order zig-zags "
        "between switches); tree = reduce-scatter within each switch, all-reduce across, all-gather within "
        "(fewest bytes on the uplinks and fewest steps, for uplinks oversubscribed past one host's rate and "
        "many hosts; docs/topology.md). Every rank must use the same value")
    send_thread: bool = setting(
        "MCCL_SEND_THREAD", True, "bool",
        "a second engine thread per communicator copies bulk frames (512K and up) into the sockets, "
        "beside the ones that receive and reduce; 0 leaves it to the thread that runs the algorithms")
    recv_threads: int = setting(
        "MCCL_RECV_THREADS", 2, "threads",
        "engine threads per communicator that read bulk payloads (128K and up) off the sockets and "
        "reduce them into place, socket i of every link on thread i % n; 0 leaves reading and "
        "reducing to the thread that runs the algorithms")
    bind_addr: str = setting(
        "MCCL_BIND_ADDR", "", "address",
        "address the engine listens on and advertises; empty: the local end of the route to MASTER_ADDR, "
        "else to the store's host, else the host name's address, else the default-route interface's")
    socket_ifname: str = setting(
        "MCCL_SOCKET_IFNAME", "", "interface",
        "network interface to listen on (its first IPv4 address); overridden by MCCL_BIND_ADDR")
    connect_timeout_s: float = setting(
        "MCCL_CONNECT_TIMEOUT", 0.0, "seconds",
        "time to build the mesh of links; 0 uses the process group's timeout")
    daemon: bool = setting(
        "MCCL_DAEMON", False, "bool",
        "hand collectives to the local mccld instead of running the engine in-process")
    daemon_fast_bytes: int = setting(
        "MCCL_DAEMON_FAST_BYTES", 2 << 20, "bytes",
        "MCCL_DAEMON=1: all-reduces up to this size, and barriers, go to mccld through a shared-memory "
        "queue that a native thread serves, copied in and out whole (docs/daemon-fastpath.md); larger ones "
        "over MCCL_PIPELINE_BYTES are pipelined through mccld's Python job thread; 0 sends every op over "
        "ZeroMQ. At most 16M; every rank of a host must use the same value")
    daemon_copy_ahead_bytes: int = setting(
        "MCCL_DAEMON_COPY_AHEAD_BYTES", 32 << 20, "bytes",
        "MCCL_DAEMON=1, pipelined all-reduces: how far the copy of a tensor into shared memory may run "
        "ahead of the results coming back, at least five of the engine's pieces; copied all at once, every "
        "rank of a host takes a core and memory bandwidth in one burst at each op's start, when the links "
        "need them. 0 copies the whole input at once")
    unified_collective: str = setting(
        "MCCL_UNIFIED_COLLECTIVE", "auto", "auto|1|0",
        "macOS/MPS all-reduce: reduce in the tensor's unified memory (shared storage; private storage is "
        "blitted into host memory), ordered by Metal shared events through the Metal bridge; auto uses it where "
        "the bridge loads, 1 requires it (ConfigError names what is missing), 0 stages through blocking CPU copies")
    wire_security: str = setting(
        "MCCL_WIRE_SECURITY", "aead", "aead|mac|off",
        "what protects the engine's frames between hosts, in-process and through mccld: aead encrypts and "
        "authenticates every frame (AES-256-GCM, OpenSSL), mac authenticates without encrypting, off does "
        "neither (logged as a warning: anyone on the network can read and alter gradients). Links are always "
        "opened with a challenge-response on the job key unless off. Every rank must use the same value")
    job_key_file: str = setting(
        "MCCL_JOB_KEY_FILE", "", "path",
        "file (mode 0600, at least 32 random bytes, e.g. `mccld keygen PATH`) holding the secret every rank "
        "of the job shares: it keys the engine's links and the MACs on rendezvous-store values; empty: the "
        "fleet key (MCCL_KEY_FILE, /etc/mccl/fleet.key or ~/.config/mccl/fleet.key). `mcclctl run` sets it")
    cuda_staging_bytes: int = setting(
        "MCCL_CUDA_STAGING_BYTES", 1 << 30, "bytes",
        "pinned host memory a process keeps for staging CUDA tensors (reused across ops; allocating pinned "
        "memory stalls the GPU, so beyond this cap a buffer is freed after its op, logged once)")

    def engine_options(self, opts: Any, timeout_s: float, connect_timeout_s: float) -> Any:
        """Fill an ``_core.Options`` (passed in: this module stays free of the engine) from
        these settings; the in-process backend and mccld build their engines alike."""
        opts.sockets_per_peer = self.sockets_per_peer
        opts.socket_buffer_bytes = self.socket_buffer_bytes
        opts.segment_bytes = self.segment_bytes
        opts.small_allreduce_bytes = self.small_allreduce_bytes
        opts.pipeline_bytes = self.pipeline_bytes
        opts.hierarchy_min_bytes = self.hierarchy_min_bytes
        opts.hierarchy_ring = self.hierarchy == "ring"
        opts.algo = self.algo
        opts.alpha_us = self.alpha_us
        opts.beta_gbps = self.beta_gbps
        opts.compression = self.compression
        opts.compression_min_bytes = self.compression_min_bytes
        opts.compression_feedback = self.compression_error_feedback
        opts.compression_threads = self.compression_threads
        opts.compression_feedback_max_bytes = self.compression_feedback_max_bytes
        opts.send_thread = self.send_thread
        opts.recv_threads = self.recv_threads
        opts.timeout_s = timeout_s
        opts.connect_timeout_s = connect_timeout_s
        # The enum is the engine's (_core.WireSecurity); its members are named like the values.
        opts.wire_security = type(opts.wire_security).__members__[self.wire_security]
        return opts

    def validate(self) -> None:
        _require(1 <= self.sockets_per_peer <= 16, "MCCL_SOCKETS_PER_PEER", self.sockets_per_peer,
                 "must be between 1 and 16")
        _require(0 <= self.recv_threads <= 16, "MCCL_RECV_THREADS", self.recv_threads,
                 "must be between 0 and 16")
        _require(self.socket_buffer_bytes >= 64 << 10, "MCCL_SOCKET_BUFFER_BYTES",
                 self.socket_buffer_bytes, "must be at least 64K")
        _require(self.segment_bytes == 0 or self.segment_bytes >= 4 << 10, "MCCL_SEGMENT_BYTES",
                 self.segment_bytes, "must be 0 (auto) or at least 4K")
        _require(self.small_allreduce_bytes >= 0, "MCCL_SMALL_ALLREDUCE_BYTES",
                 self.small_allreduce_bytes, "must not be negative")
        _require(self.alpha_us >= 0, "MCCL_ALPHA_US", self.alpha_us, "must not be negative (0: measure)")
        _require(self.beta_gbps >= 0, "MCCL_BETA_GBPS", self.beta_gbps, "must not be negative (0: measure)")
        _require(bool(self.algo.strip()), "MCCL_ALGO", self.algo, "must not be empty (auto: the cost model chooses)")
        _require(self.pipeline_bytes >= 4 << 10, "MCCL_PIPELINE_BYTES", self.pipeline_bytes,
                 "must be at least 4K")
        _require(self.hierarchy in ("tree", "ring"), "MCCL_HIERARCHY", self.hierarchy, "must be ring or tree")
        _require(self.hierarchy_min_bytes >= 0, "MCCL_HIERARCHY_MIN_BYTES", self.hierarchy_min_bytes,
                 "must not be negative")
        _require(0 <= self.daemon_fast_bytes <= 16 << 20, "MCCL_DAEMON_FAST_BYTES", self.daemon_fast_bytes,
                 "must be between 0 (off) and 16M")
        _require(self.daemon_copy_ahead_bytes >= 0, "MCCL_DAEMON_COPY_AHEAD_BYTES", self.daemon_copy_ahead_bytes,
                 "must not be negative")
        _require(self.connect_timeout_s >= 0, "MCCL_CONNECT_TIMEOUT", self.connect_timeout_s,
                 "must not be negative")
        _require(self.compression in ("off", "bf16", "fp16", "int8"), "MCCL_COMPRESSION", self.compression,
                 "must be off, bf16, fp16 or int8")
        _require(self.compression_min_bytes >= 0, "MCCL_COMPRESSION_MIN_BYTES", self.compression_min_bytes,
                 "must not be negative")
        _require(1 <= self.compression_threads <= 64, "MCCL_COMPRESSION_THREADS", self.compression_threads,
                 "must be between 1 and 64")
        _require(self.compression_feedback_max_bytes >= 0, "MCCL_COMPRESSION_FEEDBACK_MAX_BYTES",
                 self.compression_feedback_max_bytes, "must not be negative (0: no cap)")
        _require(self.wire_security in ("aead", "mac", "off"), "MCCL_WIRE_SECURITY", self.wire_security,
                 "must be aead, mac or off")


@dataclass(frozen=True)
class RendezvousConfig:
    """Settings of torchrun's ``--rdzv-backend mccl`` (libmccl/elastic/rdzv.py). Each timeout can
    also be given per run as the ``--rdzv-conf`` key in brackets, which wins over the variable."""

    anchor: str = setting(
        "MCCL_RDZV_ANCHOR", "", "host[:port]",
        "host whose rendezvous store every torchrun of the job joins, when --rdzv-endpoint is not given; "
        "a host that stays for the whole job (the store dies with the process serving it); port 29400 if omitted")
    store_timeout_s: float = setting(
        "MCCL_RDZV_STORE_TIMEOUT", 10.0, "seconds",
        "time to reach the anchor's store, and for any one request to it, before torchrun stops with an "
        "error naming the anchor [read_timeout]")
    join_timeout_s: float = setting(
        "MCCL_RDZV_JOIN_TIMEOUT", 60.0, "seconds",
        "time for the minimum number of hosts (--nnodes MIN:MAX) to join a round [join_timeout]")
    last_call_s: float = setting(
        "MCCL_RDZV_LAST_CALL", 2.0, "seconds",
        "once the minimum has joined, how long a round stays open for more hosts, up to the maximum "
        "[last_call_timeout]")
    close_timeout_s: float = setting(
        "MCCL_RDZV_CLOSE_TIMEOUT", 3.0, "seconds",
        "time to mark the rendezvous closed when a torchrun shuts down, and the most the torchrun serving the "
        "anchor's store then waits for the other hosts to do so before the store goes away [close_timeout]")
    heartbeat_s: float = setting(
        "MCCL_RDZV_HEARTBEAT", 1.0, "seconds",
        "interval of each host's keep-alive write to the anchor's store [keep_alive_interval]")
    heartbeat_misses: int = setting(
        "MCCL_RDZV_HEARTBEAT_MISSES", 5, "count",
        "keep-alives a host may miss before the others drop it from the rendezvous; MCCL_RDZV_HEARTBEAT x this "
        "must be at least 2 s (joining hosts write theirs once a second), and the hosts' clocks must agree to "
        "well within it [keep_alive_max_attempt]")
    join_at_step_s: float = setting(
        "MCCL_RDZV_JOIN_AT_STEP", 30.0, "seconds",
        "when a host asks to join a running job whose script uses libmccl.elastic.ElasticState, how long the "
        "running hosts get to finish their step, save and re-form with it; after that (at once for a script "
        "without ElasticState) torchrun restarts the workers, which then redo the steps since their last save; "
        "keep it under MCCL_RDZV_JOIN_TIMEOUT, which the joining host waits [join_at_step_timeout]")

    def validate(self) -> None:
        for name, env in (("store_timeout_s", "MCCL_RDZV_STORE_TIMEOUT"), ("join_timeout_s", "MCCL_RDZV_JOIN_TIMEOUT"),
                          ("join_at_step_s", "MCCL_RDZV_JOIN_AT_STEP"),
                          ("last_call_s", "MCCL_RDZV_LAST_CALL"), ("close_timeout_s", "MCCL_RDZV_CLOSE_TIMEOUT"),
                          ("heartbeat_s", "MCCL_RDZV_HEARTBEAT")):
            _require(getattr(self, name) > 0, env, getattr(self, name), "must be a positive number of seconds")
        _require(self.heartbeat_misses >= 1, "MCCL_RDZV_HEARTBEAT_MISSES", self.heartbeat_misses,
                 "must be at least 1")


# Settings classes whose fields the README tabulates, in order.
ALL_SETTINGS: list[type] = [EngineConfig, RendezvousConfig]


def register(cls: type[T]) -> type[T]:
    """Class decorator for settings dataclasses declared in other components (mccld, ...)."""
    if cls not in ALL_SETTINGS:
        ALL_SETTINGS.append(cls)
    return cls


def closest_name(name: str, candidates: set[str] | list[str]) -> str | None:
    """The candidate most like ``name`` (difflib), compared without the MCCL_ prefix that they
    all share (with it, any name looked 40% like every setting); None if none is close."""
    def bare(n: str) -> str:
        return n[5:] if n.upper().startswith("MCCL_") else n
    by_bare = {bare(c): c for c in candidates}
    match = difflib.get_close_matches(bare(name), sorted(by_bare), n=1, cutoff=0.6)
    return by_bare[match[0]] if match else None


def markdown_table() -> str:
    rows = ["| variable | default | unit | meaning |", "|---|---|---|---|"]
    for cls in ALL_SETTINGS:
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else ""
            if isinstance(default, bool):
                default = int(default)
            # A "|" inside a cell (units such as aead|mac|off) would end it: escape it.
            unit, text = (f.metadata[k].replace("|", "\\|") for k in ("unit", "help"))
            rows.append(f"| `{f.metadata['env']}` | `{default!s}` | {unit} | {text} |")
    return "\n".join(rows)

