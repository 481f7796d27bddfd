"""A real Prometheus server for tests: free loopback port, temp config and data dir.

``with PrometheusServer(targets) as prom:`` starts /usr/bin/prometheus scraping the
given ``host:port`` targets every second, waits (bounded) until it is ready, and always
stops it and removes its directory, also when the test fails.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from .ports import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SCRAPE_INTERVAL_S = 1
RATE_INTERVAL = "10s"   # what Grafana makes of $__rate_interval at 1 s scrapes
DASHBOARDS = sorted((Path(__file__).resolve().parents[2] / "grafana" / "dashboards").glob("*.json"))


def available() -> bool:
    return os.access(PROMETHEUS, os.X_OK)


class PrometheusServer:
    def __init__(self, targets: dict[str, dict[str, str]], scrape_job: str = "mccl",
                 ready_timeout_s: float = 30.0, exec_prefix: list[str] | None = None,
                 listen_host: str = "127.0.0.1") -> None:
        """``targets``: {"host:port": {label: value}} scraped at 1 s under ``scrape_job``.

        ``exec_prefix`` (e.g. ``Fleet.exec_argv(0, [])``) runs Prometheus inside a network
        namespace; its HTTP API is then reached with curl run through the same prefix.
        """
        self.targets = targets
        self.scrape_job = scrape_job
        self.ready_timeout_s = ready_timeout_s
        self.exec_prefix = list(exec_prefix or [])
        self.listen_host = listen_host
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

    def __enter__(self) -> "PrometheusServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="mccl-prom-"))
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                       "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
            "scrape_configs": [{
                "job_name": self.scrape_job,
                "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                "scrape_timeout": f"{SCRAPE_INTERVAL_S}s",
                "static_configs": [{"targets": [t], "labels": labels}
                                   for t, labels in self.targets.items()],
            }],
        }
        # JSON is valid YAML, so no YAML library is needed.
        (self.dir / "prometheus.yml").write_text(json.dumps(config))
        # A fresh namespace has every port free; on the host, ask the kernel for one.
        self.port = 9090 if self.exec_prefix else free_port()
        with open(self.dir / "prometheus.log", "wb") as log:
            self.proc = subprocess.Popen(
                self.exec_prefix + [
                    PROMETHEUS, f"--config.file={self.dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.dir / 'data'}",
                    f"--web.listen-address={self.listen_host}:{self.port}", "--log.level=warn"],
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                if self._get(f"{self.url}/-/ready", timeout_s=2)[0] == 200:
                    return
            except (urllib.error.URLError, OSError, subprocess.SubprocessError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {self.ready_timeout_s} s: {self.log()[-2000:]}")

    def log(self) -> str:
        try:
            return (self.dir / "prometheus.log").read_text(errors="replace")
        except (OSError, TypeError):
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # ip netns exec execs, so the pid is Prometheus' own in both cases.
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    # ---- HTTP API ---------------------------------------------------------------------

    def api(self, path: str, params: dict[str, str] | None = None, timeout_s: float = 10.0) -> object:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        _, text = self._get(url, timeout_s)
        body = json.loads(text)
        if body.get("status") != "success":
            raise AssertionError(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def _get(self, url: str, timeout_s: float) -> tuple[int, str]:
        """(HTTP status, body); API errors (4xx with a JSON body) are returned, not raised."""
        if not self.exec_prefix:
            try:
                with urllib.request.urlopen(url, timeout=timeout_s) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()
        out = subprocess.run(self.exec_prefix + ["curl", "-sS", "-m", str(timeout_s), "-w", "\n%{http_code}",
                                                 url], capture_output=True, text=True, timeout=timeout_s + 5)
        if out.returncode != 0:
            raise OSError(f"curl {url}: {out.stderr.strip()}")
        body, _, code = out.stdout.rpartition("\n")
        return int(code), body

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", {"query": expr})
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def value_when(self, expr: str, want: float, timeout_s: float = 15.0) -> float | None:
        """The query's value once it equals ``want`` (scrapes lag), or the last one seen; bounded."""
        deadline = time.monotonic() + timeout_s
        got = None
        while time.monotonic() < deadline:
            res = self.query(expr)
            got = float(res[0]["value"][1]) if res else None
            if got == want:
                break
            time.sleep(0.5)
        return got

    def wait_for(self, expr: str, timeout_s: float = 30.0) -> list[dict]:
        """Poll an instant query until it returns data; bounded."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"no data for {expr!r} within {timeout_s} s; targets: "
                                   f"{self.api('targets')['activeTargets']}")
            time.sleep(0.5)


# ---- dashboards -----------------------------------------------------------------------

def dashboard_queries(paths: list[Path]) -> list[tuple[str, str, str, list[dict]]]:
    """(dashboard file, panel title, expr, query variables) for every target of every panel."""
    out = []
    for path in paths:
        board = json.loads(path.read_text())
        variables = [v for v in board["templating"]["list"] if v["type"] == "query"]
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"], variables))
    return out


def resolve_variables(prom: PrometheusServer, variables: list[dict]) -> dict[str, str]:
    """What Grafana would substitute: "All" -> allValue, else the first value Prometheus has."""
    values = {"__rate_interval": RATE_INTERVAL}
    for var in variables:
        # grafana-foundation-sdk writes the query as a string; Grafana's editor saves it as an
        # object beside a "definition"
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
        assert m, f"variable {var['name']}: unsupported query {query!r}"
        found = prom.api(f"label/{m.group(2)}/values", {"match[]": m.group(1)})
        assert found, f"variable {var['name']} ({query}) has no values"
        values[var["name"]] = var["allValue"] if var.get("includeAll") else found[0]
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    def repl(m):
        name = m.group(1) or m.group(2)
        assert name in values, f"undefined dashboard variable ${name} in {expr}"
        return values[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)


def has_finite_value(result: list[dict]) -> bool:
    for series in result:
        points = series.get("values") or [series.get("value")]
        if any(p and math.isfinite(float(p[1])) for p in points):
            return True
    return False


def failing_dashboard_queries(prom: PrometheusServer, paths: list[Path],
                              series_only: tuple[str, ...] = ()) -> list[str]:
    """Every panel query of the dashboards, run with variables resolved; what returned nothing.
    Panels titled in ``series_only`` show quantiles of events the run may not have had (a
    quantile of no observations is NaN): for them the series must exist, a value need not."""
    assert paths, "no dashboards given"
    failures = []
    for board, title, expr, variables in dashboard_queries(paths):
        try:
            q = substitute(expr, resolve_variables(prom, variables))
            result = prom.query(q)
        except AssertionError as e:
            failures.append(f"{board} / {title}: {expr}: {e}")
            continue
        if not (has_finite_value(result) or (title in series_only and result)):
            failures.append(f"{board} / {title}: no data for {q}: {result}")
    return failures
