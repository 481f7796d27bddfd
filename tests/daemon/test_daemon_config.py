"""mccld settings: key file permissions, TOML + environment, interface choice, runtime dir."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mccl_common.errors import ConfigError
from mccl_common.settings import ALL_SETTINGS, markdown_table

from mccl_common import netif
from mccl_common.daemon_settings import DaemonConfig, load_config, read_key_file, runtime_dir, write_key_file


@pytest.mark.timeout(10)
def test_every_field_is_a_registered_setting():
    assert DaemonConfig in ALL_SETTINGS
    table = markdown_table()
    for env in ("MCCL_FLEET", "MCCL_FLEET_KEY", "MCCL_KEY_FILE", "MCCL_IFACE", "MCCL_LISTEN_ADDR", "MCCL_PORT",
                "MCCL_STATUS_PORT", "MCCL_METRICS_PORT", "MCCL_METRICS_ADDR", "MCCL_RUNTIME_DIR",
                "MCCL_ALLOW_WIFI", "MCCL_MDNS_TTL"):
        assert f"`{env}`" in table
    cfg = load_config(env={})
    assert (cfg.port, cfg.status_port, cfg.metrics_port, cfg.metrics_addr) == (29650, 29651, 29652, "")


@pytest.mark.timeout(10)
def test_key_file_must_be_private(tmp_path):
    key = write_key_file(str(tmp_path / "fleet.key"))
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    cfg = load_config(env={"MCCL_KEY_FILE": str(key)})
    assert len(cfg.read_key()) == 32        # keygen writes 32 random bytes as hex
    os.chmod(key, 0o644)
    with pytest.raises(ConfigError, match="mode 0644.*chmod 600"):
        cfg.read_key()
    with pytest.raises(ConfigError, match="does not exist.*mccld keygen"):
        load_config(env={"MCCL_KEY_FILE": str(tmp_path / "missing")}).read_key()
    with pytest.raises(FileExistsError):
        write_key_file(str(key))  # never overwrite a fleet key


@pytest.mark.timeout(30)
def test_a_key_file_this_user_may_not_read_is_skipped_or_named():
    """A user outside the service's group running mcclctl: /etc/mccl (0750) holds a key it may
    not read. The next default is used; with none, a ConfigError says what to do (it used to
    be an uncaught PermissionError)."""
    import shutil
    import tempfile
    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another user")
    nobody = 65534
    top = tempfile.mkdtemp(prefix="mccl-keyperm-")
    try:
        os.chmod(top, 0o755)
        service = os.path.join(top, "etc-mccl")
        os.mkdir(service, 0o750)          # root:root 0750: nobody may not look inside
        denied = write_key_file(os.path.join(service, "fleet.key"))
        home = os.path.join(top, "home")
        os.mkdir(home, 0o700)
        own = write_key_file(os.path.join(home, "fleet.key"))
        os.chown(home, nobody, -1)
        os.chown(own, nobody, -1)

        def read(*args: str) -> str:
            # A forked child, not a new interpreter: this one lives under /root, which
            # nobody may not enter.
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                try:
                    os.close(r)
                    os.setgid(nobody)
                    os.setuid(nobody)
                    try:
                        key = read_key_file(args[0], tuple(args[1:]), "MCCL_KEY_FILE")
                        out = f"key {len(key) if key else None}"
                    except ConfigError as e:
                        out = f"ConfigError {e}"
                    os.write(w, out.encode())
                finally:
                    os._exit(0)
            os.close(w)
            try:
                with os.fdopen(r, "rb") as f:
                    out = f.read().decode()
            finally:
                _, status = os.waitpid(pid, 0)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
            return out

        assert read("", str(denied), str(own)) == "key 32"
        out = read("", str(denied))
        assert out.startswith("ConfigError") and str(denied) in out and "MCCL_KEY_FILE" in out, out
        out = read(str(denied))
        assert out.startswith("ConfigError") and "cannot be read by this user" in out, out
        assert read("", os.path.join(home, "missing")) == "key None"
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.timeout(10)
def test_toml_then_environment(tmp_path):
    conf = tmp_path / "mccld.toml"
    conf.write_text('fleet = "lab"\nport = 30000\nallow_wifi = true\n')
    cfg = load_config(str(conf), env={"MCCL_PORT": "30001"})
    assert (cfg.fleet, cfg.port, cfg.allow_wifi) == ("lab", 30001, True)
    conf.write_text('flete = "typo"\n')
    with pytest.raises(ConfigError, match="unknown key.*flete"):
        load_config(str(conf), env={})
    conf.write_text("fleet = [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(conf), env={})
    with pytest.raises(ConfigError, match="MCCL_PORT"):
        load_config(env={"MCCL_PORT": "70000"})
    with pytest.raises(ConfigError, match="MCCL_FLEET"):
        load_config(env={"MCCL_FLEET": "bad name!"})


@pytest.mark.timeout(10)
def test_wifi_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(netif, "is_wireless", lambda name: name == "wlan0")
    monkeypatch.setattr(netif, "ipv4_of", lambda name: {"wlan0": "10.1.1.5", "eth0": "10.2.2.2"}.get(name))
    with pytest.raises(ConfigError, match="Wi-Fi interface.*MCCL_ALLOW_WIFI=1"):
        netif.choose_address("wlan0", "", allow_wifi=False)
    assert netif.choose_address("wlan0", "", allow_wifi=True) == ("wlan0", "10.1.1.5")
    monkeypatch.setattr(netif, "_candidates", lambda: ["wlan0"])
    with pytest.raises(ConfigError, match="skipped Wi-Fi: wlan0"):
        netif.choose_address("", "", allow_wifi=False)
    monkeypatch.setattr(netif, "_candidates", lambda: ["wlan0", "eth0"])
    assert netif.choose_address("", "", allow_wifi=False) == ("eth0", "10.2.2.2")
    with pytest.raises(ConfigError, match="not an IPv4 address"):
        netif.choose_address("", "not-an-ip", allow_wifi=False)


@pytest.mark.timeout(10)
def test_runtime_dir_is_private(tmp_path):
    target = tmp_path / "rt"
    target.mkdir(mode=0o755)
    path = runtime_dir(load_config(env={"MCCL_RUNTIME_DIR": str(target)}), create=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


@pytest.mark.timeout(60)
def test_cli_status_and_keygen(tmp_path):
    import subprocess
    import sys
    env = {**os.environ, "MCCL_RUNTIME_DIR": str(tmp_path / "rt")}
    res = subprocess.run([sys.executable, "-m", "mccld", "status"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 1 and "is mccld running" in res.stderr
    res = subprocess.run([sys.executable, "-m", "mccld", "keygen", str(tmp_path / "k")], env=env,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600
    assert res.stdout.startswith(f"wrote fleet key {tmp_path / 'k'} ")
    # keygen says which key it wrote, from --kind or the file's name, and never prints the key.
    for args, kind, var in ((["--kind", "submit", str(tmp_path / "a")], "submit", "MCCL_SUBMIT_KEY_FILE"),
                            ([str(tmp_path / "submit.key")], "submit", "MCCL_SUBMIT_KEY_FILE"),
                            (["--kind", "job", str(tmp_path / "j")], "job", "MCCL_JOB_KEY_FILE")):
        res = subprocess.run([sys.executable, "-m", "mccld", "keygen", *args], env=env, capture_output=True,
                             text=True, timeout=30)
        written = Path(args[-1]).read_text().strip()
        assert res.returncode == 0 and res.stdout.startswith(f"wrote {kind} key {args[-1]} "), res.stdout
        assert var in res.stdout and written not in res.stdout + res.stderr
    res = subprocess.run([sys.executable, "-m", "mccld"], env={**env, "MCCL_KEY_FILE": str(tmp_path / "nokey")},
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "does not exist" in res.stderr
