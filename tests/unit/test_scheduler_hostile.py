"""The scheduler's state checks well-formed events against what it knows (issue 12): a
forged model key, a round that has not started, bad weights, an implausible rate or a
final key outside the layout are refused with a reason and change nothing."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from services.scheduler.live.state import SchedulerState
from shared.bus.rejection import Rejected
from shared.domain.layout import final_key, model_key
from shared.wire.events import (
    Assignment,
    CopyWeight,
    GpuInfo,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    NodeHeartbeat,
    NodeRegistered,
    RoundStarted,
    ThroughputEstimate,
)

T0 = 1_700_000_000.0


def spec(job_id: str) -> JobSpec:
    return JobSpec(job_id=job_id, user="u", model="resnet", dataset="digits", batch_size=32, workers=1,
                   iterations=100)


def started_state() -> SchedulerState:
    state = SchedulerState()
    state.apply(NodeRegistered(ts=T0, source="agent", node_id="n1", gpus=(GpuInfo(index=0, type="t4"),)))
    for job_id in ("a", "victim"):
        state.apply(JobSubmitted(ts=T0, source="cli", job=spec(job_id), submitted_at=T0))
    state.apply(RoundStarted(ts=T0, source="s", round=0, policy="x", started_at=T0, ends_at=T0 + 10, nodes=("n1",)))
    state.apply(Assignment(ts=T0, source="s", round=0, job=spec("a"), copy=0, node_id="n1", gpus=(0,),
                           gpu_type="t4", world_size=1, ranks=(0,), step_budget=100, deadline=T0 + 10))
    return state


def consolidated(job_id: str = "a", round_: int = 0, *, key: str | None = None,
                 weights: tuple[float, ...] = (1.0,), total: int = 50) -> ModelConsolidated:
    return ModelConsolidated(ts=T0 + 11, source="tracker", job_id=job_id, round=round_,
                             key=model_key(job_id, round_) if key is None else key, total_steps=total,
                             copies=tuple(CopyWeight(copy=i, steps=10, weight=w) for i, w in enumerate(weights)))


@pytest.mark.parametrize("event, reason", [
    (consolidated(key="models/victim/final.safetensors"), "key"),
    (consolidated(key=model_key("a", 3)), "key"),
    (consolidated(round_=2**62), "round"),
    (consolidated(weights=(-3.0, 4.0)), "weight"),
    (consolidated(weights=(0.5, 0.2)), "weight"),
    (consolidated(job_id="ghost"), "unknown job"),
])
def test_a_forged_model_announcement_is_refused_and_changes_nothing(event, reason):
    state = started_state()
    with pytest.raises(Rejected, match=reason):
        state.apply(event)
    assert (state.jobs["a"].model_key, state.jobs["a"].steps_done, state.jobs["a"].consolidated_round) == (None, 0, -1)
    state.apply(consolidated())
    assert state.jobs["a"].model_key == model_key("a", 0) and state.jobs["a"].steps_done == 50


def test_a_completion_outside_the_layout_is_refused():
    state = started_state()
    bad = JobCompleted(ts=T0, source="tracker", job_id="a", final_key="models/victim/final.safetensors",
                       total_steps=100, jct_s=1.0, completed_at=T0 + 1)
    with pytest.raises(Rejected, match="key"):
        state.apply(bad)
    assert state.jobs["a"].active
    state.apply(JobCompleted(ts=T0, source="tracker", job_id="a", final_key=final_key("a"), total_steps=100,
                             jct_s=1.0, completed_at=T0 + 1))
    assert state.jobs["a"].state == "completed"


@pytest.mark.parametrize("rate", [5e-324, 1e-12, 1e12])
def test_an_implausible_rate_is_refused(rate):
    state = started_state()
    with pytest.raises(Rejected, match="rate"):
        state.apply(ThroughputEstimate(ts=T0, source="p", job_id="a", basis="measured", workers=1,
                                       rates={"t4": 2.0, "v100": rate}))
    assert not state.rates
    state.apply(ThroughputEstimate(ts=T0, source="p", job_id="a", basis="measured", workers=1, rates={"t4": 0.0}))
    assert state.rates[("a", "t4", 1)] == ("measured", 0.0)   # zero: "cannot run there" is plausible


def test_a_node_re_registering_with_other_gpus_is_a_new_incarnation():
    state = started_state()
    state.apply(NodeRegistered(ts=T0 + 5, source="agent", node_id="n1",
                               gpus=(GpuInfo(index=0, type="v100"), GpuInfo(index=1, type="v100"))))
    assert state.nodes["n1"].incarnation == 1 and [g.type for g in state.nodes["n1"].registered.gpus] == ["v100"] * 2
    state.apply(NodeRegistered(ts=T0 + 6, source="agent", node_id="n1",
                               gpus=(GpuInfo(index=0, type="v100"), GpuInfo(index=1, type="v100"))))
    assert state.nodes["n1"].incarnation == 1          # same devices: the same node restarting


# ---------------------------------------------------------------- hostile sequences


JOBS = st.sampled_from(["a", "b", "victim", "ghost"])
ROUNDS = st.integers(min_value=0, max_value=6) | st.just(2**62)


class HostileScheduler(RuleBasedStateMachine):
    """Valid and hostile events in any order: apply raises nothing but Rejected, and what
    the next round starts from is always a model of that job from a round that started."""

    def __init__(self) -> None:
        super().__init__()
        self.state = SchedulerState(rounds_kept=4, seen_window=16)
        self.state.apply(NodeRegistered(ts=T0, source="agent", node_id="n1", gpus=(GpuInfo(index=0, type="t4"),)))
        self.round = -1

    def fold(self, event) -> None:
        try:
            self.state.apply(event)
        except Rejected:
            pass

    @rule(job=JOBS)
    def submit(self, job):
        self.fold(JobSubmitted(ts=T0, source="cli", job=spec(job), submitted_at=T0))

    @rule(job=JOBS)
    def start_round(self, job):
        self.round += 1
        ts = T0 + 10 * self.round
        self.fold(RoundStarted(ts=ts, source="s", round=self.round, policy="x", started_at=ts, ends_at=ts + 10,
                               nodes=("n1",)))
        if job in self.state.jobs:
            self.fold(Assignment(ts=ts, source="s", round=self.round, job=spec(job), copy=0, node_id="n1",
                                 gpus=(0,), gpu_type="t4", world_size=1, ranks=(0,), step_budget=10,
                                 deadline=ts + 10))

    @rule(job=JOBS, round_=ROUNDS, forged_key=st.booleans(), weight=st.sampled_from([1.0, -3.0, 0.3, 2.0]),
          total=st.integers(0, 2**64 - 1))
    def announce(self, job, round_, forged_key, weight, total):
        key = "models/victim/final.safetensors" if forged_key else model_key(job, round_)
        self.fold(ModelConsolidated(ts=T0, source="tracker", job_id=job, round=round_, key=key, total_steps=total,
                                    copies=(CopyWeight(copy=0, steps=1, weight=weight),)))

    @rule(job=JOBS, rate=st.sampled_from([0.0, 5e-324, 1.0, 1e300]))
    def estimate(self, job, rate):
        self.fold(ThroughputEstimate(ts=T0, source="p", job_id=job, basis="estimate", workers=1, rates={"t4": rate}))

    @rule(seq=st.integers(0, 1000))
    def heartbeat(self, seq):
        self.fold(NodeHeartbeat(ts=T0 + seq, source="agent", node_id="n1", seq=seq))

    @invariant()
    def start_points_are_real(self):
        for job_id, job in self.state.jobs.items():
            if job.model_key is not None:
                assert job.model_key == model_key(job_id, job.consolidated_round)
                assert job.consolidated_round <= self.state.last_round
        assert all(rate == 0.0 or 1e-9 <= rate <= 1e6 for _, rate in self.state.rates.values())
        assert len(self.state.rounds) <= 5 and self.state.remembered_ids <= 16


TestHostileScheduler = HostileScheduler.TestCase
TestHostileScheduler.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


def test_an_abandoned_round_is_no_longer_awaited_and_a_forged_one_is_refused():
    from shared.wire.events import RoundAbandoned

    state = started_state()
    assert state.awaiting_consolidation(0) == ["a"]
    with pytest.raises(Rejected, match="not started"):
        state.apply(RoundAbandoned(ts=T0, source="tracker", job_id="a", round=5, reason="forged"))
    with pytest.raises(Rejected, match="unknown job"):
        state.apply(RoundAbandoned(ts=T0, source="tracker", job_id="ghost", round=0, reason="forged"))
    state.apply(RoundAbandoned(ts=T0, source="tracker", job_id="a", round=0, reason="no usable replica"))
    assert state.awaiting_consolidation(0) == [] and state.jobs["a"].model_key is None
