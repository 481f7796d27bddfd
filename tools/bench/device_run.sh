#!/usr/bin/env bash
# mccl-bench on a bigger Linux box (16 cores) that brings ip/tc/iperf3 in .fleet-tools/ and
# has torch, pybind11, cmake and ninja but no pyzmq/zeroconf. Builds the engine in place,
# installs the wheels carried in .whl/ (pyzmq, numpy for mccld; zeroconf, ifaddr optional:
# the daemons need no mDNS, jobs learn their peers through the rendezvous), then measures
# what issue 9's targets need, each step one mccl-bench invocation (mccl in-process, mccl
# through one mccld per host, Gloo and the iperf3 ring ceiling in the same run):
#   1-n8-10gbit      8 hosts x 1 rank at 10 Gbit/s, all_reduce 16/64/256 MB, + 8-byte latency
#   2-n4x2-10gbit    4 hosts x 2 ranks at 10 Gbit/s, all_reduce 64/256 MB (daemon: hierarchical)
#   3-ddp-n8-10gbit  8 hosts x 1 rank at 10 Gbit/s, DDP step time of a 50 MB-gradient MLP
#   4-n16-2.5gbit    16 hosts at 2.5 Gbit/s, all_reduce 16/64/256 MB, in-process + Gloo
#   5-n24-1gbit      24 hosts at 1 Gbit/s, all_reduce 16/64/256 MB, in-process + Gloo
#   6-n8-recv0       step 1's in-process all_reduce with MCCL_RECV_THREADS=0 (receive threads off)
#   7-solo-ddp       a world-size-1 DDP step, Gloo against MCCL (the MLP, and Lightning's LightningTransformer
#                    under a Lightning Trainer where lightning is installed), medians of 3
#   8-cuda-ddp-n4    DDP on cuda tensors, 4 hosts x 1 rank sharing the GPU, 10 Gbit/s: step vs the
#                    step without communication (overlap), staged copies, Gloo; in-process and through mccld
#   9-campaign       issue 11's fault campaign, 1,000 trials per mode (scripts/faults/campaign.py)
#   10-n8-wire       issue 24's wire security: all_reduce busbw (16/64/256 MB) and 8-byte latency with
#                    MCCL_WIRE_SECURITY=off and aead (WIRE_MODES), alternating, WIRE_REPEATS times, in-process
#                    and through mccld, 8 hosts x 10 Gbit/s; then one threadcpu run per security mode
#                    (CPU seconds per wire GB, in-process, 256 MB)
#   11-n8-cpu        where the CPU goes at 8 hosts x 1 rank, 10 Gbit/s, 256 MB: one run per mode under
#                    tools/bench/threadcpu.py (per process role and thread, and the whole machine)
#   12-n4-10gbit     step 1 at 4 hosts (half the processes on the same cores): in-process and daemon
#   13-membw         is memory bandwidth what binds 8 hosts? the machine's copy GB/s for 1..16 processes
#                    (tools/bench/membw.py scale), then step 1's in-process all_reduce 64/256 MB beside
#                    0, 4 and 8 niced memory-copying processes (13-n8-hog0/hog4/hog8; membw hog)
#   14-n8-tickets    step 1's in-process all_reduce twice: the plain ring, then the gated (ticketed) ring that
#                    mccld's path runs, input ready at the start (MCCL_BENCH_TICKETS=1): the gated ring alone
#                    against the plain one, without the daemon's copies
#   15-n8-ahead      step 1 (mccl only, in-process and through mccld) alternating the client's copy-in all
#                    at once (MCCL_DAEMON_COPY_AHEAD_BYTES=0) and paced (the default), AHEAD_ORDER times
#   16-n8-threads    step 1's in-process all_reduce (and Gloo) alternating fewer engine threads per rank
#                    (THREAD_ORDER: "-" for the defaults, else VAR=value[,VAR=value]), 64/256 MB;
#                    with H8=24 FAST=1gbit THR_LIMIT_S=200, the same at 24 hosts; THR_EXTRA: more mccl-bench
#                    arguments (e.g. "--compression off,int8 --backends mccl")
#   17-shared        in-process, through mccld, and through mccld with the all_reduce buffers from
#                    libmccl.shared_empty (no client copies), Gloo beside: 8 hosts x 1 (16/64/256 MB)
#                    and 4 hosts x 2 (64/256 MB), SHARED_RUNS times
#   18-scale         issue 26's scale benchmark (tools/bench/scale.py): engine-only ranks (no torch), one per
#                    emulated host, N in SCALE_HOSTS (8,64,200), all_reduce at SCALE_SIZES (8 B..256 MB), algorithm
#                    auto and pinned ring in the same run, links standing for 10 Gbit/s + a 30 us hop, time-dilated
#                    (SCALE_DIL, N:factor, default 8:2,64:64,200:200,256:256: about 10 Gbit/s of all hosts' traffic
#                    together from 64 hosts on, where the smoke run's iperf3 ring carried only 72 % of 64 x 370
#                    Mbit/s; "auto" = N x 10 Gbit/s within SCALE_MACHINE_GBIT), the iperf3
#                    ring ceiling at each shaping, Gloo (torch ranks) at 64 hosts; each N within its SCALE_LIMITS
#                    seconds. README.md (tables), scale.json and scale.png land in SCALE_DIR
#                    (docs/results/device-scale-<date>) and come back in $OUT/scale/. One call:
#                    STEPS=18 OUT=... bash tools/bench/device_run.sh  (~8 minutes)
#   19-topo-2x16     issue 26's hierarchy: 2 switches x 16 hosts (TOPO_RATE, default 500mbit), uplinks 2:1
#                    (TOPO_UPLINK 4gbit), ranks interleaved across switches, all_reduce 64 MB: flat ring,
#                    ring in switch order, tree
#   20-init          init_process_group of INIT_RANKS (200) torch ranks on loopback (tools/bench/init_scale.py)
#   21-scale-k1      step 18 at 64 hosts, 1/4 MB, Rabenseifner and ring with one socket a peer
#   22-lightning     issue 27: Lightning's LightningTransformer under a Lightning Trainer (DDPStrategy), 8 hosts x
#                    1 rank at 10 Gbit/s: mccl in-process, through mccld, Gloo; each with DDP's defaults and with
#                    libmccl.ddp_shared_buckets (buckets in mccld's shared memory); LIGHTNING_BATCH (16),
#                    LIGHTNING_STEPS (10). Needs lightning installed (pip install lightning)
#   23-daemon-socks  issue 26's links on demand through mccld: data sockets per daemon for an all-reduce-only
#                    job, then after an all-to-all, leasing every peer at set-up (as before) against the
#                    set-up hosts only; SOCK_HOSTS (8,16,32) emulated hosts in one process on loopback
#                    (tools/bench/daemon_sockets.py; no shaping, no root)
#   24-n8-compress   issue 38: all_reduce 16/64/256 MB with MCCL_COMPRESSION off, bf16 and int8, in-process and
#                    through mccld, 8 hosts x 10 Gbit/s; then threadcpu around the in-process int8 run at 256 MB
#                    (which threads are busy while the op waits on something serial)
#   26-n8-rounds     issue 37's round-time target: DiLoCo H=8 on the uniform fleet and adaptive DiLoCo with the
#                    last two hosts at half speed, alternating, ROUND_REPEATS times (default "1 2")
#   27-n8-lm         issue 38/35's time to loss: the lm workload at 8 hosts (the studio's ratio), LM_RUNS runs
#                    of SEED:VARIANTS (default "1:gloo,off,int8,diloco-h8 2:gloo,int8"), --steps LM_STEPS (128)
#   28-n8-leave      issue 35's fault target: the lm workload at 8 hosts, off and diloco-h8, without a fault and
#                    with the last host leaving at 40 % of LM_STEPS (--leave), survivors re-forming in place
#   25-n8-slow       issue 37 on the lm workload, 8 hosts, link at 0.25x the compute: DiLoCo H=8 on a uniform
#                    fleet, then DiLoCo and adaptive DiLoCo with the last two hosts at half speed (round times), then
#                    speed-balanced DDP with the last host halved at step 16 (how soon it is rebalanced)
# Step 3 takes DDP_WIDTH, DDP_DEPTH, DDP_VARIANTS (ddp,nocomm: the step with communication removed, for overlap;
# shared,sharedcopy: libmccl.ddp_shared_buckets with and without gradient_as_bucket_view) and
# DDP_BUCKET_MB (DDP's bucket_cap_mb).
# STEPS picks which run (default "1 2 3 4 5"; e.g. STEPS="1 2 3 6" then STEPS="4 5 7" as
# two calls of under ten minutes each).
# (numbered: a small run's host counts and rates may repeat). Every step has its own time
# limit, cut further so the script ends within BUDGET_S (8.5 minutes); a step that fails or
# times out is recorded in status.txt and the script moves on. Results (JSON rewritten after every measurement, tables, logs, plots) go to $RESULTS;
# after every step they are packed into $OUT/results.tgz, and status.txt and summary.txt
# (every table) are copied to $OUT, so a run cut short still returns what it measured.
#
# Run from the repository root:  OUT=/some/dir bash tools/bench/device_run.sh
# Smaller versions (a check of the script on any root Linux box; 2-4 minutes on 2 cores):
#   H8=2 H_X2=2 H_MID=2 H_SLOW=3 FAST=1gbit MID=1gbit SLOW=1gbit SIZES=1M,4M SIZES_X2=4M \
#     DDP_WIDTH=512 SKIP_BUILD=1 PY=.venv/bin/python OUT=/tmp/o bash tools/bench/device_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
RESULTS=${RESULTS:-$(mktemp -d /tmp/mccl-bench-results.XXXXXX)}
mkdir -p "$OUT" "$RESULTS"
PY=${PY:-python3}
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-510}
H8=${H8:-8} H_X2=${H_X2:-4} H_MID=${H_MID:-16} H_SLOW=${H_SLOW:-24}
FAST=${FAST:-10gbit} MID=${MID:-2.5gbit} SLOW=${SLOW:-1gbit}
SIZES=${SIZES:-16M,64M,256M} SIZES_X2=${SIZES_X2:-64M,256M}
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
status() { echo "$(( $(date +%s) - T0 ))s $*" | tee -a "$RESULTS/status.txt"; }
pack() {  # what $OUT gets back, refreshed after every step
  cp "$RESULTS/status.txt" "$OUT/status.txt"
  cat "$RESULTS"/*.txt > "$OUT/summary.txt.tmp" 2>/dev/null && mv "$OUT/summary.txt.tmp" "$OUT/summary.txt"
  tar czf "$OUT/results.tgz.tmp" -C "$RESULTS" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
}

source tools/bench/device_prepare.sh
[ "$BUILD_OK" = 1 ] || status "mccl will be reported as failed, gloo still runs"
# The ranks also register the backend themselves (worker.py), whatever the dist-info above does.

# The daemon rows need mccld importable (pyzmq, numpy); without it the steps still measure the rest.
MODES=in-process,daemon
if ! $PY -c 'import mccld.daemon' > "$RESULTS/mccld-import.txt" 2>&1; then
  MODES=in-process
  status "mccld cannot be imported (see mccld-import.txt): no daemon rows; carry pyzmq/numpy wheels in .whl/"
fi

STEPS=${STEPS:-1 2 3 4 5}
want() { [[ " $STEPS " == *" $1 "* ]]; }

bench() {  # bench NAME LIMIT_S ARGS...
  local name=$1 limit=$2; shift 2
  local remaining=$(( $(left) - 15 ))
  [ "$remaining" -lt "$limit" ] && limit=$remaining
  if [ "$limit" -lt 30 ]; then status "$name skipped: out of time"; pack; return; fi
  status "$name start (limit ${limit}s)"
  # -v: progress lines go to .err as they happen; the JSON is rewritten after every series,
  # so a run cut short by its limit still leaves what it measured.
  # WRAP (a command line that ends in "--", e.g. membw hog) runs the benchmark under it.
  timeout --kill-after=20 "$limit" ${WRAP:-} $PY -m tools.bench -v --json "$RESULTS/$name.json" "$@" \
    > "$RESULTS/$name.txt" 2> "$RESULTS/$name.err"
  local rc=$?
  status "$name rc=$rc"
  cat "$RESULTS/$name.txt"
  pack
}

# --- can this machine build a fleet at all? ------------------------------------------------
if timeout 45 $PY -m tools.fleet selftest --rate 1gbit > "$RESULTS/fleet-selftest.txt" 2>&1; then
  status "fleet selftest ok"
  COMMON=(--ops all_reduce --target-seconds 0.5)
  want 1 && bench "1-n$H8-$FAST" 150 --hosts "$H8" --rate "$FAST" --mode "$MODES" --sizes "$SIZES" "${COMMON[@]}"
  # Is the daemon's gap at 8 hosts the emulation's CPU? The same ratio with half the hosts, and
  # the cores each mode keeps busy (threadcpu wraps one mode's run; its report is the .txt).
  want 12 && bench "12-n${H4:-4}-$FAST" 100 --hosts "${H4:-4}" --rate "$FAST" --mode "$MODES" --backends mccl \
    --sizes "${SIZES_CPU:-64M,256M}" --latency-iters 0 --ceiling-seconds 2 "${COMMON[@]}"
  if want 11; then
    for mode in ${MODES//,/ }; do
      name="11-n$H8-cpu-$mode"
      status "$name start"
      timeout --kill-after=20 "$(( $(left) > 120 ? 100 : $(left) - 20 ))" $PY -m tools.bench.threadcpu \
        --delay 15 --json "$RESULTS/$name-threads.json" -- $PY -m tools.bench --json "$RESULTS/$name.json" \
        --hosts "$H8" --rate "$FAST" --mode "$mode" --backends mccl --sizes 256M --latency-iters 0 \
        --ceiling-seconds 2 --ops all_reduce --target-seconds 3 > "$RESULTS/$name.txt" 2> "$RESULTS/$name.err"
      status "$name rc=$?"
      cat "$RESULTS/$name.txt"
      pack
    done
  fi
  want 2 && bench "2-n${H_X2}x2-$FAST" 120 --hosts "$H_X2" --ranks-per-host 2 --rate "$FAST" --mode "$MODES" \
    --sizes "$SIZES_X2" "${COMMON[@]}"
  want 3 && bench "3-ddp-n$H8-$FAST" 90 --hosts "$H8" --rate "$FAST" --mode "$MODES" --workload ddp \
    --ddp-width "${DDP_WIDTH:-2048}" --ddp-depth "${DDP_DEPTH:-3}" --ddp-variants "${DDP_VARIANTS:-ddp}" ${DDP_BUCKET_MB:+--ddp-bucket-mb "$DDP_BUCKET_MB"} \
    --latency-iters 0
  want 4 && bench "4-n$H_MID-$MID" 100 --hosts "$H_MID" --rate "$MID" --sizes "$SIZES" --latency-iters 0 "${COMMON[@]}"
  want 5 && bench "5-n$H_SLOW-$SLOW" 130 --hosts "$H_SLOW" --rate "$SLOW" --sizes "$SIZES" --latency-iters 0 "${COMMON[@]}"
  # Receive threads off: what they are worth where a rank has cores to spare (step 1 has them on).
  want 6 && ( export MCCL_RECV_THREADS=0
    bench "6-n$H8-$FAST-recv0" 70 --hosts "$H8" --rate "$FAST" --backends mccl --sizes "$SIZES" --latency-iters 0 \
      --ceiling-seconds 3 "${COMMON[@]}" )
  # Issue 10's NVIDIA target: DDP on cuda tensors, 4 ranks sharing the GPU, each in its own
  # emulated host at 10 Gbit/s; plain DDP beside the step without communication (overlap),
  # staging through blocking copies, and Gloo (which also runs every variant).
  want 8 && bench "8-cuda-ddp-n4-$FAST" 280 --hosts "${H_CUDA:-4}" --rate "$FAST" --backends mccl,gloo --mode "$MODES" \
    --workload ddp --ddp-device cuda --ddp-variants ddp,nocomm,staged --ddp-width "${CUDA_WIDTH:-1024}" \
    --ddp-depth "${CUDA_DEPTH:-48}" --ddp-bucket-mb "${CUDA_BUCKET_MB:-4}" --ddp-batch "${CUDA_BATCH:-16384}" \
    --ddp-steps 8 --latency-iters 0 --ceiling-seconds 2
  # Memory bandwidth: what the machine copies with 1..16 processes, then step 1's in-process
  # all_reduce beside 0, 4 and 8 copying processes (niced: they take the cores the ranks leave idle).
  if want 13; then
    status "13-membw start"
    timeout --kill-after=10 "$(( $(left) > 80 ? 60 : $(left) - 20 ))" $PY -m tools.bench.membw scale \
      --procs "${MEMBW_PROCS:-1,2,4,8,16}" --mb "${MEMBW_MB:-256}" --seconds "${MEMBW_SECONDS:-3}" \
      --json "$RESULTS/13-membw.json" > "$RESULTS/13-membw.txt" 2> "$RESULTS/13-membw.err"
    status "13-membw rc=$?"
    cat "$RESULTS/13-membw.txt"
    pack
    for k in ${HOGS:-0 4 8}; do
      name="13-n$H8-hog$k"
      wrap=
      [ "$k" -gt 0 ] && wrap="$PY -m tools.bench.membw hog --procs $k --mb ${MEMBW_MB:-256} --json $RESULTS/$name-membw.json --"
      WRAP=$wrap bench "$name" 90 --hosts "$H8" --rate "$FAST" --backends mccl --mode in-process \
        --sizes "${MEMBW_SIZES:-64M,256M}" --latency-iters 0 --ceiling-seconds 2 "${COMMON[@]}"
    done
  fi
  if want 14; then
    for t in ${TICKET_ORDER:-0 1 0 1}; do
      n=$(( ${n14:-0} + 1 )); n14=$n
      MCCL_BENCH_TICKETS=$t bench "14-n$H8-tickets$t-r$n" 80 --hosts "$H8" --rate "$FAST" --backends mccl \
        --mode in-process --sizes "${SIZES_T:-16M,64M,256M}" --latency-iters 0 --ceiling-seconds 2 "${COMMON[@]}"
    done
  fi
  if want 15 && [[ $MODES == *daemon* ]]; then
    for ahead in ${AHEAD_ORDER:-0 default 0 default default}; do
      n=$(( ${n15:-0} + 1 )); n15=$n
      ( [ "$ahead" = default ] || export MCCL_DAEMON_COPY_AHEAD_BYTES=$ahead
        bench "15-n$H8-ahead-$ahead-r$n" 100 --hosts "$H8" --rate "$FAST" --backends mccl --mode in-process,daemon \
          --sizes "${SIZES_A:-16M,64M,256M}" --latency-iters 0 --ceiling-seconds 2 "${COMMON[@]}" )
    done
  fi
  # Are the in-process 256 MB swings at 8 hosts x 10 Gbit/s the emulation's oversubscribed
  # cores? Fewer engine threads per rank (each variant a list of VAR=value, "-" for none),
  # alternating, each run with Gloo as its baseline.
  if want 16; then
    for v in ${THREAD_ORDER:-- MCCL_RECV_THREADS=1 MCCL_SOCKETS_PER_PEER=1,MCCL_RECV_THREADS=1}; do
      n=$(( ${n16:-0} + 1 )); n16=$n
      name=${v//[=,]/_}; [ "$v" = - ] && name=default
      ( [ "$v" = - ] || for kv in ${v//,/ }; do export "$kv"; done
        bench "16-n$H8-threads-$name-r$n" "${THR_LIMIT_S:-80}" --hosts "$H8" --rate "$FAST" --mode in-process \
          --sizes "${SIZES_THR:-64M,256M}" --latency-iters 0 --ceiling-seconds 2 "${COMMON[@]}" ${THR_EXTRA:-} )
    done
  fi
  if want 17 && [[ $MODES == *daemon* ]]; then
    for n in ${SHARED_RUNS:-1 2 3}; do
      bench "17-n$H8-shared-r$n" 150 --hosts "$H8" --rate "$FAST" --mode in-process,daemon,daemon-shared \
        --sizes "$SIZES" --latency-iters 0 --ceiling-seconds 2 "${COMMON[@]}"
      bench "17-n${H_X2}x2-shared-r$n" 100 --hosts "$H_X2" --ranks-per-host 2 --rate "$FAST" \
        --mode in-process,daemon,daemon-shared --backends mccl --sizes "$SIZES_X2" --latency-iters 0 \
        --ceiling-seconds 2 "${COMMON[@]}"
    done
  fi
  if want 18; then
    name=18-scale
    SCALE_DIR=${SCALE_DIR:-docs/results/device-scale-$(date -u +%Y%m%d)}
    limit=$(( $(left) - 20 ))
    status "$name start (limit ${limit}s, per N ${SCALE_LIMITS:-8:55,64:170,200:210})"
    timeout --kill-after=30 "$limit" $PY -m tools.bench scale --hosts "${SCALE_HOSTS:-8,64,200}" \
      --sizes "${SCALE_SIZES:-8,256K,1M,4M,16M,64M,256M}" --ops "${SCALE_OPS:-all_reduce}" --algos "${SCALE_ALGOS:-auto,ring}" \
      --rate 10gbit --delay 30us --dilation "${SCALE_DIL:-8:2,64:64,200:200,256:256}" --machine-gbit "${SCALE_MACHINE_GBIT:-10}" \
      --gloo-hosts "${SCALE_GLOO_HOSTS:-64}" --gloo-sizes "${SCALE_GLOO_SIZES:-256K,1M,4M}" \
      --time-limit "${SCALE_LIMITS:-8:55,64:170,200:210}" --max-op-seconds "${SCALE_MAX_OP_S:-4}" \
      --ceiling-seconds 2 --out-dir "$SCALE_DIR" --json "$RESULTS/$name.json" --log-dir "$RESULTS/$name-logs" \
      > "$RESULTS/$name.txt" 2> "$RESULTS/$name.err"
    status "$name rc=$? (results in $SCALE_DIR)"
    mkdir -p "$OUT/scale" && cp "$SCALE_DIR"/* "$OUT/scale/" 2>/dev/null
    cat "$RESULTS/$name.txt"
    pack
  fi
  want 24 && bench "24-n$H8-compress" 220 --hosts "$H8" --rate "$FAST" --backends mccl --mode "$MODES" --ops all_reduce \
    --sizes "${SIZES_C:-16M,64M,256M}" --compression off,bf16,int8 --latency-iters 0 --target-seconds 0.5
  if want 24; then
    name="24-n$H8-compress-cpu-int8"
    status "$name start"
    timeout --kill-after=20 "$(( $(left) > 120 ? 100 : $(left) - 20 ))" $PY -m tools.bench.threadcpu \
      --delay 15 --json "$RESULTS/$name-threads.json" -- $PY -m tools.bench --json "$RESULTS/$name.json" \
      --hosts "$H8" --rate "$FAST" --mode in-process --backends mccl --sizes 256M --compression int8 --latency-iters 0 \
      --ceiling-seconds 2 --ops all_reduce --target-seconds 3 > "$RESULTS/$name.txt" 2> "$RESULTS/$name.err"
    status "$name rc=$?"
    cat "$RESULTS/$name.txt"
    pack
  fi
  if want 25; then
    LM=(--workload lm --hosts "$H8" --comm-ratio "${SLOW_RATIO:-0.25}")
    bench "25-n$H8-slow-uniform" 120 "${LM[@]}" --variants diloco-h8 --steps "${SLOW_STEPS:-64}" --eval-every 16 \
      --out-dir "$RESULTS/25-n$H8-slow-uniform"
    bench "25-n$H8-slow-diloco" 180 "${LM[@]}" --variants diloco-h8,diloco-h8-adaptive --slow "$((H8 - 2)):2,$((H8 - 1)):2" \
      --steps "${SLOW_STEPS:-64}" --eval-every 16 --out-dir "$RESULTS/25-n$H8-slow-diloco"
    bench "25-n$H8-slow-midrun" 120 "${LM[@]}" --variants balanced --slow "$((H8 - 1)):2@16" --steps 40 --eval-every 20 \
      --out-dir "$RESULTS/25-n$H8-slow-midrun"
  fi
  if want 26; then
    LM=(--workload lm --hosts "$H8" --comm-ratio "${SLOW_RATIO:-0.25}" --steps "${SLOW_STEPS:-64}" --eval-every 16)
    for rep in ${ROUND_REPEATS:-1 2}; do
      bench "26-n$H8-rounds-uniform-r$rep" 100 "${LM[@]}" --variants diloco-h8 --out-dir "$RESULTS/26-n$H8-rounds-uniform-r$rep"
      bench "26-n$H8-rounds-slow-r$rep" 100 "${LM[@]}" --variants diloco-h8-adaptive --slow "$((H8 - 2)):2,$((H8 - 1)):2" \
        --out-dir "$RESULTS/26-n$H8-rounds-slow-r$rep"
    done
  fi
  if want 27; then
    for run in ${LM_RUNS:-1:gloo,off,int8,diloco-h8 2:gloo,int8}; do
      seed=${run%%:*} variants=${run#*:}
      bench "27-n$H8-lm-seed$seed" "${LM_LIMIT_S:-300}" --workload lm --hosts "$H8" --variants "$variants" --seed "$seed" \
        --steps "${LM_STEPS:-128}" --eval-every 16 --warmup-steps 8 --out-dir "$RESULTS/27-n$H8-lm-seed$seed"
    done
  fi
  if want 28; then
    at=$(( ${LM_STEPS:-128} * 2 / 5 ))
    for fault in none leave; do
      extra=()
      [ "$fault" = leave ] && extra=(--leave "$((H8 - 1))@$at")
      bench "28-n$H8-lm-$fault" "${LM_LIMIT_S:-300}" --workload lm --hosts "$H8" --variants off,diloco-h8 \
        --steps "${LM_STEPS:-128}" --eval-every 16 --warmup-steps 8 "${extra[@]}" --out-dir "$RESULTS/28-n$H8-lm-$fault"
    done
  fi
  # Issue 26's hierarchy: 2 switches x 16 hosts, uplinks 2:1 oversubscribed (16 x TOPO_RATE / 2), ranks
  # placed across the switches in turn (what a placement blind to switches gives), 64 MB: the flat
  # ring against the ring in switch order and the tree (docs/topology.md).
  want 22 && bench "22-lightning-n$H8-$FAST" 240 --hosts "$H8" --rate "$FAST" --mode "$MODES" --workload lightning \
    --ddp-variants ddp,shared --ddp-batch "${LIGHTNING_BATCH:-16}" --ddp-steps "${LIGHTNING_STEPS:-10}" \
    --latency-iters 0 --ceiling-seconds 2
  want 19 && bench "19-topo-2x16" 150 --hosts 32 --rate "${TOPO_RATE:-500mbit}" --switches 2 \
    --uplink-rate "${TOPO_UPLINK:-4gbit}" --rank-order interleaved --mode in-process,topology,topology-ring \
    --backends mccl --ops all_reduce --sizes 64M --ceiling-tool none --latency-iters 0 --target-seconds 0.5
  # Issue 26's start-up at scale: INIT_RANKS torch ranks on loopback time init_process_group.
  if want 20; then
    status "20-init start"
    timeout --kill-after=20 "$(( $(left) > 200 ? 180 : $(left) - 20 ))" $PY tools/bench/init_scale.py \
      --ranks "${INIT_RANKS:-200}" --json "$RESULTS/20-init.json" > "$RESULTS/20-init.txt" 2> "$RESULTS/20-init.err"
    status "20-init rc=$?"
    cat "$RESULTS/20-init.txt"; tail -5 "$RESULTS/20-init.err"
    pack
  fi
  # Is the ring's lead over Rabenseifner at 64 hosts its two sockets a neighbour? Both on one socket.
  if want 21; then
    name=21-scale-k1
    status "$name start"
    MCCL_SOCKETS_PER_PEER=1 timeout --kill-after=30 "$(( $(left) > 120 ? 100 : $(left) - 20 ))" $PY -m tools.bench scale \
      --hosts 64 --sizes 1M,4M --ops all_reduce --algos rabenseifner,ring --rate 10gbit --dilation 64:64 \
      --machine-gbit 10 --gloo-hosts 0 --time-limit 64:90 --max-op-seconds 4 --ceiling-seconds 2 \
      --out-dir "$RESULTS/$name" --json "$RESULTS/$name.json" > "$RESULTS/$name.txt" 2> "$RESULTS/$name.err"
    status "$name rc=$?"
    cat "$RESULTS/$name.txt"
    pack
  fi
else
  status "fleet selftest FAILED (see fleet-selftest.txt); falling back to 8 ranks on loopback"
  bench loopback-8 240 --ranks 8 --mode "$MODES" --ops all_reduce --sizes "$SIZES"
fi
if want 7; then
  status "7-solo-ddp start"
  timeout "${SOLO_LIMIT_S:-240}" $PY -m tools.bench.solo_ddp > "$RESULTS/7-solo-ddp.txt" 2>&1; status "7-solo-ddp rc=$?"
  pack
fi

if want 23; then
  status "23-daemon-socks start"
  timeout --kill-after=20 "$(( $(left) > 200 ? 180 : $(left) - 20 ))" $PY -m tools.bench.daemon_sockets \
    --hosts "${SOCK_HOSTS:-8,16,32}" --json "$RESULTS/23-daemon-socks.json" > "$RESULTS/23-daemon-socks.txt" 2>&1
  status "23-daemon-socks rc=$?"
  cat "$RESULTS/23-daemon-socks.txt"
  pack
fi

# Issue 24's wire security: what encrypting every frame costs, each invocation with its own
# ceiling, the security modes alternating so the machine's noise spreads over all of them.
if want 10; then
  for rep in ${WIRE_REPEATS:-1 2 3}; do
    for sec in ${WIRE_MODES:-off aead}; do
      MCCL_WIRE_SECURITY=$sec bench "10-n$H8-$FAST-$sec-r$rep" "${WIRE_LIMIT_S:-150}" --hosts "$H8" --rate "$FAST" \
        --mode "$MODES" --backends mccl --ops all_reduce --sizes "${WIRE_SIZES:-16M,64M,256M}" \
        --latency-iters "${WIRE_LAT_ITERS:-200}" --ceiling-seconds 2 --target-seconds 0.5
    done
  done
  if [ "${WIRE_CPU:-1}" = 1 ]; then
    for sec in ${WIRE_MODES:-off aead}; do
      name="10-n$H8-cpu-$sec"
      status "$name start"
      MCCL_WIRE_SECURITY=$sec timeout --kill-after=20 "$(( $(left) > 120 ? 100 : $(left) - 20 ))" \
        $PY -m tools.bench.threadcpu --delay 10 --json "$RESULTS/$name-threads.json" -- $PY -m tools.bench \
        --json "$RESULTS/$name.json" --hosts "$H8" --rate "$FAST" --mode in-process --backends mccl --sizes 256M \
        --latency-iters 0 --ceiling-seconds 2 --ops all_reduce --target-seconds 3 > "$RESULTS/$name.txt" 2> "$RESULTS/$name.err"
      status "$name rc=$?"
      cat "$RESULTS/$name.txt"
      pack
    done
  fi
fi

# Issue 11's full fault campaign: 1,000 trials per mode, as campaigns side by side (a trial
# mostly waits out timeouts), both modes at once; --max-seconds keeps it inside the budget.
# Failed trials' rank and daemon logs land in campaign-kept/.
if want 9; then
  CS=${CAMPAIGN_SECONDS:-$(( $(left) - 60 ))}
  status "9-campaign start (trials stop starting after ${CS}s)"
  campaign() {  # campaign MODE SHARDS
    timeout --kill-after=30 $(( CS + 90 )) $PY scripts/faults/campaign.py --mode "$1" --shards "$2" \
      --trials "${CAMPAIGN_TRIALS:-1000}" --seed "${CAMPAIGN_SEED:-100000}" --max-seconds "$CS" \
      --keep "$RESULTS/campaign-kept" --json "$RESULTS/9-campaign-$1.json" > "$RESULTS/9-campaign-$1.txt" 2>&1
    status "9-campaign $1 rc=$?"
  }
  campaign inproc "${INPROC_SHARDS:-6}" &
  [[ $MODES == *daemon* ]] && campaign daemon "${DAEMON_SHARDS:-14}" &
  wait
  pack
fi

if $PY -c 'import matplotlib' 2>/dev/null; then
  for f in "$RESULTS"/*.json; do
    [ -s "$f" ] && $PY -m tools.bench plot "$f" "${f%.json}.png" >/dev/null 2>&1
  done
fi
status "done"
pack
