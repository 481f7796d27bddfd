"""How each engine-API call becomes a request to mccld: its arguments and its layout in
the rank's shared-memory segment (what is copied in before, and out after).

Pure bookkeeping, no I/O: ``DaemonCommunicator`` queues the returned ``OpSpec`` and
does the copies. Offsets are bytes from the segment's start; a segment holds the
input at 0 and, for ops whose output is a different buffer, the output after it
(64-byte aligned).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable

from mccl_common.errors import ConfigError

from mccl_common.wire import DTYPE_SIZE, MAX_TAG, OP_NAMES
_ALIGN = 64

Copy = tuple[int, int, int]                  # (segment offset, user pointer, nbytes)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _starts(sizes: list[int]) -> list[int]:
    return list(accumulate(sizes, initial=0))[:-1]


def _merge(copies: list[Copy]) -> list[Copy]:
    """Drop empty copies and join neighbours (a packed all-to-all is usually one block)."""
    out: list[Copy] = []
    for off, ptr, n in copies:
        if not (ptr and n):
            continue
        if out and out[-1][0] + out[-1][2] == off and out[-1][1] + out[-1][2] == ptr:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((off, ptr, n))
    return out


@dataclass
class OpSpec:
    name: str                    # the daemon's op name
    args: dict[str, Any]
    span: int                    # segment bytes needed
    copy_in: list[Copy]
    copy_out: list[Copy]
    nbytes: int                  # for the rank's byte counters
    # Copied in and out piece by piece through the segment's tickets while the daemon
    # works (one input range at offset 0, results in place): the request goes first.
    pipelined: bool = False
    # Served by mccld's native thread through the rank's small-op queue (docs/daemon-fastpath.md):
    # an all-reduce of at most fast_bytes, or a barrier.
    fast: bool = False
    # Run compressed by mccld's engine (MCCL_COMPRESSION): its input is copied in piece by piece
    # without waiting for results (submit.py), since the engine keeps several groups of chunks
    # in flight before the first is done; each piece's `ready` lets the group it completes start.
    compressed: bool = False


class OpBuilder:
    """``compressed(dtype, op, nbytes)``: whether mccld's engine runs such an all-reduce
    compressed (the job's MCCL_COMPRESSION, on a job spanning hosts); None: nothing is."""

    def __init__(self, rank: int, size: int, pipeline_bytes: int, fast_bytes: int = 0,
                 compressed: Callable[[int, int, int], bool] | None = None):
        self.rank, self.size = rank, size
        self.pipeline_bytes = pipeline_bytes
        self.fast_bytes = fast_bytes                # 0: no small-op queue
        self.compressed = compressed

    def _spec(self, name: str, args: dict[str, Any], span: int, copy_in: list[Copy], copy_out: list[Copy],
              nbytes: int) -> OpSpec:
        return OpSpec(name, args, span, _merge(copy_in), _merge(copy_out), nbytes)

    def _check_reduce(self, count: int, dtype: int, op: int) -> int:
        if not (0 <= int(dtype) < len(DTYPE_SIZE)) or not (0 <= int(op) < len(OP_NAMES)) or count < 0:
            raise ConfigError(f"[daemon-client] bad count/dtype/op ({count}, {dtype}, {op}) on rank {self.rank}; "
                              "pass a non-negative count and a dtype/op code of mccl::DType / mccl::ReduceOp")
        return count * DTYPE_SIZE[dtype]

    def _check_rank(self, r: int, what: str, any_ok: bool = False) -> None:
        if any_ok and r == -1:
            return
        if not (0 <= r < self.size) or (what != "root" and r == self.rank):
            raise ConfigError(f"[daemon-client] {what} {r} on rank {self.rank} is not "
                              f"{'a rank' if what == 'root' else 'another rank'} of world size {self.size}; "
                              f"pass a rank between 0 and {self.size - 1}")

    def _check_p2p(self, nbytes: int, tag: int) -> None:
        if nbytes < 0 or not 0 <= tag <= MAX_TAG:
            raise ConfigError(f"[daemon-client] p2p of {nbytes} bytes with tag {tag} on rank {self.rank}; "
                              "the size must be >= 0 and the tag 0..2^32-1")

    # -- collectives -----------------------------------------------------------------------
    def allreduce(self, ptr: int, count: int, dtype: int, op: int) -> OpSpec:
        n = self._check_reduce(count, dtype, op)
        # Every rank decides from the size alone. What fits the small-op queue goes there even
        # past one piece: on a busy host its native thread with whole-buffer copies beat the
        # pipelined path's Python (docs/daemon-fastpath.md); beyond it, there is copying to overlap.
        # A compressed one goes to the job's thread with the tensor's address, which keys its
        # error feedback in mccld (the small-op queue's slot is the same for every op).
        compressed = self.compressed is not None and self.compressed(dtype, op, n)
        fast = 0 < n <= self.fast_bytes and not compressed
        pipelined = not fast and n > self.pipeline_bytes
        args = {"count": count, "dtype": dtype, "op": op, "offset": 0}
        if pipelined:
            args["pipelined"] = True
        if compressed:
            args["key"] = ptr
        spec = self._spec("allreduce", args, n, [(0, ptr, n)], [(0, ptr, n)], n)
        spec.compressed = compressed
        spec.pipelined = pipelined
        spec.fast = fast
        return spec

    def broadcast(self, ptr: int, nbytes: int, root: int) -> OpSpec:
        self._check_rank(root, "root")
        mine = self.rank == root
        return self._spec("broadcast", {"nbytes": nbytes, "root": root}, nbytes,
                          [(0, ptr, nbytes)] if mine else [], [] if mine else [(0, ptr, nbytes)], nbytes)

    def allgather(self, send_ptr: int, recv_ptr: int, nbytes: int) -> OpSpec:
        off = _align(nbytes)
        return self._spec("allgather", {"send_off": 0, "recv_off": off, "nbytes": nbytes},
                          off + self.size * nbytes, [(0, send_ptr, nbytes)],
                          [(off, recv_ptr, self.size * nbytes)], self.size * nbytes)

    def reduce_scatter(self, send_ptr: int, recv_ptr: int, count: int, dtype: int, op: int) -> OpSpec:
        n = self._check_reduce(count, dtype, op)
        off = _align(n * self.size)
        args = {"send_off": 0, "recv_off": off, "count": count, "dtype": dtype, "op": op}
        if self.compressed is not None and self.compressed(dtype, op, n * self.size):
            args["key"] = send_ptr   # mccld all-reduces the whole input, compressed (see allreduce)
        return self._spec("reduce_scatter", args, off + n, [(0, send_ptr, n * self.size)],
                          [(off, recv_ptr, n)], n * self.size)

    def reduce(self, ptr: int, count: int, dtype: int, op: int, root: int) -> OpSpec:
        n = self._check_reduce(count, dtype, op)
        self._check_rank(root, "root")
        return self._spec("reduce", {"count": count, "dtype": dtype, "op": op, "root": root}, n,
                          [(0, ptr, n)], [(0, ptr, n)] if self.rank == root else [], n)

    def gather(self, send_ptr: int, recv_ptr: int, nbytes: int, root: int) -> OpSpec:
        self._check_rank(root, "root")
        off = _align(nbytes)
        out = [(off, recv_ptr, self.size * nbytes)] if self.rank == root else []
        return self._spec("gather", {"send_off": 0, "recv_off": off, "nbytes": nbytes, "root": root},
                          off + self.size * nbytes, [(0, send_ptr, nbytes)], out, nbytes)

    def scatter(self, send_ptr: int, recv_ptr: int, nbytes: int, root: int) -> OpSpec:
        self._check_rank(root, "root")
        off = _align(nbytes * self.size)
        cin = [(0, send_ptr, self.size * nbytes)] if self.rank == root else []
        return self._spec("scatter", {"send_off": 0, "recv_off": off, "nbytes": nbytes, "root": root},
                          off + nbytes, cin, [(off, recv_ptr, nbytes)], nbytes)

    def barrier(self) -> OpSpec:
        spec = self._spec("barrier", {}, 0, [], [], 0)
        spec.fast = self.fast_bytes > 0
        return spec

    def alltoall(self, send_ptr: int, recv_ptr: int, nbytes: int) -> OpSpec:
        sizes = [nbytes] * self.size
        return self.alltoallv(send_ptr, sizes, _starts(sizes), recv_ptr, sizes, _starts(sizes))

    def alltoallv(self, send_ptr: int, send_sizes: list[int], send_offsets: list[int], recv_ptr: int,
                  recv_sizes: list[int], recv_offsets: list[int]) -> OpSpec:
        lists = (send_sizes, send_offsets, recv_sizes, recv_offsets)
        if any(len(v) != self.size or any(int(x) < 0 for x in v) for v in lists):
            raise ConfigError(f"[daemon-client] alltoallv on rank {self.rank}: sizes and offsets must be "
                              f"{self.size} non-negative byte counts each")
        send_sizes, recv_sizes = [int(x) for x in send_sizes], [int(x) for x in recv_sizes]
        # Packed in rank order in the segment, whatever the caller's offsets.
        packed_in, packed_out = _starts(send_sizes), _starts(recv_sizes)
        recv_off = _align(sum(send_sizes))
        cin = [(packed_in[d], send_ptr + int(send_offsets[d]), send_sizes[d]) for d in range(self.size)]
        cout = [(recv_off + packed_out[s], recv_ptr + int(recv_offsets[s]), recv_sizes[s]) for s in range(self.size)]
        return self._spec("alltoallv", {"send_off": 0, "recv_off": recv_off, "send_sizes": send_sizes,
                                        "recv_sizes": recv_sizes},
                          recv_off + sum(recv_sizes), cin, cout, sum(send_sizes))

    # -- point-to-point ----------------------------------------------------------------------
    def send(self, ptr: int, nbytes: int, dst: int, tag: int) -> OpSpec:
        self._check_rank(dst, "dst")
        self._check_p2p(nbytes, tag)
        return self._spec("send", {"dst": dst, "tag": tag, "nbytes": nbytes}, nbytes, [(0, ptr, nbytes)], [],
                          nbytes)

    def recv_post(self, nbytes: int, src: int, tag: int, post: int) -> dict[str, Any]:
        """The ``recv`` request's arguments (no segment: the data comes with a later ``take``)."""
        self._check_rank(src, "src", any_ok=True)
        self._check_p2p(nbytes, tag)
        return {"src": src, "tag": tag, "nbytes": nbytes, "post": post}

    def take(self, ptr: int, nbytes: int, post: int) -> OpSpec:
        return self._spec("take", {"post": post}, nbytes, [], [(0, ptr, nbytes)], nbytes)
