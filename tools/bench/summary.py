"""The README's performance table and plot, from committed results in docs/results/.

``python -m tools.bench plot`` (no result files) rewrites the table between the README's
``PERF-TABLE`` markers and draws docs/img/performance.png; tests/project/test_readme_perf.py
checks the committed README holds exactly the table these files give. Each row names the one
``mccl-bench`` run (one JSON: MCCL, Gloo and the iperf3 ring ceiling measured together) it
comes from; to show a newer run, commit its JSON and point the row at it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mccl_common.errors import ConfigError
from .metrics import fmt_bytes
from .report import series_of

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PLOT = ROOT / "docs" / "img" / "performance.png"
BEGIN, END = "<!-- PERF-TABLE -->", "<!-- /PERF-TABLE -->"
SIZE = 64 << 20   # all-reduce size of every row: large enough that the link, not latency, binds


@dataclass(frozen=True)
class Row:
    config: str          # what the table's first column says
    path: str            # results JSON, relative to the repository root
    series: str = "mccl"  # the MCCL series of that run shown (mccl = in-process engine)


ROWS = (
    Row("4 hosts, 1 Gbit/s (2-core VM)", "docs/results/2core-final/n4-1gbit.json"),
    Row("4 hosts, 2.5 Gbit/s (2-core VM)", "docs/results/2core-final/n4-2.5gbit.json"),
    Row("2 hosts, 10 Gbit/s, CPU-bound (2-core VM)", "docs/results/2core-final/n2-10gbit.json"),
    Row("8 hosts, 10 Gbit/s (16-core)", "docs/results/device-issue9-shared/17-n8-shared-r3.json"),
    Row("8 hosts, 10 Gbit/s, through mccld, shared buffers (16-core)",
        "docs/results/device-issue9-shared/17-n8-shared-r3.json", "mccl-daemon-shared"),
    Row("4 hosts x 2 ranks, 10 Gbit/s, through mccld (16-core)",
        "docs/results/device-issue9-medians/r2-2-n4x2-10gbit.json", "mccl-daemon"),
    Row("16 hosts, 2.5 Gbit/s (16-core)", "docs/results/device-issue9-medians/4-n16-2.5gbit.json"),
    Row("24 hosts, 1 Gbit/s (16-core)", "docs/results/device-issue9-24h-threads/16-n24-threads-default-r1.json"),
)


@dataclass(frozen=True)
class Figure:
    row: Row
    started: str
    ceiling_gbps: float
    mccl_gbps: float
    mccl_pct: float
    gloo_gbps: float | None
    gloo_pct: float | None


def _busbw(result: dict, series: str, path: str) -> tuple[float, float] | None:
    for r in result["results"]:
        if r["op"] == "all_reduce" and r["bytes"] == SIZE and series_of(r) == series:
            return r["busbw_Gbps"], r["busbw_pct_ceiling"]
    return None


def figures(rows: tuple[Row, ...] = ROWS, root: Path = ROOT) -> list[Figure]:
    out = []
    for row in rows:
        try:
            result = json.loads((root / row.path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"[bench] cannot read {row.path} for the README's table: {e}; "
                              "point the row at a committed results JSON") from None
        mccl = _busbw(result, row.series, row.path)
        if mccl is None or not result.get("ceiling"):
            raise ConfigError(f"[bench] {row.path} has no {row.series} all_reduce of {fmt_bytes(SIZE)} or no "
                              "ring ceiling: pick a run that measured both")
        gloo = _busbw(result, "gloo", row.path)
        out.append(Figure(row, result["meta"]["started"][:10], result["ceiling"]["mean_bps"] / 1e9,
                          mccl[0], mccl[1], *(gloo or (None, None))))
    return out


def _size() -> str:
    return fmt_bytes(SIZE).replace("M", " MB")


def _cell(gbps: float | None, pct: float | None) -> str:
    return "-" if gbps is None else f"{gbps:.2f} ({pct:.1f} %)"


def table(figs: list[Figure]) -> str:
    """Markdown: busbw in Gbit/s per host and % of the ring ceiling measured in the same run."""
    lines = [f"| config (all-reduce, {_size()}) | MCCL, Gbit/s (% of ceiling) | Gloo, Gbit/s (% of ceiling) | "
             "ring ceiling, Gbit/s | run |",
             "|---|---|---|---|---|"]
    for f in figs:
        folder = str(Path(f.row.path).parent)
        lines.append(f"| {f.row.config} | {_cell(f.mccl_gbps, f.mccl_pct)} | {_cell(f.gloo_gbps, f.gloo_pct)} | "
                     f"{f.ceiling_gbps:.2f} | [{Path(folder).name}]({f.row.path}), {f.started} |")
    return "\n".join(lines)


def plot(figs: list[Figure], out_png: Path) -> None:
    """One horizontal bar pair per row: MCCL and Gloo as % of that run's ring ceiling."""
    from .plot import STYLE, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.62 * len(figs) + 1.6))
    ys = list(range(len(figs)))[::-1]   # first row on top, as in the table
    h = 0.38
    for label, color, off, vals in (
            ("MCCL", STYLE["mccl"]["color"], h / 2, [f.mccl_pct for f in figs]),
            ("Gloo", STYLE["gloo"]["color"], -h / 2, [f.gloo_pct for f in figs])):
        for y, v in zip(ys, vals):
            if v is None:
                ax.text(1, y + off, "not measured in this run", va="center", fontsize=7, color="grey")
                continue
            ax.barh(y + off, v, height=h, color=color, label=label)
            # inside the bar's end, clear of the ceiling line
            ax.text(v - 1, y + off, f"{v:.1f} %", va="center", ha="right", fontsize=7, color="white")
            label = None   # one legend entry per backend
    ax.axvline(100, color="black", linestyle="--", linewidth=1, label="ring ceiling (iperf3, same run)", zorder=0)
    ax.set_yticks(ys)
    ax.set_yticklabels([f.row.config.replace(" (", "\n(") for f in figs], fontsize=8)
    ax.set_xlim(0, 110)
    ax.set_xlabel(f"all-reduce bus bandwidth at {_size()}, % of the ring ceiling (higher is better)")
    ax.set_title("MCCL and Gloo on emulated fleets (docs/benchmarks.md)", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3, frameon=False)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def readme_with(text: str, new_table: str) -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ConfigError(f"[bench] README.md must hold {BEGIN} and {END} once each, around the performance table")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{new_table}\n{END}{tail}"


def main(readme: Path = README, out_png: Path = PLOT) -> str:
    figs = figures()
    new_table = table(figs)
    readme.write_text(readme_with(readme.read_text(), new_table))
    plot(figs, out_png)
    return new_table
