"""Which switch each host hangs off: the MCCL_TOPOLOGY file, and switches inferred from RTTs.

The file, one switch a line (``#`` starts a comment, blank lines are skipped)::

    # switch: hosts (by MCCL_HOST_ID, host name or IP), separated by spaces or commas
    rack-a: studio-01 studio-02 10.0.1.7
    rack-b: studio-17, studio-18

Strict: a line without ``switch:``, a switch or host name with characters outside
``[A-Za-z0-9._:-]``, a switch listed twice, a host listed twice or a switch without hosts is
a ConfigError naming the file and line. The first ``:`` ends the switch's name (so IPv6
hosts may follow). The engine only needs the grouping, so switches are
numbered by name (``switch_ids``), the same way on every rank.

Inference (``cluster_by_rtt``): hosts on one switch see each other at a round-trip time
clearly below the one across switches (each uplink adds a hop, and oversubscribed ones add
queueing). RTT noise only ever adds time (queues, scheduling), so the smallest of a few
samples per pair is used, and two hosts are joined whenever one measured pair between them
is near (single linkage): a pair inflated by noise splits nothing as long as its hosts are
joined through others. Near and far are told apart by the widest split of the sorted log
RTTs (two classes, least spread within each), accepted only when the classes differ by a
clear factor; otherwise every host is on one switch.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

MAX_FILE_BYTES = 1 << 20
MAX_HOSTS = 4096
_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,255}$")  # host ids, names, IPv4 and IPv6 addresses
_SWITCH = re.compile(r"^[A-Za-z0-9._-]{1,255}$")
# Far pairs must take this many times the near ones (medians of the classes), and at least
# this much longer, before hosts are split into switches: a switch hop on 10 GbE adds a few
# microseconds, an oversubscribed uplink under load or an emulated one far more.
MIN_RATIO = 1.5
MIN_GAP_S = 20e-6


@dataclass(frozen=True)
class Topology:
    """Switch name -> host names, in the file's order."""
    switches: dict[str, tuple[str, ...]]
    source: str = "MCCL_TOPOLOGY"

    def switch_of(self, *names: str) -> str | None:
        """The switch of the first of ``names`` (host id, host name, IPs) the file lists."""
        for name in names:
            for switch, hosts in self.switches.items():
                if name and name in hosts:
                    return switch
        return None

    def hosts(self) -> dict[str, str]:
        return {h: s for s, hs in self.switches.items() for h in hs}


def parse(text: str, source: str = "MCCL_TOPOLOGY") -> Topology:
    switches: dict[str, tuple[str, ...]] = {}
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {lineno}"
        switch, sep, rest = line.partition(":")
        switch = switch.strip()
        if not sep or not _SWITCH.match(switch):
            raise ConfigError(f"[topology] {where}: expected `SWITCH: HOST HOST ...`, got {raw.strip()!r}; "
                              "names use letters, digits and . _ - (hosts also :)")
        if switch in switches:
            raise ConfigError(f"[topology] {where}: switch {switch!r} is listed twice; put all its hosts on one line")
        hosts = [h for h in re.split(r"[\s,]+", rest.strip()) if h]
        if not hosts:
            raise ConfigError(f"[topology] {where}: switch {switch!r} has no hosts")
        for h in hosts:
            if not _NAME.match(h):
                raise ConfigError(f"[topology] {where}: {h!r} is not a host id, host name or IP")
            if h in seen:
                raise ConfigError(f"[topology] {where}: host {h!r} is already on a switch at line {seen[h]}; "
                                  "a host hangs off one switch")
            seen[h] = lineno
        if len(seen) > MAX_HOSTS:
            raise ConfigError(f"[topology] {where}: more than {MAX_HOSTS} hosts")
        switches[switch] = tuple(hosts)
    if not switches:
        raise ConfigError(f"[topology] {source} names no switch; write lines `SWITCH: HOST HOST ...`")
    return Topology(switches, source)


def load(path: str) -> Topology:
    """Parses the file at ``path`` (MCCL_TOPOLOGY)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"[topology] cannot read MCCL_TOPOLOGY={path}: {e.strerror}; "
                          "point it at a readable file or unset it") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"[topology] MCCL_TOPOLOGY={path} is over {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"[topology] MCCL_TOPOLOGY={path} is not UTF-8 text") from None
    return parse(text, f"MCCL_TOPOLOGY={path}")


def switch_ids(switches: list[str]) -> list[int]:
    """Per-rank switch names -> small ints, numbered by name: the engine's switch_of_rank.
    Empty when there is fewer than two switches (nothing to group)."""
    names = sorted(set(switches))
    if len(names) < 2:
        return []
    number = {n: i for i, n in enumerate(names)}
    return [number[s] for s in switches]


def _split(values: list[float]) -> tuple[float, float, float] | None:
    """(near median, far median, threshold) of the best two-class split of ``values`` (sorted
    seconds), or None when they do not fall clearly into two."""
    logs = [math.log(max(v, 1e-9)) for v in values]
    n = len(logs)
    if n < 2:
        return None
    prefix = [0.0]
    sq = [0.0]
    for x in logs:
        prefix.append(prefix[-1] + x)
        sq.append(sq[-1] + x * x)
    best, cut = math.inf, -1
    for k in range(1, n):  # classes logs[:k], logs[k:]
        if values[k] == values[k - 1]:
            continue
        s1, s2 = prefix[k], prefix[n] - prefix[k]
        v1 = sq[k] - s1 * s1 / k
        v2 = (sq[n] - sq[k]) - s2 * s2 / (n - k)
        if v1 + v2 < best:
            best, cut = v1 + v2, k
    if cut < 0:
        return None
    near, far = values[:cut], values[cut:]
    lo, hi = near[len(near) // 2], far[len(far) // 2]
    if hi < MIN_RATIO * lo or hi - lo < MIN_GAP_S:
        return None
    return lo, hi, math.sqrt(near[-1] * far[0])


def cluster_by_rtt(hosts: list[str], rtt: dict[tuple[str, str], float]) -> dict[str, list[str]]:
    """Switches inferred from measured RTTs (seconds, any subset of the pairs, either direction;
    the smallest per pair counts). Returns switch name -> hosts, each switch named after its
    first host in sorted order (``sw-<host>``), so the answer depends on the measurements only."""
    order = sorted(set(hosts))
    pairs: dict[tuple[str, str], float] = {}
    for (a, b), v in rtt.items():
        if a == b or a not in order or b not in order or not v > 0:
            continue
        key = (a, b) if a < b else (b, a)
        pairs[key] = min(v, pairs.get(key, math.inf))
    parent = {h: h for h in order}

    def root(h: str) -> str:
        while parent[h] != h:
            parent[h] = parent[parent[h]]
            h = parent[h]
        return h

    split = _split(sorted(pairs.values()))
    if split is None:
        groups = {order[0]: order} if order else {}
    else:
        threshold = split[2]
        for (a, b), v in sorted(pairs.items()):
            if v < threshold:
                ra, rb = root(a), root(b)
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)
        groups = {}
        for h in order:
            groups.setdefault(root(h), []).append(h)
    return {f"sw-{first}": members for first, members in sorted(groups.items())}


def probe_order(me: str, hosts: list[str]) -> list[str]:
    """The other hosts in the order ``me`` measures them: a shuffle seeded by the names, so each
    host samples its own spread of the fleet and the same one every time."""
    def rank(h: str) -> bytes:
        return hashlib.sha256(f"{me}\0{h}".encode()).digest()
    return sorted((h for h in set(hosts) if h != me), key=rank)


def measure_row(me: str, hosts: list[str], measure, probes: int = 48) -> dict[str, float]:
    """``me``'s RTTs (``measure(host)`` -> seconds, or None when it could not) to the first
    ``probes`` hosts of its probe order: every pair up to ``probes + 1`` hosts, a bounded
    sample beyond. A row cannot tell by itself whether its smallest RTTs are its own switch's
    (a noisy far RTT can look like a second class), so the sample is fixed, not cut short:
    with 48 probes each host of a 25-host switch among 200 misses all 24 of its neighbours,
    in its own sample and in theirs, with odds of about 3 in a million. A switch of two or
    three hosts in a larger fleet may be missed (its hosts then stand alone, each a switch of
    one): name such hosts in MCCL_TOPOLOGY."""
    row: dict[str, float] = {}
    for host in probe_order(me, hosts)[:probes]:
        v = measure(host)
        if v is not None and v > 0:
            row[host] = v
    return row


def rtt_summary(hosts: list[str], rtt: dict[tuple[str, str], float]) -> dict:
    """What the inference saw: pairs measured, and the near/far medians it split at (or None)."""
    values = sorted(min(v, rtt.get((b, a), math.inf)) for (a, b), v in rtt.items() if a != b and v > 0)
    split = _split(values)
    return {"hosts": len(set(hosts)), "pairs_measured": len(values),
            "near_rtt_s": split[0] if split else None, "far_rtt_s": split[1] if split else None,
            "threshold_s": split[2] if split else None}


def fleet_view(reports: dict[str, dict | None]) -> dict:
    """The fleet's switches from every daemon's report (mccld/net/topology.py ``status``: its switch,
    its source, its RTT row), as ``mcclctl links --topology`` shows them. Inferred from the
    union of the rows when no daemon has MCCL_TOPOLOGY; each daemon's own answer beside it (the
    switch its jobs use), so a daemon that disagrees with the fleet's view stands out."""
    reports = {h: r for h, r in reports.items() if r}
    files = {h: r for h, r in reports.items() if r.get("source") == "file"}
    rtt: dict[tuple[str, str], float] = {}
    for h, r in reports.items():
        for peer, v in (r.get("row") or {}).items():
            if isinstance(v, (int, float)):
                rtt[(h, str(peer))] = float(v)
    hosts = sorted(set(reports) | {b for _, b in rtt})
    if files:
        first = files[min(files)]
        switches = {k: list(v) for k, v in (first.get("configured") or {}).items()}
        source = "file" if len(files) == len(reports) else "mixed"
    else:
        switches, source = cluster_by_rtt(hosts, rtt), "rtt"
    return {"source": source, "switches": switches,
            "daemons": {h: r.get("switch") or "" for h, r in sorted(reports.items())},
            "rtt": rtt_summary(hosts, rtt)}
