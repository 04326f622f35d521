"""HadarE weighs what a move costs (``JobState.restart_s``): a copy on exactly the GPUs a copy
of its job held last round is warm; any other is cold and trains ``restart_s`` less."""

from __future__ import annotations

import pytest

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import JobState, Placement, Plan, PlanRequest
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies import make_policy
from services.scheduler.sim.simulator import SimOptions, simulate
from services.scheduler.sim.traces import TraceJob

TP = ThroughputModel.from_gavel_table()
JOB_TYPE = "Recommendation (batch size 512)"   # scales linearly to 4 V100s in Gavel's table
NODE = Cluster(name="one", nodes=(Node(node_id="n0", gpus=("v100",) * 4),))
ROUND_S = 360.0


def credited(k: int) -> float:
    return TP.rate(JOB_TYPE, "v100", k) * k / 4


def plan_after_three(steps: int, restart_s: float) -> Plan:
    """Round 1 of a 4-worker job whose one copy ran on three of the node's four GPUs."""
    job = JobState(job_id="j", job_type=JOB_TYPE, workers=4, total_steps=steps, restart_s=restart_s)
    previous = Plan(placements=(Placement(job_id="j", copy=0, node_id="n0", gpus=(0, 1, 2)),))
    return make_policy("hadare").plan(PlanRequest(round=1, now_s=ROUND_S, round_s=ROUND_S, cluster=NODE,
                                                  jobs=(job,), throughput=TP, previous=previous))


def test_the_sizes_make_the_cases():
    # four GPUs train more than three in a round when nothing is lost, and less after a 200 s restart
    assert credited(4) * ROUND_S > credited(3) * ROUND_S > credited(4) * (ROUND_S - 200)


@pytest.mark.parametrize(("restart_s", "gpus"), [(0.0, (0, 1, 2, 3)), (200.0, (0, 1, 2))])
def test_a_job_about_to_finish_keeps_its_warm_copy_rather_than_grow(restart_s, gpus):
    # Work for one round on four GPUs: growing restarts the copy and trains 160 s of the round.
    plan = plan_after_three(int(credited(4) * ROUND_S), restart_s)
    assert [p.gpus for p in plan.placements] == [gpus]


def test_a_long_job_grows_since_the_restart_is_paid_once_over_its_rounds():
    plan = plan_after_three(int(credited(4) * ROUND_S * 200), 200.0)
    assert [p.gpus for p in plan.placements] == [(0, 1, 2, 3)]


def test_the_simulator_tells_the_policy_its_charge_for_a_move():
    seen: list[float] = []

    class Recording:
        name = "recording"

        def plan(self, request: PlanRequest) -> Plan:
            seen.extend(j.restart_s for j in request.jobs)
            return make_policy("hadare").plan(request)

    job = TraceJob(job_id="j", arrival_s=0.0, job_type=JOB_TYPE, workers=4, total_steps=1000)
    simulate(policy=Recording(), cluster=NODE, jobs=[job], throughput=TP,
             options=SimOptions(round_s=ROUND_S, restart_s_by_job_type={JOB_TYPE: 42.0}))
    assert seen and set(seen) == {42.0}


@pytest.mark.parametrize(("restart_s", "pair"), [(200.0, ("n0", (0, 1))), (0.0, ("n1", (0, 1)))])
def test_a_warm_copy_keeps_its_gpus_before_a_narrower_job_takes_one_of_them(restart_s, pair):
    # Two nodes of two V100s. A (W = 2) ran as a pair on n0, the size its LP plans again (a
    # lone worker earns 0.4 per GPU, a pair 1.0); N (W = 1) arrives with one round's work and
    # goes first in the budgeted pass (narrowest first), taking the first idle GPU: n0's.
    # Where a move costs, A keeps its pair and N runs on n1; where it is free, nothing is kept
    # first and A's pair moves to n1.
    model = ThroughputModel(rates={("A", "v100", 1): 0.8, ("A", "v100", 2): 2.0, ("N", "v100", 1): 1.0},
                            cross_node=False)
    two = Cluster(name="two", nodes=tuple(Node(node_id=f"n{i}", gpus=("v100",) * 2) for i in range(2)))
    jobs = (JobState(job_id="a", job_type="A", workers=2, total_steps=720_000, restart_s=restart_s),
            JobState(job_id="n", job_type="N", workers=1, total_steps=300, restart_s=restart_s))
    previous = Plan(placements=(Placement(job_id="a", copy=0, node_id="n0", gpus=(0, 1)),))
    plan = make_policy("hadare").plan(PlanRequest(round=1, now_s=ROUND_S, round_s=ROUND_S, cluster=two, jobs=jobs,
                                                  throughput=model, previous=previous))
    assert pair in [(p.node_id, p.gpus) for p in plan.placements if p.job_id == "a"]
    assert [p.node_id for p in plan.placements if p.job_id == "n"] == ["n1" if pair[0] == "n0" else "n0"]
