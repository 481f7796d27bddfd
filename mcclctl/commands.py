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
from .targets import Fleet, Reply, Target, discover, fetch, find_fleet, from_hosts, load_key, version_mismatches


def find_fleet_of(args, key: bytes | None = None) -> Fleet:
    """--host, else the fleet (--fleet, else MCCL_FLEET) as this host's daemon (or a seed, or
    mDNS) knows it; ConfigError naming the fleet looked for, and the others seen, if it is empty."""
    fleet = getattr(args, "fleet", None)
    if args.host:
        return Fleet(fleet, "--host", from_hosts(args.host))
    found = find_fleet(args.discover_timeout, key, fleet)
    if not found.targets:
        others = ""
        if found.others:
            others = ("; daemons of other fleets answered: "
                      + ", ".join(f"{f} ({n})" for f, n in sorted(found.others.items()))
                      + ": pass --fleet NAME or set MCCL_FLEET")
        raise ConfigError(f"[mcclctl] no daemon of fleet {found.name!r} found: no fleet table from this host's "
                          f"mccld or the MCCL_PEERS seeds lists one, and "
                          + ("mDNS is off (MCCL_DISCOVERY=off)" if found.source.startswith("nowhere")
                             else f"none answered mDNS within {args.discover_timeout:.1f} s")
                          + f"{others}; start mccld, check that multicast reaches this host, set MCCL_PEERS, "
                          f"or use --host H[:port]")
    return found


def find_targets(args, key: bytes | None = None) -> list[Target]:
    return find_fleet_of(args, key).targets


def fleet_lines(fleet: Fleet, replies: list[Reply]) -> str:
    """The line that says which fleet a view shows, and warnings for daemons of another one."""
    reported = [r.result.get("fleet") for r in replies if isinstance(r.result, dict)]
    return "\n".join([fleet.describe(reported)] + [f"warning: {w}" for w in fleet.strays(replies)])


def resolve(names: list[str], discover_timeout: float, key: bytes | None = None,
            fleet: str | None = None) -> list[Target]:
    """Targets for names that are host[:port] or mDNS host ids (looked up only if needed)."""
    found: dict[str, Target] | None = None
    out = []
    for name in names:
        if ":" in name or _is_ip(name):
            out.extend(from_hosts([name]))
            continue
        if found is None:
            try:
                found = {t.host: t for t in discover(discover_timeout, key, fleet)}
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
    fleet = find_fleet_of(args, key)
    replies = fetch(fleet.targets, key, "status", timeout_s=args.timeout)
    if args.json:
        data = [{"target": r.target.status_addr, "host": r.target.host, "status": r.result,
                 "error": r.error} for r in replies]
        return fmt.to_json({"mcclctl_version": MCCL_VERSION, "fleet": fleet.to_json(replies), "daemons": data,
                            "warnings": version_mismatches(replies) + fleet.strays(replies)}), _rc(replies)
    rows = [(r.target.host, r.result, r.error) for r in replies]
    return (fleet_lines(fleet, replies) + "\n"
            + fmt.status_table(rows, MCCL_VERSION, version_mismatches(replies), wide=args.wide)), _rc(replies)


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
    fleet = find_fleet_of(args, key)
    replies = fetch(fleet.targets, key, method, timeout_s=args.timeout)
    if args.json:
        # One entry per daemon, each naming the fleet it answered for.
        print(fmt.to_json([{"host": r.target.host, "fleet": (r.result or {}).get("fleet") or fleet.name,
                            section: (r.result or {}).get(section), "error": r.error} for r in replies]))
    else:
        print(fleet_lines(fleet, replies))
        print(table([(r.target.host, None if r.result is None else r.result.get(section) or [],
                      r.error) for r in replies], wide=args.wide))
        for w in version_mismatches(replies):
            print(f"warning: {w}")
    return _rc(replies)


def cmd_links(args) -> int:
    if getattr(args, "topology", False):
        return _topology(args)
    return _per_host(args, "links", "links", fmt.links_table)


def _topology(args) -> int:
    key = load_key(args.key_file)
    fleet = find_fleet_of(args, key)
    replies = fetch(fleet.targets, key, "links", timeout_s=args.timeout)
    view = topology.fleet_view({(r.result or {}).get("host") or r.target.host: (r.result or {}).get("topology")
                                for r in replies if r.error is None})
    view["errors"] = {r.target.host: r.error for r in replies if r.error is not None}
    if args.json:
        print(fmt.to_json({**view, "fleet": fleet.to_json(replies)}))
    else:
        print(fleet_lines(fleet, replies) + "\n" + fmt.topology_text(view, wide=args.wide))
    return _rc(replies)


def cmd_jobs(args) -> int:
    return _per_host(args, "jobs", "jobs", fmt.jobs_table)


def cmd_capacity(args) -> int:
    key = load_key(args.key_file)
    fleet = find_fleet_of(args, key)
    replies = fetch(fleet.targets, key, "capacity", timeout_s=args.timeout)
    if args.json:
        caps = [r.result for r in replies if r.result is not None]
        print(fmt.to_json({"mcclctl_version": MCCL_VERSION, "fleet": fleet.to_json(replies),
                           "harvestable": fmt.harvestable_totals(caps),
                           "daemons": [{"target": r.target.status_addr, "host": r.target.host,
                                        "capacity": r.result, "error": r.error} for r in replies],
                           "warnings": version_mismatches(replies) + fleet.strays(replies)}))
    else:
        print(fleet_lines(fleet, replies))
        print(fmt.capacity_table([(r.target.host, r.result, r.error) for r in replies], time.time(),
                                 version_mismatches(replies), wide=args.wide))
    return _rc(replies)


def cmd_linktest(args) -> int:
    key = load_key(args.key_file)
    a, b = resolve([args.a, args.b], args.discover_timeout, key, getattr(args, "fleet", None))
    # The measurement runs on A; our request waits for it, plus connection set-up.
    (reply,) = fetch([a], key, "linktest",
                     {"target": b.status_addr, "seconds": args.seconds, "streams": args.streams},
                     timeout_s=args.seconds + args.timeout + 10.0)
    if reply.error:
        raise MCCLError(f"[mcclctl] linktest {args.a} -> {args.b} failed: {reply.error}")
    print(fmt.to_json(reply.result) if args.json else fmt.linktest_line(args.a, args.b, reply.result))
    return 0
