"""``mccld``: run the daemon in the foreground (logs to stderr); ``mccld keygen [--kind K] PATH``
writes a key (fleet, submit or job key); ``mccld status`` prints the local daemon's status."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading

from mccl_common.errors import MCCLError

from . import __version__

# What each key is for, said after ``mccld keygen`` writes one (the key itself is never printed).
KEY_KINDS = {
    "fleet": "copy it to every host of the fleet and point MCCL_KEY_FILE at it (default /etc/mccl/fleet.key): "
             "daemons link and mcclctl reads status with it",
    "submit": "copy it to the hosts that take `mcclctl run` jobs and to the people who submit them "
              "(MCCL_SUBMIT_KEY_FILE, default /etc/mccl/submit.key); it is not the fleet key",
    "job": "give it to every rank of one job (MCCL_JOB_KEY_FILE); `mcclctl run` makes one per run by itself",
}


def key_kind_of(path: str) -> str:
    """The kind a key file's name suggests: submit*.key -> submit, job*.key -> job, else fleet."""
    import os
    name = os.path.basename(path).lower()
    return "submit" if name.startswith("submit") else "job" if name.startswith("job") else "fleet"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mccld", description="MCCL per-host daemon")
    parser.add_argument("--config", help="TOML file whose keys are DaemonConfig field names")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.add_argument("--version", action="version", version=f"mccld {__version__}")
    sub = parser.add_subparsers(dest="cmd")
    keygen = sub.add_parser("keygen", help="write a new random key file (mode 0600): a fleet, submit or job key")
    keygen.add_argument("--kind", choices=sorted(KEY_KINDS),
                        help="which key: fleet (daemons and mcclctl), submit (`mcclctl run` launches) or job "
                             "(one job's ranks); default: from the file name (submit*, job*), else fleet")
    keygen.add_argument("path")
    sub.add_parser("status", help="print the local daemon's status (JSON, over the attach socket)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from mccl_common.daemon_settings import load_config, write_key_file
    from mccl_common.setting_names import warn_unknown
    warn_unknown(os.environ)
    if args.cmd == "keygen":
        kind = args.kind or key_kind_of(args.path)
        try:
            path = write_key_file(args.path)
        except FileExistsError:
            print(f"mccld: {args.path} exists; refusing to overwrite it (a key in use: remove it first "
                  f"if you mean to replace it)", file=sys.stderr)
            return 1
        print(f"wrote {kind} key {path} (mode 0600); {KEY_KINDS[kind]}")
        return 0

    if args.cmd == "status":
        import json
        from .attach import local_request
        from mccl_common.daemon_settings import runtime_dir
        try:
            reply = local_request(runtime_dir(load_config(args.config), create=False), {"type": "status"})
        except MCCLError as e:
            print(f"mccld: {e}", file=sys.stderr)
            return 1
        print(json.dumps(reply["status"], indent=2, sort_keys=True))
        return 0

    from .daemon import Daemon
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # `kill -USR1 <mccld>` writes every thread's stack to the log: what a wedged or
    # growing daemon is doing, without a debugger on the host.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    try:
        daemon = Daemon(load_config(args.config)).start()
    except MCCLError as e:
        logging.getLogger("mccld").error("%s", e)
        return 2
    try:
        while not stop.wait(1.0):  # wakes up to stay responsive to signals
            pass
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
