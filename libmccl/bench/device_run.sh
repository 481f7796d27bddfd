#!/usr/bin/env bash
# mccl-bench on a bigger Linux box (16 cores) that brings ip/tc/iperf3 in .fleet-tools/ and
# has torch, pybind11, cmake, ninja and scikit-build-core but no pyzmq/zeroconf (the bench
# needs neither). Builds the engine in place, then measures, writing JSON + tables to $OUT:
#   1. N=8 hosts at 10 Gbit/s, 16-256 MB: mccl vs gloo vs the iperf3 ring ceiling
#   2. N=2, 4, 8 at 2.5 Gbit/s, 4-256 MB all_reduce/all_gather: is busbw flat in N?
# Every step has its own time limit, cut further so the script ends within BUDGET_S (8.5
# minutes); a step that fails or times out is recorded in $OUT/status.txt and the script
# moves on.
# SEND_THREAD_AB=1 adds, after step 1, N=8 all_reduce at 64/256 MB with MCCL_SEND_THREAD=0
# (about a minute, taken from step 2's time).
# RECV_THREADS_AB=1 adds N=8 all_reduce with MCCL_RECV_THREADS=0 and =2 and the world-size-1
# DDP step (about three minutes, taken from step 2's time).
# Run from the repository root:  OUT=/some/dir bash libmccl/bench/device_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PY:-python3}
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-510}
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
status() { echo "$(( $(date +%s) - T0 ))s $*" | tee -a "$OUT/status.txt"; }

if [ -d .fleet-tools ]; then
  export LD_LIBRARY_PATH=$PWD/.fleet-tools/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$PWD/.fleet-tools/root/sbin:$PWD/.fleet-tools/root/bin:$PWD/.fleet-tools/root/usr/bin:$PATH
fi
{ uname -a; nproc; free -g; $PY -c 'import torch; print("torch", torch.__version__)';
  command -v ip tc iperf3; } > "$OUT/machine.txt" 2>&1

# --- build the engine in place (no pip: _core.so lands next to libmccl/*.py) -------------
status "build start"
PYBIND11_DIR=$($PY -c 'import pybind11; print(pybind11.get_cmake_dir())')
if timeout 90 cmake -S . -B build/device -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DPython_EXECUTABLE="$(command -v $PY)" -Dpybind11_DIR="$PYBIND11_DIR" > "$OUT/build.log" 2>&1 &&
   timeout 180 cmake --build build/device -j "$(nproc)" --target _core >> "$OUT/build.log" 2>&1; then
  cp build/device/_core*.so libmccl/
  status "build ok"
else
  status "build FAILED (see build.log); mccl will be reported as failed, gloo still runs"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# The sweep imports torch only in the ranks; torch's entry-point autoload is not installed
# here (no pip), so the ranks register the backend themselves (worker.py).

bench() {  # bench NAME LIMIT_S ARGS...
  local name=$1 limit=$2; shift 2
  local remaining=$(( $(left) - 15 ))
  [ "$remaining" -lt "$limit" ] && limit=$remaining
  if [ "$limit" -lt 30 ]; then status "$name skipped: out of time"; return; fi
  status "$name start (limit ${limit}s)"
  # -v: progress lines go to .err as they happen; the JSON is rewritten after every step,
  # so a run cut short by its limit still leaves what it measured.
  timeout --kill-after=10 "$limit" $PY -m libmccl.bench -v --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.txt" 2> "$OUT/$name.err"
  local rc=$?
  status "$name rc=$rc"
  cat "$OUT/$name.txt"
}

# --- can this machine build a fleet at all? ------------------------------------------------
if timeout 45 $PY -m libmccl.fleet selftest --rate 1gbit > "$OUT/fleet-selftest.txt" 2>&1; then
  status "fleet selftest ok"
  bench n8-10gbit 180 --hosts 8 --rate 10gbit --min-bytes 16M --max-bytes 256M --ceiling-seconds 5
  if [ "${SEND_THREAD_AB:-0}" = 1 ]; then
    # The same all_reduce with the engine's send thread off (one thread per rank does
    # all socket copies): what the send thread is worth where cores are to spare.
    ( export MCCL_SEND_THREAD=0
      bench n8-10gbit-one-thread 60 --hosts 8 --rate 10gbit --backends mccl --ops all_reduce \
        --sizes 64M,256M --ceiling-tool none )
  fi
  if [ "${RECV_THREADS_AB:-0}" = 1 ]; then
    # Receive threads off (0) and on (2, the default), Gloo in both runs; then world size 1.
    for rt in 0 2; do
      ( export MCCL_RECV_THREADS=$rt
        bench n8-10gbit-recv$rt 80 --hosts 8 --rate 10gbit --ops all_reduce --sizes 16M,64M,256M --ceiling-seconds 3 )
    done
    timeout 60 $PY -m libmccl.bench.solo_ddp > "$OUT/solo-ddp.txt" 2>&1; status "solo-ddp rc=$?"
  fi
  for n in 2 4 8; do
    bench n$n-2.5gbit 100 --hosts $n --rate 2.5gbit --ops all_reduce,all_gather \
      --min-bytes 4M --max-bytes 256M --step-factor 4 --ceiling-seconds 3
  done
else
  status "fleet selftest FAILED (see fleet-selftest.txt); falling back to 8 ranks on loopback"
  bench loopback-8 240 --ranks 8 --min-bytes 16M --max-bytes 256M --ceiling-seconds 5
fi

if $PY -c 'import matplotlib' 2>/dev/null; then
  for f in "$OUT"/*.json; do
    [ -s "$f" ] && $PY -m libmccl.bench plot "$f" "${f%.json}.png" >/dev/null 2>&1
  done
fi
status "done"
