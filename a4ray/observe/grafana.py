"""a4ray's Grafana dashboard: the charts of its Ray metrics (observe/metrics.py, staging/display.py), as
Grafana dashboard JSON.

It ships with the KubeRay manifests (`kuberay/a4ray-grafana-dashboard.json`, and the same JSON in a ConfigMap
labelled `grafana_dashboard: "1"`, `kuberay/a4ray-grafana-dashboard.yaml`): Grafana's dashboard sidecar (the
kube-prometheus-stack's, as KubeRay's Prometheus/Grafana guide installs it) loads it next to Ray's own
dashboards. The rendered head's RAY_GRAFANA_HOST / RAY_PROMETHEUS_HOST point the Ray dashboard at them.

Ray's metrics agent prefixes every name with `ray_`. Prometheus renames a4ray's `job` tag to `exported_job`
(the scrape's own `job` label wins), so the panels group by `run`, which names one run anyway. A counter
that has never been incremented does not exist yet: its panels add `or vector(0)`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

UID = "a4ray-training"
TITLE = "a4ray: training, nodes, staging, conversion"


@dataclass(frozen=True)
class Panel:
    title: str
    expr: str  # PromQL
    legend: str
    unit: str = "short"
    description: str = ""

    @property
    def metrics(self) -> list[str]:
        """The a4ray metric names (without Ray's `ray_` prefix) the query reads."""
        return sorted(set(re.findall(r"ray_(a4ray_[a-z0-9_]+)", self.expr)))


PANELS = [
    Panel("Loss", "max by (run) (ray_a4ray_train_loss)", "{{run}}", description="lm loss, as the trainer prints it"),
    Panel("Tokens per second", "max by (run) (ray_a4ray_train_tokens_per_second)", "{{run}}", "short",
          "whole job: printed, or global batch x seq length / step time"),
    Panel("Step time per node", "max by (run, node, host) (ray_a4ray_node_step_time_seconds)",
          "{{run}} node {{node}} {{host}}", "s", "each node's compute time per iteration"),
    Panel("Stragglers", "max by (run, node, host) (ray_a4ray_node_straggler)", "{{run}} node {{node}} {{host}}",
          "short", "1: the node was slower than its peers in the last window"),
    Panel("Hang culprits", "sum by (run, node, host) (ray_a4ray_hang_culprit_total) or vector(0)",
          "{{run}} node {{node}} {{host}}", "short", "hangs the watchdog blamed on each node"),
    Panel("Hangs detected", "sum by (run) (ray_a4ray_gang_hangs_total) or vector(0)", "{{run}}"),
    Panel("Gang attempt", "max by (run) (ray_a4ray_gang_attempt)", "{{run}}", "short",
          "0: the first launch; n: the n-th restart after a failure or hang"),
    Panel("Goodput", "max by (run) (ray_a4ray_goodput_ratio)", "{{run}}", "percentunit",
          "productive step time / wall time of the run so far (observe/goodput.py)"),
    Panel("Badput by kind", "max by (run, kind) (ray_a4ray_badput_seconds)", "{{run}} {{kind}}", "s",
          "seconds of the run in each bucket other than productive steps: startup, checkpoints, lost work, "
          "fault detection, recovery, ..."),
    Panel("Gradient norm", "max by (run) (ray_a4ray_train_grad_norm)", "{{run}}"),
    Panel("Iteration", "max by (run) (ray_a4ray_train_iteration)", "{{run}}"),
    Panel("Staging throughput", "sum by (artifact) (ray_a4ray_stage_rate_bytes_per_s)", "{{artifact}}", "Bps",
          "transfer rate of each artifact being staged"),
    Panel("Fabric bandwidth", "max by (run, test, figure, nodes) (ray_a4ray_fabric_gbps)",
          "{{run}} {{test}} {{figure}} nodes {{nodes}}", "GBs",
          "nccl-tests' busbw at the largest size per collective; DeepEP's best dispatch / combine bandwidths"),
    Panel("Conversion throughput", "sum by (node) (ray_a4ray_convert_rate_bytes_per_s)", "{{node}}", "Bps",
          "checkpoint write rate of the last conversion part each node finished"),
]


def dashboard() -> dict:
    """The dashboard as Grafana's JSON model (a Prometheus data source chosen by a `datasource` variable)."""
    panels = []
    for i, panel in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": panel.title, "description": panel.description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}},
            "targets": [{"refId": "A", "expr": panel.expr, "legendFormat": panel.legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}],
        })
    return {
        "uid": UID, "title": TITLE, "tags": ["a4ray", "ray"], "editable": True, "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "timezone": "",
        "templating": {"list": [{"name": "datasource", "label": "Data source", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0}]},
        "panels": panels,
    }


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"
