"""The scale benchmark's outputs: Markdown tables (README.md) and, where matplotlib is
installed (``pip install 'mccl-fleet[bench]'``), one plot per host count of time against size
for each algorithm, measured as points and the alpha-beta model as lines."""

from __future__ import annotations

import json
import os

from .metrics import fmt_bytes


def _us(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e6:.0f}" if t < 10e-3 else f"{t * 1e3:.1f} ms"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def point_table(p: dict) -> str:
    d = p["dilation"]
    head = (f"### N = {p['hosts']}{' (loopback)' if p['loopback'] else ''}: dilation D = {d:g} "
            f"(links shaped to {p.get('tc_rate') or 'none'}, delay {p.get('tc_delay') or 'none'}; "
            f"standing for {p['rate_bits'] / 1e9:g} Gbit/s + {p['delay_s'] * 1e6:g} us a hop)\n\n")
    notes = []
    c = p.get("ceiling")
    if c:
        notes.append(f"iperf3 ring ceiling at this shaping: {c['mean_bps'] / 1e6:.0f} Mbit/s a host (min "
                     f"{c['min_bps'] / 1e6:.0f}), {c['carried_pct']:.0f} % of the shaped rate: the machine "
                     f"{'carries' if c['carried_pct'] >= 90 else 'does NOT carry'} it")
    for algo, ab in (p.get("alpha_beta") or {}).items():
        notes.append(f"model for {algo}: alpha {ab['alpha_s'] * 1e6:.1f} us, beta {ab['beta_s_per_byte'] * 1e9:.3f} "
                     f"ns/B ({ab['source']})")
    if "torch_imported" in p:
        notes.append(f"torch imported by an engine rank: {p['torch_imported']}; set-up "
                     + ", ".join(f"{a} {s:.1f}s" for a, s in (p.get("init_s") or {}).items()))
    notes += p.get("notes", [])
    notes += [f"skipped {fmt_bytes(s['bytes'])}: {s['why']}" for s in p["skipped"]]
    notes += [f"error: {e}" for e in p["errors"]]
    target = f"model at {p['rate_bits'] / 1e9:g}G+{p['delay_s'] * 1e6:g}us"
    lines = [f"| op | size | algo (ran) | time (real) | model | ratio | busbw Gbit/s | flat ring | ring model | {target} |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in p["rows"]:
        if "time_s" not in r:
            lines.append(f"| {r['op']} | {fmt_bytes(r['bytes'])} | {r['algo']} | {r.get('skipped', '-')} ||||||")
            continue
        lines.append(f"| {r['op']} | {fmt_bytes(r['bytes'])} | {r['algo']} ({r['algo_used']}) | {_us(r['time_s'])} | "
                     f"{_us(r.get('model_s'))} | {_x(r.get('ratio'))} | {_x(r.get('busbw_Gbps'))} | "
                     f"{_us(r.get('ring_time_s'))} | {_us(r.get('ring_model_s'))} | {_us(r.get('target_model_s'))} |")
    gv = p.get("gloo_vs_mccl") or []
    if gv:
        lines.append("")
        lines.append("Gloo (torch ranks, same namespaces) against MCCL auto, all_reduce: " + "; ".join(
            f"{fmt_bytes(g['bytes'])}: Gloo {_us(g['gloo_s'])}, MCCL {_us(g['mccl_auto_s'])}, "
            f"MCCL {g['speedup']:.2f}x faster" for g in gv))
        for g in gv:
            if g["bytes"] == 1 << 20:
                lines.append(f"\nIssue 26's target, MCCL >= 2x Gloo's ring at 1 MB ({p['hosts']} ranks): "
                             f"{'met' if g['speedup'] >= 2 else 'NOT met'} ({g['speedup']:.2f}x).")
    return head + "".join(f"- {n}\n" for n in notes) + "\n" + "\n".join(lines) + "\n"


def markdown(result: dict) -> str:
    m = result["meta"]
    intro = (f"Scale benchmark, {m['started']}, {m['cores']} cores. Times in us unless marked, converted to the "
             f"real network (measured / D); CPU time per message is not dilated, so after / D it counts D times "
             f"too little. Model: {m['model']} formulas, {m['chooser']} choice of algorithm for auto; 'model' uses "
             f"the (alpha, beta) of the emulation as run (listed per N), the last column those of the network the "
             f"run stands for.\n\n")
    return intro + "\n".join(point_table(p) for p in result["points"])


def plot(result: dict, out_png: str) -> bool:
    """One panel per host count; False (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    points = [p for p in result["points"] if any("time_s" in r for r in p["rows"])]
    if not points:
        return False
    fig, axes = plt.subplots(1, len(points), figsize=(6 * len(points), 4.5), squeeze=False)
    colors = {"auto": "#d62728", "ring": "#1f77b4", "rd": "#2ca02c", "rabenseifner": "#9467bd", "gloo": "#7f7f7f"}
    for ax, p in zip(axes.flat, points):
        for algo in dict.fromkeys(r["algo"] for r in p["rows"]):
            rows = sorted((r for r in p["rows"] if r["algo"] == algo and "time_s" in r and r["op"] == "all_reduce"),
                          key=lambda r: r["bytes"])
            if not rows:
                continue
            c = colors.get(algo, None)
            ax.plot([r["bytes"] for r in rows], [r["time_s"] for r in rows], "o", color=c, label=f"{algo} measured")
            model = [(r["bytes"], r["model_s"]) for r in rows if r.get("model_s")]
            if model:
                ax.plot(*zip(*model), "-", color=c, alpha=0.6, label=f"{algo} model")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("all_reduce size (bytes)")
        ax.set_ylabel("time per op, real network (s)")
        ax.set_title(f"N={p['hosts']}, D={p['dilation']:g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return True


def write_outputs(result: dict, out_dir: str, plots: bool = True) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "scale.json.tmp"), "w") as f:
        json.dump(result, f, indent=1)
    os.replace(os.path.join(out_dir, "scale.json.tmp"), os.path.join(out_dir, "scale.json"))
    text = markdown(result)
    if plots and plot(result, os.path.join(out_dir, "scale.png")):
        text += "\n![time against size](scale.png)\n"
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write("# Scale benchmark\n\n" + text)
