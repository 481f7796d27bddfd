"""A world-size mismatch between ranks is said as one, naming both sizes (issue 36): rank 0's
address table passed its MAC, so a key holder wrote it, and a table of another length is rank
0 of this very job started with another world size, not tampering."""

from __future__ import annotations

import pytest

from libmccl.rendezvous import _open_table
from mccl_common.errors import ConfigError, StoreAuthError


@pytest.mark.timeout(10)
def test_a_table_of_another_world_size_names_both_sizes():
    with pytest.raises(ConfigError) as info:
        _open_table(b"10.0.0.1:1\n10.0.0.2:1", 3, "10.0.0.1:29500")
    msg = str(info.value)
    assert "world size mismatch" in msg and "world of 2 ranks" in msg and "one of 3" in msg, msg
    assert not isinstance(info.value, StoreAuthError) and "wrote something else" not in msg
    assert info.value.peer_addr == "10.0.0.1:29500"
    # Each row is "nonce address": the nonce the rank drew for this run (no replay across runs).
    assert _open_table(b"n1 10.0.0.1:1\nn2 10.0.0.2:1", 2, "x") == [("n1", "10.0.0.1:1"), ("n2", "10.0.0.2:1")]
