"""DiLoCo's state, sent to a rank that joins: theta_global, the outer optimizers' state and
the step counters, broadcast by the lowest rank that has them.

No pickle crosses the wire: a JSON manifest (sizes, dtypes, the optimizers' scalar settings)
then one broadcast per tensor, every one checked against what the receiving rank's model and
optimizers expect before it is allocated or used.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from mccl_common.errors import ConfigError

MAX_MANIFEST_BYTES = 16 << 20
MAX_STATE_PER_PARAM = 8         # optimizer state entries per parameter (Adam has 3, SGD 1)
_DTYPES = {str(t): t for t in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32)}
_SCALARS = (int, float, bool, str, type(None))


def exchange(d: Any, pg: Any, table: torch.Tensor) -> None:
    """Collective over ``pg``: every rank calls it with the same table (column 0: has state).
    ``d`` is the DiLoCo (its fragments, outer optimizers, and ``_adopt`` on a receiving rank)."""
    have = [int(r) for r in torch.nonzero(table[:, 0] > 0).flatten().tolist()]
    src_group_rank = have[0]
    src = dist.get_global_rank(pg, src_group_rank) if pg is not dist.group.WORLD else src_group_rank
    me = dist.get_rank(pg)
    dev = d._fragments[0].params[0].device
    receiving = not d._has_state
    if me == src_group_rank:
        manifest, tensors = _describe(d)
        blob = torch.frombuffer(bytearray(json.dumps(manifest).encode()), dtype=torch.uint8)
    else:
        manifest, tensors, blob = None, None, None
    size = torch.tensor([blob.numel() if blob is not None else 0], dtype=torch.int64, device=dev)
    dist.broadcast(size, src=src, group=pg)
    n = int(size.item())
    if not 0 < n <= MAX_MANIFEST_BYTES:
        raise ConfigError(f"[diloco] the state manifest from rank {src} is {n} bytes (at most {MAX_MANIFEST_BYTES})")
    buf = blob.to(dev) if blob is not None else torch.empty(n, dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src=src, group=pg)
    if manifest is None:
        try:
            manifest = json.loads(bytes(buf.cpu().tolist()).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"[diloco] the state manifest from rank {src} is not valid JSON: {exc}") from None
        specs = _check(d, manifest, src)
        tensors = [torch.empty(shape, dtype=dtype, device=where) for shape, dtype, where in specs]
    for t in tensors:
        dist.broadcast(t, src=src, group=pg)
    if receiving:
        _install(d, manifest, tensors)


def _describe(d: Any) -> tuple[dict, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = [g for f in d._fragments for g in f.globals]
    outers = []
    for o in distinct(d._outer):
        index = {id(p): i for i, p in enumerate(p for g in o.param_groups for p in g["params"])}
        state = []
        for p, st in o.state.items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    state.append([index[id(p)], key, "tensor", str(value.dtype), list(value.shape),
                                  value.device == p.device])
                    tensors.append(value.contiguous())
                elif isinstance(value, _SCALARS):
                    state.append([index[id(p)], key, "value", value])
        groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, _SCALARS)} for g in o.param_groups]
        outers.append({"groups": groups, "state": state})
    frags = [{"last_send": f.last_send, "rounds": f.rounds} for f in d._fragments]
    return {"step": d.step, "fragments": frags, "outer": outers}, tensors


def _check(d: Any, m: Any, src: int) -> list[tuple[list[int], torch.dtype, torch.device]]:
    """The tensors the manifest announces, checked against this rank's model and optimizers."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"[diloco] the state from rank {src} does not fit this rank: {what}; every rank "
                           "must build the same model and optimizers")

    if not isinstance(m, dict) or not _count(m.get("step")):
        raise bad("no step counter")
    frags = m.get("fragments")
    if not isinstance(frags, list) or len(frags) != len(d._fragments):
        raise bad("a different number of fragments")
    for f in frags:
        if not isinstance(f, dict) or not _count(f.get("rounds")) or \
                not (f.get("last_send") is None or _count(f.get("last_send"))):
            raise bad("malformed fragment counters")
    specs = [(list(g.shape), g.dtype, g.device) for f in d._fragments for g in f.globals]
    outers = distinct(d._outer)
    if not isinstance(m.get("outer"), list) or len(m["outer"]) != len(outers):
        raise bad("a different number of outer optimizers")
    for o, om in zip(outers, m["outer"]):
        params = [p for g in o.param_groups for p in g["params"]]
        if not isinstance(om, dict) or not isinstance(om.get("groups"), list) or \
                len(om["groups"]) != len(o.param_groups) or not isinstance(om.get("state"), list) or \
                not all(isinstance(g, dict) for g in om["groups"]):
            raise bad("a different outer optimizer")
        if len(om["state"]) > MAX_STATE_PER_PARAM * len(params):
            raise bad(f"{len(om['state'])} optimizer state entries for {len(params)} parameters")
        seen = set()
        for entry in om["state"]:
            if not isinstance(entry, list) or len(entry) < 4 or not _count(entry[0]) or \
                    not entry[0] < len(params) or not isinstance(entry[1], str) or len(entry[1]) > 64:
                raise bad("a malformed optimizer state entry")
            if (entry[0], entry[1]) in seen:
                raise bad(f"optimizer state {entry[1]!r} of parameter {entry[0]} twice")
            seen.add((entry[0], entry[1]))
            if entry[2] == "tensor":
                if len(entry) != 6 or entry[3] not in _DTYPES or not isinstance(entry[4], list) or \
                        len(entry[4]) > 8 or not all(_count(s) for s in entry[4]) or \
                        not isinstance(entry[5], bool):
                    raise bad(f"a malformed optimizer tensor {entry[1]!r}")
                p = params[entry[0]]
                if math_prod(entry[4]) > max(1, p.numel()):
                    raise bad(f"optimizer tensor {entry[1]!r} of {entry[4]} for a parameter of {list(p.shape)}")
                specs.append((entry[4], _DTYPES[entry[3]], p.device if entry[5] is True else torch.device("cpu")))
            elif entry[2] != "value" or len(entry) != 4 or not isinstance(entry[3], _SCALARS):
                raise bad(f"a malformed optimizer value {entry[1]!r}")
    return specs


def _install(d: Any, m: dict, tensors: list[torch.Tensor]) -> None:
    it = iter(tensors)
    with torch.no_grad():
        for f in d._fragments:
            for g in f.globals:
                g.copy_(next(it))
    for o, om in zip(distinct(d._outer), m["outer"]):
        params = [p for g in o.param_groups for p in g["params"]]
        o.state.clear()
        for entry in om["state"]:
            p = params[entry[0]]
            value = next(it) if entry[2] == "tensor" else entry[3]
            o.state[p][entry[1]] = value
        for g, gm in zip(o.param_groups, om["groups"]):
            for k, v in gm.items():
                if isinstance(k, str) and k in g and isinstance(v, _SCALARS) and type(v) is type(g[k]):
                    g[k] = v
    d._adopt(m["step"], [f["last_send"] for f in m["fragments"]], [f["rounds"] for f in m["fragments"]])


def _count(x: Any) -> bool:
    """A non-negative int that is not a bool (JSON true would pass isinstance(x, int))."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def distinct(opts: list) -> list:
    """The optimizers in ``opts`` once each, in order (one may serve several fragments)."""
    out: list = []
    for o in opts:
        if not any(o is x for x in out):
            out.append(o)
    return out


def math_prod(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
