"""``python -m tools.bench codecs``: CPU seconds per float32 GB of each compression codec
(MCCL_COMPRESSION; libmccl/csrc/compress/codec.h), one core, the numbers the engine's cost
model carries (algorithms/cost_model.h kCodecEncodeSPerGB / kCodecDecodeSPerGB).

Encode is with error feedback (what an all-reduce does); decode-add is the owner's sum of a
contribution; decode writes a result. Each is timed on the calling thread's CPU clock (the
binding drops the GIL and runs there), the median of --repeats over a buffer larger than the
caches, so the figure includes memory traffic as an all-reduce meets it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from libmccl import _core

CODECS = ("bf16", "fp16", "int8")


def measure(codec: str, count: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(count).astype(np.float32)
    residual = np.zeros(count, np.float32)
    enc = np.zeros(_core.compress_encoded_bytes(codec, count), np.uint8)
    out = np.zeros(count, np.float32)
    f32 = int(_core.DType.float32)
    gb = count * 4 / 1e9

    def timed(fn) -> float:
        runs = []
        for _ in range(repeats):
            t0 = time.thread_time()
            fn()
            runs.append(time.thread_time() - t0)
        return statistics.median(runs) / gb

    return {
        "codec": codec, "count": count, "wire_bytes_per_element": enc.size / count,
        "encode_s_per_gb": timed(lambda: _core.compress_encode(codec, f32, x.ctypes.data, count, enc.ctypes.data,
                                                               residual.ctypes.data)),
        "decode_add_s_per_gb": timed(lambda: _core.compress_decode_add(codec, enc.ctypes.data, count,
                                                                       out.ctypes.data)),
        "decode_s_per_gb": timed(lambda: _core.compress_decode(codec, enc.ctypes.data, count, f32, out.ctypes.data)),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench codecs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="float32 megabytes per run (default 64)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)
    rows = [measure(c, (args.mb << 20) // 4, args.repeats) for c in CODECS]
    print("| codec | wire bytes/element | encode (with feedback) | decode-add | decode | "
          "all-reduce per rank, N=8 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        # compressed.cc per rank: encode (N-1)/N + 1/N of the buffer, decode-add (N-1)/N, decode 1.
        n = 8
        per = r["encode_s_per_gb"] + (n - 1) / n * r["decode_add_s_per_gb"] + r["decode_s_per_gb"]
        r["allreduce_s_per_gb_n8"] = per
        print(f"| {r['codec']} | {r['wire_bytes_per_element']:.4f} | {r['encode_s_per_gb']:.3f} s/GB | "
              f"{r['decode_add_s_per_gb']:.3f} s/GB | {r['decode_s_per_gb']:.3f} s/GB | {per:.3f} s/GB |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
