"""A real Prometheus for a local cluster (`a4ray local up`): the `prometheus` binary (Debian's package) on
loopback, scraping every node of that cluster through Ray's file-based service discovery.

Ray's dashboard keeps `<session dir>/prom_metrics_service_discovery.json` current with every node's metrics
export address (ray/_private/metrics_agent.py, PrometheusServiceDiscoveryWriter); Prometheus reads it as a
`file_sd_configs` file, as the config Ray generates for itself does (ray/dashboard/modules/metrics/
templates.py), here with a shorter scrape interval, so short rehearsals show up. The head must be started
with RAY_PROMETHEUS_HOST (`head_env`) for its dashboard to query it.

Grafana is not started here: where none runs, the charts are the notebook's `result.plot()` and the
dashboard JSON in kuberay/ (`NO_GRAFANA`).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from a4ray.core import ports
from a4ray.core.errors import A4RayError

SERVICE_DISCOVERY_FILE = "prom_metrics_service_discovery.json"  # Ray's name, in its session directory
SCRAPE_INTERVAL_S = 5
NO_GRAFANA = ("no Grafana runs here: plot a run's metrics in a notebook (`a4ray.get_run(id).result().plot()`), or "
              "import kuberay/a4ray-grafana-dashboard.json into a Grafana that reads this Prometheus")
_CONFIG = """# a4ray local up: Ray's file-based service discovery of this cluster's session
global:
  scrape_interval: {interval}s
  evaluation_interval: {interval}s
scrape_configs:
- job_name: ray
  file_sd_configs:
  - files: ['{discovery}']
    refresh_interval: {interval}s
"""


def installed() -> str | None:
    return shutil.which("prometheus")


class LocalPrometheus:
    """Prometheus for one local cluster: its port chosen before the head starts (`head_env`), started on the
    head's session directory (`start`), stopped with the cluster (`stop`)."""

    def __init__(self, port: int | None = None, scrape_interval_s: int = SCRAPE_INTERVAL_S):
        self.port = port or ports.free_port("127.0.0.1")
        self.scrape_interval_s = scrape_interval_s
        self.process: subprocess.Popen | None = None
        self.log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def head_env(self) -> dict[str, str]:
        """What the head's dashboard needs to chart from this Prometheus (its Metrics page, Ray's own queries)."""
        return {"RAY_PROMETHEUS_HOST": self.url}

    def start(self, session_dir: str, timeout_s: float = 60) -> None:
        binary = installed()
        if binary is None:
            raise A4RayError("Prometheus is not installed (no `prometheus` on PATH)",
                             hint="install it (Debian/Ubuntu: apt-get install prometheus; `make system-deps`), or "
                             "start the cluster with --no-metrics")
        root = Path(session_dir) / "metrics" / "a4ray-prometheus"
        root.mkdir(parents=True, exist_ok=True)
        config = root / "prometheus.yml"
        config.write_text(_CONFIG.format(interval=self.scrape_interval_s,
                                         discovery=Path(session_dir) / SERVICE_DISCOVERY_FILE))
        self.log = root / "prometheus.log"
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        if ports.wait_http(f"{self.url}/-/ready", timeout_s, still=lambda: self.process.poll() is None) is None:
            return
        if self.process.poll() is not None:
            tail = self.log.read_text(errors="replace").splitlines()[-5:]
            raise A4RayError(f"Prometheus exited with code {self.process.returncode}: " + " | ".join(tail),
                             hint=f"its log: {self.log}")
        self.stop()
        raise A4RayError(f"Prometheus did not become ready on {self.url} in {timeout_s:g}s",
                         hint=f"its log: {self.log}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
        self.process = None
