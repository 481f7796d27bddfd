"""mcclctl command line: argument parsing and dispatch only."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from mccl_common.errors import MCCLError

from .recruit import RECRUIT_EVERY_S


def build_parser() -> argparse.ArgumentParser:
    from mccl_common import __version__
    p = argparse.ArgumentParser(prog="mcclctl", description="Inspect and diagnose an MCCL fleet.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug output to stderr")
    p.add_argument("--version", action="version", version=f"mcclctl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, hosts=True, requests=True):
        if hosts:
            sp.add_argument("--host", action="append", metavar="H[:PORT]",
                            help="daemon status endpoint (repeatable); default: the local mccld's fleet table "
                                 "(mDNS and gossip), else the MCCL_PEERS seeds', else mDNS")
        sp.add_argument("--fleet", metavar="NAME",
                        help="the fleet to show (default: MCCL_FLEET, else 'default'); daemons of other "
                             "fleets are left out, and every view names the fleet it shows")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.add_argument("-w", "--wide", action="store_true",
                        help="do not cut long fields (errors, reasons) to fit the table")
        if requests:  # only commands that talk to daemons need the key and a request timeout
            sp.add_argument("--key-file", help="fleet key file (default: MCCL_KEY_FILE or the standard paths)")
            sp.add_argument("--timeout", type=float, default=5.0,
                            help="seconds per daemon request; all are asked at once, so also about the longest "
                                 "an unreachable host delays the answer")
        sp.add_argument("--discover-timeout", type=float, default=3.0,
                        help="seconds to listen for mDNS announcements")
        return sp

    st = common(sub.add_parser("status", help="one row per daemon"))
    st.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    lk = common(sub.add_parser("links", help="per-peer links: sockets, bytes, goodput, retransmits"))
    lk.add_argument("--topology", action="store_true",
                    help="the switches instead: from MCCL_TOPOLOGY, else inferred from the daemons' RTTs")
    common(sub.add_parser("jobs", help="jobs and ranks attached to each daemon"))
    common(sub.add_parser("capacity", help="harvestable hosts now (cores, memory, devices) and hours "
                                           "harvestable per night from each daemon's history"))
    lt = common(sub.add_parser("linktest", help="measure TCP goodput A -> B; A records it as the "
                                                "link's ceiling"), hosts=False)
    lt.add_argument("a", help="measuring daemon: mDNS host id or host[:status port]")
    lt.add_argument("b", help="target daemon: mDNS host id or host[:status port]")
    lt.add_argument("--seconds", type=float, default=3.0)
    lt.add_argument("--streams", type=int, default=2, help="parallel TCP streams (like MCCL_SOCKETS_PER_PEER)")
    common(sub.add_parser("doctor", help="check this host and print a fix for each problem"))
    sd = common(sub.add_parser("prometheus-sd", help="write a Prometheus file_sd target list from mDNS"),
               requests=False)
    sd.add_argument("-o", "--output", help="file to write atomically (default: stdout)")
    sd.add_argument("--metrics-port", type=int, help="metrics port of --host targets (default 29652)")
    rn = common(sub.add_parser("run", help="lease harvestable hosts and run one torchrun on each "
                                           "(mcclctl run -n N -- python train.py ARGS)"))
    rn.add_argument("-n", type=int, help="exactly N hosts")
    rn.add_argument("--min", type=int, help="at least this many hosts (default 1)")
    rn.add_argument("--max", type=int, help="at most this many hosts (default: --min)")
    rn.add_argument("--where", action="append", metavar="TERM",
                    help="host filter, repeatable: state=idle|leased|busy|any (default idle), host=GLOB, "
                         "device=GLOB, cores>=N, memory_gib>=N")
    rn.add_argument("--nproc-per-node", type=int, default=1, help="training processes per host")
    rn.add_argument("--max-restarts", type=int,
                    help="torchrun's --max-restarts (default 0; 100 when --min < --max: one per re-form)")
    rn.add_argument("--env", action="append", metavar="NAME=VALUE", help="set in the job's environment")
    rn.add_argument("--cwd", help="working directory on every host (default: this one)")
    rn.add_argument("--job", help="the run's id (default: mccl-<time>-<pid>)")
    rn.add_argument("--anchor", metavar="ADDRESS",
                    help="this host's address the fleet reaches (default: the route to the first host)")
    rn.add_argument("--rdzv-port", type=int, default=0, help="the anchor's port (default: a free one)")
    rn.add_argument("--recruit-every", type=float, default=RECRUIT_EVERY_S, metavar="SECONDS",
                    help=f"with --min < --max, how often to look for idle hosts to grow the run into "
                         f"(default {RECRUIT_EVERY_S:g})")
    rn.add_argument("--submit-key-file", help="submit key (default: MCCL_SUBMIT_KEY_FILE or the standard paths)")
    rn.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command each host runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from mccl_common.setting_names import warn_unknown
    warn_unknown(os.environ)
    from . import commands, doctor, prometheus_sd, run
    handlers = {"status": commands.cmd_status, "links": commands.cmd_links, "jobs": commands.cmd_jobs,
                "capacity": commands.cmd_capacity, "run": run.cmd_run,
                "linktest": commands.cmd_linktest, "doctor": doctor.cmd_doctor,
                "prometheus-sd": prometheus_sd.cmd_prometheus_sd}
    if args.command == "prometheus-sd" and args.fleet is None:
        from .targets import wanted_fleet
        args.fleet = wanted_fleet(None)   # the label needs a name even with --host
    try:
        return handlers[args.command](args)
    except MCCLError as e:
        print(f"mcclctl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
