"""Pure formatters: plain data in, text out. No I/O here, so all of it is unit-tested."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Sequence

from mccl_common.status_protocol import HARVESTED_STATES

NA = "-"


def human_bytes(n: float | None) -> str:
    if n is None:
        return NA
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    raise AssertionError("unreachable")


def human_bits_rate(bits_per_s: float | None) -> str:
    """Link speeds are quoted in bits: 9.41 Gbit/s reads against a 10 GbE port."""
    if bits_per_s is None:
        return NA
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.2f} {unit}"
    return f"{bits_per_s:.0f} bit/s"


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return NA
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {s}s"
    return f"{s}s"


def truncate(text: str | None, width: int | None) -> str:
    """One line of ``text`` cut to ``width`` characters; ``width`` None (``--wide``): not cut."""
    if not text:
        return NA
    text = " ".join(str(text).split())
    return text if width is None or len(text) <= width else text[: width - 1] + "…"


def _w(width: int, wide: bool) -> int | None:
    return None if wide else width


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    rows = [[NA if c is None else str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True, default=str)


# ---- which fleet -----------------------------------------------------------------------

def fleet_line(fleet: dict) -> str:
    """The first line of every view: "fleet lab: 3 daemons (from this host's mccld)", from the
    ``fleet`` object of the JSON output (its name, else the fleets the daemons reported)."""
    name = fleet.get("name") or ", ".join(fleet.get("reported") or []) or "?"
    n = fleet.get("daemons", 0)
    text = f"fleet {name}: {n} daemon{'s' if n != 1 else ''} (from {fleet.get('source', '?')})"
    others = fleet.get("other_fleets") or {}
    if others:
        text += "; other fleets seen: " + ", ".join(f"{f} ({k})" for f, k in sorted(others.items()))
    return text


# ---- status --------------------------------------------------------------------------

# One meaning per word: HARVEST says whether the host's user is at it ("busy") or left it to the
# fleet ("idle", "leased", "draining"; docs/harvesting.md); ACTIVITY says whether the daemon runs
# a job ("training") or none ("ready"). The daemon reports that as state "idle" on the wire and
# in mccl_host_state (kept for older peers and dashboards); mcclctl never shows that "idle".
STATUS_HEADERS = ("HOST", "ADDRESS", "VERSION", "ACTIVITY", "HARVEST", "JOBS/RANKS", "LINKS", "TX", "RX",
                  "LAST ERROR", "UPTIME")
ACTIVITY = {"idle": "ready", "training": "training"}


def activity(state: str | None) -> str:
    return ACTIVITY.get(state, state) if state else NA


def live_jobs(jobs: list[dict]) -> list[dict]:
    """The jobs a daemon still runs (ended ones stay listed a while, for ``mcclctl jobs``)."""
    return [j for j in jobs if j.get("state") != "ended"]


def status_row(host: str, status: dict | None, error: str | None, our_version: str,
               wide: bool = False) -> list[str]:
    """One row of ``mcclctl status``; an unreachable daemon still gets its row."""
    if status is None:
        return [host, NA, NA, "unreachable", NA, NA, NA, NA, NA, truncate(error, _w(60, wide)), NA]
    jobs = live_jobs(status.get("jobs") or [])
    ranks = sum(len(j.get("ranks") or []) for j in jobs)
    version = status.get("version") or NA
    if version not in (NA, our_version):
        version += " (!)"
    return [
        status.get("host") or host,
        status.get("address") or NA,
        version,
        activity(status.get("state")),
        harvest_state(status.get("harvest")),
        f"{len(jobs)}/{ranks}",
        f"{status.get('links_up', 0)}/{status.get('links_total', 0)}",
        human_bits_rate(_bits(status.get("tx_bytes_per_s"))),
        human_bits_rate(_bits(status.get("rx_bytes_per_s"))),
        truncate(status.get("last_error"), _w(40, wide)),
        human_duration(status.get("uptime_s")),
    ]


def harvest_state(h: dict | None) -> str:
    """The harvest state, with the reclaim deadline while draining: "draining (leaves in 42 s)"."""
    if not h or not h.get("state"):
        return NA
    if h["state"] == "draining" and h.get("leaves_in_s") is not None:
        return f"draining (leaves in {h['leaves_in_s']:.0f} s)"
    return h["state"]


RECLAIM_HOW = {"left": "its jobs left or ended by themselves", "removed": "its jobs were removed at MCCL_RECLAIM_GRACE"}


def reclaim_notes(hosts: Iterable[tuple[str, dict | None]], now: float | None = None) -> list[str]:
    """Lines under a status or capacity table: why a host drains and when it will be free, and
    how long the last hand-back to its user took (``now`` given: how long ago)."""
    lines = []
    for host, h in hosts:
        if not h:
            continue
        if h.get("state") == "draining":
            lines.append(f"{host}: {harvest_state(h)}: {h.get('reason') or 'its user is back'}")
        last = h.get("last_reclaim")
        if last and last.get("seconds") is not None:
            ago = f", {human_duration(max(0.0, now - last['at']))} ago" if now is not None and last.get("at") else ""
            lines.append(f"{host}: handed back to its user in {last['seconds']:.1f} s "
                         f"({RECLAIM_HOW.get(last.get('how'), last.get('how'))}{ago})")
    return lines


def status_table(rows: list[tuple[str, dict | None, str | None]], our_version: str,
                 warnings: Sequence[str] = (), wide: bool = False) -> str:
    text = table(STATUS_HEADERS, [status_row(h, s, e, our_version, wide) for h, s, e in rows])
    notes = reclaim_notes([(s.get("host") or h, s.get("harvest")) for h, s, _ in rows if s is not None])
    if notes:
        text += "\n" + "\n".join(notes)
    if warnings:
        text += "\n" + "\n".join(f"warning: {w}" for w in warnings)
    return text


def _bits(bytes_per_s: float | None) -> float | None:
    return None if bytes_per_s is None else bytes_per_s * 8.0


# ---- links ---------------------------------------------------------------------------

LINK_HEADERS = ("HOST", "PEER", "PEER HOST", "UP", "SOCKETS", "DATA IDLE/LEASED", "SENT", "RECEIVED", "TX",
                "RX", "CEILING", "RETRANS", "RTT")


def _data_sockets(link: dict) -> str:
    pool = link.get("data_sockets")
    return NA if not pool else f"{pool.get('idle', 0)}/{pool.get('leased', 0)}"


def link_rows(host: str, links: list[dict]) -> list[list[str]]:
    rows = []
    for link in sorted(links, key=lambda x: str(x.get("peer"))):
        up = link.get("up")
        rows.append([
            host, link.get("peer") or NA, link.get("host") or NA,
            NA if up is None else ("up" if up else "DOWN"),
            NA if link.get("sockets") is None else str(link["sockets"]),
            _data_sockets(link),
            human_bytes(link.get("sent_bytes")), human_bytes(link.get("received_bytes")),
            human_bits_rate(_bits(link.get("tx_bytes_per_s"))),
            human_bits_rate(_bits(link.get("rx_bytes_per_s"))),
            human_bits_rate(link.get("ceiling_bits_per_s")),
            "n/a" if link.get("retransmits") is None else str(link["retransmits"]),
            NA if link.get("rtt_ms") is None else f"{link['rtt_ms']:.2f} ms",
        ])
    return rows


def _per_host_table(headers, per_host: list[tuple[str, list[dict] | None, str | None]],
                    rows_of: Callable[[str, list[dict]], list[list[str]]], empty: str, wide: bool = False) -> str:
    """One table over every daemon's items; daemons that did not answer are listed below it."""
    rows, errors = [], []
    for host, items, error in per_host:
        if items is None:
            errors.append(f"{host}: {error}")
        else:
            rows.extend(rows_of(host, items))
    text = table(headers, rows) if rows else empty
    return text + "".join(f"\nunreachable: {e}" for e in errors)


def links_table(per_host: list[tuple[str, list[dict] | None, str | None]], wide: bool = False) -> str:
    return _per_host_table(LINK_HEADERS, per_host, link_rows, "no links", wide)


def topology_text(view: dict, wide: bool = False) -> str:
    """``mcclctl links --topology``: one row per switch, then what the inference saw."""
    source = {"file": "MCCL_TOPOLOGY", "rtt": "inferred from RTTs", "mixed": "MCCL_TOPOLOGY on some daemons only"}
    rows = [[name, str(len(hosts)), " ".join(hosts)] for name, hosts in sorted(view["switches"].items())]
    out = [f"switches: {len(rows)} ({source.get(view['source'], view['source'])})",
           table(("SWITCH", "HOSTS", "MEMBERS"), rows)]
    rtt = view.get("rtt") or {}
    if view["source"] != "file":
        near, far = rtt.get("near_rtt_s"), rtt.get("far_rtt_s")
        split = (f"near {near * 1e6:.0f} us, far {far * 1e6:.0f} us" if near and far
                 else "no clear gap: one switch")
        out.append(f"RTT pairs measured: {rtt.get('pairs_measured', 0)} among {rtt.get('hosts', 0)} hosts; {split}")
    unknown = sorted(h for h, s in view.get("daemons", {}).items() if not s)
    if unknown:
        out.append("no switch yet (jobs run flat): " + " ".join(unknown))
    for host, err in sorted((view.get("errors") or {}).items()):
        out.append(f"{host}: unreachable: {truncate(err, _w(80, wide))}")
    return "\n".join(out)


# ---- jobs ----------------------------------------------------------------------------

JOB_HEADERS = ("HOST", "JOB", "STATUS", "AGE", "RANKS", "WORLD", "COMPRESSION", "COLLECTIVES", "BYTES", "OVERLAP",
               "SHARE@SAMPLES/S")
# The daemon's job states (mccld/jobs/job.py, and "ended" once it left the table) as shown.
JOB_STATUS = {"joining": "starting", "ready": "running", "failed": "failed", "closed": "ending", "ended": "ended"}


def job_status(job: dict) -> str:
    """STATUS of a job: "running", "failed", or "ended (5m ago)" / "failed (5m ago)" once over."""
    state = job.get("state")
    if state != "ended":
        return JOB_STATUS.get(state, state) if state else NA
    word = "failed" if job.get("outcome") == "failed" else "ended"
    ago = job.get("ended_s_ago")
    return word if ago is None else f"{word} ({human_duration(max(0.0, ago))} ago)"


def job_rows(host: str, jobs: list[dict]) -> list[list[str]]:
    rows = []
    for job in sorted(jobs, key=lambda j: (j.get("state") == "ended", str(j.get("job")))):
        overlap = job.get("overlap") or {}
        ov = NA if not overlap else f"{sum(overlap.values()) / len(overlap):.2f}"
        ranks = job.get("ranks")
        rows.append([host, job.get("job") or NA, job_status(job), human_duration(job.get("age_s")),
                     NA if ranks is None else ",".join(str(r) for r in ranks),
                     NA if job.get("world") is None else str(job["world"]), _compression_text(job),
                     str(job.get("collectives", NA)), human_bytes(job.get("bytes")), ov, _balance_text(job)])
    return rows


def _compression_text(job: dict) -> str:
    """The job's MCCL_COMPRESSION and, once it sent some, the ratio it achieved across hosts
    (input / encoded bytes), e.g. ``int8 3.76x``."""
    codec = job.get("compression")
    if codec is None:
        return NA   # an mccld too old to say
    given, encoded = job.get("allreduce_input_bytes") or 0, job.get("allreduce_encoded_bytes") or 0
    return f"{codec} {given / encoded:.2f}x" if codec != "off" and encoded else str(codec)


def _balance_text(job: dict) -> str:
    """Each local rank's batch share and measured speed (SpeedBalancer), e.g. ``0:11@12.3 1:5@6.1``."""
    bal = job.get("balance") or {}
    if not bal:
        return NA
    return " ".join(f"{r}:{b['share']}@{b['speed']:.1f}" for r, b in sorted(bal.items(), key=lambda kv: int(kv[0])))


def jobs_table(per_host: list[tuple[str, list[dict] | None, str | None]], wide: bool = False) -> str:
    return _per_host_table(JOB_HEADERS, per_host, job_rows, "no jobs", wide)


# ---- capacity --------------------------------------------------------------------------

CAPACITY_HEADERS = ("HOST", "HARVEST", "FOR", "USER IDLE", "CORES", "MEMORY", "DEVICE", "HOURS/NIGHT",
                    "NIGHTS", "WHY")


def capacity_row(host: str, cap: dict | None, error: str | None, now: float, wide: bool = False) -> list[str]:
    """One row of ``mcclctl capacity``; ``now`` (epoch s) dates the state's start."""
    if cap is None:
        return [host, "unreachable", NA, NA, NA, NA, NA, NA, NA, truncate(error, _w(60, wide))]
    h = cap.get("harvest") or {}
    per_night = h.get("harvestable_s_per_night")
    since = h.get("since")
    return [
        cap.get("host") or host,
        harvest_state(h),
        NA if since is None else human_duration(max(0.0, now - since)),
        human_duration(h.get("idle_s")),
        NA if cap.get("cores") is None else str(cap["cores"]),
        human_bytes(cap.get("memory_bytes")),
        cap.get("device") or NA,
        NA if per_night is None else f"{per_night / 3600:.1f}",
        str(h.get("nights", 0)),
        truncate(h.get("reason"), _w(50, wide)),
    ]


def harvestable_totals(caps: Iterable[dict]) -> dict:
    """What the fleet can lend now: hosts whose user left them (idle or leased), their sum."""
    hosts, cores, memory, devices = [], 0, 0, {}
    for cap in caps:
        if (cap.get("harvest") or {}).get("state") not in HARVESTED_STATES:
            continue
        hosts.append(cap.get("host"))
        cores += int(cap.get("cores") or 0)
        memory += int(cap.get("memory_bytes") or 0)
        kind = cap.get("device") or "unknown"
        devices[kind] = devices.get(kind, 0) + 1
    return {"hosts": sorted(h for h in hosts if h), "cores": cores, "memory_bytes": memory, "devices": devices}


def capacity_table(rows: list[tuple[str, dict | None, str | None]], now: float,
                   warnings: Sequence[str] = (), wide: bool = False) -> str:
    text = table(CAPACITY_HEADERS, [capacity_row(h, c, e, now, wide) for h, c, e in rows])
    notes = reclaim_notes([(c.get("host") or h, c.get("harvest")) for h, c, _ in rows if c is not None], now)
    if notes:
        text += "\n" + "\n".join(notes)
    t = harvestable_totals(c for _, c, _ in rows if c is not None)
    devices = ", ".join(f"{n} x {kind}" for kind, n in sorted(t["devices"].items())) or "none"
    text += (f"\nharvestable now: {len(t['hosts'])} of {len(rows)} hosts, {t['cores']} cores, "
             f"{human_bytes(t['memory_bytes'])} memory; devices: {devices}")
    if warnings:
        text += "\n" + "\n".join(f"warning: {w}" for w in warnings)
    return text


# ---- linktest, doctor ------------------------------------------------------------------

def linktest_line(a: str, b: str, result: dict) -> str:
    return (f"{a} -> {b} ({result.get('peer_address')}): {human_bits_rate(result.get('bits_per_s'))} "
            f"goodput, {human_bytes(result.get('bytes'))} in {result.get('seconds', 0):.2f} s over "
            f"{result.get('streams')} stream(s); recorded as the link's ceiling on {a}")


DOCTOR_MARK = {"ok": "[ ok ]", "warn": "[warn]", "fail": "[FAIL]", "skip": "[skip]"}


def doctor_report(checks: list[dict]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{DOCTOR_MARK.get(c['status'], '[ ?? ]')} {c['name']}: {c['detail']}")
        if c.get("fix") and c["status"] in ("warn", "fail"):
            lines.append(f"       fix: {c['fix']}")
    failed = sum(1 for c in checks if c["status"] == "fail")
    warned = sum(1 for c in checks if c["status"] == "warn")
    lines.append(f"{len(checks)} checks: {failed} failed, {warned} warnings")
    return "\n".join(lines)


# ---- run ---------------------------------------------------------------------------------

def to_json_line(data: Any) -> str:
    """One event of a stream (``mcclctl run --json``): one compact line each."""
    return json.dumps(data, sort_keys=True, default=str)


def host_line(host: str, width: int, line: str) -> str:
    return f"[{host:<{width}}] {line}"


def run_event(kind: str, data: dict) -> str:
    """What ``mcclctl run`` says about the job itself (not its output), one or a few lines."""
    if kind == "plan":
        lines = [f"mcclctl run: job {data['job']} on {len(data['hosts'])} host(s): {', '.join(data['hosts'])} "
                 f"(nnodes {data['nnodes']}, anchor {data['anchor']})"]
        if data.get("fleet"):
            lines.append(f"  {data['fleet']}")
        lines += [f"  left out {h}: {why}" for h, why in sorted(data.get("left_out", {}).items())]
        return "\n".join(lines)
    if kind == "exit":
        codes = data["codes"]
        parts = [f"{h}={c}" for h, c in sorted(codes.items())]
        return f"mcclctl run: {'finished' if data.get('rc') == 0 else 'failed'}: " + ", ".join(parts)
    return f"mcclctl run: {kind}: {data.get('message', data)}"

