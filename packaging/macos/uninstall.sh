#!/usr/bin/env bash
# Remove the mccld LaunchDaemon (docs/service.md). Keeps the fleet key, the settings, the
# venv, the logs and the user _mccl unless --purge: a reinstall then rejoins the fleet with
# the same key. NOT YET RUN ON A MAC: checked with bash -n and its --dry-run on Linux only.
set -euo pipefail

PURGE=0
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --purge) PURGE=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) echo "usage: sudo packaging/macos/uninstall.sh [--purge] [--dry-run]"; exit 0 ;;
    *) echo "uninstall.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
if [ "$(uname -s)" != Darwin ] && [ $DRY -eq 0 ]; then
  echo "uninstall.sh: this removes a macOS LaunchDaemon and runs on macOS only; on Linux use packaging/linux/uninstall.sh" >&2
  exit 1
fi
if [ $DRY -eq 0 ] && [ "$(id -u)" -ne 0 ]; then
  echo "uninstall.sh: run it as root (sudo)" >&2
  exit 1
fi

run() {
  if [ $DRY -eq 1 ]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

LABEL=com.mccl.mccld
# bootout sends SIGTERM: running jobs fail with a clear error and the daemon frees their memory.
if [ $DRY -eq 1 ] || launchctl print "system/$LABEL" >/dev/null 2>&1; then
  run launchctl bootout "system/$LABEL"
fi
run rm -f "/Library/LaunchDaemons/$LABEL.plist"
run rm -rf /usr/local/var/run/mccl
if [ $PURGE -eq 1 ]; then
  run rm -rf /etc/mccl /usr/local/mccl /Library/Logs/mccl
  if [ $DRY -eq 1 ] || dscl . -read /Users/_mccl >/dev/null 2>&1; then
    run dscl . -delete /Users/_mccl
  fi
  if [ $DRY -eq 1 ] || dscl . -read /Groups/_mccl >/dev/null 2>&1; then
    run dscl . -delete /Groups/_mccl
  fi
else
  echo "uninstall.sh: kept /etc/mccl (fleet key, settings), /usr/local/mccl, the logs and the user _mccl; --purge removes them" >&2
fi
