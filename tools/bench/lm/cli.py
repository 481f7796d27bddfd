"""``python -m tools.bench --workload lm [options]``: validation loss against wall time and samples
for each variant (variants.py) on the same hosts, written as results.json, lm-loss.png and
README.md into ``--out-dir``.

Examples::

    python -m tools.bench --workload lm --ranks 2 --variants gloo,off --steps 40    # loopback, unshaped
    python -m tools.bench --workload lm --hosts 2 --variants gloo,off,bf16,int8,int8-nofb \\
        --out-dir docs/results/2core-issue38-lm           # emulated hosts (root), link rate from calibration
    python -m tools.bench --workload lm --redraw docs/results/2core-issue38-lm/results.json \\
        --out-dir docs/results/2core-issue38-lm           # the plot and table again from saved curves
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys

from mccl_common.errors import MCCLError

from .model import ModelConfig
from .runner import LMConfig, caps_from, run_lm, summarize
from .variants import DEFAULT, VARIANTS


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _host_values(text: str, flag: str, value: str, example: str) -> dict[int, tuple[float, int]]:
    """``HOST:VALUE[@STEP],...`` -> {host: (value, step)}, the step 0 when left out."""
    out = {}
    for item in _csv(text):
        try:
            host, _, rest = item.partition(":")
            number, _, at = rest.partition("@")
            out[int(host)] = (float(number), int(at or 0))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {item!r}: expected HOST:{value}[@STEP], e.g. {example}") from None
    return out


def _slow(text: str) -> dict[int, tuple[float, int]]:
    return _host_values(text, "--slow", "FACTOR", "3:2@20")


def _cpu_cap(text: str) -> dict[int, tuple[float, int]]:
    return _host_values(text, "--cpu-cap", "CORES", "3:0.25@20")


def _background(text: str) -> dict[int, int]:
    out = {}
    for item in _csv(text):
        try:
            host, _, at = item.partition("@")
            out[int(host)] = int(at or 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--background {item!r}: expected HOST[@STEP], e.g. 3@20") from None
    return out


def _leave(text: str) -> tuple[int, int]:
    try:
        host, at = text.split("@")
        return int(host), int(at)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--leave {text!r}: expected HOST@STEP, e.g. 3@40") from None


def parser() -> argparse.ArgumentParser:
    d, m = LMConfig(), ModelConfig()
    ap = argparse.ArgumentParser(prog="python -m tools.bench --workload lm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("lm",), default="lm")
    ap.add_argument("--hosts", type=int, default=0, help="emulated hosts (needs root); 0 = loopback (default)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks on loopback (with --hosts 0)")
    ap.add_argument("--rate", default="auto",
                    help="link rate per emulated host (tc syntax), 'none', or 'auto' (default): from this model's "
                         "measured compute per step, so one fp32 all-reduce takes --comm-ratio x it")
    ap.add_argument("--comm-ratio", type=float, default=d.comm_ratio,
                    help=f"fp32 all-reduce time over compute time for --rate auto (default {d.comm_ratio}: a 1B "
                         "model's step on an M4 Max against 10 GbE, runner.STUDIO)")
    ap.add_argument("--variants", type=_csv, default=list(DEFAULT),
                    help=f"comma list of {', '.join(VARIANTS)} (default {','.join(DEFAULT)}); a variant whose "
                         "setting the installed mccl does not declare stops the run")
    ap.add_argument("--reference", default=None, help="the fp32 DDP variant others are compared with "
                                                      "(default gloo, else off)")
    ap.add_argument("--loss-tolerance", type=float, default=d.loss_tolerance,
                    help="relative margin within which a variant counts as having reached the reference's final "
                         f"loss (default {d.loss_tolerance}: fp32 sums in another order differ by ~1e-5)")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch", type=int, default=d.batch, help="sequences per rank per step")
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--val-windows", type=int, default=d.val_windows)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    ap.add_argument("--seed", type=int, default=d.seed, help="data order (the weights: --model-seed)")
    ap.add_argument("--layers", type=int, default=m.layers)
    ap.add_argument("--d-model", type=int, default=m.d_model)
    ap.add_argument("--heads", type=int, default=m.heads)
    ap.add_argument("--context", type=int, default=m.context)
    ap.add_argument("--model-seed", type=int, default=m.seed)
    ap.add_argument("--bucket-mb", type=float, default=None, help="DDP's bucket_cap_mb (default DDP's 25)")
    ap.add_argument("--slow", type=_slow, default={}, metavar="HOST:FACTOR[@STEP],...",
                    help="slow hosts: host HOST computes FACTOR times slower (2 = half speed) from step STEP "
                         "(default 0) on; a stand-in that sleeps in proportion to its samples (train.SlowHost)")
    ap.add_argument("--cpu-cap", type=_cpu_cap, default={}, metavar="HOST:CORES[@STEP],...",
                    help="cap host HOST's CPU time at CORES cores (0.25 = 2.5 ms per 10 ms; at least 0.1) from step STEP on: a "
                         "cgroup quota (root; tools/cpucap.py), so the host is slow as a CPU-bound Mac is")
    ap.add_argument("--background", type=_background, default={}, metavar="HOST[@STEP],...",
                    help="from step STEP on, host HOST's processes run at idle priority (cgroup cpu.idle), as a "
                         "job demoted to background QoS on an artist's Mac: a core only when nothing else wants it")
    ap.add_argument("--leave", type=_leave, default=None, metavar="HOST@STEP",
                    help="host HOST's user comes back after step STEP: every variant runs under "
                         "ElasticState(keep_workers=True) and the other hosts re-form in place and go on")
    ap.add_argument("--calibrate-steps", type=int, default=d.calibrate_steps)
    ap.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds allowed per variant")
    ap.add_argument("--out-dir", help="write results.json, lm-loss.png and README.md here")
    ap.add_argument("--json", dest="json_out", help="also write the result JSON here (updated after each variant)")
    ap.add_argument("--redraw", metavar="RESULTS.json", help="only redraw --out-dir's plot and table from saved results")
    ap.add_argument("--log-dir", help="keep every rank's log here")
    ap.add_argument("-v", "--verbose", action="store_true", help="show rank 0's progress")
    return ap


def _write_json(path: str | None, doc: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(path + ".tmp", path)


def main(argv: list[str]) -> int:
    from .report import table, write_outputs

    args = parser().parse_args(argv)
    if args.redraw:
        if not args.out_dir:
            print("--redraw needs --out-dir", file=sys.stderr)
            return 2
        with open(args.redraw) as f:
            result = json.load(f)
        ref = (result.get("summary") or {}).get("reference")
        result["summary"] = summarize(result["results"], ref, args.loss_tolerance)
        print("\n".join(write_outputs(result, args.out_dir)))
        return 0
    from ..__main__ import _ensure_job_key

    _ensure_job_key()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    cfg = LMConfig(hosts=args.hosts, ranks=args.ranks, rate=args.rate, comm_ratio=args.comm_ratio,
                   variants=args.variants, reference=args.reference, steps=args.steps, batch=args.batch,
                   eval_every=args.eval_every, val_windows=args.val_windows, lr=args.lr,
                   warmup_steps=args.warmup_steps, seed=args.seed, bucket_mb=args.bucket_mb,
                   loss_tolerance=args.loss_tolerance,
                   calibrate_steps=args.calibrate_steps, timeout_s=args.timeout, log_dir=args.log_dir,
                   verbose=args.verbose, slow=args.slow, cpu_caps=caps_from(args.cpu_cap, args.background),
                   leave=args.leave,
                   model=ModelConfig(layers=args.layers, d_model=args.d_model, heads=args.heads,
                                     context=args.context, seed=args.model_seed))
    try:
        result = run_lm(cfg, checkpoint=lambda partial: _write_json(args.json_out, partial))
    except (MCCLError, ValueError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 2
    result["meta"]["command"] = "python -m tools.bench " + shlex.join(argv)
    _write_json(args.json_out, result)
    if args.out_dir:
        for p in write_outputs(result, args.out_dir):
            print(f"wrote {p}")
    print(table(result))
    # A variant that failed is in the table, never papered over.
    return 0 if all(r.get("ok") for r in result["results"].values()) else 1
