"""The human-readable table of a benchmark result (nccl-tests layout, one block per op)."""

from __future__ import annotations

from .metrics import fmt_bytes


def _cell(row: dict | None) -> str:
    if row is None:
        return f"{'-':>10} {'-':>7} {'-':>7} {'-':>6} {'-':>6}"
    pct = f"{row['busbw_pct_ceiling']:5.1f}%" if row["busbw_pct_ceiling"] is not None else "     -"
    c = row["cpu_s_per_wire_gb"]
    cpu = "     -" if c is None else f"{c:6.2f}" if c < 100 else f"{c:6.0f}"
    return f"{row['time_us']:10.1f} {row['algbw_GBps']:7.3f} {row['busbw_GBps']:7.3f} {pct} {cpu}"


def render(result: dict) -> str:
    meta, ceiling = result["meta"], result["ceiling"]
    where = (f"{meta['world']} emulated hosts at {meta['rate'] or 'unshaped'}" if meta["mode"] == "fleet"
             else f"{meta['world']} ranks on loopback")
    lines = [f"# mccl-bench: {where}, machine {meta['machine']} ({meta['cpus']} CPUs, load "
             f"{meta['loadavg_start'][0]:.1f}), commit {meta['commit']}"]
    if ceiling:
        cpu = f", {ceiling['cpu_s_per_gb']:.2f} CPU s/GB" if ceiling.get("cpu_s_per_gb") else ""
        lines.append(f"# ring ceiling ({ceiling['tool']}, every host -> right neighbour): "
                     f"{ceiling['mean_bps'] / 1e9:.3f} Gbit/s per host = {ceiling['mean_bps'] / 8e9:.3f} GB/s "
                     f"(slowest host {ceiling['min_bps'] / 1e9:.3f}; before/after the backends: "
                     f"{' / '.join(f'{b / 1e9:.3f}' for b in ceiling.get('runs_mean_bps', []))}){cpu}")
    for name, b in result["backends"].items():
        if not b["ok"]:
            lines.append(f"# {name}: FAILED, no numbers: {b['error']}")
        elif b.get("teardown_errors"):
            lines.append(f"# {name}: every op completed and was checked, but shutdown failed: "
                         f"{b['teardown_errors'][0][:300]}")
    backends = [b for b, v in result["backends"].items() if v["ok"]]
    rows = {(r["backend"], r["op"], r["bytes"]): r for r in result["results"]}
    ratios = {(c["op"], c["bytes"]): c for c in result["comparison"]}
    ops = list(dict.fromkeys(r["op"] for r in result["results"]))
    head_one = f"{'time(us)':>10} {'algbw':>7} {'busbw':>7} {'%ceil':>6} {'cpu/GB':>6}"
    for op in ops:
        lines.append("")
        lines.append(f"# {op}  (algbw/busbw in GB/s, cpu/GB = CPU seconds over all ranks per GB on the wire)")
        lines.append(f"{'size':>8}  " + "  |  ".join(f"{b:^40}" for b in backends)
                     + ("  |  mccl/gloo busbw" if len(ratios) else ""))
        lines.append(f"{'':>8}  " + "  |  ".join(head_one for _ in backends))
        for size in sorted({r["bytes"] for r in result["results"] if r["op"] == op}):
            cells = "  |  ".join(_cell(rows.get((b, op, size))) for b in backends)
            c = ratios.get((op, size))
            lines.append(f"{fmt_bytes(size):>8}  {cells}" + (f"  |  {c['busbw_mccl_over_gloo']:6.2f}x" if c else ""))
    lines.append("")
    lines.append(f"# {meta['seconds']:.0f} s in all, load average at the end {meta['loadavg_end'][0]:.1f}"
                 + ("" if meta.get("complete", True) else "; PARTIAL: the run was cut short"))
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """The same measurements as a Markdown table (docs/benchmarks.md is built from these)."""
    meta, ceiling = result["meta"], result["ceiling"]
    backends = [b for b, v in result["backends"].items() if v["ok"]]
    rows = {(r["backend"], r["op"], r["bytes"]): r for r in result["results"]}
    where = (f"N={meta['world']} emulated hosts at {meta['rate'] or 'unshaped'}" if meta["mode"] == "fleet"
             else f"N={meta['world']} ranks on loopback")
    out = [f"**{where}** — {meta['machine']}, {meta['cpus']} CPUs, load {meta['loadavg_start'][0]:.1f}"
           f"→{meta['loadavg_end'][0]:.1f}, {meta['started']}, commit `{meta['commit']}`"
           + ("" if meta.get("complete", True) else " (PARTIAL: the run was cut short)")]
    if ceiling:
        out[0] += (f"; ring ceiling ({ceiling['tool']}) {ceiling['mean_bps'] / 1e9:.3f} Gbit/s per host, "
                   f"{ceiling['cpu_s_per_gb']:.2f} CPU s/GB" if ceiling.get("cpu_s_per_gb") else "")
    head = ["op", "size"] + [f"{b} {k}" for b in backends for k in ("time µs", "busbw Gbit/s", "% ceil", "CPU s/GB")]
    out += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in dict.fromkeys(r["op"] for r in result["results"]):
        for size in sorted({r["bytes"] for r in result["results"] if r["op"] == op}):
            cells = [op, fmt_bytes(size)]
            for b in backends:
                r = rows.get((b, op, size))
                if r is None:
                    cells += ["-"] * 4
                    continue
                pct = f"{r['busbw_pct_ceiling']:.1f}" if r["busbw_pct_ceiling"] is not None else "-"
                cells += [f"{r['time_us']:.1f}", f"{r['busbw_Gbps']:.3f}", pct, f"{r['cpu_s_per_wire_gb']:.2f}"]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
