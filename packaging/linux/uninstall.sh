#!/usr/bin/env bash
# Remove the mccld systemd service (docs/service.md). Keeps the fleet key, the settings,
# the venv and the user unless --purge: a reinstall then rejoins the fleet with the same key.
set -euo pipefail

PURGE=0
DRY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --purge) PURGE=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) echo "usage: sudo packaging/linux/uninstall.sh [--purge] [--dry-run]"; exit 0 ;;
    *) echo "uninstall.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
if [[ "$(uname -s)" != Linux ]]; then
  echo "uninstall.sh: this removes a systemd unit and runs on Linux only; on macOS use packaging/macos/uninstall.sh" >&2
  exit 1
fi
if [[ $DRY -eq 0 && $(id -u) -ne 0 ]]; then
  echo "uninstall.sh: run it as root (sudo)" >&2
  exit 1
fi

run() {
  if [[ $DRY -eq 1 ]]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

if [[ -e /etc/systemd/system/mccld.service ]]; then
  # SIGTERM: running jobs fail with a clear error and the daemon frees their memory.
  run systemctl disable --now mccld
  run rm -f /etc/systemd/system/mccld.service
fi
run rm -rf /etc/systemd/system/mccld.service.d
run systemctl daemon-reload
if [[ $PURGE -eq 1 ]]; then
  run rm -rf /etc/mccl /opt/mccl
  if getent passwd mccl >/dev/null; then
    run userdel mccl
  fi
  if getent group mccl >/dev/null; then
    run groupdel mccl
  fi
else
  echo "uninstall.sh: kept /etc/mccl (fleet key, settings), /opt/mccl and the user mccl; --purge removes them" >&2
fi
