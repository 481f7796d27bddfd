#!/usr/bin/env bash
# Install mccld as a LaunchDaemon running as the hidden service user _mccl (docs/service.md).
# Idempotent: a second run keeps the user, the key file and the settings, and reloads the
# daemon with the new plist and package. --dry-run prints what it would do and changes nothing.
# Written for macOS's own bash 3.2 (no arrays under set -u, no mapfile).
# NOT YET RUN ON A MAC: it was checked with bash -n and its --dry-run on Linux only.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: sudo packaging/macos/install.sh [options]
  --python PATH   use this interpreter (mccld importable, readable by _mccl) instead of
                  installing the package into /usr/local/mccl/venv
  --source DIR    the MCCL source tree to pip-install (default: this checkout)
  --key FILE      copy this fleet key (the one every host of the fleet shares) instead of
                  generating a new one; ignored when /etc/mccl/fleet.key exists
  --fleet NAME    fleet name for a new /etc/mccl/mccld.toml (default: default)
  --member USER   add USER (who runs training) to the group _mccl; repeatable
  --submit-key FILE|new
                  let `mcclctl run` start jobs here: copy this submit key (not the fleet key) to
                  /etc/mccl/submit.key, or generate one with `new` (copy it to the other hosts
                  and to the people who submit jobs); kept when /etc/mccl/submit.key exists
  --launch-user USER
                  MCCL_LAUNCH_USER, who launched jobs run as (default: the service user _mccl, the
                  only user a non-root mccld can start jobs as; they can read its keys)
  --job-python PATH
                  MCCL_LAUNCH_PYTHON: an interpreter with torch and MCCL for launched jobs (the
                  service's venv has no torch); needed with --submit-key unless --python has torch
  --dry-run       print the commands instead of running them (also off a Mac, for review)
USAGE
}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SOURCE=$(cd "$HERE/../.." && pwd)
LABEL=com.mccl.mccld
PLIST=/Library/LaunchDaemons/$LABEL.plist
PREFIX=/usr/local/mccl
RUNDIR=/usr/local/var/run/mccl
LOGDIR=/Library/Logs/mccl
ETC=/etc/mccl
SVC=_mccl
PY=""
KEY=""
FLEET=default
MEMBERS=""
SUBMIT_KEY=""
LAUNCH_USER=""
JOB_PYTHON=""
DRY=0

while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY=${2:?--python needs a path}; shift 2 ;;
    --source) SOURCE=${2:?--source needs a directory}; shift 2 ;;
    --key) KEY=${2:?--key needs a file}; shift 2 ;;
    --fleet) FLEET=${2:?--fleet needs a name}; shift 2 ;;
    --member) MEMBERS="$MEMBERS ${2:?--member needs a user}"; shift 2 ;;
    --submit-key) SUBMIT_KEY=${2:?--submit-key needs a file or new}; shift 2 ;;
    --launch-user) LAUNCH_USER=${2:?--launch-user needs a user}; shift 2 ;;
    --job-python) JOB_PYTHON=${2:?--job-python needs a path}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done

if [ "$(uname -s)" != Darwin ] && [ $DRY -eq 0 ]; then
  echo "install.sh: this installs a macOS LaunchDaemon and runs on macOS only; on Linux use packaging/linux/install.sh" >&2
  exit 1
fi
if [ $DRY -eq 0 ] && [ "$(id -u)" -ne 0 ]; then
  echo "install.sh: run it as root (sudo); it creates a system user and writes /Library and /etc" >&2
  exit 1
fi
if [[ ! "$FLEET" =~ ^[A-Za-z0-9._-]+$ ]]; then
  echo "install.sh: --fleet $FLEET: use letters, digits, '-', '_' or '.'" >&2
  exit 2
fi

LAUNCH=0
if [ -n "$SUBMIT_KEY" ] || [ -e "$ETC/submit.key" ]; then
  LAUNCH=1
fi
if [ $LAUNCH -eq 0 ] && { [ -n "$LAUNCH_USER" ] || [ -n "$JOB_PYTHON" ]; }; then
  echo "install.sh: --launch-user and --job-python only apply with a submit key (--submit-key FILE|new)" >&2
  exit 2
fi
if [ $LAUNCH -eq 1 ] && [ -z "$JOB_PYTHON" ] && [ -z "$PY" ]; then
  echo "install.sh: jobs need an interpreter with torch and MCCL, and the service's venv has none:" \
       "pass --job-python PATH (or --python PATH, one with torch)" >&2
  exit 2
fi
LAUNCH_USER=${LAUNCH_USER:-$SVC}

run() {
  if [ $DRY -eq 1 ]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

put() {
  local path=$1 mode=$2 owner=$3 tmp
  if [ $DRY -eq 1 ]; then
    printf '+ write %q (mode %s, %s):\n' "$path" "$mode" "$owner"
    sed 's/^/    /'
    return
  fi
  tmp=$(mktemp "$path.XXXXXX")
  cat >"$tmp"
  chown "$owner" "$tmp"
  chmod "$mode" "$tmp"
  mv -f "$tmp" "$path"
}

have_record() {  # have_record Users|Groups NAME
  [ $DRY -eq 0 ] || command -v dscl >/dev/null || return 1
  dscl . -read "/$1/$2" >/dev/null 2>&1
}

# An id below 500 (macOS's service accounts; login users start at 501) that is neither a
# uid nor a gid yet, so the user and its group can share it. Counts down from 499: Apple's
# own accounts sit at the bottom of the range.
free_id() {
  local used id
  if ! command -v dscl >/dev/null; then
    echo 499   # --dry-run off a Mac: nothing to ask
    return
  fi
  used=$( (dscl . -list /Users UniqueID; dscl . -list /Groups PrimaryGroupID) | awk '{print $2}')
  for ((id = 499; id >= 300; id--)); do
    if ! printf '%s\n' "$used" | grep -qx "$id"; then
      echo "$id"
      return
    fi
  done
  echo "install.sh: no free id between 300 and 499 for $SVC" >&2
  exit 1
}

# 1. The service user and group: hidden, no login shell, no home, no password.
if have_record Groups "$SVC"; then
  GID=$(dscl . -read "/Groups/$SVC" PrimaryGroupID | awk '{print $2}')
else
  GID=$(free_id)
  run dscl . -create "/Groups/$SVC"
  run dscl . -create "/Groups/$SVC" PrimaryGroupID "$GID"
  run dscl . -create "/Groups/$SVC" RealName "MCCL daemon"
  run dscl . -create "/Groups/$SVC" Password '*'
fi
if ! have_record Users "$SVC"; then
  SVC_UID=$GID
  if command -v dscl >/dev/null && dscl . -list /Users UniqueID | awk '{print $2}' | grep -qx "$GID"; then
    SVC_UID=$(free_id)
  fi
  run dscl . -create "/Users/$SVC"
  run dscl . -create "/Users/$SVC" UniqueID "$SVC_UID"
  run dscl . -create "/Users/$SVC" PrimaryGroupID "$GID"
  run dscl . -create "/Users/$SVC" UserShell /usr/bin/false
  run dscl . -create "/Users/$SVC" NFSHomeDirectory /var/empty
  run dscl . -create "/Users/$SVC" RealName "MCCL daemon"
  run dscl . -create "/Users/$SVC" Password '*'
  run dscl . -create "/Users/$SVC" IsHidden 1
fi
for m in $MEMBERS; do
  run dseditgroup -o edit -a "$m" -t user "$SVC"
done

# 2. The package, owned by root so the service user cannot alter its code. No torch in its venv:
# mccld never imports torch (--no-deps, then the daemon's own requirements).
if [ -n "$PY" ]; then
  if [ $DRY -eq 0 ] && ! sudo -u "$SVC" "$PY" -c 'import mccld' 2>/dev/null; then
    echo "install.sh: $SVC cannot run $PY -c 'import mccld'; install MCCL there and make it readable by $SVC" >&2
    exit 1
  fi
else
  PY=$PREFIX/venv/bin/python
  run install -d -m 0755 -o root -g wheel "$PREFIX"
  if [ ! -x "$PY" ]; then
    run /usr/bin/python3 -m venv "$PREFIX/venv"
  fi
  run "$PY" -m pip install --quiet --upgrade -r "$HERE/../daemon-requirements.txt"
  run "$PY" -m pip install --quiet --upgrade --no-deps "$SOURCE"
fi

# 3. Directories. The runtime dir lives outside /var/run: macOS empties that at boot and
# only root may create in it. mccld itself sets its final mode (0750, group _mccl).
run install -d -m 0755 -o root -g wheel /usr/local/var /usr/local/var/run
run install -d -m 0750 -o "$SVC" -g "$SVC" "$RUNDIR"
run install -d -m 0750 -o "$SVC" -g admin "$LOGDIR"
run install -d -m 0750 -o root -g "$SVC" "$ETC"

# 4. The fleet key, readable by _mccl alone (mccld refuses one others can read), and settings.
if [ ! -e "$ETC/fleet.key" ]; then
  if [ -n "$KEY" ]; then
    run install -m 0600 -o "$SVC" -g "$SVC" "$KEY" "$ETC/fleet.key"
  else
    run "$PY" -m mccld keygen --kind fleet "$ETC/fleet.key"
    run chown "$SVC:$SVC" "$ETC/fleet.key"
    run chmod 0600 "$ETC/fleet.key"
    echo "install.sh: generated a new fleet key $ETC/fleet.key; copy it to every other host (--key FILE)" >&2
  fi
fi
# The submit key: `mcclctl run` proves it to start jobs here (not the fleet key).
if [ $LAUNCH -eq 1 ] && [ ! -e "$ETC/submit.key" ]; then
  if [ "$SUBMIT_KEY" = new ]; then
    run "$PY" -m mccld keygen --kind submit "$ETC/submit.key"
    run chown "$SVC:$SVC" "$ETC/submit.key"
    run chmod 0600 "$ETC/submit.key"
    echo "install.sh: generated a new submit key $ETC/submit.key; copy it to the other hosts that take jobs" \
         "(--submit-key FILE) and to the people who submit them" >&2
  else
    run install -m 0600 -o "$SVC" -g "$SVC" "$SUBMIT_KEY" "$ETC/submit.key"
  fi
fi
if [ ! -e "$ETC/mccld.toml" ]; then
  put "$ETC/mccld.toml" 0640 "root:$SVC" <<TOML
# mccld settings: keys are DaemonConfig field names (README's settings table); MCCL_*
# variables in the plist win. runtime_dir, attach_group and key_file are set there.
# Apply a change: sudo launchctl kickstart -k system/$LABEL
fleet = "$FLEET"
# iface = "en0"
TOML
fi

# 5. The LaunchDaemon: launchd wants it root:wheel 0644. bootout first, so a rerun loads
# the new plist instead of failing on the loaded one.
run install -m 0644 -o root -g wheel "$HERE/$LABEL.plist" "$PLIST"
if [ "$PY" != "$PREFIX/venv/bin/python" ]; then
  run plutil -replace ProgramArguments.0 -string "$PY" "$PLIST"
fi
# Launching: who jobs run as and in which interpreter (launchd runs mccld unsandboxed: jobs are
# its children and write where their user may).
if [ $LAUNCH -eq 1 ]; then
  run plutil -replace EnvironmentVariables.MCCL_SUBMIT_KEY_FILE -string "$ETC/submit.key" "$PLIST"
  run plutil -replace EnvironmentVariables.MCCL_LAUNCH_USER -string "$LAUNCH_USER" "$PLIST"
  if [ -n "$JOB_PYTHON" ]; then
    run plutil -replace EnvironmentVariables.MCCL_LAUNCH_PYTHON -string "$JOB_PYTHON" "$PLIST"
  fi
fi
run plutil -lint "$PLIST"
if [ $DRY -eq 1 ] || launchctl print "system/$LABEL" >/dev/null 2>&1; then
  run launchctl bootout "system/$LABEL" || true
fi
run launchctl enable "system/$LABEL"
run launchctl bootstrap system "$PLIST"
echo "install.sh: done. Check: sudo launchctl print system/$LABEL; tail $LOGDIR/mccld.log; mcclctl status" >&2
if [ $LAUNCH -eq 1 ]; then
  echo "install.sh: \`mcclctl run\` jobs start here as $LAUNCH_USER; their working directory must be writable by it" >&2
else
  echo "install.sh: no submit key: this host takes no \`mcclctl run\` jobs (--submit-key FILE|new to allow it)" >&2
fi
if [ -n "$MEMBERS" ]; then
  echo "install.sh:$MEMBERS must log out and in again for the group $SVC to take effect" >&2
fi
