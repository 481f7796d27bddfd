#!/usr/bin/env bash
# tools/bench/reform.py on the 16-core accelerator machine (issue 13's re-form times to 16
# emulated hosts). That machine brings no ip/tc (carry ../shared/device-fleet as .fleet-tools/),
# no pyzmq/zeroconf (carry their wheels in .whl/) and has no MCCL installed: the engine is built
# in place (as tools/bench/device_run.sh does) and torch finds the "mccl" backend and torchrun the
# "mccl" rendezvous through a dist-info that only declares the package's two entry points.
#
# Run from the repository root:  OUT=/some/dir bash tools/bench/reform_device.sh
#   HOSTS=4,8,12,16 REPEATS=2 BUDGET_S=400 (no trial starts after it) PY=python3
# A check of the script on any root Linux box with MCCL installed (about a minute on 2 cores):
#   SKIP_BUILD=1 PY=.venv/bin/python HOSTS=2 REPEATS=1 OUT=/tmp/o bash tools/bench/reform_device.sh
# $OUT gets reform.json, reform.png, reform.txt, status.txt and logs.tgz (every trial's
# mcclctl output with arrival times, and its mcclds' logs).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
PY=${PY:-python3}
RESULTS=$(mktemp -d /tmp/mccl-reform.XXXXXX)
mkdir -p "$OUT"
T0=$(date +%s)
status() { echo "$(( $(date +%s) - T0 ))s $*" | tee -a "$OUT/status.txt"; }

source tools/bench/device_prepare.sh
[ "$BUILD_OK" = 1 ] || { tail -20 "$RESULTS/build.log" | tee -a "$OUT/status.txt"; exit 1; }
if ! $PY -c 'import torch, torch.distributed as d, mccld.daemon
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r
assert d.is_backend_available("mccl"), "no mccl backend"
assert "mccl" in r._registry, "no mccl rendezvous"
print("mccl backend and rendezvous registered")' >> "$OUT/status.txt" 2>&1; then
  status "MCCL is not importable or not registered (see above)"; exit 1
fi
timeout 45 $PY -m tools.fleet selftest > "$RESULTS/fleet-selftest.txt" 2>&1 && status "fleet selftest ok" \
  || { status "fleet selftest FAILED"; tail -5 "$RESULTS/fleet-selftest.txt" >> "$OUT/status.txt"; }

status "reform start"
PYTHONUNBUFFERED=1 timeout --kill-after=20 "${LIMIT_S:-520}" $PY -m tools.bench.reform \
  --hosts "${HOSTS:-4,8,12,16}" --repeats "${REPEATS:-2}" --budget-s "${BUDGET_S:-400}" ${REFORM_ARGS:-} \
  --json "$OUT/reform.json" --plot "$OUT/reform.png" --log-dir "$RESULTS/logs" > "$OUT/reform.txt" 2> "$OUT/reform.err"
status "reform rc=$?"
cat "$OUT/reform.txt"
tar czf "$OUT/logs.tgz" -C "$RESULTS" logs build.log fleet-selftest.txt 2>/dev/null
ip netns list 2>/dev/null | grep -c mccl | xargs echo "namespaces left:" | tee -a "$OUT/status.txt"
status "done"
