"""deploy/monitoring/ is usable as shipped: promtool accepts the Prometheus config and the
alert rules, the scrape config finds every Hadar service of deploy/stack.yml where it
serves, the Grafana dashboard loads, every PromQL expression in it and in the rules parses
and names only metrics the services really serve, and the monitoring stack validates
together with the main stack."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.required import unavailable

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
HADAR_SERVICES = ("scheduler", "tracker", "profiler", "agent")
PROMETHEUS_OWN = {"up"}   # series Prometheus writes for every target itself
KEYWORDS = {"by", "on", "and", "or", "unless", "offset", "group_left", "group_right", "ignoring", "without", "bool",
            # aggregation operators: `sum by (x) (...)` puts no parenthesis right after the name
            "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
            "quantile"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, keywords, labels, durations)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\b(by|on|without|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    return {name for name, call in re.findall(r"(?<![\w.])([a-zA-Z_:][\w:]*)\s*(\()?", e)
            if not call and name not in KEYWORDS}


def test_metric_names_finds_selectors_only():
    expr = ('sum by (gpu_type) (rate(a_total{x="b_c"}[5m])) / on(instance) group_left() (3 * c_seconds '
            'offset 15m) > 0 and on() (sum(d) > (e or vector(0)))')
    assert metric_names(expr) == {"a_total", "c_seconds", "d", "e"}


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load((MONITORING / "rules.yml").read_text())["groups"] for r in g["rules"]]


def _dashboard() -> dict:
    return json.loads((MONITORING / "grafana" / "hadar.json").read_text())


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])]


def test_promtool_check_config_and_rules(promtool):
    for args in (("check", "config", "prometheus.yml"), ("check", "rules", "rules.yml")):
        checked = subprocess.run([str(promtool), *args], cwd=MONITORING, capture_output=True, text=True, timeout=120)
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_rules_cover_what_operators_asked_for():
    alerts = {r["alert"]: r["expr"] for r in _rules()}
    assert "hadar_scheduler_last_round_start_timestamp_seconds" in alerts["HadarNoRound"]
    assert "3 * hadar_scheduler_round_length_seconds" in alerts["HadarNoRound"]
    assert "hadar_scheduler_node_heartbeat_age_seconds" in alerts["HadarAgentHeartbeatsMissing"]
    assert "hadar_scheduler_dead_letters" in alerts["HadarDeadLettersRising"]
    assert "hadar_tracker_errors_total" in alerts["HadarConsolidationFailing"]


def test_every_dashboard_query_parses(promtool, tmp_path):
    """Dashboard queries as recording rules: promtool parses each with Prometheus's parser."""
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"hadar:dashboard_query_{i}", "expr": e}
                                                          for i, e in enumerate(_dashboard_exprs())]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    checked = subprocess.run([str(promtool), "check", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_dashboard_loads_and_has_the_panels_asked_for():
    dashboard = _dashboard()
    datasource = yaml.safe_load((MONITORING / "grafana" / "datasource.yml").read_text())["datasources"][0]
    titles = " | ".join(p["title"] for p in dashboard["panels"]).lower()
    for needed in ("utilization by type", "queue", "round duration", "decision time", "consolidation time",
                   "dead letters", "per-job progress"):
        assert needed in titles
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == datasource["uid"]
        assert all(t["datasource"]["uid"] == datasource["uid"] for t in panel["targets"])
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


@pytest.mark.slow
def test_every_query_names_only_metrics_the_services_serve(scrapes):
    served = set(PROMETHEUS_OWN)
    for text in scrapes.values():
        served |= {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        # a labelled series with no child yet (no rejection so far) is declared, not sampled
        for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M):
            served |= {name} if kind != "histogram" else {f"{name}_{s}" for s in ("bucket", "sum", "count")}
    exprs = _dashboard_exprs() + [r["expr"] for r in _rules()]
    unknown = {e: sorted(metric_names(e) - served) for e in exprs if metric_names(e) - served}
    assert unknown == {}
    assert all(metric_names(e) for e in exprs)


def test_the_scrape_config_finds_every_service_of_the_stack_where_it_serves():
    stack = yaml.safe_load((ROOT / "deploy" / "stack.yml").read_text())
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    for service in HADAR_SERVICES:
        port = int(stack["services"][service]["environment"]["HADAR_HTTP_PORT"])
        (sd,) = jobs[service]["dns_sd_configs"]
        assert sd["names"] == [f"tasks.{service}"] and sd["port"] == port and sd["type"] == "A"


def test_the_monitoring_stack_validates_with_the_main_stack():
    docker = shutil.which("docker")
    if docker is None:
        unavailable("the docker client is needed to validate deploy/monitoring/stack.yml")
    out = subprocess.run([docker, "stack", "config", "-c", str(ROOT / "deploy" / "stack.yml"),
                          "-c", str(MONITORING / "stack.yml")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HADAR_IMAGE": "registry.example/hadar:1.0"})
    assert out.returncode == 0, out.stderr
    merged = yaml.safe_load(out.stdout)
    assert {"prometheus", "grafana", "scheduler", "agent"} <= set(merged["services"])
    assert merged["services"]["prometheus"]["networks"].keys() >= {"hadar"}
    for config in merged["configs"].values():
        assert Path(config["file"]).is_file(), config["file"]
