"""libmccl.devices.device_pool: staging blocks are reused by size class, and the idle ones are capped."""

from __future__ import annotations

import logging

from libmccl.devices.device_pool import MIN_BLOCK, StagingPool, size_class


class _Block:
    def __init__(self, nbytes: int, freed: list) -> None:
        self.nbytes, self.host, self._freed = nbytes, id(self), freed

    def __del__(self) -> None:
        self._freed.append(self.nbytes)


def test_size_classes_are_powers_of_two_from_the_minimum() -> None:
    assert size_class(0) == size_class(1) == MIN_BLOCK
    assert size_class(MIN_BLOCK + 1) == 2 * MIN_BLOCK
    assert size_class(3 << 20) == 4 << 20


def test_a_returned_block_serves_the_next_op_of_its_class() -> None:
    freed: list = []
    pool = StagingPool(lambda n: _Block(n, freed), 1 << 30, "MCCL_X")
    addr, block = pool.take(100_000)
    pool.give(block)
    del block
    again, _ = pool.take(120_000)  # another size, same class
    assert again == addr and pool.allocations == 1 and not freed


def test_beyond_the_cap_blocks_are_freed_and_it_warns_once(caplog) -> None:
    freed: list = []
    pool = StagingPool(lambda n: _Block(n, freed), 2 * MIN_BLOCK, "MCCL_X")
    blocks = [pool.take(MIN_BLOCK)[1] for _ in range(4)]
    with caplog.at_level(logging.DEBUG, logger="libmccl.devices.device_pool"):
        for b in blocks:
            pool.give(b)
        del blocks, b
    assert pool.idle_bytes() == 2 * MIN_BLOCK and freed == [MIN_BLOCK, MIN_BLOCK]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "MCCL_X" in warnings[0].getMessage()
