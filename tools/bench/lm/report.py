"""The lm workload's outputs: ``results.json`` (every curve), ``lm-loss.png`` (validation loss
against wall time and against samples) and ``README.md`` (the setup and one row per variant)."""

from __future__ import annotations

import json
import os


def _fmt(x, spec: str, none: str = "—") -> str:
    return none if x is None else format(x, spec)


def rate_text(rate: str | None) -> str:
    """'29098kbit' -> '29.1 Mbit/s' (the tc rate the fleet was shaped to)."""
    if not rate:
        return "unshaped"
    from ...fleet import parse_rate_bits

    bps = parse_rate_bits(rate)
    return f"{bps / 1e9:.2f} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.1f} Mbit/s"


def _bytes(x: float | None) -> str:
    if x is None:
        return "— (loopback)"
    for unit, k in (("MB", 1e6), ("kB", 1e3)):
        if x >= k:
            return f"{x / k:.2f} {unit}"
    return f"{x:.0f} B"


def table(result: dict) -> str:
    summ = result.get("summary") or {}
    ref = summ.get("reference")
    rows = summ.get("variants") or {}
    tol = f" (+{summ['tolerance'] * 100:g} %)" if summ.get("tolerance") else ""
    head = (f"| variant | final val loss (nats/byte) | vs {ref or 'reference'} at equal samples | wall time, s | "
            f"time to {ref or 'reference'}'s final loss{tol}, s (× {ref or 'reference'}'s) | samples/s | wire bytes/sample "
            "(× fp32 ring) | step, ms (median) |")
    lines = [head, "|" + "---|" * 8]
    for name, r in result["results"].items():
        label = r["variant"]["label"]
        if r.get("teardown_failure"):
            label += " (exited abnormally after writing its results)"
        if not r.get("ok"):
            lines.append(f"| {label} | failed: {r['error'][:160]} | | | | | | |")
            continue
        s = rows.get(name, {})
        ttl = s.get("time_to_ref_loss_s")
        ttl_txt = (f"{ttl:.1f} ({s['time_to_ref_loss_over_ref']:.2f}×)" if ttl is not None
                   else ("not reached" if ref else "—"))
        pct = s.get("val_loss_at_ref_samples_pct")
        wire = r["wire_bytes_per_sample"]
        wire_txt = _bytes(wire) + (f" ({r['wire_over_fp32_ring']:.2f}×)" if wire is not None else "")
        lines.append(f"| {label} | {r['final_val_loss']:.4f} | {_fmt(pct, '+.3f')} % | {r['wall_s']:.1f} | {ttl_txt} | "
                     f"{r['samples_per_s']:.1f} | {wire_txt} | {r['step_ms_median']:.0f} |")
    return "\n".join(lines)


def rounds_table(result: dict) -> str | None:
    """DiLoCo variants' outer rounds: what a slow host costs a round (issue 37's round-time target)."""
    rows = [(r["variant"]["label"], r) for r in result["results"].values() if r.get("ok") and r.get("round_ms_all")]
    if not rows:
        return None
    lines = ["| DiLoCo variant | rounds | round, ms (median) | inner steps per rank |", "|---|---|---|---|"]
    for label, r in rows:
        steps = ", ".join(str(s) for s in r.get("inner_steps") or [])
        lines.append(f"| {label} | {len(r['round_ms_all'])} | {r['round_ms_median']:.0f} | {steps} |")
    return "\n".join(lines)


def setup_text(result: dict) -> str:
    m, cal, cfg = result["meta"], result.get("calibration"), result["meta"]["config"]
    st, mc, corpus = m["studio"], cfg["model"], m.get("corpus") or {}
    out = [f"- **Hosts**: {m['hosts']} ({'emulated: network namespaces of one machine' if m['mode'] == 'fleet' else 'loopback'}"
           f", {m['cpus']} cores for all of them), one rank each; link rate {rate_text(m.get('rate'))}.",
           f"- **Model**: byte-level transformer, {mc['layers']} layers, d_model {mc['d_model']}, {mc['heads']} heads, "
           f"context {mc['context']}; batch {cfg['batch']} sequences per rank, {cfg['steps']} steps, AdamW lr "
           f"{cfg['lr']} (warm-up {cfg['warmup_steps']}, cosine), validation every {cfg['eval_every']} steps on "
           f"{cfg['val_windows']} fixed windows.",
           f"- **Corpus**: Python {corpus.get('python')}'s standard library sources, {corpus.get('files')} files "
           f"({corpus.get('val_files')} held out by path hash): {corpus.get('train_bytes', 0) / 1e6:.1f} MB train, "
           f"{corpus.get('val_bytes', 0) / 1e6:.2f} MB validation; sha256 {str(corpus.get('sha256'))[:16]}….",
           f"- **The studio's ratio**: a 1B model's step on an M4 Max, ~{st['compute_s']:.1f} s of compute "
           f"(6 × 1e9 × {st['tokens_per_host_step']} tokens at ~{st['achieved_flops'] / 1e12:.0f} TFLOPS reached), "
           f"against {st['comm_s']:.1f} s for its fp32 ring all-reduce (2 × 4 GB at 1.17 GB/s on 10 GbE): "
           f"R = {st['ratio']:.2f}; this run asked for R = {cfg['comm_ratio']}."]
    if cfg.get("leave"):
        h, at = cfg["leave"]
        out.append(f"- **A host leaves**: host {h}'s user comes back after step {at}; every variant runs under "
                   "ElasticState(keep_workers=True), and the other hosts re-form in place and go on (samples count "
                   "what the hosts present drew).")
    if m.get("cpu_caps"):
        caps = []
        for h, c in sorted(m["cpu_caps"].items(), key=lambda kv: int(kv[0])):
            what = " and ".join(x for x in (f"capped at {c['cores']:g} cores" if c["cores"] else "",
                                            "at idle priority" if c["idle"] else "") if x)
            held = ", ".join(f"{r['variant']['name']} {r['cpu_throttled_s'][h]:.1f} s"
                             for r in result["results"].values() if r.get("ok") and r.get("cpu_throttled_s"))
            caps.append(f"host {h} {what} from step {c['at']} (throttled: {held or '—'})")
        out.append("- **Slow hosts (cgroup, tools/cpucap.py)**: " + "; ".join(caps) + ".")
    if cal:
        line = (f"- **Calibration**: {cal['compute_s'] * 1e3:.0f} ms of compute per step (median, all "
                f"{cal['concurrent_hosts']} hosts computing at once on {cal['cpus']} cores, no communication), "
                f"{cal['grad_bytes'] / 1e6:.2f} MB of fp32 gradients")
        if cal.get("rate_bps"):
            line += (f"; at {cal['rate_bps'] / 1e6:.2f} Mbit/s one fp32 ring all-reduce takes "
                     f"{cal['fp32_allreduce_s_at_rate'] * 1e3:.0f} ms (R × compute)")
        out.append(line + ".")
        ref = next((r for n, r in result["results"].items() if n in ("gloo", "off") and r.get("ok")), None)
        if ref:
            out.append(f"- **Measured**: {ref['variant']['label']} steps took {ref['step_ms_median']:.0f} ms (median), "
                       f"{ref['step_ms_median'] / (cal['compute_s'] * 1e3):.2f}× the compute alone: the rest is "
                       "communication DDP's overlap did not hide.")
    if any((r.get("variant") or {}).get("diloco") for r in result["results"].values()):
        out.append("- **DiLoCo variants**: no DDP; each rank runs the same AdamW on its own batch (the same global batch "
                   "per step as DDP's), and libmccl.DiLoCo steps theta_global with SGD(lr 0.7, momentum 0.9, "
                   "Nesterov) every H inner steps (per fragment, F of them, tau steps late, mixed at alpha); the "
                   "validation loss is theta_global's, which moves only at syncs.")
    out.append("- Wall time counts training steps only (evaluation excluded); wire bytes are what the hosts' "
               "interfaces sent during training (TCP/IP headers and the engine's framing included), per sample.")
    return "\n".join(out)


def markdown(result: dict) -> str:
    m = result["meta"]
    return "\n\n".join([
        f"# Time to loss: byte-level LM, {m['hosts']} hosts ({m['started']}, commit {m.get('commit')})",
        setup_text(result), table(result), *filter(None, [rounds_table(result)]),
        "![validation loss against wall time and samples](lm-loss.png)",
        "Reproduce: `" + (m.get("command") or "python -m tools.bench --workload lm ...") + "`"]) + "\n"


def plot(result: dict, out_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in result["results"].items():
        if not r.get("ok"):
            continue
        pts = r["curve"][1:]   # step 0 sits at t=0 for all: the untrained loss, off the scale
        lab = r["variant"]["label"]
        ax_t.plot([p["wall_s"] for p in pts], [p["val_loss"] for p in pts], marker="o", ms=3, label=lab)
        ax_s.plot([p["samples"] for p in pts], [p["val_loss"] for p in pts], marker="o", ms=3, label=lab)
    m = result["meta"]
    where = f"{m['hosts']} hosts, {rate_text(m.get('rate'))} ({m['cpus']}-core emulation)"
    ax_t.set(xlabel="training wall time, s", ylabel="validation loss, nats/byte", title=f"Loss vs wall time: {where}")
    ax_s.set(xlabel="samples (sequences, all ranks)", ylabel="validation loss, nats/byte", title="Loss vs samples")
    for ax in (ax_t, ax_s):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def write_outputs(result: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("results.json", "lm-loss.png", "README.md")]
    with open(paths[0] + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(paths[0] + ".tmp", paths[0])
    if any(r.get("ok") for r in result["results"].values()):
        plot(result, paths[1])
    else:
        paths.remove(paths[1])
    with open(paths[-1], "w") as f:
        f.write(markdown(result))
    return paths
