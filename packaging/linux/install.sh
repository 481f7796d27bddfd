#!/usr/bin/env bash
# Install mccld as a systemd service running as the system user `mccl` (docs/service.md).
# Idempotent: a second run keeps the user, the key file and the env file, and refreshes
# the unit and the package. --dry-run prints what it would do and changes nothing.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: sudo packaging/linux/install.sh [options]
  --venv DIR      use this existing virtualenv (mccld importable in it) instead of
                  installing the package into /opt/mccl/venv
  --source DIR    the MCCL source tree to pip-install into /opt/mccl/venv (default: this checkout)
  --key FILE      copy this fleet key (the one every host of the fleet shares) instead of
                  generating a new one; ignored when /etc/mccl/fleet.key exists
  --fleet NAME    MCCL_FLEET for a new /etc/mccl/mccld.env (default: default)
  --member USER   add USER (who runs training) to the group mccl; repeatable
  --submit-key FILE|new
                  let `mcclctl run` start jobs here: copy this submit key (not the fleet key) to
                  /etc/mccl/submit.key, or generate one with `new` (copy it to the other hosts
                  and to the people who submit jobs); kept when /etc/mccl/submit.key exists
  --launch-user USER
                  MCCL_LAUNCH_USER, who launched jobs run as (default: the service user mccl, the
                  only user a non-root mccld can start jobs as; they can read its keys)
  --job-python PATH
                  MCCL_LAUNCH_PYTHON: an interpreter with torch and MCCL for launched jobs (the
                  service's venv has no torch); needed with --submit-key unless --venv has torch
  --no-start      install and enable, but do not start now
  --dry-run       print the commands instead of running them
USAGE
}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SOURCE=$(cd "$HERE/../.." && pwd)
PREFIX=/opt/mccl
ETC=/etc/mccl
UNIT=/etc/systemd/system/mccld.service
DROPIN=/etc/systemd/system/mccld.service.d
SVC_USER=mccl
VENV=""
KEY=""
FLEET=default
MEMBERS=()
SUBMIT_KEY=""
LAUNCH_USER=""
JOB_PYTHON=""
START=1
DRY=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --venv) VENV=${2:?--venv needs a directory}; shift 2 ;;
    --source) SOURCE=${2:?--source needs a directory}; shift 2 ;;
    --key) KEY=${2:?--key needs a file}; shift 2 ;;
    --fleet) FLEET=${2:?--fleet needs a name}; shift 2 ;;
    --member) MEMBERS+=("${2:?--member needs a user}"); shift 2 ;;
    --submit-key) SUBMIT_KEY=${2:?--submit-key needs a file or new}; shift 2 ;;
    --launch-user) LAUNCH_USER=${2:?--launch-user needs a user}; shift 2 ;;
    --job-python) JOB_PYTHON=${2:?--job-python needs a path}; shift 2 ;;
    --no-start) START=0; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done

if [[ "$(uname -s)" != Linux ]]; then
  echo "install.sh: this installs a systemd unit and runs on Linux only; on macOS use packaging/macos/install.sh" >&2
  exit 1
fi
if [[ $DRY -eq 0 && $(id -u) -ne 0 ]]; then
  echo "install.sh: run it as root (sudo); it creates a system user and writes /etc and /opt" >&2
  exit 1
fi
if [[ $DRY -eq 0 ]] && ! command -v systemctl >/dev/null; then
  echo "install.sh: systemctl not found; this host does not run systemd" >&2
  exit 1
fi
if [[ ! "$FLEET" =~ ^[A-Za-z0-9._-]+$ ]]; then
  echo "install.sh: --fleet $FLEET: use letters, digits, '-', '_' or '.'" >&2
  exit 2
fi

LAUNCH=0
if [[ -n "$SUBMIT_KEY" || -e "$ETC/submit.key" ]]; then
  LAUNCH=1
fi
if [[ $LAUNCH -eq 0 && ( -n "$LAUNCH_USER" || -n "$JOB_PYTHON" ) ]]; then
  echo "install.sh: --launch-user and --job-python only apply with a submit key (--submit-key FILE|new)" >&2
  exit 2
fi
if [[ $LAUNCH -eq 1 && -z "$JOB_PYTHON" && -z "$VENV" ]]; then
  echo "install.sh: jobs need an interpreter with torch and MCCL, and the service's venv has none:" \
       "pass --job-python PATH (or --venv DIR, a venv with torch)" >&2
  exit 2
fi
LAUNCH_USER=${LAUNCH_USER:-$SVC_USER}

run() {
  if [[ $DRY -eq 1 ]]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

# Writes stdin to PATH with MODE and OWNER:GROUP, atomically (never a half-written unit).
put() {
  local path=$1 mode=$2 owner=$3 tmp
  if [[ $DRY -eq 1 ]]; then
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

# 1. The service user and group: a system account with no home and no login shell.
if ! getent group "$SVC_USER" >/dev/null; then
  run groupadd --system "$SVC_USER"
fi
if ! getent passwd "$SVC_USER" >/dev/null; then
  run useradd --system --gid "$SVC_USER" --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin --comment "MCCL daemon" "$SVC_USER"
fi
for m in ${MEMBERS[@]+"${MEMBERS[@]}"}; do
  run usermod --append --groups "$SVC_USER" "$m"
done

# 2. The package: a venv of its own, owned by root so the service user cannot alter its code.
# No torch in it: mccld never imports torch (--no-deps, then the daemon's own requirements).
if [[ -n "$VENV" ]]; then
  PY="$VENV/bin/python"
  if [[ $DRY -eq 0 ]] && ! "$PY" -c 'import mccld' 2>/dev/null; then
    echo "install.sh: $PY cannot import mccld; install MCCL into that venv first" >&2
    exit 1
  fi
else
  PY="$PREFIX/venv/bin/python"
  run install -d -m 0755 -o root -g root "$PREFIX"
  if [[ ! -x "$PY" ]]; then
    run python3 -m venv "$PREFIX/venv"
  fi
  run "$PY" -m pip install --quiet --upgrade -r "$HERE/../daemon-requirements.txt"
  run "$PY" -m pip install --quiet --upgrade --no-deps "$SOURCE"
fi
run install -d -m 0755 -o root -g root "$PREFIX/doc"
run install -m 0644 -o root -g root "$SOURCE/docs/service.md" "$PREFIX/doc/service.md"

# 3. Settings and the fleet key. /etc/mccl is 0750 root:mccl: the daemon can enter it, the
# key inside stays readable by mccl alone (mccld refuses a key file others can read).
run install -d -m 0750 -o root -g "$SVC_USER" "$ETC"
if [[ ! -e "$ETC/fleet.key" ]]; then
  if [[ -n "$KEY" ]]; then
    run install -m 0600 -o "$SVC_USER" -g "$SVC_USER" "$KEY" "$ETC/fleet.key"
  else
    run "$PY" -m mccld keygen --kind fleet "$ETC/fleet.key"
    run chown "$SVC_USER:$SVC_USER" "$ETC/fleet.key"
    run chmod 0600 "$ETC/fleet.key"
    echo "install.sh: generated a new fleet key $ETC/fleet.key; copy it to every other host (--key FILE)" >&2
  fi
fi
# The submit key: `mcclctl run` proves it to start jobs here (not the fleet key).
if [[ $LAUNCH -eq 1 && ! -e "$ETC/submit.key" ]]; then
  if [[ "$SUBMIT_KEY" == new ]]; then
    run "$PY" -m mccld keygen --kind submit "$ETC/submit.key"
    run chown "$SVC_USER:$SVC_USER" "$ETC/submit.key"
    run chmod 0600 "$ETC/submit.key"
    echo "install.sh: generated a new submit key $ETC/submit.key; copy it to the other hosts that take jobs" \
         "(--submit-key FILE) and to the people who submit them" >&2
  else
    run install -m 0600 -o "$SVC_USER" -g "$SVC_USER" "$SUBMIT_KEY" "$ETC/submit.key"
  fi
fi
if [[ ! -e "$ETC/mccld.env" ]]; then
  put "$ETC/mccld.env" 0640 "root:$SVC_USER" <<ENV
# MCCL_* settings of mccld (README's settings table). MCCL_RUNTIME_DIR, MCCL_ATTACH_GROUP
# and MCCL_KEY_FILE are set by the unit. Apply a change: systemctl restart mccld
MCCL_FLEET=$FLEET
#MCCL_IFACE=eth0
ENV
fi

# 4. The unit, and a drop-in when the interpreter is not the unit's default one.
run install -m 0644 -o root -g root "$HERE/mccld.service" "$UNIT"
if [[ "$PY" != "$PREFIX/venv/bin/python" ]]; then
  run install -d -m 0755 -o root -g root "$DROPIN"
  put "$DROPIN/python.conf" 0644 root:root <<CONF
[Service]
ExecStart=
ExecStart=$PY -m mccld
CONF
elif [[ -e "$DROPIN/python.conf" ]]; then
  run rm -f "$DROPIN/python.conf"
fi
# Launching: who jobs run as and in which interpreter. Each job runs as a transient unit of its
# own (mccld/host/job_unit.py), outside this unit's sandbox, so it can write its working
# directory; a non-root mccld starts them in its user's own systemd manager, which lingering
# keeps running without a login.
if [[ $LAUNCH -eq 1 ]]; then
  run loginctl enable-linger "$SVC_USER"
  run install -d -m 0755 -o root -g root "$DROPIN"
  put "$DROPIN/launch.conf" 0644 root:root <<CONF
[Service]
Environment=MCCL_SUBMIT_KEY_FILE=$ETC/submit.key
Environment=MCCL_LAUNCH_USER=$LAUNCH_USER
${JOB_PYTHON:+Environment=MCCL_LAUNCH_PYTHON=$JOB_PYTHON}
CONF
elif [[ -e "$DROPIN/launch.conf" ]]; then
  run rm -f "$DROPIN/launch.conf"
fi
run systemctl daemon-reload
run systemctl enable mccld
if [[ $START -eq 1 ]]; then
  # restart, not start: on an upgrade the running daemon must pick up the new code and unit.
  run systemctl restart mccld
fi
echo "install.sh: done. Check: systemctl status mccld; journalctl -u mccld; mcclctl status" >&2
if [[ $LAUNCH -eq 1 ]]; then
  echo "install.sh: \`mcclctl run\` jobs start here as $LAUNCH_USER, each in a unit of its own; their" \
       "working directory must be writable by $LAUNCH_USER" >&2
else
  echo "install.sh: no submit key: this host takes no \`mcclctl run\` jobs (--submit-key FILE|new to allow it)" >&2
fi
if [[ ${#MEMBERS[@]} -gt 0 ]]; then
  echo "install.sh: ${MEMBERS[*]} must log in again for the group mccl to take effect" >&2
fi
