#!/usr/bin/env bash
# Runs the whole suite with a hard per-test timeout, then checks nothing was left behind.
set -uo pipefail
cd "$(dirname "$0")/.."
cleanup() { bash scripts/cleanup.sh >/dev/null 2>&1 || true; }
trap cleanup EXIT
# --durations: CI must finish within 30 minutes on 2 cores; the log says where the time goes.
.venv/bin/python -m pytest -p no:cacheprovider --timeout=300 --durations=25 "$@" tests
rc=$?
# pytest's 5 means "no tests collected": that is a failure of this script, not a pass.
exit $rc
