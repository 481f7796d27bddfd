"""The wire-security table of device_run.sh step 10: ``python -m tools.bench.wire_report DIR``.

Reads DIR/10-n*-<security>-r<rep>.json (one mccl-bench run each, security modes alternating)
and prints, per series and size, every run's bus bandwidth, the medians, their ratio to
``off`` and the CPU seconds per wire GB, then the 8-byte latency medians.
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics as st
import sys
from collections import defaultdict


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tools.bench.wire_report RESULTS_DIR", file=sys.stderr)
        return 2
    bw: dict = defaultdict(list)
    cpu: dict = defaultdict(list)
    lat: dict = defaultdict(list)
    modes: set[str] = set()
    for path in sorted(glob.glob(os.path.join(argv[0], "10-n*-r*.json"))):
        m = re.search(r"-(off|mac|aead)-r(\d+)\.json$", path)
        if not m:
            continue
        sec, rep = m.group(1), int(m.group(2))
        modes.add(sec)
        with open(path) as f:
            run = json.load(f)
        for e in run["results"]:
            key = (e["series"], e["bytes"], sec)
            bw[key].append((rep, e["busbw_GBps"]))
            cpu[key].append(e["cpu_s_per_wire_gb"])
        for series, v in (run.get("latency") or {}).items():
            if isinstance(v, dict) and "median_us" in v:
                lat[(series, sec)].append(v["median_us"])
    if "off" not in modes:
        print(f"no runs with MCCL_WIRE_SECURITY=off under {argv[0]}", file=sys.stderr)
        return 1
    others = [s for s in ("aead", "mac") if s in modes]
    print("| series | size | off busbw GB/s, each run (median) | "
          + " | ".join(f"{s} busbw GB/s, each run (median) | {s}/off" for s in others)
          + " | CPU s per wire GB, " + " → ".join(["off", *others]) + " |")
    print("|---" * (3 + 2 * len(others) + 1) + "|")
    for series, size in sorted({(k[0], k[1]) for k in bw}):
        base = st.median(v for _, v in bw[(series, size, "off")])
        cells = [f"{series} | {size >> 20} MB | "
                 + " ".join(f"{v:.3f}" for _, v in sorted(bw[(series, size, 'off')])) + f" ({base:.3f})"]
        for s in others:
            med = st.median(v for _, v in bw[(series, size, s)])
            cells.append(" ".join(f"{v:.3f}" for _, v in sorted(bw[(series, size, s)])) + f" ({med:.3f})")
            cells.append(f"{med / base:.2f}x")
        cells.append(" → ".join(f"{st.median(cpu[(series, size, s)]):.2f}" for s in ["off", *others]))
        print("| " + " | ".join(cells) + " |")
    print()
    for series in sorted({k[0] for k in lat if not k[0].startswith("daemon_over")}):
        base = st.median(lat[(series, "off")])
        row = [f"{series}: 8-byte all_reduce median of medians off {base:.0f} us"]
        for s in others:
            med = st.median(lat[(series, s)])
            row.append(f"{s} {med:.0f} us ({med / base:.2f}x)")
        print(", ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
