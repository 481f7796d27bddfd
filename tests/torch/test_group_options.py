"""pg_options: libmccl.Options reaches the engine of that group; anything else is refused."""

from __future__ import annotations

import dataclasses

import pytest

from support.ranks import init_pg


def test_options_validate_names_types_and_ranges() -> None:
    from libmccl import Options
    from mccl_common.settings import EngineConfig
    from mccl_common.errors import ConfigError

    base = EngineConfig()
    cfg = Options(sockets_per_peer=4, segment_bytes=1 << 20).apply(base)
    assert (cfg.sockets_per_peer, cfg.segment_bytes) == (4, 1 << 20)
    # Untouched settings keep the environment's values.
    assert dataclasses.replace(cfg, sockets_per_peer=base.sockets_per_peer, segment_bytes=0) == base
    with pytest.raises(ConfigError, match="not an engine setting.*sockets_per_peer"):
        Options(socket_per_peer=4)
    with pytest.raises(ConfigError, match=r"sockets_per_peer='4'.*expected int"):
        Options(sockets_per_peer="4")
    with pytest.raises(ConfigError, match="expected int"):
        Options(sockets_per_peer=True)  # a bool is not a count
    with pytest.raises(ConfigError, match="between 1 and 16"):
        Options(sockets_per_peer=0).apply(base)
    assert Options(daemon=False) == Options(daemon=False)
    assert repr(Options(segment_bytes=4096, sockets_per_peer=3)) == "Options(segment_bytes=4096, sockets_per_peer=3)"


def _rank(rank: int, world: int, mismatch: bool) -> str:
    import torch
    import torch.distributed as dist

    from libmccl import Options
    from mccl_common.errors import ConfigError

    init_pg(rank, world)
    try:
        opts = Options(sockets_per_peer=3 + (rank if mismatch else 0), segment_bytes=64 << 10)
        try:
            sub = dist.new_group(list(range(world)), pg_options=opts)
        except ConfigError as exc:
            return "refused: " + str(exc)
        assert sub.options == opts
        t = torch.arange(1 << 18, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.arange(1 << 18, dtype=torch.float32) * sum(range(1, world + 1)))
        with pytest.raises(ConfigError, match="pg_options of type dict"):
            dist.new_group(list(range(world)), pg_options={"sockets_per_peer": 2})
        return "ok"
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_pg_options_reach_the_engine(ranks) -> None:
    assert ranks(_rank, 2, False, timeout_s=100) == ["ok", "ok"]


@pytest.mark.timeout(120)
def test_ranks_disagreeing_on_pg_options_are_told_which_setting(ranks) -> None:
    # The engine's handshake compares sockets per peer: that it names the difference
    # proves the per-group value, not the environment's, reached the engine.
    out = ranks(_rank, 2, True, timeout_s=100)
    assert all(o.startswith("refused") and "sockets" in o for o in out), out
