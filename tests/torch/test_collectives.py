"""Every collective x dtype x size against a local reference, at world sizes 2, 3, 4."""

from __future__ import annotations

import pytest

from support.collective_suite import MODES, run_suite
from support.ranks import init_pg


def _suite_rank(rank: int, world: int, skip: frozenset[str] = frozenset()) -> dict:
    import torch.distributed as dist

    init_pg(rank, world, timeout_s=120)
    try:
        result = run_suite(rank, world, skip=skip)
        # Teardown right after the last (64 MB) collective is test_async's subject;
        # here a barrier keeps it out of the correctness verdict.
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("world", [2, 3, 4])
def test_collective_suite(mode: str, world: int, ranks) -> None:
    with MODES[mode].setup() as env:
        results = ranks(_suite_rank, world, MODES[mode].unsupported, timeout_s=540, env=env)
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["failures"]]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    assert all(res["checked"] > 400 for res in results), results
