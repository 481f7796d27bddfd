"""libmccl/torch/switch_groups.py: rank 0 places the ranks from MCCL_TOPOLOGY, every rank takes its word."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from libmccl.torch import switch_groups
from mccl_common.errors import CollectiveTimeout, ConfigError
from mccl_common.settings import EngineConfig


class Store:
    """The few store calls agree() makes, over a dict (the real one is the sealed c10d store)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.cv = threading.Condition()

    def set(self, k, v):
        with self.cv:
            self.data[k] = v.encode() if isinstance(v, str) else v
            self.cv.notify_all()

    def get(self, k):
        return self.data[k]

    def wait(self, keys, timeout):
        with self.cv:
            if not self.cv.wait_for(lambda: all(k in self.data for k in keys), timeout.total_seconds()):
                raise RuntimeError("store wait timed out")


ADDRS = ["10.0.0.1:4000", "10.0.0.2:4000", "10.0.0.1:4001", "10.0.0.3:4000"]


def cfg(path="") -> EngineConfig:
    return dataclasses.replace(EngineConfig(), topology=str(path))


def agree_all(cfgs, addrs=ADDRS):
    store, out = Store(), {}

    def rank(r):
        try:
            out[r] = switch_groups.agree(store, r, len(addrs), addrs, cfgs[r], 5.0)
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[r] = e
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(addrs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return [out[r] for r in range(len(addrs))]


def test_every_rank_gets_rank_0s_placement(tmp_path):
    f = tmp_path / "t"
    f.write_text("b: 10.0.0.1\na: 10.0.0.2, 10.0.0.3\n")
    assert agree_all([cfg(f)] * 4) == [[1, 0, 1, 0]] * 4  # switches numbered by name
    assert agree_all([cfg()] * 4) == [[]] * 4             # no file: flat
    f.write_text("a: 10.0.0.1 10.0.0.2 10.0.0.3\n")
    assert agree_all([cfg(f)] * 4) == [[]] * 4            # one switch: nothing to group


def test_an_unplaced_rank_or_another_file_fails_clearly(tmp_path):
    f, g = tmp_path / "t", tmp_path / "u"
    f.write_text("a: 10.0.0.1\nb: 10.0.0.2\n")
    out = agree_all([cfg(f)] * 4)
    assert all(isinstance(e, ConfigError) and "rank 3 listens at 10.0.0.3:4000" in str(e) for e in out), out
    g.write_text("a: 10.0.0.1 10.0.0.3\nb: 10.0.0.2\n")
    f.write_text("a: 10.0.0.1\nb: 10.0.0.2 10.0.0.3\n")
    out = agree_all([cfg(f), cfg(f), cfg(g), cfg()])
    assert out[:2] == [[0, 1, 0, 1]] * 2
    assert isinstance(out[2], ConfigError) and "differs from rank 0's" in str(out[2])
    assert isinstance(out[3], ConfigError) and "(unset) differs" in str(out[3])


def test_a_rank_waits_for_rank_0_no_longer_than_its_timeout():
    with pytest.raises(CollectiveTimeout, match="waiting for rank 0's switch placement"):
        switch_groups.agree(Store(), 2, 4, ADDRS, cfg(), 0.2)
