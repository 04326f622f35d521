"""Job-level baselines: YARN-CS, Tiresias, Gavel (max-min fairness, makespan, total throughput)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import (
    JobState,
    Plan,
    PlanRequest,
    WaitCode,
    check_plan,
    copy_rate,
)
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies import make_policy
from services.scheduler.policies.gavel.lp import max_min_fairness, min_total_duration

ROUND_S = 360.0
BASELINES = ("yarn-cs", "tiresias", "gavel", "gavel-makespan", "gavel-throughput", "gavel-throughput-sia")
GAVEL_TABLE = ThroughputModel.from_gavel_table()

# "fast" runs 10x faster on a V100 than on a K80; "even" runs the same on both.
TOY = ThroughputModel(rates={("fast", "v100", 1): 10.0, ("fast", "k80", 1): 1.0,
                             ("even", "v100", 1): 1.0, ("even", "k80", 1): 1.0,
                             ("fast", "v100", 2): 20.0, ("fast", "k80", 2): 2.0})


def cluster(*nodes: tuple[str, ...]) -> Cluster:
    return Cluster(name="test", nodes=tuple(Node(node_id=f"n{i}", gpus=g) for i, g in enumerate(nodes)))


def job(job_id: str, job_type: str = "even", *, workers: int = 1, steps: int = 10**6,
        arrival: float = 0.0, **kw: object) -> JobState:
    return JobState(job_id=job_id, job_type=job_type, workers=workers, total_steps=steps,
                    arrival_s=arrival, **kw)


def req(cl: Cluster, jobs: list[JobState], *, now: float = 0.0, tm: ThroughputModel = TOY,
         previous: Plan | None = None) -> PlanRequest:
    return PlanRequest(round=int(now // ROUND_S), now_s=now, round_s=ROUND_S, cluster=cl, jobs=tuple(jobs),
                    throughput=tm, previous=previous)


def advance(s: PlanRequest, plan: Plan, arrivals: list[JobState] = ()) -> PlanRequest:
    """One round as Gavel's simulator runs it: int(rate x round) steps, capped; done jobs leave.

    Deliberately leaves attained_gpu_s / time_by_type at 0: policies must keep their own books.
    """
    copies = plan.copies()
    jobs = []
    for j in s.jobs:
        parts = copies.get((j.job_id, 0))
        steps = min(int(copy_rate(s, j, parts) * s.round_s), j.remaining) if parts else 0
        if j.remaining - steps > 0:
            jobs.append(dataclasses.replace(j, steps_done=j.steps_done + steps))
    return dataclasses.replace(s, round=s.round + 1, now_s=s.now_s + s.round_s,
                               jobs=tuple(jobs) + tuple(arrivals), previous=plan)


def placed(plan: Plan) -> dict[str, tuple[tuple[str, tuple[int, ...]], ...]]:
    return {job_id: tuple((p.node_id, p.gpus) for p in parts) for (job_id, _), parts in plan.copies().items()}


def waits(plan: Plan) -> dict[str, WaitCode]:
    return {w.job_id: w.code for w in plan.waiting}


def run_checked(policy_name: str, s: PlanRequest, **options: object) -> Plan:
    plan = make_policy(policy_name, **options).plan(s)
    check_plan(s, plan)
    return plan


# ------------------------------------------------------------------ shared: feasibility, placement

@pytest.mark.parametrize("name", BASELINES)
def test_four_workers_on_three_v100_three_k80_single_gpu_nodes_is_infeasible(name: str) -> None:
    # W=4 > 3 GPUs of every type: no type can hold the gang, whatever the other jobs do,
    # so the job waits INFEASIBLE (not CAPACITY, which would mean "not this round").
    cl = cluster(("v100",), ("v100",), ("v100",), ("k80",), ("k80",), ("k80",))
    plan = run_checked(name, req(cl, [job("big", "fast", workers=4), job("pair", "fast", workers=2)]))
    assert waits(plan)["big"] is WaitCode.INFEASIBLE
    assert "W=4" in next(w.detail for w in plan.waiting if w.job_id == "big")
    pair = placed(plan)["pair"]  # two single-GPU nodes of one type: spanning nodes is allowed
    assert len(pair) == 2 and len({cl.by_id[n].gpus[0] for n, _ in pair}) == 1


@pytest.mark.parametrize("name", BASELINES)
def test_zero_rate_everywhere_is_infeasible(name: str) -> None:
    tm = ThroughputModel(rates={("oom", "v100", 1): 0.0, ("even", "v100", 1): 1.0})
    plan = run_checked(name, req(cluster(("v100", "v100")), [job("x", "oom"), job("y")], tm=tm))
    assert waits(plan) == {"x": WaitCode.INFEASIBLE}


def test_gang_is_consolidated_on_the_best_fitting_node() -> None:
    cl = cluster(("v100",) * 4, ("v100",) * 2, ("v100",))
    plan = run_checked("yarn-cs", req(cl, [job("two", "fast", workers=2, arrival=0.0),
                                            job("one", "fast", arrival=1.0)]))
    assert placed(plan) == {"two": (("n1", (0, 1)),), "one": (("n2", (0,)),)}
    # Five GPUs need two nodes: the largest, then the best fit for the remaining one.
    tm = TOY.with_rates({("fast", "v100", 5): 50.0})
    plan = run_checked("tiresias", req(cl, [job("five", "fast", workers=5)], tm=tm))
    assert placed(plan) == {"five": (("n0", (0, 1, 2, 3)), ("n2", (0,)))}


# ------------------------------------------------------------------ YARN-CS

def test_yarn_cs_is_fifo_and_non_preemptive() -> None:
    cl = cluster(("v100", "v100"))
    s = req(cl, [job("A"), job("B", workers=2, arrival=1.0), job("C", arrival=2.0)],
             tm=TOY.with_rates({("even", "v100", 2): 2.0}))
    plan = run_checked("yarn-cs", s)
    # A starts; B (W=2) does not fit behind it (PRIORITY: a job ahead in FIFO took the GPU
    # this round); YARN does not reserve for B, so C backfills.
    assert set(placed(plan)) == {"A", "C"}
    assert waits(plan) == {"B": WaitCode.PRIORITY}
    assert plan.explain["B"]["queue_position"] == 2

    strict = run_checked("yarn-cs", s, skip_blocked_head=False)
    assert set(placed(strict)) == {"A"}
    assert waits(strict) == {"B": WaitCode.PRIORITY, "C": WaitCode.PRIORITY}
    assert "behind blocked head B" in next(w.detail for w in strict.waiting if w.job_id == "C")

    # A job that arrived earlier than everything running still cannot take their GPUs,
    # and the running jobs keep exactly the GPUs they had.
    s2 = advance(s, plan, arrivals=[job("early", arrival=-5.0)])
    plan2 = run_checked("yarn-cs", s2)
    assert placed(plan2) == placed(plan)
    assert waits(plan2) == {"early": WaitCode.NON_PREEMPTIVE, "B": WaitCode.NON_PREEMPTIVE}
    assert plan2.explain["early"]["queue_position"] == 1
    assert plan2.explain["A"]["state"] == "running"


def test_yarn_cs_starts_the_blocked_head_when_gpus_free_up() -> None:
    cl = cluster(("v100", "v100"))
    tm = TOY.with_rates({("even", "v100", 2): 2.0})
    s = req(cl, [job("A", steps=100), job("B", workers=2, arrival=1.0)], tm=tm)
    plan = run_checked("yarn-cs", s)
    assert set(placed(plan)) == {"A"}
    s2 = advance(s, plan)  # A finishes (100 steps < 360 steps per round)
    assert [j.job_id for j in s2.jobs] == ["B"]
    assert set(placed(run_checked("yarn-cs", s2))) == {"B"}


# ------------------------------------------------------------------ Tiresias

def test_tiresias_demotes_past_threshold_then_preempts_for_a_new_job() -> None:
    cl = cluster(("v100",))
    policy = make_policy("tiresias")  # thresholds (3600 GPU-s,): Q0 below, Q1 above
    s = req(cl, [job("A")])
    for _ in range(10):  # 10 rounds x 360 s x 1 GPU = 3600 GPU-s
        plan = policy.plan(s)
        check_plan(s, plan)
        assert set(placed(plan)) == {"A"}
        s = advance(s, plan)
    plan = policy.plan(s)
    assert plan.explain["A"]["queue"] == 1 and plan.explain["A"]["attained_gpu_s"] == 3600.0
    s = advance(s, plan, arrivals=[job("B", arrival=s.now_s)])
    plan = policy.plan(s)
    check_plan(s, plan)
    assert set(placed(plan)) == {"B"}
    assert waits(plan) == {"A": WaitCode.PRIORITY}
    assert "preempted" in plan.waiting[0].detail and plan.explain["B"]["queue"] == 0


def test_tiresias_trusts_reported_attained_service_after_a_restart() -> None:
    s = req(cluster(("v100",)), [job("old", attained_gpu_s=7200.0), job("new", arrival=50.0)])
    plan = run_checked("tiresias", s)
    assert set(placed(plan)) == {"new"} and plan.explain["old"]["queue"] == 1


def test_tiresias_starvation_guard_promotes_a_long_waiting_job() -> None:
    policy = make_policy("tiresias", promote_knob=0.5)
    s = req(cluster(("v100",)), [job("A")])
    for _ in range(10):
        s = advance(s, policy.plan(s))
    s = dataclasses.replace(s, jobs=s.jobs + (job("B", arrival=s.now_s),))
    history = []
    for _ in range(7):
        plan = policy.plan(s)
        check_plan(s, plan)
        history.append(sorted(placed(plan)))
        s = advance(s, plan)
    # A ran 3600 s, so it is promoted after waiting 0.5 x 3600 = 1800 s (5 rounds), and
    # in Q0 it is ahead of B by arrival.
    assert history == [["B"]] * 5 + [["A"]] * 2
    assert plan.explain["A"]["promotions"] == 1 and plan.explain["A"]["queue"] == 0


def test_tiresias_rejects_bad_thresholds() -> None:
    with pytest.raises(ValueError):
        make_policy("tiresias", thresholds_gpu_s=(7200.0, 3600.0))


# ------------------------------------------------------------------ Gavel

def test_max_min_lp_gives_the_v100_to_the_job_that_is_ten_times_faster_on_it() -> None:
    # 1 V100 + 1 K80. Equal share = half of each type: iso(fast) = 5.5, iso(even) = 1.
    # Normalised throughputs: fast 10/5.5 x_v + 1/5.5 x_k, even x_v + x_k. "even" can reach at
    # most 1, so z* = 1; of the optimal face, fast on the V100 and even on the K80 is best.
    rates = np.array([[10.0, 1.0], [1.0, 1.0]])  # columns: v100, k80
    x = max_min_fairness(rates, np.array([1.0, 1.0]), np.array([1.0, 1.0]), np.array([1.0, 1.0]))
    np.testing.assert_allclose(x, [[1.0, 0.0], [0.0, 1.0]], atol=1e-6)
    plan = run_checked("gavel", req(cluster(("v100",), ("k80",)), [job("A", "fast"), job("B", "even")]))
    assert placed(plan) == {"A": (("n0", (0,)),), "B": (("n1", (0,)),)}
    assert plan.explain["A"]["allocation"] == {"k80": 0.0, "v100": 1.0}


def test_max_min_lp_splits_one_gpu_by_priority_weight() -> None:
    # Same job twice on one GPU, weights 2 and 1: normalised throughput 2x / 2 = 2(1-x) / 1.
    x = max_min_fairness(np.array([[3.0], [3.0]]), np.ones(2), np.array([2.0, 1.0]), np.array([1.0]))
    np.testing.assert_allclose(x[:, 0], [2 / 3, 1 / 3], atol=1e-6)


def test_gavel_rotates_equal_jobs_by_time_received() -> None:
    policy = make_policy("gavel")
    s = req(cluster(("v100",)), [job("A"), job("B", arrival=1.0)])
    runs = []
    for _ in range(4):
        plan = policy.plan(s)
        check_plan(s, plan)
        runs.append(sorted(placed(plan)))
        s = advance(s, plan)
    # Allocation 1/2 each; the job that ran has the larger share of the type's time.
    assert runs == [["A"], ["B"], ["A"], ["B"]]
    assert plan.explain["A"]["allocation"] == {"v100": 0.5}


def test_gavel_new_job_waits_for_the_next_reset() -> None:
    cl = cluster(("v100",), ("v100",))
    policy = make_policy("gavel")  # min_reset_interval_s = 1920, as in Gavel
    t0 = 10 * ROUND_S  # not 0: Gavel treats a reset at t=0 as "never reset" (tested below)
    s = req(cl, [job("A", arrival=t0)], now=t0)
    s = advance(s, policy.plan(s), arrivals=[job("B", arrival=t0 + ROUND_S)])
    plan = policy.plan(s)
    assert waits(plan) == {"B": WaitCode.PRIORITY} and "no allocation yet" in plan.waiting[0].detail
    for _ in range(4):  # resets are allowed again 1920 s after the first: at t0 + 2160
        s = advance(s, plan)
        plan = policy.plan(s)
        assert "B" not in placed(plan)
    s = advance(s, plan)
    assert set(placed(policy.plan(s))) == {"A", "B"}
    eager = make_policy("gavel", min_reset_interval_s=0)
    s = req(cl, [job("A", arrival=t0)], now=t0)
    s = advance(s, eager.plan(s), arrivals=[job("B", arrival=t0 + ROUND_S)])
    assert set(placed(eager.plan(s))) == {"A", "B"}


def test_gavel_reset_at_time_zero_counts_as_never_reset() -> None:
    # Gavel's _update_priorities: `... or self._last_reset_time == 0`.
    cl = cluster(("v100",), ("v100",))
    policy = make_policy("gavel")
    s = req(cl, [job("A")])
    s = advance(s, policy.plan(s), arrivals=[job("B", arrival=ROUND_S)])
    assert set(placed(policy.plan(s))) == {"A", "B"}


def test_gavel_makespan_finishes_both_jobs_by_the_same_makespan() -> None:
    # fast: 36000 steps, 10/s on V100; even: 3600 steps, 1/s anywhere. "even" alone needs
    # 3600 s of whole-GPU time, so T* = 3600 s (fast on V100, even on K80).
    rates = np.array([[10.0, 1.0], [1.0, 1.0]])
    remaining = np.array([36000.0, 3600.0])
    x, makespan = min_total_duration(rates, np.ones(2), remaining, np.ones(2))
    assert 3600.0 <= makespan <= 3600.0 * 1.05
    finish = remaining / (rates * x).sum(axis=1)
    assert np.all(finish <= makespan * (1 + 1e-6))
    plan = run_checked("gavel-makespan", req(cluster(("v100",), ("k80",)),
                                              [job("A", "fast", steps=36000), job("B", "even", steps=3600)]))
    assert placed(plan) == {"A": (("n0", (0,)),), "B": (("n1", (0,)),)}
    assert plan.explain["A"]["lp_makespan_s"] == pytest.approx(makespan, abs=0.1)


# ------------------------------------------------------------------ determinism and invariants

@pytest.mark.parametrize("name", BASELINES)
def test_same_snapshot_same_decision(name: str) -> None:
    cl = cluster(("v100", "v100"), ("k80",), ("p100", "p100"))
    jobs = [job(f"j{i}", GAVEL_TABLE.job_types[(7 * i) % len(GAVEL_TABLE.job_types)],
                arrival=float(i % 3), workers=1 + (i % 2)) for i in range(6)]
    s = req(cl, jobs, tm=GAVEL_TABLE)
    for _ in range(3):
        s = advance(s, make_policy(name).plan(s))
    first, second = make_policy(name).plan(s), make_policy(name).plan(s)
    assert first.decision() == second.decision()
    assert first.state == second.state


@st.composite
def random_snapshots(draw: st.DrawFn) -> PlanRequest:
    node_specs = draw(st.lists(st.tuples(st.sampled_from(["v100", "p100", "k80"]), st.integers(1, 4)),
                               min_size=1, max_size=4))
    cl = cluster(*[(t,) * n for t, n in node_specs])
    n_jobs = draw(st.integers(0, 6))
    jobs = [job(f"j{i}", draw(st.sampled_from(GAVEL_TABLE.job_types)),
                workers=draw(st.sampled_from([1, 1, 1, 2, 4, 8])),
                steps=draw(st.integers(1, 20000)), arrival=float(draw(st.integers(0, 3))),
                priority=draw(st.sampled_from([1.0, 1.0, 2.0])))
            for i in range(n_jobs)]
    return req(cl, jobs, tm=GAVEL_TABLE)


@pytest.mark.parametrize("name", BASELINES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=random_snapshots())
def test_plans_pass_check_plan_over_several_rounds(name: str, s: PlanRequest) -> None:
    policy = make_policy(name)
    for _ in range(3):
        plan = policy.plan(s)
        check_plan(s, plan)
        for (job_id, _), parts in plan.copies().items():
            types = {s.cluster.by_id[p.node_id].gpus[g] for p in parts for g in p.gpus}
            assert len(types) == 1  # one GPU type per job
            assert sum(len(p.gpus) for p in parts) == next(j.workers for j in s.jobs if j.job_id == job_id)
        assert all(w.detail for w in plan.waiting)
        s = advance(s, plan)
