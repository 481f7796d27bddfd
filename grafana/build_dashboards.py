"""Generates dashboards/mccl-fleet.json and dashboards/mccl-job.json.

The dashboards are code so that every panel uses the same datasource variable, the
same host join and the same label conventions; the JSON files are committed so the
folder can be dropped into Grafana's provisioning directory as is. Re-run after an
edit: ``python grafana/build_dashboards.py``; tests/e2e/test_grafana_queries.py runs every
query below against a real Prometheus.
"""

from __future__ import annotations

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
INST = 'instance=~"$instance"'
# Series are per scrape target (instance); joining mccl_build_info adds the host name.
HOSTNAME = "* on (instance) group_left (hostname) max by (instance, hostname) (mccl_build_info)"


class Layout:
    """Places panels left to right on Grafana's 24-column grid."""

    def __init__(self) -> None:
        self.x = self.y = self.row_h = 0
        self.next_id = 1

    def place(self, w: int, h: int) -> dict:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos


def panel(layout: Layout, kind: str, title: str, targets: list[tuple[str, str]], *, unit: str = "short",
          w: int = 12, h: int = 8, description: str = "", instant: bool = False,
          extra: dict | None = None) -> dict:
    p = {
        "id": layout.next_id, "type": kind, "title": title, "description": description,
        "datasource": DS, "gridPos": layout.place(w, h),
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend,
                     "instant": instant, "range": not instant}
                    for i, (expr, legend) in enumerate(targets)],
    }
    if extra:
        p.update(extra)
    layout.next_id += 1
    return p


def datasource_var() -> dict:
    return {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
            "current": {"text": "MCCL Prometheus", "value": "mccl-prometheus"}, "hide": 0,
            "refresh": 1, "regex": "", "options": []}


def query_var(name: str, label: str, query: str, include_all: bool = True) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
            "refresh": 2, "includeAll": include_all, "multi": include_all,
            "allValue": ".+" if include_all else None, "sort": 1,
            "current": {"text": "All", "value": "$__all"} if include_all else {}, "options": []}


def dashboard(uid: str, title: str, panels: list[dict], variables: list[dict], description: str) -> dict:
    return {"uid": uid, "title": title, "description": description, "tags": ["mccl"],
            "timezone": "browser", "schemaVersion": 39, "version": 1, "editable": True,
            "graphTooltip": 1, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
            "templating": {"list": variables}, "annotations": {"list": []}, "panels": panels}


def fleet() -> dict:
    L = Layout()
    panels = [
        panel(L, "stat", "Hosts up", [
            (f'sum(up{{job="$scrape_job", {INST}}})', "up"),
            (f'count(up{{job="$scrape_job", {INST}}})', "known")], w=4, h=5, instant=True,
            description="Daemons Prometheus scraped successfully / all scrape targets"),
        panel(L, "stat", "Hosts training", [
            (f'sum(mccl_host_state{{state="training", {INST}}})', "training"),
            (f'sum(mccl_host_state{{state="idle", {INST}}})', "idle")], w=4, h=5, instant=True),
        panel(L, "stat", "Peer links down", [
            (f"sum(1 - mccl_peer_up{{{INST}}})", "down")], w=4, h=5, instant=True,
            description="Links a daemon reports down; 0 is healthy",
            extra={"fieldConfig": {"defaults": {"unit": "short", "thresholds": {
                "mode": "absolute", "steps": [{"color": "green", "value": None},
                                              {"color": "red", "value": 1}]}}, "overrides": []}}),
        panel(L, "stat", "Attached processes", [
            (f"sum(mccl_attached_processes{{{INST}}})", "attached")], w=4, h=5, instant=True),
        panel(L, "stat", "Errors (1 h)", [
            (f"sum(increase(mccl_errors_total{{{INST}}}[1h]))", "errors")], w=4, h=5, instant=True),
        panel(L, "stat", "Slowest link ceiling", [
            (f"min(mccl_link_ceiling_bytes_per_second{{{INST}}}) * 8", "bit/s")], unit="bps",
            w=4, h=5, instant=True, description="Lowest goodput measured by `mcclctl linktest`"),
        panel(L, "table", "Hosts", [
            (f"max by (instance, hostname, version) (mccl_build_info{{{INST}}})", "build"),
            (f"max by (instance, state) (mccl_host_state{{{INST}}} == 1) {HOSTNAME}", "state"),
            (f"max by (instance) (mccl_uptime_seconds{{{INST}}}) {HOSTNAME}", "uptime")],
            w=24, h=6, instant=True, extra={"transformations": [{"id": "merge", "options": {}}]}),
        panel(L, "state-timeline", "Host state", [
            (f'max by (instance) (mccl_host_state{{state="training", {INST}}}) {HOSTNAME}',
             "{{hostname}}")], w=24, h=5,
            extra={"fieldConfig": {"defaults": {"unit": "short", "mappings": [
                {"type": "value", "options": {"0": {"text": "idle", "color": "blue"},
                                              "1": {"text": "training", "color": "green"}}}]},
                "overrides": []}}),
        panel(L, "timeseries", "Fleet bandwidth (all links)", [
            (f"sum(rate(mccl_peer_sent_bytes_total{{{INST}}}[{RATE}]))", "tx"),
            (f"sum(rate(mccl_peer_received_bytes_total{{{INST}}}[{RATE}]))", "rx")], unit="Bps"),
        panel(L, "timeseries", "Bandwidth per host (tx)", [
            (f"sum by (instance) (rate(mccl_peer_sent_bytes_total{{{INST}}}[{RATE}])) {HOSTNAME}",
             "{{hostname}} tx"),
            (f"sum by (instance) (rate(mccl_peer_received_bytes_total{{{INST}}}[{RATE}])) {HOSTNAME}",
             "{{hostname}} rx")], unit="Bps"),
        panel(L, "timeseries", "Bus bandwidth % of link goodput", [
            (f"max by (instance, op) (mccl_busbw_link_ratio{{{INST}}}) {HOSTNAME}",
             "{{hostname}} {{op}}")], unit="percentunit",
            description="Bus bandwidth of the last 10 s of collectives / the slowest live link's "
                        "ceiling from `mcclctl linktest`. Near 1: the network is the limit."),
        panel(L, "timeseries", "Bus bandwidth by op", [
            (f"sum by (op) (rate(mccl_collective_bus_bytes_total{{{INST}}}[{RATE}])) / "
             f"sum by (op) (rate(mccl_collective_duration_seconds_sum{{{INST}}}[{RATE}]))", "{{op}}"),
            (f"max by (op) (mccl_busbw_bytes_per_second{{{INST}}})", "{{op}} (daemon, 10 s)")],
            unit="Bps", description="nccl-tests bus bandwidth: bytes each link carried / time in "
                                    "collectives"),
        panel(L, "timeseries", "All-reduce latency p50 / p99 by size", [
            (f'histogram_quantile(0.5, sum by (le, size_bucket) (rate(mccl_collective_duration_seconds_bucket'
             f'{{op="allreduce", {INST}}}[{RATE}])))', "p50 {{size_bucket}}"),
            (f'histogram_quantile(0.99, sum by (le, size_bucket) (rate(mccl_collective_duration_seconds_bucket'
             f'{{op="allreduce", {INST}}}[{RATE}])))', "p99 {{size_bucket}}")], unit="s"),
        panel(L, "timeseries", "Collectives per second", [
            (f"sum by (op) (rate(mccl_collective_duration_seconds_count{{{INST}}}[{RATE}]))", "{{op}}")],
            unit="ops"),
        panel(L, "timeseries", "Overlap ratio", [
            (f"avg by (job_id) (mccl_overlap_ratio{{{INST}}})", "{{job_id}}"),
            (f"min by (job_id) (mccl_overlap_ratio{{{INST}}})", "{{job_id}} worst rank")],
            unit="percentunit", description="1 - exposed communication time / total communication "
                                            "time, as training processes report it"),
        panel(L, "timeseries", "Errors by kind", [
            (f"sum by (kind) (increase(mccl_errors_total{{{INST}}}[5m]))", "{{kind}}")], unit="short"),
        panel(L, "timeseries", "Peer links up", [
            (f"sum by (instance) (mccl_peer_up{{{INST}}}) {HOSTNAME}", "{{hostname}} up"),
            (f"count by (instance) (mccl_peer_up{{{INST}}}) {HOSTNAME}", "{{hostname}} known")],
            unit="short", description="Links each daemon has up, out of the peers it knows"),
        *harvest_panels(L),
    ]
    variables = [datasource_var(),
                 query_var("scrape_job", "Scrape job", "label_values(mccl_build_info, job)", False),
                 query_var("instance", "Host", "label_values(mccl_build_info, instance)")]
    return dashboard("mccl-fleet", "MCCL fleet", panels, variables,
                     "Every MCCL daemon of the fleet: health, bandwidth, latency, overlap, errors")


def harvest_panels(L: Layout) -> list[dict]:
    """What the fleet can borrow from hosts whose users left them (docs/harvesting.md)."""
    # 1 on a host whose user left it to the fleet (idle or leased), 0 elsewhere: multiplying by it
    # keeps every host in the sum, so an all-busy fleet reads 0, not "no data".
    harvested = f'sum by (instance) (mccl_harvest_state{{state=~"idle|leased", {INST}}})'
    state_code = (f'(max by (instance) (mccl_harvest_state{{state="idle", {INST}}}) '
                  f'+ 2 * max by (instance) (mccl_harvest_state{{state="leased", {INST}}}) '
                  f'+ 3 * max by (instance) (mccl_harvest_state{{state="draining", {INST}}}))')
    return [
        panel(L, "stat", "Hosts by harvest state", [
            (f"sum by (state) (mccl_harvest_state{{{INST}}})", "{{state}}")], w=6, h=5, instant=True,
            description="busy: the user is there; idle: harvestable, free; leased: harvestable, running a "
                        "job; draining: the user came back, the job finishes"),
        panel(L, "stat", "Harvestable now", [
            (f"sum({harvested})", "hosts"),
            (f"sum(mccl_host_cpu_cores{{{INST}}} * on (instance) {harvested})", "cores")],
            w=6, h=5, instant=True, description="Hosts idle or leased, and their CPU cores (`mcclctl capacity`)"),
        panel(L, "stat", "Harvestable memory", [
            (f"sum(mccl_host_memory_bytes{{{INST}}} * on (instance) {harvested})", "memory")],
            unit="bytes", w=6, h=5, instant=True),
        panel(L, "bargauge", "Harvestable hours per night", [
            (f"max by (instance) (mccl_harvestable_seconds_per_night{{{INST}}}) / 3600 {HOSTNAME}",
             "{{hostname}}")], unit="h", w=6, h=5, instant=True,
            description="Mean hours per night (noon to noon) each host was idle or leased, over the last "
                        "complete nights of its history (at most 7)"),
        panel(L, "state-timeline", "Harvest state", [
            (f"{state_code} {HOSTNAME}", "{{hostname}}")], w=24, h=5,
            extra={"fieldConfig": {"defaults": {"unit": "short", "mappings": [
                {"type": "value", "options": {"0": {"text": "busy", "color": "blue"},
                                              "1": {"text": "idle", "color": "green"},
                                              "2": {"text": "leased", "color": "purple"},
                                              "3": {"text": "draining", "color": "orange"}}}]},
                "overrides": []}}),
        panel(L, "timeseries", "Time since user input", [
            (f"max by (instance) (mccl_host_idle_seconds{{{INST}}}) {HOSTNAME}", "{{hostname}}")],
            unit="s", w=24, description="A host becomes idle after MCCL_IDLE_AFTER seconds without input"),
        panel(L, "timeseries", "Hand-back to the user (reclaim latency)", [
            (f"histogram_quantile({q}, sum by (le) (mccl_reclaim_seconds_bucket{{{INST}}}))", f"p{round(q * 100)}")
            for q in (0.5, 0.99)] + [
            (f"histogram_quantile(0.99, sum by (le, how) (mccl_reclaim_seconds_bucket{{{INST}}}))",
             "p99 {{how}}")], unit="s", w=18,
            description="Seconds from a host's user coming back to the host free of job processes, over the "
                        "hand-backs since the daemons started. left: the jobs left at a step boundary (or "
                        "ended); removed: MCCL_RECLAIM_GRACE ran out (the promise: grace + 10 s at most)"),
        panel(L, "stat", "Hand-backs by outcome", [
            (f"sum by (how) (mccl_reclaim_seconds_count{{{INST}}})", "{{how}}")], w=6, instant=True,
            description="How many times a host was handed back to its user, since the daemons started"),
    ]


def job() -> dict:
    L = Layout()
    # Host-level series restricted to the hosts that run the selected job.
    on_job = f'and on (instance) mccl_job_world_size{{job_id=~"$job_id"}}'
    panels = [
        panel(L, "stat", "World size", [(f'max(mccl_job_world_size{{job_id=~"$job_id"}})', "ranks")],
              w=6, h=5, instant=True),
        panel(L, "stat", "Hosts in the job", [(f'count(mccl_job_world_size{{job_id=~"$job_id"}})', "hosts")],
              w=6, h=5, instant=True),
        panel(L, "stat", "Mean overlap", [(f'avg(mccl_overlap_ratio_mean{{job_id=~"$job_id"}})', "mean")],
              unit="percentunit", w=6, h=5, instant=True),
        panel(L, "stat", "Collectives per second", [
            (f'sum(rate(mccl_job_collectives_total{{job_id=~"$job_id"}}[{RATE}]))', "ops/s")],
            unit="ops", w=6, h=5, instant=True),
        panel(L, "timeseries", "Overlap ratio per rank", [
            (f'mccl_overlap_ratio{{job_id=~"$job_id"}}', "rank {{rank}}"),
            (f'mccl_overlap_ratio_mean{{job_id=~"$job_id"}}', "rank {{rank}} mean")], unit="percentunit"),
        panel(L, "timeseries", "Job traffic", [
            (f'sum by (instance) (rate(mccl_job_bytes_total{{job_id=~"$job_id"}}[{RATE}])) {HOSTNAME}',
             "{{hostname}}")], unit="Bps", description="Collective buffer bytes per second, per host"),
        panel(L, "timeseries", "Collective latency p50 / p99 (job hosts)", [
            (f"histogram_quantile(0.5, sum by (le, op) (rate(mccl_collective_duration_seconds_bucket[{RATE}]) "
             f"{on_job}))", "p50 {{op}}"),
            (f"histogram_quantile(0.99, sum by (le, op) (rate(mccl_collective_duration_seconds_bucket[{RATE}]) "
             f"{on_job}))", "p99 {{op}}")], unit="s"),
        panel(L, "timeseries", "Bus bandwidth (job hosts)", [
            (f"sum by (op) (rate(mccl_collective_bus_bytes_total[{RATE}]) {on_job}) / "
             f"sum by (op) (rate(mccl_collective_duration_seconds_sum[{RATE}]) {on_job})", "{{op}}")],
            unit="Bps"),
        panel(L, "timeseries", "Bus bandwidth % of link goodput (job hosts)", [
            (f"max by (instance, op) (mccl_busbw_link_ratio {on_job}) {HOSTNAME}",
             "{{hostname}} {{op}}")], unit="percentunit"),
        panel(L, "timeseries", "Link bandwidth (job hosts)", [
            (f"sum by (instance) (rate(mccl_peer_sent_bytes_total[{RATE}]) {on_job}) {HOSTNAME}",
             "{{hostname}} tx")], unit="Bps"),
        panel(L, "timeseries", "Errors (job hosts)", [
            (f"sum by (kind) (increase(mccl_errors_total[5m]) {on_job})", "{{kind}}")]),
    ]
    variables = [datasource_var(),
                 query_var("job_id", "Job", "label_values(mccl_job_world_size, job_id)", False)]
    return dashboard("mccl-job", "MCCL training job", panels, variables,
                     "One training job: its ranks' overlap, and the hosts it runs on")


def main() -> None:
    out = Path(__file__).resolve().parent / "dashboards"
    out.mkdir(exist_ok=True)
    for name, board in (("mccl-fleet.json", fleet()), ("mccl-job.json", job())):
        (out / name).write_text(json.dumps(board, indent=2) + "\n")


if __name__ == "__main__":
    main()
