"""Every collective with device tensors (libmccl.devices.device_check's cases) through the backend,
ranks as processes: on the emulated CUDA driver (CudaOps, pinned staging, stream memory
operations), on the fake device (seeded jitter, race detection) and with a CPU rank beside
device ranks. Each case checks the result against the same case on CPU tensors and that
the call returned while the device had not yet run the kernels writing its inputs.
"""

from __future__ import annotations

import pytest

from support.collective_suite import MODES
from support.ranks import init_pg


def _rows(rank: int, world: int, kind: str, passes: int = 1, broken: bool = False) -> list[tuple]:
    """Every case ``passes`` times; only the last holds the device back (and, on the
    emulated driver, forbids the calls that wait for it): the ones before warm the pools."""
    from libmccl.devices import device_check as C
    from libmccl.devices.cuda_emulator import SYNCHRONISING

    init_pg(rank, world)
    if kind == "mixed":
        kind = "cpu" if rank == 0 else "emulated"
    dev = {"emulated": lambda: C.emulated_cuda(),
           "fake-staged": lambda: C.fake_device(seed=rank, unified=False),
           "fake-unified": lambda: C.fake_device(seed=rank, unified=True),
           "cpu": C.CpuDevice}[kind]()
    undo = C.without_o1() if broken else None
    rows = []
    try:
        for p in range(passes):
            if p == passes - 1 and p > 0 and hasattr(dev, "emulator"):
                # Warm: staging blocks and ticket words come from the pools, so nothing in a
                # collective call may wait for the device.
                dev.emulator.forbid(*SYNCHRONISING)
            for name in C.CASES:
                try:
                    r = C.run_case(name, dev, None, [("mccl-cpu", None)], rank, world, hold=p == passes - 1,
                                   seed_offset=1000 * p)
                    rows.append((p, r.case, r.equal, r.returned_early or p < passes - 1, r.detail))
                except Exception as exc:  # noqa: BLE001 - the negative control's DeviceRace, reported
                    if not broken:
                        raise
                    # The device's own error is the root cause. The op may surface only the engine's
                    # "the producer poisoned its ready ticket" when the poison won the race to the
                    # caller (seen once beside two busy loops).
                    check = getattr(getattr(dev, "ops", None), "check", None)
                    try:
                        if check is not None:
                            check()
                    except Exception as cause:  # noqa: BLE001 - reported as the row's detail
                        exc = cause
                    rows.append((p, name, False, True, f"{type(exc).__name__}: {exc}"))
                    break
        if hasattr(dev, "emulator"):
            rows.append(("calls", dict(dev.emulator.calls)))
        import sys
        client = sys.modules.get("libmccl.daemon.client")   # imported only with MCCL_DAEMON=1
        rows.append(("comm", "daemon" if client is not None and client._live else "in-process"))
    finally:
        if undo is not None:
            undo()
        dev.close()
        import torch.distributed as dist

        dist.destroy_process_group()
    return rows


def _check(per_rank: list[list[tuple]]) -> None:
    for rank, rows in enumerate(per_rank):
        for row in rows:
            if row[0] in ("calls", "comm"):
                continue
            _, case, equal, early, detail = row
            assert equal, f"rank {rank}: {case} differs from the CPU run: {detail}"
            assert early, f"rank {rank}: {case}: the call waited for the device's producer kernels"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_collective_on_the_emulated_cuda_driver(ranks, world: int) -> None:
    per_rank = ranks(_rows, world, "emulated", 2, timeout_s=200)
    _check(per_rank)
    for rows in per_rank:
        calls = rows[-2][1]
        assert not calls.get("cuStreamSynchronize") and not calls.get("cuCtxSynchronize"), calls


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["emulated", "fake-staged", "fake-unified", "mixed"])
def test_every_collective_through_mccld(ranks, kind: str) -> None:
    """The same cases with MCCL_DAEMON=1: the gates and the unified all-reduce's tickets are
    kept by the daemon client's queue (libmccl/daemon/gates.py) instead of the engine's."""
    with MODES["daemon"].setup() as env:
        per_rank = ranks(_rows, 2 if kind != "mixed" else 3, kind, 2 if kind in ("emulated", "mixed") else 1,
                         timeout_s=250, env=env)
    _check(per_rank)
    assert {rows[-1] for rows in per_rank} == {("comm", "daemon")}, [rows[-1] for rows in per_rank]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["fake-staged", "fake-unified"])
def test_every_collective_on_the_fake_device(ranks, kind: str) -> None:
    _check(ranks(_rows, 2, kind, timeout_s=200))


@pytest.mark.timeout(240)
def test_a_cpu_rank_and_cuda_ranks_share_every_collective(ranks) -> None:
    _check(ranks(_rows, 3, "mixed", 2, timeout_s=200))


@pytest.mark.timeout(240)
def test_without_o1_the_results_are_wrong_on_the_emulated_driver(ranks) -> None:
    per_rank = ranks(_rows, 2, "emulated", 2, True, timeout_s=200)
    wrong = [row for rows in per_rank for row in rows if row[0] not in ("calls", "comm") and not row[2]]
    assert wrong, "the negative control (O1 removed) gave right results: the checks cannot see a missing O1"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["inprocess", "daemon"])
def test_without_o1_the_fake_device_names_the_race(ranks, mode: str) -> None:
    with MODES[mode].setup() as env:
        per_rank = ranks(_rows, 2, "fake-staged", 1, True, timeout_s=200, env=env)
    details = [row[4] for rows in per_rank for row in rows if row[0] not in ("calls", "comm") and not row[2]]
    assert any("DeviceRace" in d for d in details), details
