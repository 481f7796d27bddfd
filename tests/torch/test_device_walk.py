"""The device path reads top-down (issue 28, deliverable 2): one all-reduce on CPU tensors and one
on the fake device, traced on the calling thread by tools/device_walk.py, call nothing back that
is still below them on the stack, enter libmccl.devices through one module at most twice
(prepare, then launch), and every other devices module is called from one devices module only;
an all-gather keeps the same tree."""

from __future__ import annotations

import pytest

from tools import device_walk

pytestmark = pytest.mark.timeout(180)


def test_an_all_reduce_walks_the_device_layer_as_a_tree() -> None:
    walks = device_walk.walks(collectives=("all_reduce", "all_gather"))
    assert set(walks) == {"cpu", "fake", "cpu all_gather", "fake all_gather"}
    for kind in ("cpu", "fake"):
        w = walks[kind]
        assert device_walk.tree_violations(w) == [], device_walk.report(kind, w)
        into = w.entries_from("libmccl.torch.backend", "libmccl.devices")
        assert into == {"libmccl.devices.plan": 2}, device_walk.report(kind, w)
        # A collective whose buffers the backend builds on the plan: more calls, the same tree.
        w = walks[f"{kind} all_gather"]
        assert device_walk.tree_violations(w, max_entries=None) == [], device_walk.report(kind, w, None)
    # The fake device's op took the device path: its kind was reached, from the ordering alone.
    fake = walks["fake"]
    assert fake.callers.get("libmccl.devices.fake_device") == {"libmccl.devices.device_order"}, \
        device_walk.report("fake", fake)
    assert "libmccl.devices.fake_device" not in walks["cpu"].entries


def test_the_counting_sees_a_call_back_into_a_module_below() -> None:
    # Two fake modules: ``a.outer`` calls ``b.mid``, which calls back into ``a.inner``.
    def frame_module(name: str, source: str) -> dict:
        scope: dict = {"__name__": name}
        exec(compile(source, f"<{name}>", "exec"), scope)
        return scope

    a = frame_module("libmccl.a", "def outer(mid):\n    return mid(inner)\n\ndef inner():\n    return 1\n")
    b = frame_module("libmccl.b", "def mid(cb):\n    return cb()\n")
    w = device_walk.walk(lambda: a["outer"](b["mid"]))
    assert w.up_calls == [("libmccl.b", "libmccl.a")]
    assert w.callers == {"libmccl.a": {device_walk.OUTSIDE, "libmccl.b"}, "libmccl.b": {"libmccl.a"}}
    assert w.entries == {"libmccl.a": 2, "libmccl.b": 1}
    assert w.path == ["libmccl.a", "libmccl.b", "libmccl.a", "libmccl.b", "libmccl.a"]
