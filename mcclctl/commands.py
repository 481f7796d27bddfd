"""status, links, jobs, linktest, capacity: find the daemons, fetch, hand the data to a formatter."""

from __future__ import annotations

import ipaddress
import sys
import time
from typing import Callable

from mccl_common import __version__ as MCCL_VERSION
from mccl_common import topology
from mccl_common.errors import ConfigError, MCCLError

from . import formatting as fmt
from .targets import Target, discover, fetch, from_hosts, load_key, version_mismatches


def find_targets(args, key: bytes | None = None) -> list[Target]:
    """--host, else the fleet as this host's daemon (or a seed, or mDNS) knows it."""
    if args.host:
        return from_hosts(args.host)
    targets = discover(args.discover_timeout, key)
    if not targets:
        raise ConfigError(f"[mcclctl] no fleet table from this host's mccld or the MCCL_PEERS seeds, and no "
                          f"mccld answered mDNS within {args.discover_timeout:.1f} s; start mccld, check that "
                          f"multicast reaches this host, set MCCL_PEERS, or use --host H[:port]")
    return targets


def resolve(names: list[str], discover_timeout: float, key: bytes | None = None) -> list[Target]:
    """Targets for names that are host[:port] or mDNS host ids (looked up only if needed)."""
    found: dict[str, Target] | None = None
    out = []
    for name in names:
        if ":" in name or _is_ip(name):
            out.extend(from_hosts([name]))
            continue
        if found is None:
            try:
                found = {t.host: t for t in discover(discover_timeout, key)}
            except ConfigError:
                found = {}
        out.append(found.get(name) or from_hosts([name])[0])
    return out


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _render_status(args, key: bytes) -> tuple[str, int]:
    replies = fetch(find_targets(args, key), key, "status", timeout_s=args.timeout)
    if args.json:
        data = [{"target": r.target.status_addr, "host": r.target.host, "status": r.result,
                 "error": r.error} for r in replies]
        return fmt.to_json({"mcclctl_version": MCCL_VERSION, "daemons": data,
                            "warnings": version_mismatches(replies)}), _rc(replies)
    rows = [(r.target.host, r.result, r.error) for r in replies]
    return fmt.status_table(rows, MCCL_VERSION, version_mismatches(replies)), _rc(replies)


def _rc(replies) -> int:
    return 0 if replies and all(r.error is None for r in replies) else 1


def cmd_status(args) -> int:
    key = load_key(args.key_file)
    if not args.watch:
        text, rc = _render_status(args, key)
        print(text)
        return rc
    if args.watch < 0.5:
        raise ConfigError(f"[mcclctl] --watch {args.watch} is too fast; use at least 0.5 seconds")
    try:
        while True:
            text, _ = _render_status(args, key)
            if sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")
            print(time.strftime("%H:%M:%S"), f"(every {args.watch:g} s, Ctrl-C to stop)")
            print(text, flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _per_host(args, method: str, section: str, table: Callable) -> int:
    key = load_key(args.key_file)
    replies = fetch(find_targets(args, key), key, method, timeout_s=args.timeout)
    if args.json:
        print(fmt.to_json([{"host": r.target.host, section: (r.result or {}).get(section),
                            "error": r.error} for r in replies]))
    else:
        print(table([(r.target.host, None if r.result is None else r.result.get(section) or [],
                      r.error) for r in replies]))
        for w in version_mismatches(replies):
            print(f"warning: {w}")
    return _rc(replies)


def cmd_links(args) -> int:
    if getattr(args, "topology", False):
        return _topology(args)
    return _per_host(args, "links", "links", fmt.links_table)


def _topology(args) -> int:
    replies = fetch(find_targets(args), load_key(args.key_file), "links", timeout_s=args.timeout)
    view = topology.fleet_view({(r.result or {}).get("host") or r.target.host: (r.result or {}).get("topology")
                                for r in replies if r.error is None})
    view["errors"] = {r.target.host: r.error for r in replies if r.error is not None}
    print(fmt.to_json(view) if args.json else fmt.topology_text(view))
    return _rc(replies)


def cmd_jobs(args) -> int:
    return _per_host(args, "jobs", "jobs", fmt.jobs_table)


def cmd_capacity(args) -> int:
    key = load_key(args.key_file)
    replies = fetch(find_targets(args, key), key, "capacity", timeout_s=args.timeout)
    if args.json:
        caps = [r.result for r in replies if r.result is not None]
        print(fmt.to_json({"mcclctl_version": MCCL_VERSION, "harvestable": fmt.harvestable_totals(caps),
                           "daemons": [{"target": r.target.status_addr, "host": r.target.host,
                                        "capacity": r.result, "error": r.error} for r in replies],
                           "warnings": version_mismatches(replies)}))
    else:
        print(fmt.capacity_table([(r.target.host, r.result, r.error) for r in replies], time.time(),
                                 version_mismatches(replies)))
    return _rc(replies)


def cmd_linktest(args) -> int:
    key = load_key(args.key_file)
    a, b = resolve([args.a, args.b], args.discover_timeout, key)
    # The measurement runs on A; our request waits for it, plus connection set-up.
    (reply,) = fetch([a], key, "linktest",
                     {"target": b.status_addr, "seconds": args.seconds, "streams": args.streams},
                     timeout_s=args.seconds + args.timeout + 10.0)
    if reply.error:
        raise MCCLError(f"[mcclctl] linktest {args.a} -> {args.b} failed: {reply.error}")
    print(fmt.to_json(reply.result) if args.json else fmt.linktest_line(args.a, args.b, reply.result))
    return 0
