"""mccl-bench: ``python -m tools.bench [options]`` runs a sweep; ``... plot RESULTS.json... OUT.png`` plots;
``python -m tools.bench plot`` alone redraws the README's performance table and docs/img/performance.png
from the committed runs tools/bench/summary.py names;
``python -m tools.bench table RESULTS.json...`` prints saved results as Markdown tables;
``python -m tools.bench scale ...`` runs the scale benchmark (engine-only ranks, 8-256 hosts, scale.py).

Examples::

    python -m tools.bench --ranks 2 --max-bytes 64M               # 2 ranks on loopback
    python -m tools.bench --hosts 4 --rate 1gbit --json n4.json   # 4 emulated hosts (root)
    python -m tools.bench --hosts 4 --ranks-per-host 2 --mode in-process,daemon --ops all_reduce --sizes 64M,256M
                                                       # + mccl through one mccld per host
    python -m tools.bench --hosts 4 --ops all_reduce --sizes 8    # small-message latency
    python -m tools.bench --hosts 8 --rate 10gbit --mode in-process,daemon --workload ddp   # DDP step times
    python -m tools.bench --hosts 8 --rate 10gbit --mode in-process,daemon --workload lightning   # Lightning Trainer steps
    python -m tools.bench --hosts 8 --rate 200mbit --switches 2 --uplink-rate 400mbit --rank-order interleaved \\
        --mode in-process,topology,topology-ring --backends mccl --ops all_reduce --sizes 64M
                                                       # by switch (tree, ring) vs a zig-zag flat ring, 2:1 uplinks
    python -m tools.bench --hosts 2 --rate 1gbit --backends mccl --ops all_reduce --sizes 16M,64M \
        --compression off,bf16,int8                            # compressed all-reduce (effective busbw)
    python -m tools.bench codecs                                  # CPU seconds per float32 GB of each codec
    python -m tools.bench plot n4.json docs/img/n4-1gbit.png
    python -m tools.bench plot                                    # README.md's table, docs/img/performance.png
    python -m tools.bench table n4.json
    python -m tools.bench scale --hosts 8,64,200 --rate 10gbit --delay 30us --out-dir docs/results/x
    python -m tools.bench --workload lm --hosts 2 --variants gloo,off --out-dir /tmp/lm
                                                       # time to loss of a byte-level LM (tools/bench/lm; its own
                                                       # options: python -m tools.bench --workload lm --help)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from mccl_common.errors import MCCLError
from .metrics import OPS, parse_bytes, sweep_sizes
from .sweep import BACKENDS, COMPRESSION, MODES, WORKLOADS, BenchConfig, run_bench


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_argument_group("where the ranks run")
    where.add_argument("--hosts", type=int, default=0,
                       help="emulated hosts (needs root); 0 = loopback (default)")
    where.add_argument("--ranks", type=int, default=2, help="ranks in all on loopback (with --hosts 0)")
    where.add_argument("--ranks-per-host", type=int, default=1,
                       help="ranks per host (on loopback: per daemon); busbw counts all hosts x ranks")
    where.add_argument("--rate", default="1gbit", help="link rate per emulated host (tc syntax) or 'none'")
    where.add_argument("--switches", type=int, default=0,
                       help="emulated switches, the hosts split evenly in order, each switch with one uplink to "
                            "a core (default: one switch); --mode topology then runs by switch")
    where.add_argument("--uplink-rate", default=None,
                       help="rate of each switch's uplink (tc syntax), e.g. 400mbit for 4 hosts x 200mbit at 2:1")
    where.add_argument("--rank-order", choices=("hosts", "interleaved"), default="hosts",
                       help="hosts: rank r on host r (switch by switch); interleaved: consecutive ranks on "
                            "different switches, so a flat ring zig-zags across the uplinks")
    where.add_argument("--uplink-delay", default=None, help="delay added per uplink hop (needs netem), e.g. 200us")
    what = ap.add_argument_group("what is measured")
    what.add_argument("--backends", type=_csv, default=list(BACKENDS), help="comma list (default mccl,gloo)")
    what.add_argument("--mode", dest="modes", type=_csv, default=["in-process"],
                      help=f"how mccl runs, comma list of {', '.join(MODES)} (default in-process); daemon "
                           "starts one mccld per host for the run and attaches the ranks with MCCL_DAEMON=1; "
                           "daemon-shared does too, with the all_reduce buffers from libmccl.shared_empty")
    what.add_argument("--compression", type=_csv, default=["off"],
                      help=f"MCCL_COMPRESSION of the mccl series, comma list of {', '.join(COMPRESSION)} "
                           "(default off); each mode runs once per value, named e.g. mccl-int8, and the report "
                           "gives each over off (busbw counts float32 bytes)")
    what.add_argument("--ops", type=_csv, default=list(OPS), help=f"comma list of {', '.join(OPS)}")
    what.add_argument("--min-bytes", type=parse_bytes, default=4 << 10, help="default 4K")
    what.add_argument("--max-bytes", type=parse_bytes, default=256 << 20, help="default 256M")
    what.add_argument("--step-factor", type=float, default=2.0)
    what.add_argument("--sizes", type=lambda t: [parse_bytes(x) for x in _csv(t)], default=None,
                      help="explicit comma list of sizes, instead of the min/max/step sweep")
    what.add_argument("--warmup", type=int, default=1, help="untimed ops per size (after the correctness check)")
    what.add_argument("--iters", type=int, default=0,
                      help="ops per timed loop; 0 = enough for about --target-seconds (default)")
    what.add_argument("--target-seconds", type=float, default=0.2)
    what.add_argument("--max-iters", type=int, default=200)
    what.add_argument("--repeats", type=int, default=3, help="timed loops per size; the median is reported (>= 3)")
    what.add_argument("--ceiling-seconds", type=float, default=3.0, help="duration of the ring ceiling measurement")
    what.add_argument("--ceiling-tool", choices=("auto", "iperf3", "probe", "none"), default="auto")
    what.add_argument("--workload", choices=(*WORKLOADS, "lm"), default="collectives",
                      help="collectives: the size sweep (default); lm: time to loss of a byte-level language "
                           "model per compression variant, with options of its own (python -m tools.bench "
                           "--workload lm --help); ddp: DDP training steps of a fixed MLP "
                           "with ~50 MB of gradients, timed per series (the sweep options are ignored); "
                           "lightning: Lightning's LightningTransformer under a Lightning Trainer with DDPStrategy "
                           "(58.5 MB of gradients; --ddp-steps, --ddp-batch, --ddp-variants ddp,shared apply; "
                           "needs `pip install lightning`)")
    what.add_argument("--ddp-steps", type=int, default=10, help="timed DDP steps per series (after 3 warm-up)")
    what.add_argument("--ddp-width", type=int, default=2048,
                      help="MLP width; 3 layers of width^2 weights (2048: 50 MB of gradients)")
    what.add_argument("--ddp-depth", type=int, default=3, help="linear layers of the DDP model")
    what.add_argument("--ddp-batch", type=int, default=32, help="samples per rank per DDP step")
    what.add_argument("--ddp-bucket-mb", type=float, default=None,
                      help="DDP's bucket_cap_mb (default: DDP's own, 25)")
    what.add_argument("--ddp-device", default="cpu",
                      help="where the DDP model lives: cpu, or cuda (every rank on the one GPU, cuda:0)")
    what.add_argument("--ddp-variants", type=_csv, default=["ddp"],
                      help="comma list of ddp (plain DDP), nocomm (communication removed: a no-op comm hook), "
                           "staged (a hook staging each bucket through a blocking CPU copy), shared "
                           "(libmccl.ddp_shared_buckets with gradient_as_bucket_view: no copies through mccld), sharedcopy "
                           "(the hook without gradient_as_bucket_view)")
    what.add_argument("--latency-iters", type=int, default=300,
                      help="8-byte all_reduces timed one by one per series for the small-op latency; 0 = none")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per series (a backend in one mode)")
    ap.add_argument("--json", dest="json_out", help="write the full result here")
    ap.add_argument("--log-dir", help="keep every rank's and tool's log here (default: a temporary folder)")
    ap.add_argument("-v", "--verbose", action="store_true", help="show rank 0's progress")
    return ap


def _ensure_job_key() -> None:
    """Every rank of an mccl job must hold the same job key (mccl_common/jobkey.py): without one
    in the environment, the benchmark writes a throwaway key (mode 0600) that its ranks inherit."""
    from mccl_common.daemon_settings import write_key_file
    from mccl_common.jobkey import find_job_key

    if os.environ.get("MCCL_WIRE_SECURITY") == "off" or find_job_key() is not None:
        return
    import atexit
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="mccl-bench-key-")
    atexit.register(shutil.rmtree, root, True)
    os.environ["MCCL_JOB_KEY_FILE"] = str(write_key_file(os.path.join(root, "job.key")))


def _workload(argv: list[str]) -> str | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workload")
    return pre.parse_known_args(argv)[0].workload


def _write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        if len(argv) == 1:   # the README's table and plot, from the runs tools/bench/summary.py names
            from .summary import PLOT, README, main as summary_main

            try:
                print(summary_main())
            except MCCLError as e:
                print(e, file=sys.stderr)
                return 2
            print(f"wrote the table into {README.name} and {PLOT.relative_to(README.parent)}")
            return 0
        if len(argv) < 3:
            print("usage: python -m tools.bench plot [RESULTS.json [MORE.json...] OUT.png]", file=sys.stderr)
            return 2
        from .plot import plot

        plot(argv[1:-1], argv[-1])
        print(f"wrote {argv[-1]}")
        return 0
    if argv[:1] == ["scale"]:
        _ensure_job_key()
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        from .scale import main as scale_main

        try:
            return scale_main(argv[1:])
        except (MCCLError, ValueError) as e:
            print(e, file=sys.stderr)
            return 2
    if argv[:1] == ["scale-report"]:   # README.md and plots again from a saved scale.json
        if len(argv) != 3:
            print("usage: python -m tools.bench scale-report SCALE.json OUT_DIR", file=sys.stderr)
            return 2
        from .scale_report import write_outputs

        with open(argv[1]) as f:
            write_outputs(json.load(f), argv[2])
        print(f"wrote {argv[2]}/README.md")
        return 0
    if argv[:1] == ["codecs"]:
        from .codecs import main as codecs_main

        return codecs_main(argv[1:])
    if argv[:1] == ["table"]:
        from .report import markdown

        for path in argv[1:]:
            with open(path) as f:
                print(markdown(json.load(f)) + "\n")
        return 0
    if _workload(argv) == "lm":   # its own options (tools/bench/lm/cli.py)
        from .lm.cli import main as lm_main

        return lm_main(argv)
    args = _parser().parse_args(argv)
    _ensure_job_key()
    # Let SIGTERM (timeout(1), a CI cancel) unwind like an exception, so the ranks are killed
    # and an emulated fleet is torn down rather than left behind.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        sizes = args.sizes or sweep_sizes(args.min_bytes, args.max_bytes, args.step_factor)
        cfg = BenchConfig(hosts=args.hosts, ranks=args.ranks, ranks_per_host=args.ranks_per_host,
                          rate=None if args.rate == "none" else args.rate, switches=args.switches,
                          uplink_rate=args.uplink_rate, uplink_delay=args.uplink_delay,
                          rank_order=args.rank_order, backends=args.backends,
                          modes=args.modes, compression=args.compression, ops=args.ops, latency_iters=args.latency_iters, sizes=sizes,
                          workload=args.workload,
                          ddp={"steps": args.ddp_steps, "width": args.ddp_width, "depth": args.ddp_depth,
                               "batch": args.ddp_batch, "device": args.ddp_device, "variants": args.ddp_variants,
                               "bucket_mb": args.ddp_bucket_mb},
                          warmup=args.warmup, iters=args.iters, repeats=args.repeats, target_s=args.target_seconds,
                          max_iters=args.max_iters, ceiling_seconds=args.ceiling_seconds,
                          ceiling_tool=args.ceiling_tool, timeout_s=args.timeout, verbose=args.verbose,
                          log_dir=args.log_dir)
        result = run_bench(cfg, checkpoint=lambda partial: _write_json(args.json_out, partial))
    except (MCCLError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    from .report import render

    print(render(result))
    _write_json(args.json_out, result)
    # A series that failed (or is not built yet) is reported above, never papered over.
    return 0 if all(b["ok"] for b in result["backends"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
