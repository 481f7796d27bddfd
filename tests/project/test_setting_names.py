"""No MCCL_* name is ignored without a word (issue 36): a name no setting declares, in the
environment, is warned about once per process with the closest registered name; an unknown
key of mccld.toml is an error naming the key it most likely means. The names that are not
settings and yet belong in an environment (set by mccld for its jobs, read by tools and
tests) are listed in mccl_common.setting_names.OTHER_NAMES, and every name the code, tools and
tests read or set is one or the other."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mccl_common import setting_names, settings
from mccl_common.daemon_settings import load_config
from mccl_common.errors import ConfigError
from mccl_common.launch_protocol import RESERVED_ENV
from mccl_common.settings import EngineConfig, load

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh(monkeypatch):
    """Nothing warned yet in this process, as at a process's start."""
    monkeypatch.setattr(setting_names, "_warned", set())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == setting_names.__name__ and r.levelno == logging.WARNING]


@pytest.mark.timeout(10)
def test_a_mistyped_name_warns_once_naming_the_setting_it_resembles(fresh, caplog):
    env = {"MCCL_DEAMON": "1", "MCCL_SOCKET_PER_PEER": "8", "MCCL_NO_SUCH_THING_AT_ALL": "1"}
    with caplog.at_level(logging.WARNING, logger=setting_names.__name__):
        setting_names.warn_unknown(env)
        setting_names.warn_unknown(env)   # once per process, not at every call
        cfg = load(EngineConfig, env=env)
    assert cfg.daemon is False and cfg.sockets_per_peer == EngineConfig().sockets_per_peer
    got = _warnings(caplog)
    assert len(got) == 3, got
    deamon, nothing, socket = got       # in name order
    assert "MCCL_DEAMON" in deamon and "did you mean MCCL_DAEMON?" in deamon
    assert "did you mean MCCL_SOCKETS_PER_PEER?" in socket
    assert "MCCL_NO_SUCH_THING_AT_ALL" in nothing and "did you mean" not in nothing


@pytest.mark.timeout(10)
def test_settings_and_the_names_mccld_and_the_tools_set_do_not_warn(fresh, caplog):
    env = {name: "1" for name in setting_names.registered_names() | set(setting_names.OTHER_NAMES) | set(RESERVED_ENV)}
    env["MCCL_DAEMON"] = "0"
    with caplog.at_level(logging.WARNING, logger=setting_names.__name__):
        assert setting_names.warn_unknown(env) == []
    assert _warnings(caplog) == []


@pytest.mark.timeout(120)
def test_a_job_started_with_MCCL_DEAMON_prints_a_warning_naming_MCCL_DAEMON(tmp_path):
    """What the user sees: a one-rank process group with the typo runs (in-process, as before),
    and its stderr names the setting meant."""
    script = ("import torch, torch.distributed as dist, libmccl\n"
              "dist.init_process_group('mccl', rank=0, world_size=1)\n"
              "t = torch.ones(4); dist.all_reduce(t); assert t.sum().item() == 4\n"
              "dist.destroy_process_group()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCCL_")}
    env.update(MCCL_DEAMON="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=100,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "MCCL_DEAMON" in line]
    assert len(lines) == 1 and "did you mean MCCL_DAEMON?" in lines[0], out.stderr[-3000:]


@pytest.mark.timeout(10)
def test_an_unknown_key_of_mccld_toml_names_the_key_meant(tmp_path):
    conf = tmp_path / "mccld.toml"
    conf.write_text('listen_adr = "127.0.0.1"\nMCCL_PORT = 30000\n')
    with pytest.raises(ConfigError) as info:
        load_config(str(conf), env={})
    msg = str(info.value)
    assert "listen_adr: did you mean listen_addr?" in msg and "MCCL_PORT: did you mean port?" in msg, msg


# Where the code reads or sets an MCCL_* variable: os.environ / getenv / env["..."], an env
# dict's key, or NAME=value in a shell line.
_USE = re.compile(r"""(?:environ(?:\.get|\.setdefault|\.pop)?\s*[(\[]\s*|getenv\(\s*|\[\s*)["'](MCCL_[A-Z0-9_]+)["']"""
                  r"""|["'](MCCL_[A-Z0-9_]+)["']\s*:|\b(MCCL_[A-Z0-9_]+)=""")
_SCANNED = ("mccl_common", "libmccl", "mccld", "mcclctl", "tools", "scripts", "tests", "packaging", ".ci",
            ".github")


@pytest.mark.timeout(30)
def test_every_name_the_code_tools_and_tests_use_is_a_setting_or_listed():
    known = setting_names.registered_names() | set(setting_names.OTHER_NAMES)
    unknown: dict[str, set[str]] = {}
    for top in _SCANNED:
        for path in (ROOT / top).rglob("*"):
            if path.suffix not in (".py", ".sh", ".service", ".yml", ".yaml", "") or not path.is_file():
                continue
            if "fuzz_corpus" in path.parts or path == Path(__file__):
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            for m in _USE.finditer(text):
                name = next(g for g in m.groups() if g)
                if name not in known:
                    unknown.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert not unknown, (f"MCCL_* names used but neither declared in mccl_common/settings.py nor listed in "
                         f"setting_names.OTHER_NAMES (they would warn as typos): {unknown}")
    assert set(RESERVED_ENV) <= known


def _free_port() -> int:
    from support.ports import free_port
    return free_port()
