"""``python -m mccld.host.job_exec ENV_FILE -- COMMAND...``: replace this process by COMMAND with
exactly the environment in ENV_FILE (a JSON object of strings, written 0600 by mccld for one
job; see job_unit.py). It runs inside a job's own systemd unit, whose manager's environment
would otherwise mix with the one mccld built from its allow-list."""

from __future__ import annotations

import json
import os
import sys


def load_env(path: str) -> dict[str, str]:
    with open(path, encoding="utf-8") as fh:
        env = json.load(fh)
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"{path} is not a JSON object of strings")
    return env


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m mccld.host.job_exec ENV_FILE -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    try:
        env = load_env(argv[0])
    except (OSError, ValueError) as e:
        print(f"mccld job_exec: cannot read the job's environment: {e}", file=sys.stderr)
        return 2
    try:
        os.execvpe(argv[2], argv[2:], env)
    except OSError as e:
        print(f"mccld job_exec: cannot run {argv[2]}: {e.strerror}", file=sys.stderr)
        return 127
    return 0   # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
