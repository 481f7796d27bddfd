"""``mccl-bench plot results.json out.png``: bus bandwidth against size, per op, with the
ring ceiling as a line: how close each backend comes to what the network can carry."""

from __future__ import annotations

import json
import math

from mccl_common.errors import ConfigError
from .metrics import fmt_bytes
from .report import where, series_of

STYLE = {"mccl": dict(color="#d62728", marker="o"), "mccl-daemon": dict(color="#ff7f0e", marker="^"),
         "mccl-daemon-shared": dict(color="#2ca02c", marker="v"), "gloo": dict(color="#1f77b4", marker="s")}


def pyplot():
    """matplotlib.pyplot drawing to files only (no display needed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("[bench] plotting needs matplotlib: pip install 'mccl-fleet[bench]'") from None
    return plt


def plot(results_paths: list[str], out_png: str, title: str | None = None) -> None:
    plt = pyplot()
    results = []
    for p in results_paths:
        with open(p) as f:
            results.append(json.load(f))
    ops = list(dict.fromkeys(r["op"] for res in results for r in res["results"]))
    if not ops:
        raise ConfigError(f"[bench] {', '.join(results_paths)} hold no measurements to plot")
    cols = min(2, len(ops))
    rows_n = math.ceil(len(ops) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.5 * cols, 4.2 * rows_n), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        for res in results:
            m = res["meta"]
            per_host = m.get("ranks_per_host", 1)
            tag = (f"N={m.get('hosts', m['world'])}{f'x{per_host}' if per_host > 1 else ''} "
                   f"{m['rate'] or 'loopback'}" if len(results) > 1 else "")
            for series in dict.fromkeys(series_of(r) for r in res["results"]):
                pts = sorted((r["bytes"], r["busbw_Gbps"]) for r in res["results"]
                             if r["op"] == op and series_of(r) == series)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{series} {tag}".strip(),
                            **STYLE.get(series, {}), markersize=4)
            if res["ceiling"]:
                c = res["ceiling"]["mean_bps"] / 1e9
                ax.axhline(c, color="black", linestyle="--", linewidth=1,
                           label=f"ring ceiling ({res['ceiling']['tool']}) {tag}".strip() + f" {c:.2f}")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["bytes"] for res in results for r in res["results"] if r["op"] == op})
        ticks = ticks[::2] if len(ticks) > 10 else ticks
        ax.set_xticks(ticks)
        ax.set_xticklabels([fmt_bytes(t) for t in ticks], rotation=45, fontsize=8)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)  # room above the ceiling line for the legend
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (Gbit/s per rank)")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    m = results[0]["meta"]
    fig.suptitle(title or f"mccl-bench: {where(m)}, busbw for n={m['world']}\n({m['machine']}, {m['started']})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
