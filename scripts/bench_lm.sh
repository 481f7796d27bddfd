#!/usr/bin/env bash
# Time to loss of the byte-level LM (tools/bench/lm) on an emulated fleet, from a clean checkout:
# sets up .venv and builds mccl (scripts/setup.sh), then trains one model per variant on the same
# hosts and writes results.json, lm-loss.png and README.md into OUT.
#
#   sudo bash scripts/bench_lm.sh                       # 2 hosts, gloo,off: docs/results/2core-issue38-lm
#   sudo HOSTS=4 VARIANTS=gloo,off,bf16,int8,int8-nofb OUT=/tmp/lm bash scripts/bench_lm.sh
#
# Root: the hosts are network namespaces with shaped links. The link rate is calibrated (--rate auto):
# this model's compute per step, measured with every host computing at once, sets it so that an fp32
# all-reduce takes the studio's ratio of it (tools/bench/lm/runner.py, STUDIO). EXTRA passes more
# options (python -m tools.bench --workload lm --help), e.g. EXTRA="--steps 300 --comm-ratio 3".
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTS=${HOSTS:-2}
VARIANTS=${VARIANTS:-gloo,off}
OUT=${OUT:-docs/results/2core-issue38-lm}
[ -x .venv/bin/python ] || bash scripts/setup.sh
.venv/bin/python -c "import libmccl._core" 2>/dev/null || \
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
# shellcheck disable=SC2086  # EXTRA is a list of options
exec nice -n 5 .venv/bin/python -m tools.bench --workload lm --hosts "$HOSTS" --variants "$VARIANTS" \
  --out-dir "$OUT" --json "$OUT/results.json" ${EXTRA:-}
