"""Structure-aware mutation of captured messages, as hypothesis strategies.

A seed is a real message (a JSON object captured from a client or peer daemon, or an
HTTP request). ``mutated_json`` picks one and applies one to three mutations at random
places in its tree: delete a field, change its type, put a boundary number or an
oversized string there, swap in a value another message uses for the same field (enum
values: message types, op names, purposes, methods), nest it deep, grow a list, add an
unknown field. ``byte_noise`` then damages the encoding itself now and then (truncate,
flip, insert), and ``random_bytes`` is the unstructured baseline.

Hypothesis draws every choice, so a run is a function of its seed (``hypothesis.seed``).
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any, Iterable

from hypothesis import strategies as st

# Numbers where code that checks bounds (or forgets to) goes wrong.
BOUNDARY_INTS = [0, 1, -1, 2, 7, 8, 255, 256, 4095, 4096, 65535, 65536, (1 << 31) - 1, 1 << 31, -(1 << 31),
                 (1 << 32) - 1, 1 << 32, (1 << 48), (1 << 48) + 1, (1 << 63) - 1, 1 << 63, -(1 << 63), 1 << 64,
                 10 ** 30]
BOUNDARY_FLOATS = [0.0, -0.0, 1e-9, 0.5, 1.0, 1e7, 1e7 + 1, 1e308, -1e308, math.inf, -math.inf, math.nan]
ODD_STRINGS = ["", " ", "\x00", "..", "../../etc/passwd", "%s%n", "\u202e", "\ud800", "é" * 40, "0" * 13,
               "ffffffffffff", "FFFFFFFFFFFF", "-1", "1e9", "null", "127.0.0.1:0", "127.0.0.1:65536",
               "[::1]:29650", "host:", ":1", "data:", "data:" + "x" * 300, "control", "mccl-0-0-0-0",
               "mccl-ffffffffffff-999999-999999999-999999"]

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(BOUNDARY_INTS),
                         st.floats(allow_nan=True), st.sampled_from(BOUNDARY_FLOATS), st.text(max_size=20),
                         st.sampled_from(ODD_STRINGS))
json_values = st.recursive(json_scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                                st.dictionaries(st.text(max_size=8), kids,
                                                                                max_size=4)),
                           max_leaves=8)


def _slots(obj: Any, path: tuple = ()) -> Iterable[tuple]:
    """Every place in the tree a mutation can land: () is the root, then each key/index path."""
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _slots(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:16]):
            yield from _slots(v, path + (i,))


def _get(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def _values_by_key(seeds: list[Any]) -> dict[Any, list[Any]]:
    """Each field name's values across the seeds: the enum values a swap may pick from."""
    out: dict[Any, list[Any]] = {}

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            for k, v in o.items():
                if not isinstance(v, (dict, list)):
                    vals = out.setdefault(k, [])
                    if v not in vals:
                        vals.append(v)
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)
    for s in seeds:
        walk(s)
    return out


MUTATIONS = ("delete", "retype", "boundary_int", "boundary_float", "odd_string", "huge_string", "swap",
             "deep", "grow_list", "extra_field", "wrap_list", "empty")


@st.composite
def _mutate_once(draw, msg: Any, by_key: dict[Any, list[Any]]) -> Any:
    path = draw(st.sampled_from(list(_slots(msg))))
    how = draw(st.sampled_from(MUTATIONS))
    cur = _get(msg, path)
    if how == "delete" and path:
        parent = _get(msg, path[:-1])
        del parent[path[-1]]
        return msg
    if how == "extra_field" and isinstance(cur, dict):
        cur[draw(st.text(min_size=1, max_size=12))] = draw(json_values)
        return msg
    if how == "grow_list" and isinstance(cur, list) and cur:
        cur.extend([copy.deepcopy(cur[0])] * draw(st.sampled_from([1, 2, 100, 5000])))
        return msg
    new: Any
    if how == "retype":
        new = draw(json_values)
    elif how == "boundary_int":
        new = draw(st.sampled_from(BOUNDARY_INTS))
    elif how == "boundary_float":
        new = draw(st.sampled_from(BOUNDARY_FLOATS))
    elif how == "odd_string":
        new = draw(st.sampled_from(ODD_STRINGS))
    elif how == "huge_string":
        new = "A" * draw(st.sampled_from([256, 257, 4097, 70_000, 1 << 20]))
    elif how == "swap" and path and by_key.get(path[-1]):
        new = copy.deepcopy(draw(st.sampled_from(by_key[path[-1]])))
    elif how == "deep":
        new = f"$DEEP{draw(st.sampled_from([50, 900, 5000, 200_000]))}"   # expanded by encode()
    elif how == "wrap_list":
        new = [cur]
    elif how == "empty":
        new = type(cur)() if isinstance(cur, (dict, list, str)) else None
    else:
        new = draw(json_values)
    if not path:
        return new
    _get(msg, path[:-1])[path[-1]] = new
    return msg


@st.composite
def mutated_json(draw, seeds: list[Any], max_mutations: int = 3) -> Any:
    """A copy of one seed with 0..max_mutations structural mutations (0 now and then: the
    seed itself, which must keep working)."""
    by_key = _values_by_key(seeds)
    msg = copy.deepcopy(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(0, max_mutations))):
        msg = draw(_mutate_once(msg, by_key))
    return msg


_DEEP = re.compile(rb'"\$DEEP(\d+)"')


def encode(msg: Any) -> bytes:
    """JSON as a sloppy peer might write it: NaN/Infinity tokens allowed, unpaired surrogates
    escaped, and "$DEEP<n>" written as n nested arrays (deeper than json.dumps could go)."""
    raw = json.dumps(msg, allow_nan=True).encode("utf-8", "surrogatepass")
    return _DEEP.sub(lambda m: b"[" * int(m.group(1)) + b"]" * int(m.group(1)), raw)


@st.composite
def byte_noise(draw, data: bytes) -> bytes:
    """Usually ``data`` as is; sometimes truncated, with a byte flipped, or with bytes inserted."""
    how = draw(st.sampled_from(["keep"] * 6 + ["truncate", "flip", "insert", "duplicate"]))
    if not data or how == "keep":
        return data
    i = draw(st.integers(0, len(data) - 1))
    if how == "truncate":
        return data[:i]
    if how == "flip":
        return data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1:]
    if how == "insert":
        return data[:i] + draw(st.binary(min_size=1, max_size=16)) + data[i:]
    return data + data


random_bytes = st.one_of(st.binary(max_size=64), st.binary(min_size=64, max_size=2048))
