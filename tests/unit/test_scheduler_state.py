"""The live scheduler's fold, plan request and round events, without a broker."""

from __future__ import annotations

from services.scheduler.core.policy import Placement, Plan, Wait, WaitCode
from services.scheduler.live.rounds import RoundTiming, build_request, plan_to_events
from services.scheduler.live.state import SchedulerState
from services.scheduler.policies import PolicyChoice
from shared.wire.events import (
    Assignment,
    CopyFinished,
    CopyWeight,
    GpuInfo,
    JobCancelled,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    NodeHeartbeat,
    NodeRegistered,
    Progress,
    RoundStarted,
    ThroughputEstimate,
)
from shared.wire.topics import JOBS

T0 = 1_700_000_000.0


def spec(job_id: str, workers: int = 1, iterations: int = 100) -> JobSpec:
    return JobSpec(job_id=job_id, user="u", model="resnet", dataset="digits", batch_size=32,
                   workers=workers, iterations=iterations)


def node(node_id: str, *types: str, ts: float = T0) -> NodeRegistered:
    return NodeRegistered(ts=ts, source="agent", node_id=node_id, address=f"{node_id}.lan",
                          gpus=tuple(GpuInfo(index=i, type=t) for i, t in enumerate(types)))


def test_duplicate_events_are_folded_once():
    state = SchedulerState()
    e = JobSubmitted(ts=T0, source="cli", job=spec("a"), submitted_at=T0)
    assert state.apply(e) is True
    assert state.apply(e) is False
    assert list(state.jobs) == ["a"] and state.events_applied == 1


def test_measured_throughput_is_never_replaced_by_an_estimate():
    state = SchedulerState()
    state.apply(ThroughputEstimate(ts=T0, source="p", job_id="a", basis="measured", workers=1, rates={"t4": 5.0}))
    state.apply(ThroughputEstimate(ts=T0 + 1, source="p", job_id="a", basis="estimate", workers=1,
                                   rates={"t4": 9.0, "v100": 20.0}))
    assert state.rates[("a", "t4", 1)] == ("measured", 5.0)
    assert state.rates[("a", "v100", 1)] == ("estimate", 20.0)


def test_nodes_leave_after_three_missed_heartbeats():
    state = SchedulerState()
    state.apply(node("n1", "t4"))
    state.apply(node("n2", "v100"))
    state.apply(NodeHeartbeat(ts=T0 + 20, source="agent", node_id="n2"))
    alive = [n.registered.node_id for n in state.live_nodes(T0 + 20, heartbeat_s=5)]
    assert alive == ["n2"]   # n1 last seen 20 s ago > 3 x 5 s


def test_consolidated_model_sets_progress_and_start_point():
    state = SchedulerState()
    state.apply(JobSubmitted(ts=T0, source="cli", job=spec("a"), submitted_at=T0))
    state.apply(RoundStarted(ts=T0, source="s", round=0, policy="x", started_at=T0, ends_at=T0 + 10))
    state.apply(Progress(ts=T0 + 1, source="agent", job_id="a", round=0, copy=0, node_id="n1", gpu_type="t4",
                         workers=1, steps_round=30, steps_total=30, samples_per_s=10, loss=1.0))
    assert state.jobs["a"].progress_steps() == 30 and state.jobs["a"].steps_done == 0
    state.apply(ModelConsolidated(ts=T0 + 2, source="tracker", job_id="a", round=0, key="models/a/0.safetensors",
                                  total_steps=40, copies=(CopyWeight(copy=0, steps=40, weight=1.0),)))
    job = state.jobs["a"]
    assert job.steps_done == 40 and job.model_key == "models/a/0.safetensors" and job.progress_steps() == 40


def test_cancelled_job_is_no_longer_active():
    state = SchedulerState()
    state.apply(JobSubmitted(ts=T0, source="cli", job=spec("a"), submitted_at=T0))
    state.apply(JobCancelled(ts=T0 + 1, source="cli", job_id="a"))
    assert state.active_jobs() == [] and state.jobs["a"].state == "cancelled"


def _state_with_cluster() -> SchedulerState:
    state = SchedulerState()
    state.apply(node("n1", "v100", "v100"))
    state.apply(node("n2", "t4"))
    state.apply(JobSubmitted(ts=T0, source="cli", job=spec("a", workers=3, iterations=90), submitted_at=T0))
    state.apply(JobSubmitted(ts=T0 + 1, source="cli", job=spec("b"), submitted_at=T0 + 1))
    state.apply(ThroughputEstimate(ts=T0, source="p", job_id="a", basis="estimate", workers=3,
                                   rates={"v100": 30.0, "t4": 9.0}))
    return state


YARN = PolicyChoice(name="yarn-cs")


def test_a_request_on_recorded_nodes_ignores_heartbeats():
    state = _state_with_cluster()
    timing = RoundTiming(round=0, started_at=T0 + 10_000, round_s=10, heartbeat_s=5)   # every node silent
    assert build_request(state, timing, None, seed=0).cluster.nodes == ()
    recorded = build_request(state, timing, None, seed=0, nodes=("n2", "gone"))
    assert [n.node_id for n in recorded.cluster.nodes] == ["n2"]


def test_the_request_reflects_the_state():
    state = _state_with_cluster()
    timing = RoundTiming(round=0, started_at=T0 + 5, round_s=10, heartbeat_s=5)
    request = build_request(state, timing, None, seed=3)
    assert [n.node_id for n in request.cluster.nodes] == ["n1", "n2"]
    assert request.cluster.by_id["n1"].gpus == ("v100", "v100")
    assert [j.job_id for j in request.jobs] == ["a", "b"]
    assert request.throughput.rate("a", "v100", 3) == 30.0
    assert request.seed == 3 and request.now_s == T0 + 5


def test_plan_to_events_spanning_copy_gets_ranks_rendezvous_and_peers():
    state = _state_with_cluster()
    timing = RoundTiming(round=4, started_at=T0 + 5, round_s=10, heartbeat_s=5)
    request = build_request(state, timing, None, seed=0)
    plan = Plan(placements=(Placement(job_id="a", copy=0, node_id="n1", gpus=(0, 1)),
                            Placement(job_id="a", copy=0, node_id="n2", gpus=(0,))),
                waiting=(Wait(job_id="b", code=WaitCode.CAPACITY, detail="no free GPU"),))
    choice = PolicyChoice(name="hadar", options={"horizon": 16})
    events = plan_to_events(plan, request, state, timing, choice=choice, seed=7, source="scheduler",
                            inputs={f"{JOBS}:0": 2}, decision_ms=1.5)
    started, *assignments = events
    assert isinstance(started, RoundStarted) and started.round == 4 and started.assignments == 2
    assert (started.policy, started.policy_options, started.seed) == ("hadar", '{"horizon":16}', 7)
    assert (started.round_s, started.heartbeat_s) == (10, 5)
    assert [w.job_id for w in started.waiting] == ["b"] and started.inputs == {f"{JOBS}:0": 2}
    assert all(isinstance(a, Assignment) for a in assignments)
    a1, a2 = assignments
    assert (a1.node_id, a1.ranks, a2.node_id, a2.ranks) == ("n1", (0, 1), "n2", (2,))
    assert a1.world_size == a2.world_size == 3
    assert a1.rendezvous == a2.rendezvous and a1.rendezvous.startswith("n1.lan:")
    assert a1.peers == a2.peers == ("n1", "n1", "n2")   # what the agents' warm groups are bound to
    assert a1.step_budget == 90 and a1.deadline == T0 + 15


def test_step_budget_is_split_across_copies_by_rate():
    state = _state_with_cluster()
    state.apply(ThroughputEstimate(ts=T0, source="p", job_id="b", basis="estimate", workers=1,
                                   rates={"v100": 30.0, "t4": 10.0}))
    timing = RoundTiming(round=0, started_at=T0 + 5, round_s=10, heartbeat_s=5)
    request = build_request(state, timing, None, seed=0)
    plan = Plan(placements=(Placement(job_id="b", copy=0, node_id="n1", gpus=(0,)),
                            Placement(job_id="b", copy=1, node_id="n2", gpus=(0,))),
                waiting=(Wait(job_id="a", code=WaitCode.CAPACITY),))
    events = plan_to_events(plan, request, state, timing, choice=YARN, seed=0, source="s", inputs={}, decision_ms=0)
    budgets = {e.copy: e.step_budget for e in events if isinstance(e, Assignment)}
    assert budgets == {0: 75, 1: 25}


def test_step_budgets_of_copies_on_fewer_than_w_workers_are_in_their_own_steps():
    """Samples (issue 11): a W=2 job's copy on 1 worker is credited half a job step per step.
    Rates 30 and 10 steps/s on 1 worker credit 15 and 5 job steps/s: copy 0 gets 75% of the
    100 remaining job steps, 75 job steps, which are 150 of its own steps; copy 1 50."""
    state = _state_with_cluster()
    state.apply(JobSubmitted(ts=T0, source="cli", job=spec("w2", workers=2), submitted_at=T0))
    state.apply(ThroughputEstimate(ts=T0, source="p", job_id="w2", basis="estimate", workers=1,
                                   rates={"v100": 30.0, "t4": 10.0}))
    timing = RoundTiming(round=0, started_at=T0 + 5, round_s=10, heartbeat_s=5)
    request = build_request(state, timing, None, seed=0)
    plan = Plan(placements=(Placement(job_id="w2", copy=0, node_id="n1", gpus=(0,)),
                            Placement(job_id="w2", copy=1, node_id="n2", gpus=(0,))),
                waiting=(Wait(job_id="a", code=WaitCode.CAPACITY), Wait(job_id="b", code=WaitCode.CAPACITY)))
    events = plan_to_events(plan, request, state, timing, choice=YARN, seed=0, source="s", inputs={}, decision_ms=0)
    budgets = {e.copy: e.step_budget for e in events if isinstance(e, Assignment)}
    assert budgets == {0: 150, 1: 50}
    # Together they are worth the job's remaining steps: 150 x 1/2 + 50 x 1/2 = 100.


def test_a_budget_in_copy_steps_is_rounded_up_and_overshoots_by_at_most_a_step_per_copy():
    state = _state_with_cluster()
    state.apply(JobSubmitted(ts=T0, source="cli", job=spec("w3", workers=3, iterations=101), submitted_at=T0))
    state.apply(ThroughputEstimate(ts=T0, source="p", job_id="w3", basis="estimate", workers=1,
                                   rates={"v100": 7.0, "t4": 7.0}))
    timing = RoundTiming(round=0, started_at=T0 + 5, round_s=10, heartbeat_s=5)
    request = build_request(state, timing, None, seed=0)
    plan = Plan(placements=(Placement(job_id="w3", copy=0, node_id="n1", gpus=(0,)),
                            Placement(job_id="w3", copy=1, node_id="n2", gpus=(0,))),
                waiting=(Wait(job_id="a", code=WaitCode.CAPACITY), Wait(job_id="b", code=WaitCode.CAPACITY)))
    events = plan_to_events(plan, request, state, timing, choice=YARN, seed=0, source="s", inputs={}, decision_ms=0)
    budgets = [e.step_budget for e in events if isinstance(e, Assignment)]
    assert budgets == [152, 152]   # 50.5 job steps each = 151.5 copy steps, rounded up
    credited = sum(b * 1 / 3 for b in budgets)
    assert 101 <= credited <= 101 + len(budgets)


# ---------------------------------------------------------------- bounded state (issue 12)


def _round(state: SchedulerState, r: int, *, nodes=("n1", "n2"), jobs=("a",)) -> None:
    ts = T0 + 10 * r
    state.apply(RoundStarted(ts=ts, source="s", round=r, policy="x", started_at=ts, ends_at=ts + 10, nodes=nodes))
    for job_id in jobs:
        state.apply(Assignment(ts=ts, source="s", round=r, job=state.jobs[job_id].spec, copy=0, node_id="n1",
                               gpus=(0,), gpu_type="v100", world_size=1, ranks=(0,), step_budget=10,
                               deadline=ts + 10))


def test_dedupe_remembers_a_bounded_window_of_ids():
    state = SchedulerState(seen_window=100)
    state.apply(node("n1", "t4"))
    for i in range(1_000):
        state.apply(NodeHeartbeat(ts=T0 + i, source="agent", node_id="n1", seq=i))
    assert state.remembered_ids <= 100 and state.events_applied == 1_001


def test_old_rounds_are_pruned_and_utilization_still_counts_them():
    full, pruned = SchedulerState(rounds_kept=1_000), SchedulerState(rounds_kept=4)
    for state in (full, pruned):
        state.apply(node("n1", "v100", "v100"))
        state.apply(node("n2", "t4"))
        state.apply(JobSubmitted(ts=T0, source="cli", job=spec("a"), submitted_at=T0))
        for r in range(50):
            _round(state, r)
    assert len(pruned.rounds) <= 5 and len(full.rounds) == 50
    assert pruned.allocation_utilization() == full.allocation_utilization() == 1 / 3
    assert pruned.jobs["a"].rounds_run == full.jobs["a"].rounds_run == 50
    assert pruned.jobs["a"].attained_gpu_s == full.jobs["a"].attained_gpu_s


def test_a_redelivered_assignment_is_not_counted_twice_even_past_the_id_window():
    state = SchedulerState(seen_window=2, rounds_kept=3)
    state.apply(node("n1", "v100"))
    state.apply(JobSubmitted(ts=T0, source="cli", job=spec("a"), submitted_at=T0))
    _round(state, 0)
    first = state.rounds[0].assignments[0]
    for i in range(5):
        state.apply(NodeHeartbeat(ts=T0 + i, source="agent", node_id="n1", seq=i))   # push it out of the window
    for r in range(1, 10):
        _round(state, r)
    before = (state.jobs["a"].attained_gpu_s, state.jobs["a"].rounds_run, state.jobs["a"].last_round)
    state.apply(first)
    assert (state.jobs["a"].attained_gpu_s, state.jobs["a"].rounds_run, state.jobs["a"].last_round) == before


def test_finished_jobs_drop_their_rates_and_live_progress():
    state = _state_with_cluster()
    state.apply(Progress(ts=T0 + 1, source="agent", job_id="a", round=0, copy=0, node_id="n1", gpu_type="t4",
                         workers=3, steps_round=30, steps_total=30, samples_per_s=10, loss=1.0))
    state.apply(JobCancelled(ts=T0 + 2, source="cli", job_id="a"))
    assert not any(key[0] == "a" for key in state.rates) and state.jobs["a"].live_steps == {}
    assert state.jobs["a"].state == "cancelled"


def test_only_the_latest_finished_jobs_keep_their_records():
    from shared.domain.layout import final_key, model_key
    from shared.wire.events import JobCompleted

    state = SchedulerState(finished_kept=2)
    state.apply(RoundStarted(ts=T0, source="s", round=0, policy="x", started_at=T0, ends_at=T0 + 10))
    for i in range(5):
        job_id = f"j{i}"
        state.apply(JobSubmitted(ts=T0, source="cli", job=spec(job_id), submitted_at=T0))
        state.apply(JobCompleted(ts=T0 + i, source="tracker", job_id=job_id, final_key=final_key(job_id),
                                 total_steps=100, jct_s=1.0, completed_at=T0 + i))
    assert sorted(state.jobs) == ["j3", "j4"]
    state.apply(JobSubmitted(ts=T0 + 9, source="cli", job=spec("j0"), submitted_at=T0 + 9))
    assert "j0" not in state.jobs                      # a finished id is not reused
    state.apply(ModelConsolidated(ts=T0 + 9, source="tracker", job_id="j0", round=0, key=model_key("j0", 0),
                                  total_steps=100, copies=(CopyWeight(copy=0, steps=100, weight=1.0),)))
    assert "j0" not in state.jobs                      # a late model of a forgotten job: accepted, no effect


def test_progress_shown_before_consolidation_counts_samples():
    """Two copies on 1 of a W=2 job's workers reporting 90 and 30 of their own steps have
    trained (90 + 30) x b samples: 60 job steps, not 120 (issue 11)."""
    state = SchedulerState()
    state.apply(node("n1", "t4"))
    state.apply(node("n2", "t4"))
    state.apply(JobSubmitted(ts=T0, source="cli", job=spec("a", workers=2, iterations=1000), submitted_at=T0))
    state.apply(RoundStarted(ts=T0, source="s", round=0, policy="x", started_at=T0, ends_at=T0 + 10))
    for copy, node_id in enumerate(("n1", "n2")):
        state.apply(Assignment(ts=T0, source="s", round=0, job=spec("a", workers=2, iterations=1000), copy=copy,
                               node_id=node_id, gpus=(0,), gpu_type="t4", world_size=1, ranks=(0,),
                               step_budget=500, deadline=T0 + 10))
    state.apply(Progress(ts=T0 + 1, source="agent", job_id="a", round=0, copy=0, node_id="n1", gpu_type="t4",
                         workers=1, steps_round=90, steps_total=90, samples_per_s=10, loss=1.0))
    state.apply(CopyFinished(ts=T0 + 2, source="agent", job_id="a", round=0, copy=1, node_id="n2", status="ok",
                             steps_round=30, checkpoint="checkpoints/a/0/n2/1.safetensors"))
    assert state.jobs["a"].progress_steps() == 60
