"""Policy state is typed: every policy carries a PolicyState and reads back only its own."""

from __future__ import annotations

import dataclasses

import pytest

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import (
    JobState,
    Plan,
    PlanRequest,
    PolicyState,
    previous_state,
)
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies import POLICY_NAMES, make_policy

TOY = ThroughputModel(rates={("a", "v100", 1): 2.0, ("a", "k80", 1): 1.0,
                             ("a", "v100", 2): 4.0, ("a", "k80", 2): 2.0})


def _snapshot(previous: Plan | None = None) -> PlanRequest:
    cluster = Cluster(name="t", nodes=(Node(node_id="n0", gpus=("v100", "v100")), Node(node_id="n1", gpus=("k80",))))
    jobs = (JobState(job_id="j1", job_type="a", workers=1, total_steps=10_000),
            JobState(job_id="j2", job_type="a", workers=2, total_steps=10_000, arrival_s=1.0))
    return PlanRequest(round=0, now_s=0.0, round_s=360.0, cluster=cluster, jobs=jobs, throughput=TOY,
                    previous=previous)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_carries_a_policy_state(name: str) -> None:
    plan = make_policy(name).plan(_snapshot())
    assert plan.state is None or isinstance(plan.state, PolicyState)
    again = make_policy(name).plan(dataclasses.replace(_snapshot(plan), round=1, now_s=360.0))
    assert again.state is None or isinstance(again.state, PolicyState)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_policy_ignores_state_it_did_not_make(name: str) -> None:
    @dataclasses.dataclass(frozen=True)
    class Foreign(PolicyState):
        note: str = "from another policy"

    fresh = make_policy(name).plan(_snapshot())
    foreign = make_policy(name).plan(_snapshot(Plan(state=Foreign())))
    assert foreign.decision() == fresh.decision()


def test_previous_state_returns_only_the_asked_type() -> None:
    @dataclasses.dataclass(frozen=True)
    class Mine(PolicyState):
        n: int = 1

    @dataclasses.dataclass(frozen=True)
    class Other(PolicyState):
        n: int = 1

    assert previous_state(_snapshot(), Mine) is None
    assert previous_state(_snapshot(Plan()), Mine) is None
    assert previous_state(_snapshot(Plan(state=Other())), Mine) is None
    mine = Mine()
    assert previous_state(_snapshot(Plan(state=mine)), Mine) is mine


def test_the_base_adds_no_equality() -> None:
    @dataclasses.dataclass(frozen=True, eq=False)
    class ByIdentity(PolicyState):
        n: int = 1

    assert ByIdentity() != ByIdentity()   # a field-less inherited __eq__ would call them equal
