"""A private mccld for the demo: started before the training job, shown with
``mcclctl`` while the job runs, stopped (and checked for leftovers) afterwards.

The daemon listens on loopback only, with its own runtime directory, fleet key and
free ports, so the demo never touches a daemon the machine may already run and never
sends mDNS or link traffic off this host.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from mccl_common.errors import DaemonUnavailableError

_READY_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DemoDaemon:
    """One ``mccld`` subprocess with explicit start/stop."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="mccl-demo-"))
        self.key_file = self.dir / "fleet.key"
        self.status_port, self.metrics_port = _free_port(), _free_port()
        self.env = {
            "MCCL_RUNTIME_DIR": str(self.dir / "run"),
            "MCCL_KEY_FILE": str(self.key_file),
            "MCCL_FLEET": "demo",
            "MCCL_LISTEN_ADDR": "127.0.0.1",
            "MCCL_PORT": str(_free_port()),
            "MCCL_STATUS_PORT": str(self.status_port),
            "MCCL_METRICS_PORT": str(self.metrics_port),
            "MCCL_METRICS_ADDR": "127.0.0.1",
            "MCCL_HOST_ID": f"demo-{socket.gethostname()}",
        }
        self.log_path = self.dir / "mccld.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "DemoDaemon":
        py = sys.executable
        subprocess.run([py, "-m", "mccld", "keygen", str(self.key_file)], check=True,
                       stdout=subprocess.DEVNULL, env=self._env(), timeout=30)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([py, "-m", "mccld"], env=self._env(), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DaemonUnavailableError(
                    f"[demo] mccld exited with status {self.proc.returncode} during start-up; "
                    f"its log:\n{self.log_path.read_text(errors='replace')[-2000:]}")
            if self._status_ok():
                return self
            time.sleep(0.2)
        self.stop()
        raise DaemonUnavailableError(f"[demo] Timed out after {_READY_TIMEOUT_S:.0f}s waiting for mccld to answer; "
                                     f"see {self.log_path}")

    def _env(self) -> dict[str, str]:
        return dict(os.environ, **self.env)

    def _status_ok(self) -> bool:
        r = self.mcclctl("status", "--json", check=False)
        return r.returncode == 0

    def mcclctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "mcclctl", *args, "--host", f"127.0.0.1:{self.status_port}",
                "--key-file", str(self.key_file)]
        return subprocess.run(argv, env=self._env(), capture_output=True, text=True, timeout=30, check=check)

    def metrics(self) -> dict[str, list[float]]:
        """Scrape /metrics once: every sample's value, grouped by sample name."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, list[float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.setdefault(sample.name, []).append(sample.value)
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if getattr(self, "_log", None):
            self._log.close()

    def cleanup(self) -> None:
        for p in sorted(self.dir.rglob("*"), reverse=True):
            (p.rmdir if p.is_dir() else p.unlink)()
        self.dir.rmdir()


def show_status(d: DemoDaemon, title: str) -> None:
    print(f"\n[demo] $ mcclctl status   ({title})", flush=True)
    print(d.mcclctl("status").stdout.rstrip(), flush=True)


def show_metrics(d: DemoDaemon) -> None:
    m = d.metrics()
    count = sum(m.get("mccl_collective_duration_seconds_count", []))
    total = sum(m.get("mccl_collective_duration_seconds_sum", []))
    overlap = m.get("mccl_overlap_ratio_mean", [])
    print("\n[demo] mccld's Prometheus exporter after the job:", flush=True)
    print(f"  collectives run by the daemon        {count:.0f}"
          + (f" (mean {total / count * 1e3:.2f} ms)" if count else ""))
    print(f"  overlap ratio (mean over ranks)      {sum(overlap) / len(overlap):.2f}"
          if overlap else "  overlap ratio                        (none reported)")
    print(f"  attached processes now               {sum(m.get('mccl_attached_processes', [])):.0f}")
    errors = sum(m.get("mccl_errors_total", []))
    print(f"  errors                               {errors:.0f}", flush=True)


def host_states(d: DemoDaemon) -> list[str]:
    daemons = json.loads(d.mcclctl("status", "--json").stdout)["daemons"]
    return [(x.get("status") or {}).get("state", "unreachable") for x in daemons]
