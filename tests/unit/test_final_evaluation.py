"""A user-code job's final model is evaluated by one evaluation copy on a free GPU (issue 25
item 8): the scheduler's rule, the agent's check of it, and what ``hadar logs`` shows."""

from __future__ import annotations

from dataclasses import replace

from services.agent.daemon.validation import assignment_problem
from services.cli.joblog import TrainingLog
from services.cli.jobview import job_doc
from services.scheduler.core.policy import Placement, Plan
from services.scheduler.live.records import MAX_EVALUATIONS
from services.scheduler.live.rounds import RoundTiming, build_request, plan_to_events
from services.scheduler.live.state import EVALUATION_REPORT_S, SchedulerState
from services.scheduler.policies import PolicyChoice
from shared.domain.layout import final_key, model_key
from shared.wire.events import (
    Assignment,
    CopyFinished,
    CopyWeight,
    Event,
    GpuInfo,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    NodeRegistered,
    RoundStarted,
)
from shared.wire.records import UserCode

T0 = 1_700_000_000.0
CODE = UserCode(digest="a" * 64, size=10, entrypoint="train.py")
YARN = PolicyChoice(name="yarn-cs")


def spec(job_id: str, *, code: UserCode | None = CODE) -> JobSpec:
    return JobSpec(job_id=job_id, user="alice", model="user" if code else "resnet",
                   dataset="-" if code else "digits", batch_size=32, workers=1, iterations=100, code=code)


def completed_state(*jobs: JobSpec) -> SchedulerState:
    """Nodes n1 (2 x v100) and n2 (1 x t4); each job ran round 0 and completed."""
    state = SchedulerState()
    state.apply(NodeRegistered(ts=T0, source="agent", node_id="n1", address="n1.lan",
                               gpus=(GpuInfo(index=0, type="v100"), GpuInfo(index=1, type="v100"))))
    state.apply(NodeRegistered(ts=T0, source="agent", node_id="n2", address="n2.lan",
                               gpus=(GpuInfo(index=0, type="t4"),)))
    state.apply(RoundStarted(ts=T0, source="s", round=0, policy="x", started_at=T0, ends_at=T0 + 10))
    for i, job in enumerate(jobs):
        state.apply(JobSubmitted(ts=T0, source="cli", job=job, submitted_at=T0))
        state.apply(ModelConsolidated(ts=T0 + 9, source="t", job_id=job.job_id, round=0,
                                      key=model_key(job.job_id, 0), total_steps=100,
                                      copies=(CopyWeight(copy=0, steps=100, weight=1.0),)))
        state.apply(JobCompleted(ts=T0 + 10 + i, source="t", job_id=job.job_id, final_key=final_key(job.job_id),
                                 total_steps=100, jct_s=10.0 + i, completed_at=T0 + 10 + i))
    return state


def plan_round(state: SchedulerState, round_: int, plan: Plan | None = None) -> list[Event]:
    timing = RoundTiming(round=round_, started_at=T0 + 10 * round_, round_s=10, heartbeat_s=1000)
    request = build_request(state, timing, None, seed=0)
    events = plan_to_events(plan or Plan(placements=()), request, state, timing, choice=YARN, seed=0, source="s",
                            inputs={}, decision_ms=0)
    for event in events:
        state.apply(event)
    return events


def evaluations(events: list[Event]) -> list[Assignment]:
    return [e for e in events if isinstance(e, Assignment) and e.evaluation]


def report(a: Assignment, *, metric: float | None, status: str = "ok") -> CopyFinished:
    return CopyFinished(ts=a.deadline - 1, source=f"agent/{a.node_id}", job_id=a.job_id, round=a.round, copy=a.copy,
                        node_id=a.node_id, status=status, steps_round=0, evaluation=True,  # type: ignore[arg-type]
                        metric_name="accuracy" if metric is not None else "", start_metric=metric,
                        reason="" if status == "ok" else "crashed")


def test_a_completed_user_job_gets_one_evaluation_copy_of_its_final_model_on_a_free_gpu() -> None:
    state = completed_state(spec("u1"), spec("zoo", code=None))
    busy = Plan(placements=(Placement(job_id="other", copy=0, node_id="n1", gpus=(0,)),))
    state.apply(JobSubmitted(ts=T0, source="cli", job=spec("other", code=None), submitted_at=T0))
    events = plan_round(state, 1, busy)
    started = events[0]
    assert isinstance(started, RoundStarted) and started.assignments == 2   # the plan's copy and the evaluation
    (a,) = evaluations(events)   # none for the zoo job: the tracker evaluates those
    assert (a.job_id, a.node_id, a.gpus, a.gpu_type) == ("u1", "n1", (1,), "v100")   # GPU 0 is the plan's
    assert (a.step_budget, a.copies, a.world_size, a.start_from) == (0, 1, 1, final_key("u1"))
    assert a.deadline == started.ends_at
    job = state.jobs["u1"]
    assert (job.rounds_run, job.last_round, job.attained_gpu_s) == (0, None, 0.0)   # not training, not charged


def test_an_evaluation_never_displaces_training_and_waits_for_a_free_gpu() -> None:
    state = completed_state(spec("u1"))
    full = Plan(placements=(Placement(job_id="x", copy=0, node_id="n1", gpus=(0,)),
                            Placement(job_id="x", copy=1, node_id="n1", gpus=(1,)),
                            Placement(job_id="y", copy=0, node_id="n2", gpus=(0,))))
    for job_id in ("x", "y"):
        state.apply(JobSubmitted(ts=T0, source="cli", job=spec(job_id, code=None), submitted_at=T0))
    assert evaluations(plan_round(state, 1, full)) == []
    assert [a.job_id for a in evaluations(plan_round(state, 2))] == ["u1"]


def test_the_oldest_completion_is_evaluated_first_one_gpu_each() -> None:
    state = completed_state(spec("u2"), spec("u1"), spec("u3"), spec("u4"))   # completed in this order
    placed = evaluations(plan_round(state, 1))
    assert [(a.job_id, a.node_id, a.gpus) for a in placed] == [("u2", "n1", (0,)), ("u1", "n1", (1,)),
                                                               ("u3", "n2", (0,))]
    assert [a.job_id for a in evaluations(plan_round(state, 2))] == ["u4"]


def test_a_reported_metric_ends_the_evaluations_and_is_the_final_models() -> None:
    state = completed_state(spec("u1"))
    (a,) = evaluations(plan_round(state, 1))
    state.apply(report(a, metric=0.97))
    assert (state.jobs["u1"].final_metric_name, state.jobs["u1"].final_metric) == ("accuracy", 0.97)
    for round_ in range(2, 8):
        assert evaluations(plan_round(state, round_)) == []


def test_a_try_without_a_metric_is_retried_at_most_max_evaluations_times() -> None:
    state = completed_state(spec("u1"))
    tries = []
    for round_ in range(1, 4 * MAX_EVALUATIONS):
        for a in evaluations(plan_round(state, round_)):
            tries.append(round_)
            state.apply(report(a, metric=None, status="failed" if len(tries) % 2 else "ok"))
    assert tries == [1, 2, 3][:MAX_EVALUATIONS]   # each report came: the next round tries again
    job = state.jobs["u1"]
    assert job.final_metric is None and job.evaluations == MAX_EVALUATIONS and job.evaluation_failure


def test_a_try_that_never_reports_is_retried_once_its_report_is_overdue() -> None:
    state = completed_state(spec("u1"))
    (first,) = evaluations(plan_round(state, 1))   # deadline T0 + 20; rounds start every 10 s
    overdue = first.deadline + EVALUATION_REPORT_S
    tries = [r for r in range(2, 12) if evaluations(plan_round(state, r))]
    assert tries == [int((overdue - T0) // 10)]
    assert not state.awaiting_evaluation(overdue - 1) and state.jobs["u1"].evaluations == 2


def test_a_report_from_a_node_the_evaluation_was_not_placed_on_changes_nothing() -> None:
    state = completed_state(spec("u1"))
    (a,) = evaluations(plan_round(state, 1))
    for round_ in range(100):   # held for an Assignment that never comes: one per node, so no flood
        state.apply(report(replace(a, node_id="n2", round=round_), metric=0.01))
    assert state.jobs["u1"].final_metric is None and len(state.jobs["u1"].evaluation_reports) == 1
    state.apply(report(a, metric=0.9))
    assert state.jobs["u1"].final_metric == 0.9


def test_the_agent_runs_an_evaluation_only_from_the_jobs_final_model() -> None:
    state = completed_state(spec("u1"))
    (a,) = evaluations(plan_round(state, 1))
    check = dict(gpus={0, 1}, now=a.deadline - 5, max_deadline_ahead_s=86_400)
    assert assignment_problem(a, **check) is None
    for start in (model_key("u1", 0), final_key("u2")):
        problem = assignment_problem(replace(a, start_from=start), **check)
        assert problem is not None and problem.code == "start_from"


def test_hadar_logs_shows_the_evaluation_as_the_final_models_metric() -> None:
    state = completed_state(spec("u1"))
    (a,) = evaluations(plan_round(state, 1))
    log = TrainingLog()
    model = ModelConsolidated(ts=T0 + 9, source="t", job_id="u1", round=0, key=model_key("u1", 0), total_steps=100,
                              copies=(CopyWeight(copy=0, steps=100, weight=1.0),))
    log.fold([model, a, report(a, metric=0.97)])
    doc = log.doc("u1")
    assert doc["final_model"] == {"key": final_key("u1"), "metric": {"name": "accuracy", "value": 0.97, "by": "agent"}}
    assert doc["rounds"][0]["model"]["metric"] == {"name": "accuracy", "value": 0.97, "by": "agent"}
    assert doc["latest"]["metric"] == {"round": 0, "name": "accuracy", "value": 0.97}
    evaluation_row = next(r for r in doc["rounds"] if r["round"] == 1)["copies"][0]
    assert evaluation_row["evaluation"] is True and evaluation_row["step_budget"] == 0


def test_hadar_status_says_how_the_final_models_evaluation_went() -> None:
    state = completed_state(spec("u1"), spec("zoo", code=None))
    assert job_doc(state, "zoo", now=T0 + 100)["final_evaluation"] is None   # the tracker evaluates zoo models
    doc = job_doc(state, "u1", now=T0 + 100)["final_evaluation"]
    assert doc == {"state": "pending", "tries": 0, "metric": None, "failure": None}
    for round_ in range(1, 1 + MAX_EVALUATIONS):
        for a in evaluations(plan_round(state, round_)):
            state.apply(report(a, metric=None, status="failed"))
    doc = job_doc(state, "u1", now=T0 + 100)["final_evaluation"]
    assert doc == {"state": "given up", "tries": MAX_EVALUATIONS, "metric": None, "failure": "crashed"}
    other = completed_state(spec("u2"))
    (a,) = evaluations(plan_round(other, 1))
    other.apply(report(a, metric=0.97))
    doc = job_doc(other, "u2", now=T0 + 100)["final_evaluation"]
    assert doc == {"state": "measured", "tries": 1, "metric": {"name": "accuracy", "value": 0.97}, "failure": None}


def test_a_report_folded_before_its_assignment_still_counts() -> None:
    """A viewer (``hadar status``) and a restarted scheduler fold placements after progress:
    the evaluation's report waits for its Assignment, then counts."""
    live = completed_state(spec("u1"))
    (a,) = evaluations(plan_round(live, 1))
    viewer = completed_state(spec("u1"))
    viewer.apply(RoundStarted(ts=a.ts, source="s", round=1, policy="x", started_at=a.ts, ends_at=a.deadline))
    viewer.apply(report(a, metric=0.97))
    assert viewer.jobs["u1"].final_metric is None
    viewer.apply(a)
    assert viewer.jobs["u1"].final_metric == 0.97 and viewer.jobs["u1"].last_evaluation_reported
    assert not viewer.awaiting_evaluation(a.deadline + 1000)
