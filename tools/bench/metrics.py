"""What each collective's size, bus bandwidth and wire bytes mean (nccl-tests conventions).

``S`` is the size the sweep reports for an op, in bytes:
  all_reduce      S = the buffer every rank reduces in place
  all_gather      S = the gathered output; each rank contributes S/n
  reduce_scatter  S = the input; each rank keeps S/n
  broadcast       S = the buffer

algbw = S / t. busbw = algbw * bus_factor(n): the rate each rank's link must sustain,
so busbw is comparable across ops and to a link's line rate. Wire bytes are what one rank
sends (on average) per op with a ring algorithm; CPU per wire GB divides the ranks' CPU
time by these bytes summed over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mccl_common.errors import ConfigError

ELEMENT_BYTES = 4  # float32: every op is benchmarked on float32 with SUM


@dataclass(frozen=True)
class OpSpec:
    name: str
    bus_factor: Callable[[int], float]
    # Average bytes one rank puts on the wire per op, as a multiple of S.
    wire_factor: Callable[[int], float]
    # The smallest S the op can run: every rank needs at least one element.
    min_elements: Callable[[int], int]


OPS: dict[str, OpSpec] = {
    "all_reduce": OpSpec("all_reduce", lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1) / n, lambda n: 1),
    "all_gather": OpSpec("all_gather", lambda n: (n - 1) / n, lambda n: (n - 1) / n, lambda n: n),
    "reduce_scatter": OpSpec("reduce_scatter", lambda n: (n - 1) / n, lambda n: (n - 1) / n, lambda n: n),
    # A pipelined ring broadcast: every rank but the last forwards S, so (n-1)·S over n ranks.
    "broadcast": OpSpec("broadcast", lambda n: 1.0, lambda n: (n - 1) / n, lambda n: 1),
}


def op_elements(op: str, nbytes: int, n: int) -> int:
    """Element count of an op of S = nbytes, rounded down so it splits evenly over n ranks
    where the op needs it; 0 if the size is too small for this op."""
    count = nbytes // ELEMENT_BYTES
    if op in ("all_gather", "reduce_scatter"):
        count -= count % n
    return count if count >= OPS[op].min_elements(n) else 0


def sweep_sizes(min_bytes: int, max_bytes: int, step_factor: float) -> list[int]:
    if min_bytes <= 0 or max_bytes < min_bytes or step_factor <= 1:
        raise ConfigError(f"[bench] bad sweep: min={min_bytes} max={max_bytes} step={step_factor}; "
                          "pass 0 < --min-bytes <= --max-bytes and --step-factor > 1")
    sizes, s = [], float(min_bytes)
    while s <= max_bytes * (1 + 1e-9):
        sizes.append(int(round(s)))
        s *= step_factor
    return sizes


def fmt_bytes(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale:.0f}{unit}"
    return f"{n:.0f}"


def parse_bytes(text: str) -> int:
    t = text.strip().upper().rstrip("B").rstrip("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if scale > 1 else t) * scale)
