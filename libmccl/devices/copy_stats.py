"""Counters of the copies a collective's bytes take on their way between a tensor and the
wire: bytes, copies and seconds per direction (issue 27: where the time of a step goes).

Directions, in the order a device bucket through mccld meets them:

- ``device_to_host``: a device tensor staged into host memory (an asynchronous copy on the
  device's stream; seconds measured by the device where it can, libmccl/devices/device_order.py);
- ``host_to_segment``: the daemon client copying a tensor into its shared segment
  (libmccl/daemon/client.py), none where the tensor already lies in a shared buffer;
- ``segment_to_host``: the result copied back out of the segment;
- ``host_to_device``: the result copied back to the device tensor.

A copy whose duration is not known (the small-op queue copies in C++; a device without
timing) is counted in ``_untimed`` and adds nothing to ``_s``. Torch-free.
"""

from __future__ import annotations

import threading

DIRECTIONS = ("device_to_host", "host_to_segment", "segment_to_host", "host_to_device")
_FIELDS = ("bytes", "count", "s", "untimed")


class CopyStats:
    """Thread-safe running totals; ``snapshot`` gives flat ``copy_<direction>_<field>`` keys."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = {d: dict.fromkeys(_FIELDS, 0) for d in DIRECTIONS}

    def record(self, direction: str, nbytes: int, copies: int = 1, seconds: float | None = None) -> None:
        with self._lock:
            t = self._totals[direction]
            t["bytes"] += nbytes
            t["count"] += copies
            if seconds is None:
                t["untimed"] += copies
            else:
                t["s"] += seconds

    def add_seconds(self, direction: str, seconds: float | None, copies: int) -> None:
        """The duration of ``copies`` already recorded as timed, known only later (a device's
        marks); None: the device could not tell after all."""
        with self._lock:
            t = self._totals[direction]
            if seconds is None:
                t["untimed"] += copies
            else:
                t["s"] += seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {f"copy_{d}_{f}": v for d, t in self._totals.items() for f, v in t.items()}


def merged(*snapshots: dict[str, float]) -> dict[str, float]:
    """Sums of several ``snapshot``s (the daemon client's and the devices')."""
    out = dict.fromkeys((f"copy_{d}_{f}" for d in DIRECTIONS for f in _FIELDS), 0)
    for snap in snapshots:
        for k in out:
            out[k] += snap.get(k, 0)
    return out


def per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, dict[str, float]]:
    """Copies, MB and ms per step in each direction between two snapshots."""
    out = {}
    for d in DIRECTIONS:
        def delta(f: str) -> float:
            return after.get(f"copy_{d}_{f}", 0) - before.get(f"copy_{d}_{f}", 0)
        out[d] = {"copies": delta("count") / steps, "mb": delta("bytes") / steps / 1e6,
                  "ms": delta("s") / steps * 1e3, "untimed": delta("untimed") / steps}
    return out
