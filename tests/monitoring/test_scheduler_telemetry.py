"""The scheduler's cluster gauges are a pure function of its folded state and the time."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from services.scheduler.live.metrics import SchedulerTelemetry, cluster_view
from services.scheduler.live.state import SchedulerState
from shared.domain.layout import model_key
from shared.wire.events import (
    Assignment,
    CopyWeight,
    GpuInfo,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    NodeHeartbeat,
    NodeRegistered,
    RoundStarted,
)

T0 = 1_700_000_000.0
HEARTBEAT_S = 10.0


def spec(job_id: str, iterations: int = 1000) -> JobSpec:
    return JobSpec(job_id=job_id, user="u", model="resnet", dataset="digits", batch_size=32, workers=2,
                   iterations=iterations)


def state() -> SchedulerState:
    s = SchedulerState()
    s.apply(NodeRegistered(ts=T0, source="agent", node_id="a", gpus=(GpuInfo(index=0, type="v100"),
                                                                     GpuInfo(index=1, type="v100"))))
    s.apply(NodeRegistered(ts=T0, source="agent", node_id="b", gpus=(GpuInfo(index=0, type="t4"),)))
    s.apply(NodeRegistered(ts=T0 - 100, source="agent", node_id="gone", gpus=(GpuInfo(index=0, type="k80"),)))
    for job_id in ("run", "wait"):
        s.apply(JobSubmitted(ts=T0, source="cli", job=spec(job_id), submitted_at=T0))
    s.apply(RoundStarted(ts=T0, source="s", round=0, policy="x", started_at=T0, ends_at=T0 + 60, nodes=("a", "b")))
    s.apply(Assignment(ts=T0, source="s", round=0, job=spec("run"), copy=0, node_id="a", gpus=(0, 1),
                       gpu_type="v100", world_size=2, ranks=(0, 1), step_budget=100, deadline=T0 + 60))
    return s


def test_capacity_and_allocation_by_type_count_live_nodes_and_the_current_round():
    view = cluster_view(state(), now=T0 + 5, heartbeat_s=HEARTBEAT_S)
    assert view.capacity == {"v100": 2, "t4": 1}        # "gone" was last heard 105 s ago: lost
    assert view.allocated == {"v100": 2, "t4": 0}
    assert view.nodes == {"live": 2, "lost": 1}
    assert view.heartbeat_age_s == {"a": 5.0, "b": 5.0, "gone": 105.0}
    assert view.jobs == {"waiting": 1, "running": 1, "stuck": 0}
    assert view.last_round_start == T0


def test_allocation_ends_with_the_round_and_heartbeats_renew_a_node():
    s = state()
    s.apply(NodeHeartbeat(ts=T0 + 70, source="agent", node_id="gone"))
    view = cluster_view(s, now=T0 + 75, heartbeat_s=HEARTBEAT_S)
    assert view.capacity == {"k80": 1} and view.allocated == {"k80": 0}   # only types of live nodes
    assert view.heartbeat_age_s["gone"] == 5.0
    assert view.nodes == {"live": 1, "lost": 2}   # a and b: silent 75 s > 3 periods


def test_progress_is_the_last_consolidated_model_over_the_iterations():
    s = state()
    s.apply(ModelConsolidated(ts=T0 + 61, source="tracker", job_id="run", round=0, key=model_key("run", 0),
                              total_steps=250, copies=(CopyWeight(copy=0, steps=250, weight=1.0),)))
    view = cluster_view(s, now=T0 + 61, heartbeat_s=HEARTBEAT_S)
    assert view.consolidated_steps == {"run": 250, "wait": 0}
    assert view.target_steps == {"run": 1000, "wait": 1000}


def test_round_duration_and_lag_follow_round_starts_but_not_an_idle_gap():
    registry = CollectorRegistry()
    telemetry = SchedulerTelemetry(registry, state=SchedulerState, now=lambda: T0, round_s=60.0, heartbeat_s=5.0)

    def value(name: str) -> float | None:
        return registry.get_sample_value(name)
    telemetry.round_started(T0)
    assert value("hadar_scheduler_round_duration_seconds_count") == 0
    assert value("hadar_scheduler_round_lag_seconds") == 0
    telemetry.round_started(T0 + 75)          # waited 15 s for the models
    assert value("hadar_scheduler_round_duration_seconds_sum") == pytest.approx(75)
    assert value("hadar_scheduler_round_lag_seconds") == pytest.approx(15)
    telemetry.went_idle()
    telemetry.round_started(T0 + 10_000)      # the first round after an idle hour: no duration
    assert value("hadar_scheduler_round_duration_seconds_count") == 1
    assert value("hadar_scheduler_round_lag_seconds") == 0
    assert value("hadar_scheduler_round_length_seconds") == 60
    assert value("hadar_scheduler_heartbeat_period_seconds") == 5
