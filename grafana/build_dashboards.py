"""Generates dashboards/mccl-fleet.json and dashboards/mccl-job.json with Grafana's typed
builder, grafana-foundation-sdk (Apache-2.0; pinned in scripts/setup.sh).

The dashboards are code so that every panel uses the same datasource variable, the
same host join and the same label conventions; the JSON files are committed so the
folder can be dropped into Grafana's provisioning directory as is. Re-run after an
edit: ``python grafana/build_dashboards.py``; tests/e2e/test_grafana_queries.py runs every
query below against a real Prometheus, tests/project/test_grafana_dashboards.py checks the
committed JSON is what this produces.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, dashboard, prometheus, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as model

DS = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
INST = 'instance=~"$instance"'
# Series are per scrape target (instance); joining mccl_build_info adds the host name.
HOSTNAME = "* on (instance) group_left (hostname) max by (instance, hostname) (mccl_build_info)"

_KINDS = {"stat": stat.Panel, "table": table.Panel, "state-timeline": statetimeline.Panel,
          "timeseries": timeseries.Panel, "bargauge": bargauge.Panel}


def panel(kind: str, title: str, targets: list[tuple[str, str]], *, unit: str = "short", w: int = 12,
          h: int = 8, description: str = "", instant: bool = False):
    """One panel of ``kind`` with its PromQL targets (expr, legend); the dashboard places it."""
    p = (_KINDS[kind]().title(title).description(description).datasource(DS).unit(unit).span(w).height(h))
    for i, (expr, legend) in enumerate(targets):
        q = prometheus.Dataquery().ref_id(chr(ord("A") + i)).datasource(DS).expr(expr).legend_format(legend)
        p.with_target(q.instant() if instant else q.range())
    return p


def value_names(names: dict[int, tuple[str, str]]) -> list[model.ValueMap]:
    """A state code's text and colour, for the state timelines."""
    return [model.ValueMap({str(v): model.ValueMappingResult(text=text, color=color)
                            for v, (text, color) in names.items()})]


def datasource_var():
    return (dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
            .current(model.VariableOption(text="MCCL Prometheus", value="mccl-prometheus")))


def query_var(name: str, label: str, query: str, include_all: bool = True):
    v = (dashboard.QueryVariable(name).label(label).datasource(DS).query(query)
         .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(model.VariableSort.ALPHABETICAL_ASC))
    if include_all:
        v = (v.include_all(True).multi(True).all_value(".+")
             .current(model.VariableOption(text="All", value="$__all")))
    return v


def board(uid: str, title: str, panels: list, variables: list, description: str) -> dict:
    """The dashboard as JSON-ready dicts; panels are numbered and laid out left to right, in order,
    the SDK starting a new line of the grid once one is full."""
    d = (dashboard.Dashboard(title).uid(uid).description(description).tags(["mccl"]).timezone("browser")
         .editable().tooltip(model.DashboardCursorSync.CROSSHAIR).refresh("10s").time("now-1h", "now")
         .version(1))
    for i, p in enumerate(panels, 1):
        # A row starts a new line of the grid whatever is left of the one before it.
        d.with_row(p.id(i)) if isinstance(p, dashboard.Row) else d.with_panel(p.id(i))
    for v in variables:
        d.with_variable(v)
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def fleet() -> dict:
    links_down = (dashboard.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE)
                  .steps([model.Threshold(None, "green"), model.Threshold(1, "red")]))
    panels = [
        panel("stat", "Hosts up", [
            (f'sum(up{{job="$scrape_job", {INST}}})', "up"),
            (f'count(up{{job="$scrape_job", {INST}}})', "known")], w=4, h=5, instant=True,
            description="Daemons Prometheus scraped successfully / all scrape targets"),
        panel("stat", "Hosts training", [
            (f'sum(mccl_host_state{{state="training", {INST}}})', "training"),
            # mccl_host_state's "idle" is a daemon without a job: shown as "ready", as mcclctl does,
            # since "idle" in the harvest panels means the host's user left it.
            (f'sum(mccl_host_state{{state="idle", {INST}}})', "ready")], w=4, h=5, instant=True),
        panel("stat", "Peer links down", [
            (f"sum(1 - mccl_peer_up{{{INST}}})", "down")], w=4, h=5, instant=True,
            description="Links a daemon reports down; 0 is healthy").thresholds(links_down),
        panel("stat", "Attached processes", [
            (f"sum(mccl_attached_processes{{{INST}}})", "attached")], w=4, h=5, instant=True),
        panel("stat", "Errors (1 h)", [
            (f"sum(increase(mccl_errors_total{{{INST}}}[1h]))", "errors")], w=4, h=5, instant=True),
        panel("stat", "Slowest link ceiling", [
            (f"min(mccl_link_ceiling_bytes_per_second{{{INST}}}) * 8", "bit/s")], unit="bps",
            w=4, h=5, instant=True, description="Lowest goodput measured by `mcclctl linktest`"),
        panel("table", "Hosts", [
            (f"max by (instance, hostname, version) (mccl_build_info{{{INST}}})", "build"),
            (f"max by (instance, state) (mccl_host_state{{{INST}}} == 1) {HOSTNAME}", "state"),
            (f"max by (instance) (mccl_uptime_seconds{{{INST}}}) {HOSTNAME}", "uptime")],
            w=24, h=6, instant=True).with_transformation(model.DataTransformerConfig(id_val="merge", options={})),
        panel("state-timeline", "Host state", [
            (f'max by (instance) (mccl_host_state{{state="training", {INST}}}) {HOSTNAME}',
             "{{hostname}}")], w=24, h=5).mappings(value_names({0: ("ready", "blue"), 1: ("training", "green")})),
        panel("timeseries", "Fleet bandwidth (all links)", [
            (f"sum(rate(mccl_peer_sent_bytes_total{{{INST}}}[{RATE}]))", "tx"),
            (f"sum(rate(mccl_peer_received_bytes_total{{{INST}}}[{RATE}]))", "rx")], unit="Bps"),
        panel("timeseries", "Bandwidth per host (tx)", [
            (f"sum by (instance) (rate(mccl_peer_sent_bytes_total{{{INST}}}[{RATE}])) {HOSTNAME}",
             "{{hostname}} tx"),
            (f"sum by (instance) (rate(mccl_peer_received_bytes_total{{{INST}}}[{RATE}])) {HOSTNAME}",
             "{{hostname}} rx")], unit="Bps"),
        panel("timeseries", "Bus bandwidth % of link goodput", [
            (f"max by (instance, op) (mccl_busbw_link_ratio{{{INST}}}) {HOSTNAME}",
             "{{hostname}} {{op}}")], unit="percentunit",
            description="Bus bandwidth of the last 10 s of collectives / the slowest live link's "
                        "ceiling from `mcclctl linktest`. Near 1: the network is the limit."),
        panel("timeseries", "Bus bandwidth by op", [
            (f"sum by (op) (rate(mccl_collective_bus_bytes_total{{{INST}}}[{RATE}])) / "
             f"sum by (op) (rate(mccl_collective_duration_seconds_sum{{{INST}}}[{RATE}]))", "{{op}}"),
            (f"max by (op) (mccl_busbw_bytes_per_second{{{INST}}})", "{{op}} (daemon, 10 s)")],
            unit="Bps", description="nccl-tests bus bandwidth: bytes each link carried / time in "
                                    "collectives"),
        panel("timeseries", "All-reduce latency p50 / p99 by size", [
            (f'histogram_quantile(0.5, sum by (le, size_bucket) (rate(mccl_collective_duration_seconds_bucket'
             f'{{op="allreduce", {INST}}}[{RATE}])))', "p50 {{size_bucket}}"),
            (f'histogram_quantile(0.99, sum by (le, size_bucket) (rate(mccl_collective_duration_seconds_bucket'
             f'{{op="allreduce", {INST}}}[{RATE}])))', "p99 {{size_bucket}}")], unit="s"),
        panel("timeseries", "Collectives per second", [
            (f"sum by (op) (rate(mccl_collective_duration_seconds_count{{{INST}}}[{RATE}]))", "{{op}}")],
            unit="ops"),
        panel("timeseries", "Overlap ratio", [
            (f"avg by (job_id) (mccl_overlap_ratio{{{INST}}})", "{{job_id}}"),
            (f"min by (job_id) (mccl_overlap_ratio{{{INST}}})", "{{job_id}} worst rank")],
            unit="percentunit", description="1 - exposed communication time / total communication "
                                            "time, as training processes report it"),
        panel("timeseries", "Errors by kind", [
            (f"sum by (kind) (increase(mccl_errors_total{{{INST}}}[5m]))", "{{kind}}")], unit="short"),
        panel("timeseries", "Peer links up", [
            (f"sum by (instance) (mccl_peer_up{{{INST}}}) {HOSTNAME}", "{{hostname}} up"),
            (f"count by (instance) (mccl_peer_up{{{INST}}}) {HOSTNAME}", "{{hostname}} known")],
            unit="short", description="Links each daemon has up, out of the peers it knows"),
        *harvest_panels(),
    ]
    variables = [datasource_var(),
                 query_var("scrape_job", "Scrape job", "label_values(mccl_build_info, job)", False),
                 query_var("instance", "Host", "label_values(mccl_build_info, instance)")]
    return board("mccl-fleet", "MCCL fleet", panels, variables,
                 "Every MCCL daemon of the fleet: health, bandwidth, latency, overlap, errors")


def harvest_panels() -> list:
    """What the fleet can borrow from hosts whose users left them (docs/harvesting.md)."""
    # 1 on a host whose user left it to the fleet (idle or leased), 0 elsewhere: multiplying by it
    # keeps every host in the sum, so an all-busy fleet reads 0, not "no data".
    harvested = f'sum by (instance) (mccl_harvest_state{{state=~"idle|leased", {INST}}})'
    state_code = (f'(max by (instance) (mccl_harvest_state{{state="idle", {INST}}}) '
                  f'+ 2 * max by (instance) (mccl_harvest_state{{state="leased", {INST}}}) '
                  f'+ 3 * max by (instance) (mccl_harvest_state{{state="draining", {INST}}}))')
    return [
        dashboard.Row("Harvesting"),
        panel("stat", "Hosts by harvest state", [
            (f"sum by (state) (mccl_harvest_state{{{INST}}})", "{{state}}")], w=6, h=5, instant=True,
            description="busy: the user is there; idle: harvestable, free; leased: harvestable, running a "
                        "job; draining: the user came back, the job finishes"),
        panel("stat", "Harvestable now", [
            (f"sum({harvested})", "hosts"),
            (f"sum(mccl_host_cpu_cores{{{INST}}} * on (instance) {harvested})", "cores")],
            w=6, h=5, instant=True, description="Hosts idle or leased, and their CPU cores (`mcclctl capacity`)"),
        panel("stat", "Harvestable memory", [
            (f"sum(mccl_host_memory_bytes{{{INST}}} * on (instance) {harvested})", "memory")],
            unit="bytes", w=6, h=5, instant=True),
        panel("bargauge", "Harvestable hours per night", [
            (f"max by (instance) (mccl_harvestable_seconds_per_night{{{INST}}}) / 3600 {HOSTNAME}",
             "{{hostname}}")], unit="h", w=6, h=5, instant=True,
            description="Mean hours per night (noon to noon) each host was idle or leased, over the last "
                        "complete nights of its history (at most 7)"),
        panel("state-timeline", "Harvest state", [(f"{state_code} {HOSTNAME}", "{{hostname}}")], w=24, h=5)
        .mappings(value_names({0: ("busy", "blue"), 1: ("idle", "green"), 2: ("leased", "purple"),
                               3: ("draining", "orange")})),
        panel("timeseries", "Time since user input", [
            (f"max by (instance) (mccl_host_idle_seconds{{{INST}}}) {HOSTNAME}", "{{hostname}}")],
            unit="s", w=24, description="A host becomes idle after MCCL_IDLE_AFTER seconds without input"),
        panel("timeseries", "Hand-back to the user (reclaim latency)", [
            (f"histogram_quantile({q}, sum by (le) (mccl_reclaim_seconds_bucket{{{INST}}}))", f"p{round(q * 100)}")
            for q in (0.5, 0.99)] + [
            (f"histogram_quantile(0.99, sum by (le, how) (mccl_reclaim_seconds_bucket{{{INST}}}))",
             "p99 {{how}}")], unit="s", w=18,
            description="Seconds from a host's user coming back to the host free of job processes, over the "
                        "hand-backs since the daemons started. left: the jobs left at a step boundary (or "
                        "ended); removed: MCCL_RECLAIM_GRACE ran out (the promise: grace + 10 s at most)"),
        panel("stat", "Hand-backs by outcome", [
            (f"sum by (how) (mccl_reclaim_seconds_count{{{INST}}})", "{{how}}")], w=6, instant=True,
            description="How many times a host was handed back to its user, since the daemons started"),
    ]


def job() -> dict:
    # Host-level series restricted to the hosts that run the selected job.
    on_job = f'and on (instance) mccl_job_world_size{{job_id=~"$job_id"}}'
    panels = [
        panel("stat", "World size", [(f'max(mccl_job_world_size{{job_id=~"$job_id"}})', "ranks")],
              w=6, h=5, instant=True),
        panel("stat", "Hosts in the job", [(f'count(mccl_job_world_size{{job_id=~"$job_id"}})', "hosts")],
              w=6, h=5, instant=True),
        panel("stat", "Mean overlap", [(f'avg(mccl_overlap_ratio_mean{{job_id=~"$job_id"}})', "mean")],
              unit="percentunit", w=6, h=5, instant=True),
        panel("stat", "Collectives per second", [
            (f'sum(rate(mccl_job_collectives_total{{job_id=~"$job_id"}}[{RATE}]))', "ops/s")],
            unit="ops", w=6, h=5, instant=True),
        panel("timeseries", "Overlap ratio per rank", [
            (f'mccl_overlap_ratio{{job_id=~"$job_id"}}', "rank {{rank}}"),
            (f'mccl_overlap_ratio_mean{{job_id=~"$job_id"}}', "rank {{rank}} mean")], unit="percentunit"),
        panel("timeseries", "Job traffic", [
            (f'sum by (instance) (rate(mccl_job_bytes_total{{job_id=~"$job_id"}}[{RATE}])) {HOSTNAME}',
             "{{hostname}}")], unit="Bps", description="Collective buffer bytes per second, per host"),
        panel("timeseries", "All-reduce bytes across hosts, before and after compression", [
            (f'sum by (instance, compression) (rate(mccl_job_allreduce_input_bytes_total{{job_id=~"$job_id"}}'
             f'[{RATE}])) {HOSTNAME}', "{{hostname}} before ({{compression}})"),
            (f'sum by (instance, compression) (rate(mccl_job_allreduce_encoded_bytes_total{{job_id=~"$job_id"}}'
             f'[{RATE}])) {HOSTNAME}', "{{hostname}} after ({{compression}})")], unit="Bps",
            description="What each host contributed to the job's all-reduces across hosts per second, as "
                        "float bytes and as encoded for the wire (MCCL_COMPRESSION; equal when off)"),
        panel("timeseries", "Collective latency p50 / p99 (job hosts)", [
            (f"histogram_quantile(0.5, sum by (le, op) (rate(mccl_collective_duration_seconds_bucket[{RATE}]) "
             f"{on_job}))", "p50 {{op}}"),
            (f"histogram_quantile(0.99, sum by (le, op) (rate(mccl_collective_duration_seconds_bucket[{RATE}]) "
             f"{on_job}))", "p99 {{op}}")], unit="s"),
        panel("timeseries", "Bus bandwidth (job hosts)", [
            (f"sum by (op) (rate(mccl_collective_bus_bytes_total[{RATE}]) {on_job}) / "
             f"sum by (op) (rate(mccl_collective_duration_seconds_sum[{RATE}]) {on_job})", "{{op}}")],
            unit="Bps"),
        panel("timeseries", "Bus bandwidth % of link goodput (job hosts)", [
            (f"max by (instance, op) (mccl_busbw_link_ratio {on_job}) {HOSTNAME}",
             "{{hostname}} {{op}}")], unit="percentunit"),
        panel("timeseries", "Link bandwidth (job hosts)", [
            (f"sum by (instance) (rate(mccl_peer_sent_bytes_total[{RATE}]) {on_job}) {HOSTNAME}",
             "{{hostname}} tx")], unit="Bps"),
        panel("timeseries", "Errors (job hosts)", [
            (f"sum by (kind) (increase(mccl_errors_total[5m]) {on_job})", "{{kind}}")]),
    ]
    variables = [datasource_var(),
                 query_var("job_id", "Job", "label_values(mccl_job_world_size, job_id)", False)]
    return board("mccl-job", "MCCL training job", panels, variables,
                 "One training job: its ranks' overlap, and the hosts it runs on")


def main() -> None:
    out = Path(__file__).resolve().parent / "dashboards"
    out.mkdir(exist_ok=True)
    for name, built in (("mccl-fleet.json", fleet()), ("mccl-job.json", job())):
        (out / name).write_text(json.dumps(built, indent=2) + "\n")


if __name__ == "__main__":
    main()
