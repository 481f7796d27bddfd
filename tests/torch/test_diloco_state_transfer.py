"""The state a joining rank receives (libmccl/training/state_transfer.py) is a JSON manifest
from a peer: everything in it is checked against the receiving rank's own model and outer
optimizer before a tensor is allocated or a value installed."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from libmccl.training import state_transfer
from mccl_common.errors import ConfigError


def _rank():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    params = list(model.parameters())
    outer = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    for p in params:
        p.grad = torch.ones_like(p)
    outer.step()                         # momentum buffers exist
    frag = SimpleNamespace(globals=[p.detach().clone() for p in params], params=params, last_send=4, rounds=1)
    return SimpleNamespace(_fragments=[frag], _outer=[outer], step=4)


def test_a_manifest_from_the_same_model_is_accepted_as_described() -> None:
    d = _rank()
    manifest, tensors = state_transfer._describe(d)
    specs = state_transfer._check(d, manifest, src=0)
    assert [(tuple(s), t) for s, t, _ in specs] == [(tuple(t.shape), t.dtype) for t in tensors]
    assert len(specs) == 4               # weight, bias, and a momentum buffer of each


def _bad(mutate):
    d = _rank()
    manifest, _ = state_transfer._describe(d)
    m = copy.deepcopy(manifest)
    mutate(m)
    with pytest.raises(ConfigError, match="does not fit this rank"):
        state_transfer._check(d, m, src=3)


@pytest.mark.parametrize("mutate", [
    lambda m: m.update(step=-1),
    lambda m: m.update(step=True),
    lambda m: m.update(step="4"),
    lambda m: m["fragments"].append({"rounds": 0, "last_send": None}),
    lambda m: m["fragments"][0].update(rounds=None),
    lambda m: m["outer"].append(m["outer"][0]),
    lambda m: m["outer"][0]["groups"].append({}),
    lambda m: m["outer"][0].update(groups=["lr"]),
    lambda m: m["outer"][0]["state"][0].__setitem__(0, 7),            # no such parameter
    lambda m: m["outer"][0]["state"][0].__setitem__(0, -1),
    lambda m: m["outer"][0]["state"][0].__setitem__(3, "torch.complex64"),
    lambda m: m["outer"][0]["state"][0].__setitem__(4, [1 << 20, 1 << 20]),   # far larger than the parameter
    lambda m: m["outer"][0]["state"][0].__setitem__(4, [2, -4]),
    lambda m: m["outer"][0]["state"].append(list(m["outer"][0]["state"][0])),  # the same entry twice
    lambda m: m["outer"][0]["state"].extend([[0, f"k{i}", "value", 1] for i in range(100)]),
    lambda m: m["outer"][0]["state"].append([0, "x", "value", {"nested": 1}]),
    lambda m: m["outer"][0]["state"].append([0, "x", "code", "os.system"]),
], ids=lambda f: "")
def test_a_malformed_or_oversized_manifest_is_refused(mutate) -> None:
    _bad(mutate)
