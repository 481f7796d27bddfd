"""packaging/: the macOS LaunchDaemon and the systemd unit run mccld as a service user, never
root, with the settings their install scripts lay out (docs/service.md). The scripts are
syntax-checked and their --dry-run read; none of them is run for real here."""

from __future__ import annotations

import plistlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mccl_common.daemon_settings import DaemonConfig

ROOT = Path(__file__).resolve().parents[2]
PLIST = ROOT / "packaging/macos/com.mccl.mccld.plist"
UNIT = ROOT / "packaging/linux/mccld.service"
SCRIPTS = sorted((ROOT / "packaging").glob("*/*.sh"))
SETTINGS = {f.metadata["env"] for f in DaemonConfig.__dataclass_fields__.values() if "env" in f.metadata}


def _unit() -> dict[str, dict[str, list[str]]]:
    """The unit as section -> key -> values (systemd keys repeat; configparser would merge them)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return sections


def test_plist_is_a_launch_daemon_as_the_service_user():
    p = plistlib.loads(PLIST.read_bytes())
    assert p["Label"] == "com.mccl.mccld" and p["UserName"] == "_mccl" and p["GroupName"] == "_mccl"
    assert p["ProgramArguments"] == ["/usr/local/mccl/venv/bin/python", "-m", "mccld",
                                     "--config", "/etc/mccl/mccld.toml"]
    assert p["RunAtLoad"] is True and p["KeepAlive"] == {"SuccessfulExit": False}
    assert 5 <= p["ThrottleInterval"] <= 60 and p["ExitTimeOut"] == 45
    assert p["ProcessType"] == "Interactive" and p["Umask"] == 0o027
    assert p["StandardOutPath"] == p["StandardErrorPath"] == "/Library/Logs/mccl/mccld.log"
    env = p["EnvironmentVariables"]
    assert env == {"MCCL_RUNTIME_DIR": "/usr/local/var/run/mccl", "MCCL_ATTACH_GROUP": "_mccl",
                   "MCCL_KEY_FILE": "/etc/mccl/fleet.key"}
    assert set(env) <= SETTINGS
    # What the plist names, the installer lays out.
    script = (ROOT / "packaging/macos/install.sh").read_text()
    for path in ("/Library/LaunchDaemons/$LABEL.plist", "PREFIX=/usr/local/mccl", "RUNDIR=/usr/local/var/run/mccl",
                 "LOGDIR=/Library/Logs/mccl", "mccld.toml", "fleet.key"):
        assert path in script, path


def test_unit_runs_mccld_as_the_service_user_hardened():
    unit = _unit()
    svc = unit["Service"]
    assert svc["User"] == ["mccl"] and svc["Group"] == ["mccl"]
    assert "DynamicUser" not in svc and "root" not in svc["User"]
    assert svc["ExecStart"] == ["/opt/mccl/venv/bin/python -m mccld"]
    env = dict(e.split("=", 1) for e in svc["Environment"])
    assert env == {"MCCL_RUNTIME_DIR": "/run/mccl", "MCCL_ATTACH_GROUP": "mccl",
                   "MCCL_KEY_FILE": "/etc/mccl/fleet.key"}
    assert set(env) <= SETTINGS
    assert svc["EnvironmentFile"] == ["-/etc/mccl/mccld.env"]
    assert svc["RuntimeDirectory"] == ["mccl"] and svc["RuntimeDirectoryMode"] == ["0750"]
    assert svc["ReadWritePaths"] == ["/run/mccl"]
    for key, want in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes",
                      "Restart": "on-failure", "TimeoutStopSec": "45", "CapabilityBoundingSet": ""}.items():
        assert svc[key] == [want], key
    assert unit["Unit"]["StartLimitBurst"] and unit["Unit"]["StartLimitIntervalSec"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_both_services_agree_on_the_stop_timeout():
    assert plistlib.loads(PLIST.read_bytes())["ExitTimeOut"] == int(_unit()["Service"]["TimeoutStopSec"][0])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze on this host")
def test_systemd_analyze_verify(tmp_path):
    # verify wants the executable to exist: point it at this interpreter, change nothing else.
    text = UNIT.read_text().replace("/opt/mccl/venv/bin/python", sys.executable)
    (tmp_path / "mccld.service").write_text(text)
    res = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "mccld.service")],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert "mccld.service" not in res.stderr, res.stderr   # warnings about our unit count too


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_parse_and_are_strict(script):
    assert subprocess.run(["bash", "-n", str(script)], timeout=10).returncode == 0
    assert "set -euo pipefail" in script.read_text()


def _dry(script: str, *args: str) -> str:
    res = subprocess.run(["bash", str(ROOT / script), "--dry-run", *args], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _requirements(text: str) -> dict[str, str]:
    import re
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip().strip('",')
        m = re.match(r"^([A-Za-z0-9_.-]+)", line)
        if m:
            out[m.group(1).lower()] = line
    return out


def test_the_service_venv_gets_the_daemons_requirements_and_no_torch():
    """Both installers put MCCL into the service's venv with --no-deps, then
    packaging/daemon-requirements.txt: pyproject's dependencies less torch (mccld never imports it)."""
    import tomllib
    declared = _requirements("\n".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]))
    service = _requirements((ROOT / "packaging/daemon-requirements.txt").read_text())
    assert "torch" in declared and "torch" not in service
    assert {k: v for k, v in declared.items() if k != "torch"}.items() <= service.items()
    for script in ("packaging/linux/install.sh", "packaging/macos/install.sh"):
        text = (ROOT / script).read_text()
        assert 'pip install --quiet --upgrade -r "$HERE/../daemon-requirements.txt"' in text, script
        assert 'pip install --quiet --upgrade --no-deps "$SOURCE"' in text, script
        assert 'pip install --quiet --upgrade "$SOURCE"' not in text, script


@pytest.mark.skipif(sys.platform != "linux", reason="the Linux installer refuses other systems")
def test_linux_install_sets_up_launching_like_the_macos_one():
    options = ("--submit-key", "--launch-user", "--job-python")
    for script in ("packaging/linux/install.sh", "packaging/macos/install.sh"):
        usage = subprocess.run(["bash", str(ROOT / script), "--help"], capture_output=True, text=True,
                               timeout=10).stdout
        assert all(o in usage for o in options), (script, usage)
    out = _dry("packaging/linux/install.sh", "--submit-key", "new", "--job-python", "/srv/train/bin/python")
    if "mccld keygen --kind submit" in out:                       # no submit key on this host yet
        assert ("+ /opt/mccl/venv/bin/python -m mccld keygen --kind submit /etc/mccl/submit.key\n"
                "+ chown mccl:mccl /etc/mccl/submit.key\n+ chmod 0600 /etc/mccl/submit.key") in out
    # Jobs run in units of their own, in mccld's user's own systemd manager: it must keep running.
    assert "+ loginctl enable-linger mccl" in out
    assert ("Environment=MCCL_SUBMIT_KEY_FILE=/etc/mccl/submit.key\n    Environment=MCCL_LAUNCH_USER=mccl\n"
            "    Environment=MCCL_LAUNCH_PYTHON=/srv/train/bin/python") in out
    assert set(re.findall(r"Environment=(MCCL_\w+)=", out)) <= SETTINGS
    # Launching needs an interpreter with torch: the service's venv has none.
    res = subprocess.run(["bash", str(ROOT / "packaging/linux/install.sh"), "--dry-run", "--submit-key", "new"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "--job-python PATH" in res.stderr
    res = subprocess.run(["bash", str(ROOT / "packaging/linux/install.sh"), "--dry-run", "--launch-user", "bob"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "only apply with a submit key" in res.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="the Linux installer refuses other systems")
def test_linux_install_dry_run():
    out = _dry("packaging/linux/install.sh", "--fleet", "studio", "--member", "alice", "--venv", "/srv/v")
    assert "+ usermod --append --groups mccl alice" in out
    assert "+ install -d -m 0750 -o root -g mccl /etc/mccl" in out
    assert "MCCL_FLEET=studio" in out
    assert "ExecStart=/srv/v/bin/python -m mccld" in out          # the drop-in for another venv
    assert out.rstrip().endswith("+ systemctl restart mccld")
    if "mccld keygen" in out:                                     # no key on this host yet
        assert "+ chown mccl:mccl /etc/mccl/fleet.key\n+ chmod 0600 /etc/mccl/fleet.key" in out


def test_macos_install_dry_run():
    out = _dry("packaging/macos/install.sh", "--fleet", "studio", "--member", "alice", "--python", "/opt/py")
    assert "+ dseditgroup -o edit -a alice -t user _mccl" in out
    assert "+ plutil -replace ProgramArguments.0 -string /opt/py /Library/LaunchDaemons/com.mccl.mccld.plist" in out
    assert 'fleet = "studio"' in out
    assert "+ install -m 0600 -o _mccl -g _mccl" in out or "+ chmod 0600 /etc/mccl/fleet.key" in out
    assert out.rstrip().endswith("+ launchctl bootstrap system /Library/LaunchDaemons/com.mccl.mccld.plist")
    if sys.platform != "darwin":   # no dscl: the user is planned with the top free id
        assert "+ dscl . -create /Users/_mccl UniqueID 499" in out and "IsHidden 1" in out


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the refusal off a Mac")
def test_macos_scripts_refuse_other_systems():
    for script in ("install.sh", "uninstall.sh"):
        res = subprocess.run(["bash", str(ROOT / "packaging/macos" / script)], capture_output=True, text=True,
                             timeout=10)
        assert res.returncode == 1 and "runs on macOS only" in res.stderr
