"""Fuzz mccld's input surfaces: attach socket, link port, data sockets, status endpoint, metrics port.

    .venv/bin/python scripts/fuzz --inputs 2000 [--surface attach,link] [--seed 1]
                                  [--batch 200] [--budget-s 60] [--corpus DIR] [--json PATH]
    .venv/bin/python scripts/fuzz --replay tests/fuzz_corpus/*.json

``--inputs`` counts per surface. Prints progress on stderr and the JSON summary on
stdout (or into --json): inputs per surface, crashes, unanswered requests, failed
collectives between batches, and the daemon's RSS, fds and threads before and after.
Exit status 0 when the run found nothing (``ok``), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from fuzz import runner  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=1000, help="inputs per surface")
    ap.add_argument("--surface", default="all", help=f"comma-separated, of {','.join(runner.SURFACES)}, or all; "
                    "name:N gives that surface its own input count")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=200, help="inputs between two real collectives")
    ap.add_argument("--budget-s", type=float, default=None, help="time limit per surface")
    ap.add_argument("--corpus", type=Path, default=None, help="save findings here")
    ap.add_argument("--json", type=Path, default=None, help="write the summary here")
    ap.add_argument("--replay", type=Path, nargs="*", default=None, help="replay corpus files instead")
    args = ap.parse_args()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.replay is not None:
        problems = runner.replay(args.replay)
        print(json.dumps({"replayed": len(args.replay), "problems": problems}, indent=1))
        return 1 if problems else 0
    names = list(runner.SURFACES) if args.surface == "all" else args.surface.split(",")
    counts = {n.partition(":")[0]: int(n.partition(":")[2] or args.inputs) for n in names}
    unknown = sorted(set(counts) - set(runner.SURFACES))
    if unknown:
        ap.error(f"unknown surface(s) {unknown}; choose from {list(runner.SURFACES)}")
    summary = runner.run(counts, args.inputs, args.seed, args.batch, args.corpus, args.budget_s, log)
    text = json.dumps(summary, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
