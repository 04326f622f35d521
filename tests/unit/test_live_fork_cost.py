"""The live HadarE pays the consolidation cost the simulator charges: model size as policy input.

The live scheduler's job type is the job id, so the policy cannot look a model's size up by
job type; the size travels as data (ThroughputEstimate.model_bytes / optimizer_slots, folded
per job, JobState.model_bytes / optimizer_slots) and both paths give HadarE the same facts.
"""

from __future__ import annotations

import pytest

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import JobState
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.live.rerun import LoggedEvent, rerun
from services.scheduler.live.rounds import RoundTiming, build_request, plan_to_events
from services.scheduler.live.snapshot import capture, restore
from services.scheduler.live.state import SchedulerState
from services.scheduler.policies import PolicyChoice, make_policy
from services.scheduler.sim.simulator import RoundObservation, SimOptions, simulate
from services.scheduler.sim.traces import TraceJob
from shared.domain import workloads
from shared.persistence.snapshot import dump, load
from shared.wire.events import (
    MAX_MODEL_BYTES,
    MAX_OPTIMIZER_SLOTS,
    GpuInfo,
    InvalidEvent,
    JobCancelled,
    JobSpec,
    JobSubmitted,
    NodeRegistered,
    ThroughputEstimate,
    decode,
    encode,
)
from shared.wire.topics import JOBS, NODES, PLACEMENTS, THROUGHPUT

T0 = 1_700_000_000.0
TP = ThroughputModel.from_gavel_table()
MODEL, BATCH = "ResNet-50", 32
JOB_TYPE = f"{MODEL} (batch size {BATCH})"
TYPES = ("v100", "v100", "v100")
STEPS = 10_000_000
# Slow enough that consolidating ResNet-50's checkpoint (weights + momentum) of 2+ copies
# costs more than the round: the cost, not the cluster, decides the copy count.
STORE_GBPS = 1e-3


def _estimate(job_id: str, *, model_bytes: int = 0, optimizer_slots: int = 1, ts: float = T0) -> ThroughputEstimate:
    return ThroughputEstimate(ts=ts, source="profiler", job_id=job_id, basis="estimate", workers=1,
                              rates={t: TP.rate(JOB_TYPE, t, 1) for t in set(TYPES)},
                              model_bytes=model_bytes, optimizer_slots=optimizer_slots)


def _live_state(model_bytes: int) -> SchedulerState:
    state = SchedulerState()
    for i, t in enumerate(TYPES):
        state.apply(NodeRegistered(ts=T0, source="agent", node_id=f"n{i}", address=f"n{i}.lan",
                                   gpus=(GpuInfo(index=0, type=t),)))
    spec = JobSpec(job_id="job-a", user="u", model=MODEL, dataset="imagenet", batch_size=BATCH, workers=1,
                   iterations=STEPS)
    state.apply(JobSubmitted(ts=T0, source="cli", job=spec, submitted_at=T0))
    state.apply(_estimate("job-a", model_bytes=model_bytes))
    return state


def _live_copies(state: SchedulerState) -> int:
    req = build_request(state, RoundTiming(round=0, started_at=T0, round_s=360.0, heartbeat_s=5.0), None, seed=0)
    plan = make_policy("hadare", store_gbps=STORE_GBPS).plan(req)
    return len(plan.placements)


def _simulated_copies() -> int:
    cluster = Cluster(name="c", nodes=tuple(Node(node_id=f"n{i}", gpus=(t,)) for i, t in enumerate(TYPES)))
    first: list[RoundObservation] = []
    simulate(policy=make_policy("hadare", store_gbps=STORE_GBPS), cluster=cluster, throughput=TP,
             jobs=[TraceJob(job_id="job-a", arrival_s=0.0, job_type=JOB_TYPE, workers=1, total_steps=STEPS)],
             options=SimOptions(round_s=360.0, store_gbps=STORE_GBPS, max_rounds=1),
             observer=lambda o: first.append(o) if not first else None)
    return len(first[0].plan.placements)


def test_live_hadare_forks_as_many_copies_as_the_simulated_one():
    simulated = _simulated_copies()
    assert simulated == 1          # the cost forbids a second copy
    assert _live_copies(_live_state(workloads.model_bytes(JOB_TYPE))) == simulated


def test_a_live_job_of_unknown_size_is_charged_nothing():
    assert _live_copies(_live_state(0)) == len(TYPES)


def test_the_fold_keeps_the_latest_stated_size_and_drops_it_with_the_job():
    state = _live_state(1000)
    state.apply(_estimate("job-a", model_bytes=0, ts=T0 + 1))        # a measurement: states no size
    state.apply(_estimate("job-a", model_bytes=2000, optimizer_slots=2, ts=T0 + 2))
    req = build_request(state, RoundTiming(round=0, started_at=T0, round_s=360.0, heartbeat_s=5.0), None, seed=0)
    assert [(j.model_bytes, j.optimizer_slots) for j in req.jobs] == [(2000, 2)]
    state.apply(JobCancelled(ts=T0 + 3, source="cli", job_id="job-a"))
    assert "job-a" not in state.sizes


def test_a_size_known_before_the_job_is_kept_for_it():
    state = SchedulerState()
    state.apply(_estimate("job-a", model_bytes=4000))
    state.apply(JobSubmitted(ts=T0, source="cli", job=JobSpec(job_id="job-a", user="u", model=MODEL, dataset="d",
                                                              batch_size=BATCH, workers=1, iterations=10),
                             submitted_at=T0))
    req = build_request(state, RoundTiming(round=0, started_at=T0, round_s=360.0, heartbeat_s=5.0), None, seed=0)
    assert req.jobs[0].model_bytes == 4000 and req.jobs[0].optimizer_slots == 1


def test_a_job_state_without_a_size_is_charged_nothing_and_slots_default_to_the_policy():
    job = JobState(job_id="a", job_type=JOB_TYPE, workers=1, total_steps=10)
    assert job.model_bytes == 0 and job.optimizer_slots is None


@pytest.mark.parametrize("field, value", [
    ("model_bytes", -1), ("model_bytes", MAX_MODEL_BYTES + 1), ("optimizer_slots", -1),
    ("optimizer_slots", MAX_OPTIMIZER_SLOTS + 1),
])
def test_hostile_sizes_are_refused(field: str, value: int):
    with pytest.raises(InvalidEvent, match=field):
        _estimate("job-a", **{field: value})


def test_an_old_estimate_without_a_size_still_decodes():
    old = _estimate("job-a")
    assert decode(encode(old)).model_bytes == 0


def test_a_state_snapshot_carries_the_sizes_and_an_old_one_restores_without_them():
    state = _live_state(1234)
    body = restore(load(dump(capture(state=state, previous=None, previous_key=None, next_round=1, folded={},
                                     placed={}, created_at=T0)), service="scheduler"))
    assert body.state.sizes == {"job-a": (1234, 1)}
    old_state = _live_state(0)
    del old_state.sizes        # a snapshot written before sizes were folded
    old = load(dump(capture(state=old_state, previous=None, previous_key=None, next_round=1, folded={},
                            placed={}, created_at=T0)), service="scheduler")
    assert restore(old).state.sizes == {}


def _recorded_log() -> list[LoggedEvent]:
    """A one-round log as the live scheduler writes it: nodes, the job and its sized
    estimate, then the round HadarE decided from them."""
    nodes = [NodeRegistered(ts=T0, source="agent", node_id=f"n{i}", address=f"n{i}.lan",
                            gpus=(GpuInfo(index=0, type=t),)) for i, t in enumerate(TYPES)]
    spec = JobSpec(job_id="job-a", user="u", model=MODEL, dataset="imagenet", batch_size=BATCH, workers=1,
                   iterations=STEPS)
    job = JobSubmitted(ts=T0, source="cli", job=spec, submitted_at=T0)
    estimate = _estimate("job-a", model_bytes=workloads.model_bytes(JOB_TYPE))
    state = SchedulerState()
    for e in [*nodes, job, estimate]:
        state.apply(e)
    choice = PolicyChoice(name="hadare", options={"store_gbps": STORE_GBPS})
    timing = RoundTiming(round=0, started_at=T0, round_s=360.0, heartbeat_s=5.0)
    req = build_request(state, timing, None, seed=0)
    inputs = {f"{NODES}:0": len(nodes), f"{JOBS}:0": 1, f"{THROUGHPUT}:0": 1}
    events = plan_to_events(choice.build().plan(req), req, state, timing, choice=choice, seed=0,
                            source="scheduler", inputs=inputs, decision_ms=1.0)
    log = [LoggedEvent(topic=NODES, partition=0, offset=i, event=e) for i, e in enumerate(nodes)]
    log += [LoggedEvent(topic=JOBS, partition=0, offset=0, event=job),
            LoggedEvent(topic=THROUGHPUT, partition=0, offset=0, event=estimate)]
    log += [LoggedEvent(topic=PLACEMENTS, partition=0, offset=i, event=e) for i, e in enumerate(events)]
    return log


def test_rerun_reproduces_the_sized_plan_from_the_folded_estimate():
    log = _recorded_log()
    [check] = rerun(log)
    assert check.matches and len(check.recorded) == 1
    assert [(j.job_id, j.model_bytes) for j in check.request.jobs] == [("job-a", workloads.model_bytes(JOB_TYPE))]
    # The folded size is what decided: the same log with an estimate that states none
    # re-derives the uncharged plan (a copy on every node), not the recorded one.
    unsized = [LoggedEvent(topic=i.topic, partition=i.partition, offset=i.offset, event=_estimate("job-a"))
               if isinstance(i.event, ThroughputEstimate) else i for i in log]
    [what_if] = rerun(unsized)
    assert not what_if.matches and len(what_if.rederived) == len(TYPES)
