#!/usr/bin/env bash
# Removes anything a crashed test run may have left: MCCL processes, test namespaces and
# shared-memory segments, CPU-cap cgroups. Only touches names MCCL itself creates.
set -u
for pid in $(pgrep -f 'mccld|tools.bench|mccl_fleet' 2>/dev/null); do
  [ "$pid" != "$$" ] && kill -9 "$pid" 2>/dev/null
done
if command -v ip >/dev/null; then
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^mccl'); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
  for br in $(ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}' | grep '^mccl'); do
    ip link del "$br" 2>/dev/null
  done
fi
rm -f /dev/shm/mccl* 2>/dev/null
# CPU caps of emulated hosts (tools/cpucap.py): empty once their processes are gone.
for g in /sys/fs/cgroup/mccl-bench-* /sys/fs/cgroup/cpu/mccl-bench-* /sys/fs/cgroup/cpu,cpuacct/mccl-bench-*; do
  [ -d "$g" ] && rmdir "$g" 2>/dev/null
done
exit 0
