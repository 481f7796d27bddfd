"""The README's quick start uses commands, options and settings that exist: each `mcclctl` line
parses with mcclctl's own parser, each installer option is one the script accepts, each `mccld`
subcommand is mccld's, and each setting it names is declared."""

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import mccl_common.daemon_settings as daemon_settings
import mccl_common.settings as settings
from mcclctl.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]


def quick_start() -> tuple[str, list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start on a Mac fleet\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    lines = [line.split("  #")[0].strip() for line in block.splitlines()]
    return section, [line for line in lines if line and not line.startswith("#")]


@pytest.mark.timeout(30)
def test_mcclctl_lines_parse():
    _, lines = quick_start()
    used = [line for line in lines if line.startswith("mcclctl ")]
    assert {shlex.split(u)[1] for u in used} >= {"status", "run"}
    for line in used:
        build_parser().parse_args(shlex.split(line)[1:])   # SystemExit on an unknown option


@pytest.mark.timeout(60)
def test_installer_options_mccld_subcommands_and_settings_exist():
    section, lines = quick_start()
    for line in lines:
        m = re.search(r"(packaging/\w+/install\.sh)(.*)", line)
        if m:
            script = (ROOT / m.group(1)).read_text()
            for opt in re.findall(r"(--[a-z-]+)", m.group(2)):
                assert re.search(rf"^\s*{opt}\)", script, re.M), f"{m.group(1)} takes no {opt}"
        m = re.search(r"bin/mccld (\w+)", line)
        if m:
            subprocess.run([sys.executable, "-m", "mccld", m.group(1), "--help"], check=True,
                           capture_output=True, timeout=50)
    declared = {f.metadata["env"] for cls in settings.ALL_SETTINGS for f in dataclasses.fields(cls)}
    for name in re.findall(r"\b(MCCL_[A-Z_]+)", section):
        assert name in declared, f"the quick start names {name}, which no setting declares"
    fields = {f.name for f in dataclasses.fields(daemon_settings.DaemonConfig)}
    for key in re.findall(r"'(\w+) = ", section):
        assert key in fields, f"mccld.toml key {key} is no DaemonConfig field"
