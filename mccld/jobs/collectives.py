"""Hierarchical collectives: this host's ranks through shared memory, then across hosts.

One ``Hierarchy`` per job. Inputs are the local ranks' shared-memory regions (integer
addresses); the inter-host step runs on the engine communicator among the job's
daemons (one rank per host), directly on the first local rank's region, so the data
is never copied on its way to the network. Each method is one small algorithm:
reduce locally -> engine op across hosts -> write back to every local rank.

Ops built from others are noted where they move more bytes than a dedicated
algorithm would (reduce_scatter, gather, scatter); their results are exact.

All-to-all(v) is the one op whose arguments differ per rank (each rank's split sizes),
so ``run`` takes every local rank's arguments; the others read the first rank's.
"""

from __future__ import annotations

import ctypes
from itertools import accumulate
from dataclasses import dataclass
from typing import Any, Callable

from mccl_common.errors import CollectiveMismatch, ConfigError, ProtocolError
from mccl_common.wire import AVG, DTYPE_SIZE, SUM

from .pipelined import Pipeline, Region
from .rawbuf import RawBuffer
from .reduce import ReducePool, check

# Runs one engine op: (method name, *args) -> None once done, raises its typed error.
EngineRun = Callable[..., None]

SUPPORTED = ("allreduce", "broadcast", "allgather", "reduce_scatter", "reduce", "gather",
             "scatter", "barrier", "alltoallv")


def per_rank_args(op: str) -> frozenset[str]:
    """Arguments that legitimately differ between the ranks of one collective."""
    if op == "alltoallv":
        return frozenset({"segment", "send_off", "recv_off", "send_sizes", "recv_sizes"})
    if op == "allreduce":
        # base: where the op starts in the rank's tickets; offset: in its segment (a tensor in a
        # shared buffer sits wherever its allocation put it); key: the rank's tensor address
        return frozenset({"segment", "base", "offset", "key"})
    if op == "reduce_scatter":
        return frozenset({"segment", "key"})
    return frozenset({"segment"})


def _copy(dst: int, src: int, nbytes: int) -> None:
    if nbytes and dst != src:
        ctypes.memmove(dst, src, nbytes)


def _starts(sizes: list[int]) -> list[int]:
    return list(accumulate(sizes, initial=0))[:-1]


@dataclass
class Topology:
    size: int                    # world size of the job
    hosts: list[list[int]]       # global ranks of each host, hosts in host-rank order
    host_rank: int               # this daemon's index in ``hosts``

    @property
    def local(self) -> list[int]:
        return self.hosts[self.host_rank]

    def host_of(self, rank: int) -> int:
        for h, ranks in enumerate(self.hosts):
            if rank in ranks:
                return h
        raise ConfigError(f"[daemon] rank {rank} is in no host of this job (size {self.size})")


class Hierarchy:
    def __init__(self, topo: Topology, pool: ReducePool, engine: EngineRun | None, pipeline_bytes: int,
                 timeout_s: float):
        self.topo = topo
        self.pool = pool
        self.engine = engine  # None: single-host job
        self.pipeline = Pipeline(pool, pipeline_bytes, timeout_s)
        self._scratch = RawBuffer(0)

    def close(self) -> None:
        self.pipeline.close()

    def run(self, op: str, bases: dict[int, int], args: dict[int, dict[str, Any]],
            tickets: dict[int, tuple[Any, Any]] | None = None) -> None:
        """``bases``: local rank -> address of its region; ``args``: local rank -> its
        arguments as sent by its client; ``tickets``: local rank -> its segment's (ready,
        done), for ops the clients pipeline."""
        fn = getattr(self, "_" + op, None) if op in SUPPORTED else None
        if fn is None:
            raise ConfigError(f"[daemon] collective {op!r} is not supported in daemon mode "
                              f"(supported: {', '.join(SUPPORTED)}); unset MCCL_DAEMON to run it in-process")
        if op == "alltoallv":
            fn(bases, args)
            return
        if op == "allreduce":
            # Each rank's region starts at its own offset: from here on, at its base.
            bases = {r: bases[r] + args[r].get("offset", 0) for r in bases}
            if args[self.topo.local[0]].get("pipelined"):
                self._allreduce_pipelined(bases, args, tickets or {})
                return
        fn(bases, **{k: v for k, v in args[self.topo.local[0]].items() if k not in ("segment", "offset")})

    # Error feedback of a compressed op (docs/compression.md) is keyed by the first local rank's
    # tensor address ("key", as its client sent it): the segment the daemon runs the op on is
    # reused by every op, while a DDP bucket keeps its tensor across steps, and a rebuilt bucket
    # gets a new one. Without a key (an exact op of an older client) the engine keys by the region.

    # -- helpers -------------------------------------------------------------------------
    def _leader_reduce(self, bases: dict[int, int], off: int, count: int, dtype: int, op: int) -> int:
        """Reduce every local region into the first local rank's; returns its address."""
        check(dtype, op)
        local = self.topo.local
        dst = bases[local[0]] + off
        for r in local[1:]:
            self.pool.reduce(bases[r] + off, dst, count, dtype, SUM if op == AVG else op)
        return dst

    def _scratch_addr(self, nbytes: int) -> int:
        if self._scratch.nbytes < max(nbytes, 1):  # never empty: the engine refuses null pointers
            self._scratch = RawBuffer(max(nbytes, 1))
        return self._scratch.addr

    def _gather_all(self, bases: dict[int, int], send_off: int, nbytes: int) -> int:
        """Every rank's ``nbytes`` block in global rank order; returns the scratch address."""
        topo = self.topo
        width = max(len(h) for h in topo.hosts) * nbytes    # hosts padded to the widest
        scratch = self._scratch_addr(width * (len(topo.hosts) + 1) + topo.size * nbytes)
        stage_recv = scratch + width
        out = stage_recv + width * len(topo.hosts)
        for j, r in enumerate(topo.local):
            _copy(scratch + j * nbytes, bases[r] + send_off, nbytes)
        if self.engine is not None:
            self.engine("allgather", scratch, stage_recv, width)
        else:
            _copy(stage_recv, scratch, width)
        for h, ranks in enumerate(topo.hosts):
            for j, r in enumerate(ranks):
                _copy(out + r * nbytes, stage_recv + h * width + j * nbytes, nbytes)
        return out

    # -- algorithms ------------------------------------------------------------------------
    def _allreduce(self, bases, count: int, dtype: int, op: int, key: int = 0) -> None:
        buf = self._leader_reduce(bases, 0, count, dtype, op)
        # One rank on every host: the engine's AVG is the job's (as in the pipelined path), and a
        # compressed one divides before it encodes the sum, as in-process (the same bits).
        engine_divides = self.engine is not None and self.topo.size == len(self.topo.hosts)
        if self.engine is not None:
            self.engine("allreduce", buf, count, dtype, SUM if op == AVG and not engine_divides else op,
                        feedback_key=key)
        if op == AVG and not engine_divides:
            self.pool.finalize_avg(buf, count, dtype, self.topo.size)
        for r in self.topo.local[1:]:
            _copy(bases[r], buf, count * DTYPE_SIZE[dtype])

    def _allreduce_pipelined(self, bases, args: dict[int, dict[str, Any]],
                             tickets: dict[int, tuple[Any, Any]]) -> None:
        a = args[self.topo.local[0]]
        count, dtype, op = a["count"], a["dtype"], a["op"]
        check(dtype, op)
        for r in self.topo.local:
            if "base" not in args[r] or r not in tickets:
                raise ProtocolError(f"[daemon] pipelined allreduce: rank {r} sent no base or no segment; "
                                    "the client and daemon releases differ?")
        regions = [Region(bases[r], *tickets[r], args[r]["base"]) for r in self.topo.local]
        topo = self.topo
        self.pipeline.allreduce(regions, count, dtype, op, topo.size, self.engine,
                                engine_divides=topo.size == len(topo.hosts), key=a.get("key", 0))

    def _broadcast(self, bases, nbytes: int, root: int) -> None:
        local = self.topo.local
        src = bases[root] if root in local else bases[local[0]]
        if self.engine is not None:
            self.engine("broadcast", src, nbytes, self.topo.host_of(root))
        for r in local:
            _copy(bases[r], src, nbytes)

    def _allgather(self, bases, send_off: int, recv_off: int, nbytes: int) -> None:
        out = self._gather_all(bases, send_off, nbytes)
        for r in self.topo.local:
            _copy(bases[r] + recv_off, out, self.topo.size * nbytes)

    def _gather(self, bases, send_off: int, recv_off: int, nbytes: int, root: int) -> None:
        # All-gather, then only the root keeps it: world*nbytes crosses every link.
        out = self._gather_all(bases, send_off, nbytes)
        if root in self.topo.local:
            _copy(bases[root] + recv_off, out, self.topo.size * nbytes)

    def _reduce_scatter(self, bases, send_off: int, recv_off: int, count: int, dtype: int, op: int,
                        key: int = 0) -> None:
        # All-reduce of the whole input, then each rank keeps its block: correct, but moves
        # the full buffer rather than 1/world of it (compressed too, where the job compresses).
        total = count * self.topo.size
        buf = self._leader_reduce(bases, send_off, total, dtype, op)
        if self.engine is not None:
            self.engine("allreduce", buf, total, dtype, SUM if op == AVG else op, feedback_key=key)
        if op == AVG:
            self.pool.finalize_avg(buf, total, dtype, self.topo.size)
        block = count * DTYPE_SIZE[dtype]
        for r in self.topo.local:
            _copy(bases[r] + recv_off, buf + r * block, block)

    def _reduce(self, bases, count: int, dtype: int, op: int, root: int) -> None:
        local = self.topo.local
        buf = self._leader_reduce(bases, 0, count, dtype, op)
        if self.engine is not None:
            self.engine("reduce", buf, count, dtype, SUM if op == AVG else op, self.topo.host_of(root))
        if root in local:
            if op == AVG:
                self.pool.finalize_avg(buf, count, dtype, self.topo.size)
            _copy(bases[root], buf, count * DTYPE_SIZE[dtype])

    def _scatter(self, bases, send_off: int, recv_off: int, nbytes: int, root: int) -> None:
        # Broadcast of the root's whole send buffer, then each rank takes its block.
        local = self.topo.local
        total = nbytes * self.topo.size
        src = bases[root] + send_off if root in local else bases[local[0]] + send_off
        if self.engine is not None:
            self.engine("broadcast", src, total, self.topo.host_of(root))
        for r in local:
            _copy(bases[r] + recv_off, src + r * nbytes, nbytes)

    def _alltoallv(self, bases, args: dict[int, dict[str, Any]]) -> None:
        """Ranks of this host exchange directly; other hosts' blocks go in ONE engine
        all-to-all-v among hosts, packed per destination host in (source rank, destination
        rank) order, which the receiving daemon unpacks in the same order."""
        topo, local = self.topo, self.topo.local
        send = {r: _starts(args[r]["send_sizes"]) for r in local}
        recv = {r: _starts(args[r]["recv_sizes"]) for r in local}

        def src_at(s: int, d: int) -> int:
            return bases[s] + args[s]["send_off"] + send[s][d]

        def dst_at(d: int, s: int) -> int:
            return bases[d] + args[d]["recv_off"] + recv[d][s]

        for s in local:
            for d in local:
                n = args[s]["send_sizes"][d]
                if n != args[d]["recv_sizes"][s]:
                    raise CollectiveMismatch(
                        f"[daemon] alltoallv: rank {s} sends {n} bytes to rank {d}, which expects "
                        f"{args[d]['recv_sizes'][s]}; every rank's output splits must match the senders' "
                        "input splits", peer_rank=s)
                _copy(dst_at(d, s), src_at(s, d), n)
        if self.engine is None:
            return
        me, hosts = topo.host_rank, topo.hosts
        out_sizes = [0 if h == me else sum(args[s]["send_sizes"][d] for s in local for d in ranks)
                     for h, ranks in enumerate(hosts)]
        in_sizes = [0 if h == me else sum(args[d]["recv_sizes"][s] for s in ranks for d in local)
                    for h, ranks in enumerate(hosts)]

        def wire_order(sending: bool):
            """(address in a local rank's region, bytes) of each cross-host block, in the
            order both ends use: per other host, by source rank, then destination rank."""
            for h, ranks in enumerate(hosts):
                if h != me:
                    for s in local if sending else ranks:
                        for d in ranks if sending else local:
                            yield ((src_at(s, d), args[s]["send_sizes"][d]) if sending
                                   else (dst_at(d, s), args[d]["recv_sizes"][s]))

        packed = self._scratch_addr(sum(out_sizes) + sum(in_sizes))
        unpacked = packed + sum(out_sizes)
        at = packed
        for addr, n in wire_order(sending=True):
            _copy(at, addr, n)
            at += n
        self.engine("alltoallv", packed, out_sizes, _starts(out_sizes), unpacked, in_sizes, _starts(in_sizes))
        at = unpacked
        for addr, n in wire_order(sending=False):
            _copy(addr, at, n)
            at += n

    def _barrier(self, bases) -> None:
        if self.engine is not None:
            self.engine("barrier")
