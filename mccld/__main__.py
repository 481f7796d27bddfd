"""``mccld``: run the daemon in the foreground (logs to stderr); ``mccld keygen PATH`` writes a
fleet key; ``mccld status`` prints the local daemon's status."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
import threading

from mccl_common.errors import MCCLError

from . import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mccld", description="MCCL per-host daemon")
    parser.add_argument("--config", help="TOML file whose keys are DaemonConfig field names")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.add_argument("--version", action="version", version=f"mccld {__version__}")
    sub = parser.add_subparsers(dest="cmd")
    keygen = sub.add_parser("keygen", help="write a new random fleet key file (mode 0600)")
    keygen.add_argument("path")
    sub.add_parser("status", help="print the local daemon's status (JSON, over the attach socket)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from mccl_common.daemon_settings import load_config, write_key_file
    if args.cmd == "keygen":
        try:
            path = write_key_file(args.path)
        except FileExistsError:
            print(f"mccld: {args.path} exists; refusing to overwrite a fleet key", file=sys.stderr)
            return 1
        print(f"wrote fleet key {path}; copy it (mode 0600) to every host of the fleet")
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
