"""Every service's real ``/metrics`` passes ``promtool check metrics`` (Prometheus's own
linter: names, units, ``_total`` on counters, help text) and follows the project's naming
rule: ``hadar_<service>_`` on every series it defines, plus ``process_*`` and build info."""

from __future__ import annotations

import re
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

SERVICES = ("scheduler", "tracker", "profiler", "agent")


@pytest.mark.slow
@pytest.mark.parametrize("service", SERVICES)
def test_promtool_check_metrics_passes_on_each_service_scrape(service, scrapes, promtool):
    checked = subprocess.run([str(promtool), "check", "metrics"], input=scrapes[service].encode(),
                             capture_output=True, timeout=120)
    assert checked.returncode == 0, (checked.stdout + checked.stderr).decode()


@pytest.mark.slow
@pytest.mark.parametrize("service", SERVICES)
def test_every_series_has_the_service_prefix_or_is_a_process_metric(service, scrapes):
    names = [f.name for f in text_string_to_metric_families(scrapes[service])]
    foreign = [n for n in names if not n.startswith(f"hadar_{service}_") and not n.startswith("process_")]
    assert foreign == []
    assert f"hadar_{service}_build_info" in names
    assert "process_cpu_seconds" in names and "process_resident_memory_bytes" in names
    version = re.search(rf'hadar_{service}_build_info{{[^}}]*version="([^"]+)"', scrapes[service])
    assert version is not None and version.group(1)


@pytest.mark.slow
def test_the_scheduler_scrape_has_what_the_dashboard_and_alerts_need(scrapes):
    text = scrapes["scheduler"]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("hadar_scheduler_gpu_capacity", (("gpu_type", "cpu"),))] == 1
    assert ("hadar_scheduler_gpus_allocated", (("gpu_type", "cpu"),)) in samples
    assert samples[("hadar_scheduler_nodes", (("state", "live"),))] == 1
    assert ("hadar_scheduler_node_heartbeat_age_seconds", (("node", "n1"),)) in samples
    assert samples[("hadar_scheduler_jobs", (("state", "running"),))] == 1
    assert samples[("hadar_scheduler_job_target_steps", (("job", "j1"),))] == 10**6
    assert samples[("hadar_scheduler_round_duration_seconds_count", ())] >= 1
    # one undecodable record, met by four consumer groups: one dead letter counted
    assert samples[("hadar_scheduler_dead_letters", (("topic", "hadar.jobs"),))] == 1
