"""What the per-frame MAC (MCCL_WIRE_SECURITY=mac) costs a link at line rate: the CPU the tags take.

    python scripts/frame_mac_cost.py [--rate-gbit 10] [--hosts 8] [--json out.json]

Measures frame_tag (libmccl/csrc/integrity/mac.h: a ChaCha20-derived one-time key and
Poly1305 over header + payload) in GB/s on one core, for the engine's frame sizes, over a
buffer larger than the caches. A rank at line rate sends and receives `rate` at once, and
both ends tag every frame, so it needs 2 x rate / 8 bytes per second of tagging; the
script prints that as cores per rank, and as a share of this machine with `--hosts` ranks
on it (how the emulated fleets of docs/benchmarks.md run).
"""

from __future__ import annotations

import argparse
import json
import os

from libmccl import _core


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-gbit", type=float, default=10.0)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    need = 2 * args.rate_gbit * 1e9 / 8  # bytes tagged per second per rank: sent + received
    cores = os.cpu_count() or 1
    rows = []
    for frame in (64 << 10, 512 << 10, 2 << 20):
        per_core = 1 / _core.frame_tag_seconds_per_byte(frame, 256 << 20, 5)
        rows.append({"frame_bytes": frame, "gb_per_s_per_core": per_core / 1e9, "cores_per_rank": need / per_core,
                     "share_of_machine": need / per_core * args.hosts / cores})
        print(f"frame {frame >> 10:5d} KiB: {per_core / 1e9:.2f} GB/s per core; at {args.rate_gbit:g} Gbit/s a rank "
              f"needs {need / per_core:.2f} cores for its tags, {args.hosts} ranks "
              f"{100 * need / per_core * args.hosts / cores:.0f} % of this machine's {cores} cores")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rate_gbit": args.rate_gbit, "hosts": args.hosts, "cpus": cores, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
