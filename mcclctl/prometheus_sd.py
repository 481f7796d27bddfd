"""Prometheus file_sd target list from mDNS, so Prometheus follows the fleet as it changes."""

from __future__ import annotations

import json
import os
import tempfile

from .targets import Target, discover, from_hosts


def file_sd(targets: list[Target], fleet: str) -> list[dict]:
    """One target group per host, so each series carries a ``host`` label from mDNS."""
    return [{"targets": [t.metrics_addr], "labels": {"host": t.host, "fleet": fleet}}
            for t in sorted(targets, key=lambda t: t.host)]


def write_atomically(path: str, text: str) -> None:
    # Prometheus re-reads the file when it changes; a half-written file would drop targets.
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".mccl-sd-", dir=directory)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def cmd_prometheus_sd(args) -> int:
    targets = from_hosts(args.host) if args.host else discover(args.discover_timeout, fleet=args.fleet)
    if args.host and args.metrics_port:
        targets = [Target(t.host, t.status_addr, f"{t.host}:{args.metrics_port}") for t in targets]
    text = json.dumps(file_sd(targets, args.fleet), indent=2) + "\n"
    if args.output in (None, "-"):
        print(text, end="")
    else:
        write_atomically(args.output, text)
        print(json.dumps({"output": args.output, "fleet": args.fleet, "targets": len(targets)}) if args.json
              else f"wrote {len(targets)} target(s) of fleet {args.fleet} to {args.output}")
    return 0 if targets else 1
