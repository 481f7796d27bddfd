"""A real Prometheus server for tests: free loopback port, temp config and data dir.

``with PrometheusServer(targets) as prom:`` starts /usr/bin/prometheus scraping the
given ``host:port`` targets every second, waits (bounded) until it is ready, and always
stops it and removes its directory, also when the test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SCRAPE_INTERVAL_S = 1


def available() -> bool:
    return os.access(PROMETHEUS, os.X_OK)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    def __init__(self, targets: dict[str, dict[str, str]], scrape_job: str = "mccl",
                 ready_timeout_s: float = 30.0) -> None:
        """``targets``: {"host:port": {label: value}} scraped at 1 s under ``scrape_job``."""
        self.targets = targets
        self.scrape_job = scrape_job
        self.ready_timeout_s = ready_timeout_s
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
        self.port = free_port()
        with open(self.dir / "prometheus.log", "wb") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={self.dir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
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
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
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
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        if body.get("status") != "success":
            raise AssertionError(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", {"query": expr})
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

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
