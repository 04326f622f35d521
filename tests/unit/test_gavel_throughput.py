"""Gavel's max_sum_throughput_perf (gavel-throughput) and Sia's way of running it (gavel-throughput-sia)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import JobState, Placement, PlanRequest, WaitCode, check_plan
from services.scheduler.policies import make_policy
from services.scheduler.policies.gang import GangRequest, sequential_gangs
from services.scheduler.policies.gavel.lp import max_sum_throughput
from services.scheduler.sim.sia_table import build_sia_throughput, job_type_name

ROUND_S = 360.0
SIA = build_sia_throughput()
SIA_APPS = (("cifar10", 2048), ("imagenet", 1600), ("bert", 384), ("deepspeech2", 320), ("yolov3", 64))


def cluster(*nodes: tuple[str, ...]) -> Cluster:
    return Cluster(name="test", nodes=tuple(Node(node_id=f"n{i}", gpus=g) for i, g in enumerate(nodes)))


# ------------------------------------------------------------------ the LP

def test_the_lp_gives_each_type_to_the_job_with_the_most_steps_per_second_there() -> None:
    rates = np.array([[10.0, 1.0], [2.0, 1.5]])   # columns: fast type, slow type (one GPU each)
    x = max_sum_throughput(rates, np.ones(2), np.ones(2))
    np.testing.assert_allclose(x, [[1.0, 0.0], [0.0, 1.0]], atol=1e-9)


def test_identical_jobs_get_identical_shares() -> None:
    # Three identical jobs, two GPUs: a vertex would run two full time and starve one.
    x = max_sum_throughput(np.full((3, 1), 4.0), np.ones(3), np.array([2.0]))
    np.testing.assert_allclose(x[:, 0], [2 / 3] * 3, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_lp_never_over_allocates(data: st.DataObject) -> None:
    m, n = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 3))
    rates = np.array([[data.draw(st.sampled_from([0.0, 0.5, 1.0, 3.0, 7.5])) for _ in range(n)] for _ in range(m)])
    sf = np.array([data.draw(st.sampled_from([1, 2, 4])) for _ in range(m)], dtype=float)
    gpus = np.array([data.draw(st.integers(1, 8)) for _ in range(n)], dtype=float)
    x = max_sum_throughput(rates, sf, gpus)
    assert np.all(x >= 0) and np.all(x.sum(axis=1) <= 1 + 1e-9)
    assert np.all((sf[:, None] * x).sum(axis=0) <= gpus + 1e-9)
    assert np.all(x[rates == 0] == 0)


# ------------------------------------------------------------------ plans

@st.composite
def sia_requests(draw: st.DrawFn) -> PlanRequest:
    specs = draw(st.lists(st.tuples(st.sampled_from(["t4", "rtx2080ti", "a100"]), st.sampled_from([4, 8])),
                          min_size=1, max_size=5))
    cl = cluster(*[(t,) * n for t, n in specs])
    jobs = []
    for i in range(draw(st.integers(0, 10))):
        (app, batch), workers = draw(st.sampled_from(SIA_APPS)), draw(st.sampled_from([1, 2, 4, 6, 8, 12]))
        jobs.append(JobState(job_id=f"j{i}", job_type=job_type_name(app, batch, workers), workers=workers,
                             total_steps=draw(st.integers(1, 5000)), arrival_s=float(draw(st.integers(0, 3)))))
    return PlanRequest(round=0, now_s=0.0, round_s=ROUND_S, cluster=cl, jobs=tuple(jobs), throughput=SIA, previous=None)


@pytest.mark.parametrize("name", ["gavel-throughput", "gavel-throughput-sia"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=sia_requests())
def test_plans_honour_the_request_on_a_random_cluster(name: str, s: PlanRequest) -> None:
    policy = make_policy(name)
    for r in range(3):
        plan = policy.plan(s)
        check_plan(s, plan)   # no GPU twice, only active jobs, placed xor waiting with a reason
        for (job_id, _), parts in plan.copies().items():
            types = {s.cluster.by_id[p.node_id].gpus[g] for p in parts for g in p.gpus}
            assert len(types) == 1
            job = next(j for j in s.jobs if j.job_id == job_id)
            assert sum(len(p.gpus) for p in parts) == job.workers
        assert all(w.detail for w in plan.waiting)
        assert {w.job_id for w in plan.waiting if w.code is WaitCode.INFEASIBLE} == {
            j.job_id for j in s.jobs if not any(s.cluster.gpus_by_type.get(t, 0) >= j.workers
                                                and SIA.rate(j.job_type, t, j.workers) > 0 for t in s.cluster.types)}
        s = PlanRequest(round=r + 1, now_s=s.now_s + ROUND_S, round_s=ROUND_S, cluster=s.cluster, jobs=s.jobs,
                        throughput=SIA, previous=plan)


def test_sia_variant_restores_from_its_own_state_only() -> None:
    cl = cluster(("t4",) * 4, ("a100",) * 8)
    jobs = (JobState(job_id="a", job_type=job_type_name(*SIA_APPS[0], 4), workers=4, total_steps=10**5),
            JobState(job_id="b", job_type=job_type_name(*SIA_APPS[1], 8), workers=8, total_steps=10**5))
    s = PlanRequest(round=0, now_s=0.0, round_s=ROUND_S, cluster=cl, jobs=jobs, throughput=SIA, previous=None)
    first = make_policy("gavel-throughput").plan(s)
    nxt = PlanRequest(round=1, now_s=ROUND_S, round_s=ROUND_S, cluster=cl, jobs=jobs, throughput=SIA, previous=first)
    # The other variant's books are ignored: same decision as from a first round.
    fresh = PlanRequest(round=1, now_s=ROUND_S, round_s=ROUND_S, cluster=cl, jobs=jobs, throughput=SIA, previous=None)
    sia = make_policy("gavel-throughput-sia")
    assert sia.plan(nxt).decision() == sia.plan(fresh).decision()
    assert first.state is not None and first.state.policy == "gavel-throughput"


# ------------------------------------------------------------------ Sia's sequential GPU assignment

def test_sequential_assignment_lets_a_larger_job_take_a_smaller_one_s_gpus() -> None:
    cl = cluster(("t4",) * 4, ("t4",) * 4)
    previous = {"small": (Placement(job_id="small", copy=0, node_id="n0", gpus=(0, 1)),)}
    requests = [GangRequest(job_id="small", gpu_type="t4", workers=2),
                GangRequest(job_id="big", gpu_type="t4", workers=6)]
    got = sequential_gangs(cl, requests, previous)
    # Largest first from the pointer: big takes n0 entirely and two of n1; small moves.
    assert [(p.node_id, p.gpus) for p in got["big"]] == [("n0", (0, 1, 2, 3)), ("n1", (0, 1))]
    assert [(p.node_id, p.gpus) for p in got["small"]] == [("n1", (2, 3))]
    # A job that keeps its type and whose GPUs are free keeps them.
    kept = sequential_gangs(cl, requests[:1], previous)
    assert [(p.node_id, p.gpus) for p in kept["small"]] == [("n0", (0, 1))]
