"""The human-readable table of a benchmark result (nccl-tests layout, one block per op),
one column group per series (mccl, mccl-daemon, gloo), then their ratios."""

from __future__ import annotations

from . import ddp
from .metrics import fmt_bytes

# Ratio columns: (comparison key, heading); shown where the comparison has them.
_RATIOS = (("busbw_mccl_over_gloo", "mccl/gloo"), ("busbw_daemon_over_in_process", "daemon/in-proc"),
           ("busbw_daemon_over_gloo", "daemon/gloo"), ("busbw_shared_over_in_process", "shared/in-proc"),
           ("busbw_topology_over_flat", "by-switch/flat"), ("busbw_switch_ring_over_flat", "sw-ring/flat"))


def series_of(row: dict) -> str:
    """A row's series; results saved before the daemon mode have only the backend."""
    return row.get("series", row["backend"])


def where(meta: dict) -> str:
    per_host = meta.get("ranks_per_host", 1)
    if meta["mode"] == "fleet":
        hosts = meta.get("hosts", meta["world"])
        ranks = f" x {per_host} ranks ({meta['world']} in all)" if per_host > 1 else ""
        return f"{hosts} emulated hosts{ranks} at {meta['rate'] or 'unshaped'}"
    return f"{meta['world']} ranks on loopback" + (f", {per_host} per daemon host" if per_host > 1 else "")


def _cell(row: dict | None) -> str:
    if row is None:
        return f"{'-':>10} {'-':>7} {'-':>7} {'-':>6} {'-':>6}"
    pct = f"{row['busbw_pct_ceiling']:5.1f}%" if row["busbw_pct_ceiling"] is not None else "     -"
    c = row["cpu_s_per_wire_gb"]
    cpu = "     -" if c is None else f"{c:6.2f}" if c < 100 else f"{c:6.0f}"
    return f"{row['time_us']:10.1f} {row['algbw_GBps']:7.3f} {row['busbw_GBps']:7.3f} {pct} {cpu}"


def _latency_lines(result: dict) -> list[str]:
    lat = result.get("latency") or {}
    out = [f"# {name}: {v['bytes']}-byte all_reduce median {v['median_us']:.1f} us, p90 {v['p90_us']:.1f} us "
           f"({v['iters']} ops)" for name, v in lat.items() if isinstance(v, dict)]
    if "daemon_over_in_process" in lat:
        out.append(f"# small-op latency through mccld: {lat['daemon_over_in_process']:.2f}x in-process")
    return out


def _ddp_lines(result: dict) -> list[str]:
    steps = result.get("ddp") or {}
    if not steps:
        return []
    first = next(iter(steps.values()))
    floor = first["wire_floor_ms"]
    model = first["config"].get("model") or f"MLP {first['config']['depth']} x {first['config']['width']}^2"
    out = [f"# DDP step ({model}, "
           f"{first['grad_bytes'] / 1e6:.1f} MB of gradients, median of {first['steps']} steps, slowest rank)"
           + (f"; wire floor {floor:.1f} ms at the ring ceiling" if floor else "")]
    for name, v in steps.items():
        rel = "".join(f", {v[k]:.2f}x {what}" for k, what in (("step_over_gloo", "gloo"),
                                                               ("step_over_in_process", "in-process")) if k in v)
        extra = "".join(f", {what} {v[k]:.1f} ms" for k, what in (("nocomm_ms", "communication removed"),
                                                                  ("staged_ms", "staged through CPU copies"),
                                                                  ("shared_ms", "buckets in shared memory"),
                                                                  ("sharedcopy_ms", "scaled into shared memory"),
                                                                  ("comm_alone_ms", "all-reduce alone")) if k in v)
        if "overlap_ratio" in v:
            extra += f", {v['step_over_nocomm']:.3f}x the step without communication, overlap {v['overlap_ratio']:.2f}"
        if "params_match_gloo" in v:
            extra += ", parameters " + ("match" if v["params_match_gloo"] else "DIFFER from") + " gloo's"
        step = f"{v['step_ms']:8.1f} ms a step" if v["step_ms"] else "(plain DDP not timed)"
        out.append(f"#   {name:<12} {step} (compute alone {v['compute_ms']:.1f} ms{extra}){rel}")
        copies = ddp.copies_text(v)
        if copies:
            out.append(f"#   {'':<12} copies a DDP step: {copies}")
    return out


def render(result: dict) -> str:
    meta, ceiling = result["meta"], result["ceiling"]
    n = meta["world"]
    lines = [f"# mccl-bench: {where(meta)}, machine {meta['machine']} ({meta['cpus']} CPUs, load "
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
        if b.get("cleaned_after"):
            lines.append(f"# {name}: the daemons left {len(b['cleaned_after'])} thing(s) the bench cleaned: "
                         f"{'; '.join(b['cleaned_after'])[:300]}")
    lines += _latency_lines(result)
    lines += _ddp_lines(result)
    series = [b for b, v in result["backends"].items() if v["ok"]]
    rows = {(series_of(r), r["op"], r["bytes"]): r for r in result["results"]}
    ratios = {(c["op"], c["bytes"]): c for c in result["comparison"]}
    shown = [(k, h) for k, h in _RATIOS if any(k in c for c in ratios.values())]
    ops = list(dict.fromkeys(r["op"] for r in result["results"]))
    head_one = f"{'time(us)':>10} {'algbw':>7} {'busbw':>7} {'%ceil':>6} {'cpu/GB':>6}"
    for op in ops:
        lines.append("")
        lines.append(f"# {op}  (algbw/busbw in GB/s, busbw counted for n={n} ranks; cpu/GB = CPU seconds "
                     f"over all ranks per GB on the wire; ratios are busbw)")
        lines.append(f"{'size':>8}  " + "  |  ".join(f"{b:^40}" for b in series)
                     + "".join(f"  | {h:>14}" for _, h in shown))
        lines.append(f"{'':>8}  " + "  |  ".join(head_one for _ in series))
        for size in sorted({r["bytes"] for r in result["results"] if r["op"] == op}):
            cells = "  |  ".join(_cell(rows.get((b, op, size))) for b in series)
            c = ratios.get((op, size), {})
            lines.append(f"{fmt_bytes(size):>8}  {cells}"
                         + "".join(f"  | {c[k]:13.2f}x" if k in c else f"  | {'-':>14}" for k, _ in shown))
    lines.append("")
    lines.append(f"# {meta['seconds']:.0f} s in all, load average at the end {meta['loadavg_end'][0]:.1f}"
                 + ("" if meta.get("complete", True) else "; PARTIAL: the run was cut short"))
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """The same measurements as a Markdown table (docs/benchmarks.md is built from these)."""
    meta, ceiling = result["meta"], result["ceiling"]
    series = [b for b, v in result["backends"].items() if v["ok"]]
    rows = {(series_of(r), r["op"], r["bytes"]): r for r in result["results"]}
    ratios = {(c["op"], c["bytes"]): c for c in result["comparison"]}
    shown = [(k, h) for k, h in _RATIOS if any(k in c for c in ratios.values())]
    out = [f"**{where(meta)}** (busbw for n={meta['world']}) — {meta['machine']}, {meta['cpus']} CPUs, load "
           f"{meta['loadavg_start'][0]:.1f}→{meta['loadavg_end'][0]:.1f}, {meta['started']}, "
           f"commit `{meta['commit']}`" + ("" if meta.get("complete", True) else " (PARTIAL: the run was cut short)")]
    if ceiling:
        out[0] += (f"; ring ceiling ({ceiling['tool']}) {ceiling['mean_bps'] / 1e9:.3f} Gbit/s per host, "
                   f"{ceiling['cpu_s_per_gb']:.2f} CPU s/GB" if ceiling.get("cpu_s_per_gb") else "")
    lat = [line.lstrip("# ") for line in _latency_lines(result)]
    if lat:
        out += ["", "; ".join(lat)]
    steps = result.get("ddp") or {}
    if steps:
        out += ["", _ddp_lines(result)[0].lstrip("# "), "",
                "| series | step ms | compute alone ms | vs gloo | copies a step |", "|---|---|---|---|---|"]
        out += [f"| {name} | {v['step_ms'] or 0:.1f} | {v['compute_ms']:.1f} | "
                + (f"{v['step_over_gloo']:.2f}× |" if "step_over_gloo" in v else "- |")
                + f" {ddp.copies_text(v) or '-'} |" for name, v in steps.items()]
    head = (["op", "size"] + [f"{b} {k}" for b in series for k in ("time µs", "busbw Gbit/s", "% ceil", "CPU s/GB")]
            + [h for _, h in shown])
    if not result["results"]:
        return "\n".join(out)
    out += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in dict.fromkeys(r["op"] for r in result["results"]):
        for size in sorted({r["bytes"] for r in result["results"] if r["op"] == op}):
            cells = [op, fmt_bytes(size)]
            for b in series:
                r = rows.get((b, op, size))
                if r is None:
                    cells += ["-"] * 4
                    continue
                pct = f"{r['busbw_pct_ceiling']:.1f}" if r["busbw_pct_ceiling"] is not None else "-"
                cells += [f"{r['time_us']:.1f}", f"{r['busbw_Gbps']:.3f}", pct, f"{r['cpu_s_per_wire_gb']:.2f}"]
            c = ratios.get((op, size), {})
            cells += [f"{c[k]:.2f}×" if k in c else "-" for k, _ in shown]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
