"""Fleet tables spread by gossip over the authenticated daemon links, so daemons find each
other across subnets, VLANs and routers, where mDNS (one broadcast domain) does not reach.

Every ``interval`` a daemon bumps its own entry's heartbeat counter and sends a digest of its
table (mccl_common/gossip_protocol.py) to ``FANOUT`` random known peers, and to the MCCL_PEERS
seeds it has not exchanged with lately; push-pull exchanges spread a change to N daemons in
O(log N) rounds. Seeds and peers are dialled through LinkManager, so the fleet key proves both
ends before a single gossip byte is read; dials, name resolution and sends run on a small pool
(``MAX_DIALS`` at once, each bounded by MCCL_LINK_TIMEOUT), never on a link's reader.

What one authenticated but malicious member can do, and the bound on it:
- Flood: per peer at most ``MAX_MESSAGES_PER_ROUND`` messages are taken per interval (the rest
  dropped), every message is validated once and refused whole if malformed, the table holds at
  most MAX_TABLE hosts, and one peer may introduce at most ``MAX_NEW_PER_PEER`` unknown hosts per
  TTL, so it cannot fill the table alone.
- Keep a dead host alive or make an entry younger: entries age from the moment their version
  last advanced here, and only a newer version advances it; relaying copies never does. A
  dropped entry's version is remembered for a TTL, so a slower peer's stale copy cannot bring
  it back.
- Forge another host's entry with a higher version: the incarnation may not lie more than an
  hour ahead of our clock, and the owner refutes it: a daemon never takes an entry about itself
  from anyone, and on seeing one newer than its own it jumps its version past it and warns,
  naming the peer. With a shared fleet key any member can claim any host id on a link too
  (docs/security.md); rotating the key is what removes a member for good.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from mccl_common import gossip_protocol as gp
from mccl_common.errors import MCCLError

from ..logutil import OnceLogger
from .workers import WorkerPool

log = logging.getLogger(__name__)

FANOUT = 3                    # random peers per round, besides due seeds
MAX_DIALS = 4                 # dials / sends in flight at once
_STOP_JOIN_S = 15.0           # stop() waits this long for a dial in flight (MCCL_LINK_TIMEOUT is 10 s)
MAX_QUEUED = 64               # dials and sends accepted, queued or running; past it a round sends less
# Messages taken from one peer per interval: a whole table is MAX_TABLE / MAX_ENTRIES_PER_MESSAGE
# of them, and a peer may answer our digest while sending its own.
MAX_MESSAGES_PER_ROUND = 4 * gp.MAX_TABLE // gp.MAX_ENTRIES_PER_MESSAGE
MAX_NEW_PER_PEER = gp.MAX_TABLE // 4
MAX_BACKOFF_S = 60.0
_INBOX = 256


@dataclass
class _Known:
    entry: gp.Entry
    refreshed: float          # monotonic time its version last advanced here
    via: str                  # the peer we took that version from


@dataclass
class _Seed:
    host: str
    port: int
    next_try: float = 0.0
    backoff: float = 0.0
    last_ok: float = -1e18
    failures: int = 0
    busy: bool = False        # an attempt is in flight (dialling every address may outlast a round)


class Gossip:
    def __init__(self, fleet: str, host_id: str, links, own: Callable[[], dict[str, Any]],
                 seeds: list[tuple[str, int]], interval_s: float, ttl_s: float,
                 local_peers: Callable[[], list[str]] = lambda: [],
                 on_change: Callable[[str, dict | None], None] = lambda host, row: None):
        self.fleet, self.host_id = fleet, host_id
        self._links = links                 # LinkManager (link_to, send_host)
        self._own_fields = own              # this daemon's announced fields, read each heartbeat
        self._local_peers = local_peers     # link addresses mDNS found on our subnet
        self._on_change = on_change
        self._interval, self._ttl = interval_s, ttl_s
        self._seeds = [_Seed(h, p) for h, p in seeds]
        self._incarnation = int(time.time() * 1000)
        self._counter = 0
        self._own: gp.Entry | None = None
        self._table: dict[str, _Known] = {}
        self._dropped: dict[str, tuple[tuple[int, int], float]] = {}   # host -> (version, when) for a TTL
        self._introduced: dict[str, list[float]] = {}                  # peer -> times it brought a new host
        self._budget: dict[str, int] = {}                              # peer -> messages left this round
        self._shunned: dict[str, tuple[float, float]] = {}             # addr -> (retry at, backoff) after a failure
        self._lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue(maxsize=_INBOX)
        self._dials = WorkerPool("mccld-gossip-dial", MAX_DIALS, MAX_QUEUED,
                                 lambda: log.debug("gossip: a dial task failed", exc_info=True), _STOP_JOIN_S)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._once = OnceLogger(log, rewarn_s=None)
        self._full_warned = -1e18

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Gossip":
        self._heartbeat()
        self._dials.start()
        self._thread = threading.Thread(target=self._loop, name="mccld-gossip", daemon=True)
        self._thread.start()
        if self._seeds:
            log.info("gossip: seeds %s", ", ".join(f"{s.host}:{s.port}" for s in self._seeds))
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        self._dials.stop()   # a dial in flight ends by MCCL_LINK_TIMEOUT

    # -- what the daemon reads ---------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """Every live host we know by gossip, ourselves included, in discovery.FleetTable's shape."""
        with self._lock:
            entries = [k.entry for k in self._table.values()] + ([self._own] if self._own else [])
        return sorted((e.table_row() for e in entries), key=lambda r: r["host_id"])

    def forget(self, host_id: str) -> None:
        """mDNS saw ``host_id`` leave our subnet (goodbye or expiry): drop its entry now, not a
        gossip TTL later. Its owner's next heartbeat brings it back if it is alive after all."""
        with self._lock:
            known = self._table.pop(host_id, None)
            if known is not None:
                self._dropped[host_id] = (known.entry.key, time.monotonic())
        if known is not None:
            self._on_change(host_id, None)

    def on_message(self, peer_host: str, msg: dict[str, Any]) -> None:
        """A gossip message from an authenticated link's reader: counted against the peer's
        budget and queued, never handled on the reader (it must not block on a send)."""
        with self._lock:
            left = self._budget.get(peer_host, MAX_MESSAGES_PER_ROUND)
            if left <= 0 or (peer_host not in self._budget and len(self._budget) >= gp.MAX_TABLE):
                self._once.warn(f"rate:{peer_host}", "[gossip] peer %s sends more than %d gossip messages per "
                                "%.1f s; dropping the excess (a misbehaving or hostile fleet member?)",
                                peer_host, MAX_MESSAGES_PER_ROUND, self._interval)
                return
            self._budget[peer_host] = left - 1
        try:
            self._inbox.put_nowait((peer_host, msg))
        except queue.Full:
            log.debug("gossip inbox full; dropping a message from %s", peer_host)

    # -- the round ---------------------------------------------------------------------------
    def _loop(self) -> None:
        next_round = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_round:
                # Jitter: daemons started together must not gossip in lock step.
                next_round = now + self._interval * random.uniform(0.8, 1.2)
                try:
                    self._round(now)
                except Exception:  # noqa: BLE001 - the gossip thread must survive anything
                    log.exception("[gossip] round failed")
            try:
                peer, msg = self._inbox.get(timeout=max(0.0, min(0.2, next_round - time.monotonic())))
            except queue.Empty:
                continue
            self._handle(peer, msg)

    def _round(self, now: float) -> None:
        self._heartbeat()
        self._expire(now)
        with self._lock:
            self._budget.clear()
            addrs = {k.entry.link_addr for k in self._table.values()}
        own_addr = self._own.link_addr if self._own else ""
        addrs.update(a for a in self._local_peers() if a != own_addr)
        addrs.discard(own_addr)
        with self._lock:
            # A peer that failed (down, or another fleet key: mDNS is unauthenticated) waits out
            # its backoff instead of costing a handshake every round.
            addrs = {a for a in addrs if self._shunned.get(a, (0.0, 0.0))[0] <= now}
        targets = random.sample(sorted(addrs), min(FANOUT, len(addrs)))
        for addr in targets:
            self._submit(self._exchange, addr, None)
        for seed in self._seeds:
            # A seed we exchanged with lately is an ordinary peer; one we lost (or never reached)
            # is retried with backoff, so a partitioned daemon finds its way back.
            if now - seed.last_ok > self._ttl / 2 and now >= seed.next_try and not seed.busy:
                seed.busy = True      # before the submit: the attempt may end before it returns
                if not self._submit(self._contact_seed, seed, None):
                    seed.busy = False

    def _submit(self, fn: Callable, a: Any, b: Any) -> bool:
        """Run fn(a, b) on a dial worker; False when too much is queued (or we stop) and it will not run."""
        return not self._stop.is_set() and self._dials.submit(fn, a, b)

    def _digest(self) -> dict[str, Any]:
        with self._lock:
            rows = [[h, *k.entry.key] for h, k in self._table.items()]
            if self._own is not None:
                rows.append([self.host_id, *self._own.key])
        return {"type": gp.DIGEST, "digest": rows}

    def _exchange(self, addr: str, _: Any) -> None:
        try:
            self._links.link_to(addr, quiet=True).send(self._digest())
        except MCCLError as e:
            log.debug("gossip to %s failed: %s", addr, e)
            with self._lock:
                backoff = min(MAX_BACKOFF_S, max(self._interval, 2 * self._shunned.get(addr, (0.0, 0.0))[1]))
                self._shunned[addr] = (time.monotonic() + backoff, backoff)
                if len(self._shunned) > gp.MAX_TABLE:
                    self._shunned.pop(next(iter(self._shunned)))
            return
        with self._lock:
            self._shunned.pop(addr, None)

    def _contact_seed(self, seed: _Seed, _: Any) -> None:
        try:
            self._try_seed(seed)
        finally:
            seed.busy = False

    def _try_seed(self, seed: _Seed) -> None:
        name = f"{seed.host}:{seed.port}"
        try:
            addrs = gp.resolve_seed(seed.host, seed.port)
        except OSError as e:
            self._seed_failed(seed, f"{name} does not resolve ({e})")
            return
        own = self._own.link_addr if self._own else ""
        reached, why = 0, "no address"
        for addr in addrs:
            if addr == own:
                reached += 1     # a DNS name of the whole fleet names us too
                continue
            try:
                self._links.link_to(addr, quiet=True).send(self._digest())
                reached += 1
            except MCCLError as e:
                why = str(e)
        if reached:
            if seed.failures:
                log.info("gossip: seed %s reachable again", name)
                self._once.forget(f"seed:{name}")
            seed.last_ok, seed.backoff, seed.failures = time.monotonic(), 0.0, 0
        else:
            self._seed_failed(seed, why)

    def _seed_failed(self, seed: _Seed, why: str) -> None:
        seed.failures += 1
        seed.backoff = min(MAX_BACKOFF_S, max(self._interval, seed.backoff * 2))
        seed.next_try = time.monotonic() + seed.backoff * random.uniform(0.75, 1.25)
        self._once.warn(f"seed:{seed.host}:{seed.port}", "[gossip] seed %s:%d (MCCL_PEERS) is unreachable: %s; "
                        "retrying with backoff up to %.0f s (is mccld running there, on that MCCL_PORT, with "
                        "this fleet's key?)", seed.host, seed.port, why, MAX_BACKOFF_S)

    # -- messages ----------------------------------------------------------------------------
    def _handle(self, peer: str, msg: dict[str, Any]) -> None:
        now_ms = int(time.time() * 1000)
        try:
            if msg.get("type") == gp.DIGEST:
                theirs = gp.check_digest(msg, now_ms)
                self._answer_digest(peer, theirs)
            else:
                entries, want = gp.check_entries(msg, self.fleet, now_ms)
                for e in entries:
                    self._merge(e, peer)
                if want:
                    self._send_entries(peer, want, [])
        except ValueError as e:
            self._once.warn(f"bad:{peer}", "[gossip] dropping a malformed %s from peer %s: %s (mixed mccld "
                            "versions, or a misbehaving fleet member)", str(msg.get("type"))[:32], peer, e)

    def _answer_digest(self, peer: str, theirs: dict[str, tuple[int, int]]) -> None:
        with self._lock:
            mine = {h: k.entry for h, k in self._table.items()}
            if self._own is not None:
                mine[self.host_id] = self._own
        newer = [h for h, e in mine.items() if h not in theirs or e.key > theirs[h]]
        want = [h for h, v in theirs.items() if h != self.host_id and (h not in mine or v > mine[h].key)]
        self._send_entries(peer, newer, want[:gp.MAX_TABLE])

    def _send_entries(self, peer: str, hosts: list[str], want: list[str]) -> None:
        with self._lock:
            entries = [self._own if h == self.host_id else self._table[h].entry
                       for h in hosts if h == self.host_id or h in self._table]
        if not entries and not want:
            return
        step = gp.MAX_ENTRIES_PER_MESSAGE
        chunks = [entries[i:i + step] for i in range(0, len(entries), step)] or [[]]
        msgs = [{"type": gp.ENTRIES, "entries": [e.wire() for e in chunk], "want": want if i == 0 else []}
                for i, chunk in enumerate(chunks) if chunk or (i == 0 and want)]
        self._submit(self._send_all, peer, msgs)

    def _send_all(self, peer: str, msgs: list[dict[str, Any]]) -> None:
        try:
            for m in msgs:
                self._links.send_host(peer, m)
        except MCCLError as e:
            log.debug("gossip answer to %s failed: %s", peer, e)

    def _merge(self, e: gp.Entry, peer: str) -> None:
        now = time.monotonic()
        if e.host_id == self.host_id:
            self._refute(e, peer)
            return
        with self._lock:
            known = self._table.get(e.host_id)
            if known is not None:
                if e.key <= known.entry.key:
                    return          # not newer: a relay cannot make an entry younger
                self._table[e.host_id] = _Known(e, now, peer)
                changed = replace(known.entry, counter=e.counter) != e
            else:
                dropped = self._dropped.get(e.host_id)
                if dropped is not None and e.key <= dropped[0]:
                    return          # the copy we dropped, still circulating
                if len(self._table) >= gp.MAX_TABLE or not self._may_introduce(peer, now):
                    self._table_full(peer)
                    return
                self._table[e.host_id] = _Known(e, now, peer)
                self._dropped.pop(e.host_id, None)
                changed = True
        if known is None:
            log.info("fleet: %s joined via gossip from %s (%s)", e.host_id, peer, e.link_addr)
        if changed:
            self._on_change(e.host_id, e.table_row())

    def _may_introduce(self, peer: str, now: float) -> bool:
        # Under self._lock.
        times = [t for t in self._introduced.get(peer, []) if now - t < self._ttl]
        if len(times) >= MAX_NEW_PER_PEER:
            self._introduced[peer] = times
            return False
        times.append(now)
        self._introduced[peer] = times
        if len(self._introduced) > gp.MAX_TABLE:
            self._introduced.pop(next(iter(self._introduced)))
        return True

    def _table_full(self, peer: str) -> None:
        now = time.monotonic()
        if now - self._full_warned >= 60.0:
            self._full_warned = now
            log.warning("[gossip] not taking a new host from peer %s: the table holds %d hosts (at most %d), or "
                        "that peer introduced %d in the last %.0f s; a fleet that large, or a member flooding it",
                        peer, len(self._table), gp.MAX_TABLE, MAX_NEW_PER_PEER, self._ttl)

    def _refute(self, e: gp.Entry, peer: str) -> None:
        with self._lock:
            own = self._own
            if own is None or e.key <= own.key or e == own:
                return
            # Someone holds a version of our entry we never made: outrank it, so ours spreads.
            self._incarnation, self._counter = e.incarnation, e.counter
        self._once.warn(f"claim:{peer}", "[gossip] peer %s relayed an entry for this host (%s) that this daemon "
                        "never made (version %d.%d); another host uses our MCCL_HOST_ID, or a fleet member forges "
                        "it: outranking it with ours", peer, self.host_id, e.incarnation, e.counter)
        self._heartbeat()

    # -- our own entry and expiry ------------------------------------------------------------
    def _heartbeat(self) -> None:
        fields = self._own_fields()
        with self._lock:
            self._counter += 1
            try:
                self._own = gp.check_entry({**fields, "host_id": self.host_id, "fleet": self.fleet,
                                            "incarnation": self._incarnation, "counter": self._counter},
                                           self.fleet, int(time.time() * 1000) + gp.MAX_FUTURE_MS)
            except ValueError as e:
                self._once.warn("own", "[gossip] this daemon's own entry is not valid (%s); not gossiping it", e)

    def _expire(self, now: float) -> None:
        with self._lock:
            gone = [h for h, k in self._table.items() if now - k.refreshed > self._ttl]
            for h in gone:
                self._dropped[h] = (self._table.pop(h).entry.key, now)
            for h in [h for h, (_, t) in self._dropped.items() if now - t > self._ttl]:
                del self._dropped[h]
            for p in [p for p, ts in self._introduced.items() if not ts or now - ts[-1] > self._ttl]:
                del self._introduced[p]
        for h in gone:
            log.info("fleet: %s expired (its owner did not refresh it for %.0f s)", h, self._ttl)
            self._on_change(h, None)
