"""The README's performance table and plot are what `python -m tools.bench plot` makes from
the committed results (tools/bench/summary.py names the runs)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import summary

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(30)
def test_readme_table_is_regenerated_from_the_committed_results():
    text = (ROOT / "README.md").read_text()
    figs = summary.figures()
    assert len(figs) == len(summary.ROWS)
    # rewriting the README with a fresh table changes nothing
    assert summary.readme_with(text, summary.table(figs)) == text, (
        "README.md's performance table is stale: run `.venv/bin/python -m tools.bench plot` and commit both")
    for f in figs:
        assert (ROOT / f.row.path).is_file() and f.row.path.startswith("docs/results/")
        assert 0 < f.mccl_gbps <= f.ceiling_gbps * 1.2 and f.mccl_pct > 50, f.row


@pytest.mark.timeout(30)
def test_readme_shows_the_committed_plot():
    png = summary.PLOT
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rel = png.relative_to(ROOT).as_posix()
    assert f"]({rel})" in (ROOT / "README.md").read_text(), f"README.md does not show {rel}"


@pytest.mark.timeout(120)
def test_plot_draws_every_row(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "performance.png"
    # in a child: matplotlib keeps its font files open for the life of the process
    code = "import sys; from pathlib import Path; from tools.bench import summary; " \
           "summary.plot(summary.figures(), Path(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, check=True, timeout=100)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
