"""One collective correctness suite, shared by every backend mode.

``run_suite(rank, world)`` runs inside each rank of an initialised ``mccl`` group and
loops over every case (op x dtype x size) in one process group, so a world size
costs one spawn. Every rank derives every other rank's inputs from a seed, computes
the expected result locally in float64/int64 and compares.

Backend modes: ``MODES`` maps a mode name to how its ranks run: a context manager
yielding their environment (starting whatever they need) and the case families the
mode does not offer. Both the in-process engine and the daemon mode (MCCL_DAEMON=1,
one in-process mccld) run every family.
"""

from __future__ import annotations

import contextlib
import pathlib
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from libmccl.torch import compat


@dataclass(frozen=True)
class Mode:
    setup: Callable[[], contextlib.AbstractContextManager[dict[str, str]]]
    unsupported: frozenset[str] = field(default_factory=frozenset)  # case families, e.g. "send_recv"


MODES: dict[str, Mode] = {}


def register_mode(name: str, setup: Callable[[], contextlib.AbstractContextManager[dict[str, str]]],
                  unsupported: frozenset[str] = frozenset()) -> None:
    MODES[name] = Mode(setup, unsupported)


@contextlib.contextmanager
def _inprocess() -> Iterator[dict[str, str]]:
    yield {"MCCL_DAEMON": "0"}


@contextlib.contextmanager
def _daemon() -> Iterator[dict[str, str]]:
    from mccl_common.daemon_settings import load_config
    from mccld.daemon import Daemon
    from support.daemon import daemon_env  # the daemon tests own its test settings

    with tempfile.TemporaryDirectory(prefix="mccl-suite-") as rdir:
        env = daemon_env(pathlib.Path(rdir))
        daemon = Daemon(load_config(env=env)).start()
        try:
            yield dict(env, MCCL_DAEMON="1")
        finally:
            daemon.stop()


register_mode("inprocess", _inprocess)
register_mode("daemon", _daemon)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool]
# 1 element, odd, and not divisible by any world size 2..4.
SIZES = [1, 7, 1001]
BIG_BYTES = 64 << 20
R = dist.ReduceOp


def _ops_for(dtype: torch.dtype) -> list[Any]:
    if dtype == torch.bool:
        return [R.SUM, R.MIN, R.MAX, R.PRODUCT, R.BAND, R.BOR, R.BXOR]
    if dtype.is_floating_point:
        return [R.SUM, R.AVG, R.MIN, R.MAX, R.PRODUCT]
    return [R.SUM, R.AVG, R.MIN, R.MAX, R.PRODUCT, R.BAND, R.BOR, R.BXOR]


def make_input(seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Small integers, so sums/products are exact in every dtype whatever the order."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    low = 0 if dtype == torch.uint8 else -3
    vals = torch.randint(low, 4, shape, generator=g)
    return vals.to(dtype)


def reference_reduce(parts: list[torch.Tensor], op: Any) -> torch.Tensor:
    dtype = parts[0].dtype
    if dtype == torch.bool:
        s = torch.stack(parts)
        if op in (R.SUM, R.MAX, R.BOR):
            return s.any(0)
        if op in (R.PRODUCT, R.MIN, R.BAND):
            return s.all(0)
        return (s.sum(0) % 2).bool()
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    s = torch.stack([p.to(wide) for p in parts])
    if op == R.SUM:
        out = s.sum(0)
    elif op == R.AVG:
        out = s.sum(0) / len(parts) if dtype.is_floating_point else torch.div(s.sum(0), len(parts), rounding_mode="trunc")
    elif op == R.MIN:
        out = s.min(0).values
    elif op == R.MAX:
        out = s.max(0).values
    elif op == R.PRODUCT:
        out = s.prod(0)
    else:
        out = parts[0].to(torch.int64)
        for p in parts[1:]:
            p = p.to(torch.int64)
            out = out & p if op == R.BAND else out | p if op == R.BOR else out ^ p
    return out.to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype.is_floating_point:
        return torch.allclose(got.double(), want.double(), rtol=1e-2, atol=1e-2)
    return torch.equal(got, want)


@dataclass
class Case:
    name: str
    run: Callable[[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]]  # (seed, rank, world) -> [(got, want)]


def _all(seed: int, world: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    return [make_input(seed, r, shape, dtype) for r in range(world)]


def _case_all_reduce(dtype, n, op):
    def run(seed, rank, world):
        t = make_input(seed, rank, (n,), dtype)
        dist.all_reduce(t, op=op)
        return [(t, reference_reduce(_all(seed, world, (n,), dtype), op))]
    return Case(f"all_reduce[{op}|{dtype}|{n}]", run)


def _case_reduce(dtype, n, op):
    def run(seed, rank, world):
        root = world - 1
        t = make_input(seed, rank, (n,), dtype)
        dist.reduce(t, dst=root, op=op)
        want = reference_reduce(_all(seed, world, (n,), dtype), op) if rank == root else make_input(seed, rank, (n,), dtype)
        return [(t, want)]
    return Case(f"reduce[{op}|{dtype}|{n}]", run)


def _case_broadcast(dtype, n):
    def run(seed, rank, world):
        root = 1 % world
        t = make_input(seed, rank, (n, 2), dtype)
        dist.broadcast(t, src=root)
        return [(t, make_input(seed, root, (n, 2), dtype))]
    return Case(f"broadcast[{dtype}|{n}]", run)


def _case_all_gather(dtype, n):
    def run(seed, rank, world):
        outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
        dist.all_gather(outs, make_input(seed, rank, (n,), dtype))
        flat = torch.empty(world * n, dtype=dtype)
        dist.all_gather_into_tensor(flat, make_input(seed, rank, (n,), dtype))
        ins = _all(seed, world, (n,), dtype)
        return list(zip(outs, ins)) + [(flat, torch.cat(ins))]
    return Case(f"all_gather[{dtype}|{n}]", run)


def _case_reduce_scatter(dtype, n, op):
    def run(seed, rank, world):
        ins = [make_input(seed, rank, (world * n,), dtype)]
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, ins[0].clone(), op=op)
        out_list = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(out_list, list(ins[0].clone().chunk(world)), op=op)
        full = reference_reduce(_all(seed, world, (world * n,), dtype), op)
        want = full[rank * n:(rank + 1) * n]
        return [(out, want), (out_list, want)]
    return Case(f"reduce_scatter[{op}|{dtype}|{n}]", run)


def _case_gather_scatter(dtype, n):
    def run(seed, rank, world):
        root = world - 1
        mine = make_input(seed, rank, (n,), dtype)
        gathered = [torch.empty(n, dtype=dtype) for _ in range(world)] if rank == root else None
        dist.gather(mine, gathered, dst=root)
        pairs = list(zip(gathered, _all(seed, world, (n,), dtype))) if rank == root else []
        out = torch.empty(n, dtype=dtype)
        chunks = [make_input(seed + 7, r, (n,), dtype) for r in range(world)]
        dist.scatter(out, chunks if rank == 0 else None, src=0)
        return pairs + [(out, chunks[rank])]
    return Case(f"gather_scatter[{dtype}|{n}]", run)


def _case_all_to_all(dtype, n):
    def run(seed, rank, world):
        inp = make_input(seed, rank, (world * n,), dtype)
        out = torch.empty(world * n, dtype=dtype)
        dist.all_to_all_single(out, inp)
        want = torch.cat([x[rank * n:(rank + 1) * n] for x in _all(seed, world, (world * n,), dtype)])
        # Uneven splits: rank r sends (r + d + 1) rows to rank d.
        send_splits = [rank + d + 1 for d in range(world)]
        recv_splits = [s + rank + 1 for s in range(world)]
        vin = make_input(seed + 1, rank, (sum(send_splits), 2), dtype)
        vout = torch.empty(sum(recv_splits), 2, dtype=dtype)
        dist.all_to_all_single(vout, vin, recv_splits, send_splits)
        vwant = []
        for s in range(world):
            theirs = make_input(seed + 1, s, (sum(s + d + 1 for d in range(world)), 2), dtype)
            start = sum(s + d + 1 for d in range(rank))
            vwant.append(theirs[start:start + s + rank + 1])
        outs = [torch.empty(n + r, dtype=dtype) for r in range(world)]
        dist.all_to_all(outs, [make_input(seed + 2, rank * world + d, (n + rank,), dtype) for d in range(world)])
        lwant = [make_input(seed + 2, s * world + rank, (n + s,), dtype) for s in range(world)]
        return [(out, want), (vout, torch.cat(vwant))] + list(zip(outs, lwant))
    return Case(f"all_to_all[{dtype}|{n}]", run)


def _case_send_recv(dtype, n):
    def run(seed, rank, world):
        right, left = (rank + 1) % world, (rank - 1) % world
        got = torch.empty(n, dtype=dtype)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, make_input(seed, rank, (n,), dtype), right),
                                       dist.P2POp(dist.irecv, got, left)])
        for req in reqs:
            req.wait()
        return [(got, make_input(seed, left, (n,), dtype))]
    return Case(f"send_recv[{dtype}|{n}]", run)


def _case_coalesced(dtype, n):
    def run(seed, rank, world):
        a, b = make_input(seed, rank, (n,), dtype), make_input(seed + 1, rank, (n + 3, 2), dtype)
        pairs = []
        if dtype != torch.bool:
            dist.all_reduce_coalesced([a, b], op=R.SUM)
            pairs += [(a, reference_reduce(_all(seed, world, (n,), dtype), R.SUM)),
                      (b, reference_reduce(_all(seed + 1, world, (n + 3, 2), dtype), R.SUM))]
        x, y = make_input(seed + 2, rank, (n,), dtype), make_input(seed + 3, rank, (2, n), dtype)
        outs = [[torch.empty(n, dtype=dtype), torch.empty(2, n, dtype=dtype)] for _ in range(world)]
        dist.all_gather_coalesced(outs, [x, y])
        for r in range(world):
            pairs += [(outs[r][0], make_input(seed + 2, r, (n,), dtype)),
                      (outs[r][1], make_input(seed + 3, r, (2, n), dtype))]
        # The coalescing manager's fast paths: allgather/reduce-scatter_tensor_coalesced.
        ag = [torch.empty(world * n, dtype=dtype), torch.empty(world * (n + 1), dtype=dtype)]
        with compat.coalescing_manager():
            dist.all_gather_into_tensor(ag[0], make_input(seed + 4, rank, (n,), dtype))
            dist.all_gather_into_tensor(ag[1], make_input(seed + 5, rank, (n + 1,), dtype))
        pairs += [(ag[0], torch.cat(_all(seed + 4, world, (n,), dtype))),
                  (ag[1], torch.cat(_all(seed + 5, world, (n + 1,), dtype)))]
        if dtype != torch.bool:
            # With a device, torch brackets the block with _start/_end_coalescing.
            c1, c2 = make_input(seed + 8, rank, (n,), dtype), make_input(seed + 9, rank, (n + 1,), dtype)
            with compat.coalescing_manager(device=torch.device("cpu")):
                dist.all_reduce(c1)
                dist.all_reduce(c2)
            pairs += [(c1, reference_reduce(_all(seed + 8, world, (n,), dtype), R.SUM)),
                      (c2, reference_reduce(_all(seed + 9, world, (n + 1,), dtype), R.SUM))]
            rs = [torch.empty(n, dtype=dtype), torch.empty(n + 2, dtype=dtype)]
            with compat.coalescing_manager():
                dist.reduce_scatter_tensor(rs[0], make_input(seed + 6, rank, (world * n,), dtype))
                dist.reduce_scatter_tensor(rs[1], make_input(seed + 7, rank, (world * (n + 2),), dtype))
            for out, s, m in ((rs[0], seed + 6, n), (rs[1], seed + 7, n + 2)):
                full = reference_reduce(_all(s, world, (world * m,), dtype), R.SUM)
                pairs.append((out, full[rank * m:(rank + 1) * m]))
        return pairs
    return Case(f"coalesced[{dtype}|{n}]", run)


def _case_non_contiguous(dtype, n):
    def run(seed, rank, world):
        base = make_input(seed, rank, (n, 3), dtype)
        col = base.t()[1]  # a strided view: the glue must stage and copy back
        guard = base.clone()
        dist.all_reduce(col, op=R.MAX)
        full = reference_reduce([x.t()[1].contiguous() for x in _all(seed, world, (n, 3), dtype)], R.MAX)
        untouched = guard.clone()
        untouched.t()[1] = full
        return [(base, untouched)]
    return Case(f"non_contiguous[{dtype}|{n}]", run)


def _case_any_source():
    def run(seed, rank, world):
        pairs = []
        # recv without a source: rank 0 hears from every other rank, in any order.
        if rank == 0:
            senders = []
            for _ in range(world - 1):
                t = torch.empty(4, dtype=torch.int64)
                senders.append(dist.recv(t))
                pairs.append((t, torch.full((4,), senders[-1], dtype=torch.int64)))
            pairs.append((torch.tensor(sorted(senders)), torch.arange(1, world)))
        else:
            dist.send(torch.full((4,), rank, dtype=torch.int64), dst=0)
        return pairs
    return Case("recv_any_source", run)


def _case_objects():
    def run(seed, rank, world):
        pairs = []
        # Object collectives pickle into uint8 tensors and ride on all-gather/broadcast.
        objs = [None] * world
        dist.all_gather_object(objs, {"rank": rank, "seed": seed})
        pairs.append((torch.tensor([o["rank"] for o in objs]), torch.arange(world)))
        box = [{"from": "root", "n": seed}] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0)
        pairs.append((torch.tensor([box[0]["n"]]), torch.tensor([seed])))
        return pairs
    return Case("object_collectives", run)


def _case_barrier():
    def run(seed, rank, world):
        dist.barrier()
        return []
    return Case("barrier", run)


def _case_shared(dtype, n, op):
    """All-reduces of tensors from ``libmccl.shared_empty``: in place through mccld (its
    zero-copy counter must move), an ordinary tensor in-process. The slice sits at a different
    offset of each rank's buffer, as independent allocations would put it."""
    def run(seed, rank, world):
        import libmccl
        comm = dist.group.WORLD.communicator
        before = comm.stats().get("zero_copy_ops")
        whole = libmccl.shared_empty(n + 64 * world, dtype=dtype)
        whole.copy_(make_input(seed + 1, rank, (n + 64 * world,), dtype))
        part = whole[64 * rank:64 * rank + n]
        part.copy_(make_input(seed, rank, (n,), dtype))
        dist.all_reduce(part, op=op)
        pairs = [(part, reference_reduce(_all(seed, world, (n,), dtype), op)),
                 (whole[:64 * rank], make_input(seed + 1, rank, (n + 64 * world,), dtype)[:64 * rank])]
        if before is not None:  # through mccld: not copied, unless the small-op queue took it
            from mccl_common.settings import EngineConfig, load
            in_place = n * whole.element_size() > load(EngineConfig).daemon_fast_bytes
            pairs.append((torch.tensor(comm.stats()["zero_copy_ops"] - before), torch.tensor(int(in_place))))
        return pairs
    return Case(f"shared_all_reduce[{op}|{dtype}|{n}]", run)


def _case_big(world):
    n = BIG_BYTES // 4

    def run(seed, rank, world):
        t = torch.full((n,), float(rank + 1))
        dist.all_reduce(t)
        b = torch.arange(n, dtype=torch.float32) if rank == 0 else torch.zeros(n)
        dist.broadcast(b, 0)
        ok_b = bool(b[-1] == n - 1) and bool(b[12345] == 12345)
        return [(t[:1000], torch.full((1000,), float(world * (world + 1) // 2))),
                (t[-1000:], torch.full((1000,), float(world * (world + 1) // 2))),
                (torch.tensor([ok_b]), torch.tensor([True]))]
    return Case("big_64MB[all_reduce+broadcast]", run)


def cases(world: int, big: bool = True) -> list[Case]:
    out: list[Case] = [_case_barrier(), _case_any_source(), _case_objects()]
    for dtype in DTYPES:
        for n in SIZES:
            for op in _ops_for(dtype):
                out.append(_case_all_reduce(dtype, n, op))
            out += [_case_broadcast(dtype, n), _case_all_gather(dtype, n), _case_gather_scatter(dtype, n),
                    _case_all_to_all(dtype, n), _case_send_recv(dtype, n), _case_coalesced(dtype, n)]
            # reduce / reduce-scatter: one arithmetic and one order-sensitive op per dtype.
            for op in (R.SUM, R.MAX) if dtype != torch.bool else (R.BOR,):
                out += [_case_reduce(dtype, n, op), _case_reduce_scatter(dtype, n, op)]
        out.append(_case_non_contiguous(dtype, 5))
    # In shared buffers: below the small-op queue's size (copied into its slot), through the
    # daemon's job thread, and pipelined through the buffer's own tickets.
    for n, op in ((7, R.SUM), (100_001, R.AVG), (3 << 20, R.SUM)):
        out.append(_case_shared(torch.float32, n, op))
    if big:
        out.append(_case_big(world))
    return out


def family(case: Case) -> str:
    return case.name.split("[")[0]


def run_suite(rank: int, world: int, big: bool = True, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Run every case (but the ``skip`` families) in the current default group;
    returns counts and failures."""
    failures: list[str] = []
    checked = 0
    selected = [(seed, case) for seed, case in enumerate(cases(world, big)) if family(case) not in skip]
    for seed, case in selected:
        try:
            pairs = case.run(seed, rank, world)
        except Exception as exc:  # noqa: BLE001 - report and keep going: one bad case must not hide others
            failures.append(f"{case.name}: raised {type(exc).__name__}: {exc}")
            if isinstance(exc, (dist.DistBackendError,)) or "PeerLost" in type(exc).__name__:
                break
            continue
        for i, (got, want) in enumerate(pairs):
            checked += 1
            if not _close(got, want):
                failures.append(f"{case.name} output {i}: got {got.flatten()[:8].tolist()} "
                                f"want {want.flatten()[:8].tolist()} ({got.dtype}/{want.dtype}, "
                                f"{tuple(got.shape)}/{tuple(want.shape)})")
    return {"cases": len(selected), "checked": checked, "failures": failures}
