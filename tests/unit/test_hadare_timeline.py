"""HadarE's time-indexed LP (hadare/timeline): the plan it solves, the target end it keeps,
and what the policy does with it over whole simulated runs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import JobState, PlanRequest
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies import make_policy
from services.scheduler.policies.hadare.timeline import (
    COMPLETION_WEIGHT,
    TIMELINE_SLACK,
    TimelineState,
    budgets,
    target_end_s,
)
from services.scheduler.policies.lp.model import WorkLp, fork_lp, makespan
from services.scheduler.policies.lp.timeline import POOL_ABOVE, intervals, solve
from shared.persistence.codec import pack, unpack
from tests.unit.generated_runs import run_generated

TP = ThroughputModel.from_gavel_table()
TYPES = ("k80", "p100", "v100")
JOB_TYPES = ("ResNet-18 (batch size 64)", "ResNet-50 (batch size 32)", "Transformer (batch size 32)",
             "Recommendation (batch size 512)", "A3C")


def pooled(rems: list[float], gpus: int) -> WorkLp:
    """Jobs on ``gpus`` identical GPUs, each able to use all of them (forked), rate 1."""
    n = len(rems)
    return WorkLp(types=["g"], rho=np.ones((n, 1)), rem=np.array(rems, dtype=float),
                  cap_f=np.full((n, 1), float(gpus)), cap_g=np.full(n, float(gpus)), count=np.array([float(gpus)]))


def round_shares(lp: WorkLp, ids: list[str], *, round_s: float, horizon_s: float) -> dict[str, dict[str, float]]:
    """The LP's slice of the first round: job id -> {type: GPUs}, noise dropped."""
    plan = solve(lp, round_s=round_s, horizon_s=horizon_s)
    assert plan is not None
    now = plan.x[:, :, 0] / plan.lengths[0]
    return {i: {lp.types[r]: float(now[k, r]) for r in range(len(lp.types)) if now[k, r] > 1e-4}
            for k, i in enumerate(ids)}


def credited(job: JobState, gpu_type: str, k: int) -> float:
    return TP.rate(job.job_type, gpu_type, k) * k / job.workers


def test_intervals_start_with_the_round_then_double_up_to_the_horizon():
    assert intervals(100.0, 10.0) == [10.0, 10.0, 20.0, 40.0, 20.0]
    assert intervals(5.0, 10.0) == [5.0]
    assert sum(intervals(12_345.6, 360.0)) == pytest.approx(12_345.6)
    assert len(intervals(1e6, 360.0)) <= 14


def test_the_shortest_job_runs_first_on_a_pooled_cluster():
    # Smith's rule on one machine: the job of 1 round before the job of 10, whatever the order given.
    assert round_shares(pooled([1.0, 10.0], 1), ["a", "b"], round_s=1.0, horizon_s=11.0) == {"a": {"g": 1.0}, "b": {}}
    assert round_shares(pooled([10.0, 1.0], 1), ["b", "a"], round_s=1.0, horizon_s=11.0) == {"b": {}, "a": {"g": 1.0}}


def test_the_horizon_makes_the_long_job_start_now():
    # Alone, the short job would go first; a horizon of exactly T* leaves no room to wait.
    shares = round_shares(pooled([1.0, 10.0], 1), ["a", "b"], round_s=1.0, horizon_s=11.0)
    assert shares["a"] == {"g": 1.0}
    two = WorkLp(types=["fast", "slow"], rho=np.array([[1.0, 1.0], [1.0, 0.1]]), rem=np.array([1.0, 10.0]),
                 cap_f=np.ones((2, 2)), cap_g=np.full(2, 2.0), count=np.ones(2))
    tight = round_shares(two, ["short", "long"], round_s=1.0, horizon_s=10.0)
    assert tight["long"] == pytest.approx({"fast": 1.0}) and tight["short"] == pytest.approx({"slow": 1.0})


@st.composite
def instances(draw):
    nodes = tuple(Node(node_id=f"n{i}", gpus=tuple(draw(st.lists(st.sampled_from(TYPES), min_size=1, max_size=3))))
                  for i in range(draw(st.integers(1, 4))))
    jobs = [JobState(job_id=f"j{i}", job_type=draw(st.sampled_from(JOB_TYPES)),
                     workers=draw(st.sampled_from((1, 1, 2))),
                     total_steps=draw(st.integers(1_000, 3_000_000))) for i in range(draw(st.integers(1, 6)))]
    return Cluster(name="prop", nodes=nodes), jobs, draw(st.sampled_from((0.0, 0.03, 0.5)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_the_plan_does_all_work_by_the_horizon_within_every_cap(instance):
    cluster, jobs, slack = instance
    lp = fork_lp(jobs, cluster, credited)
    best = makespan(lp)
    assert best is not None
    plan = solve(lp, round_s=360.0, horizon_s=(1.0 + slack) * best)
    assert plan is not None
    x, lengths = plan.x, plan.lengths
    assert lengths.sum() == pytest.approx((1.0 + slack) * best, rel=1e-5, abs=1e-3)
    assert np.all(x >= -1e-6)
    work = np.einsum("jr,jrk->j", lp.rho, x)
    assert np.all(work >= lp.rem * (1 - 1e-6) - 1e-6)                                  # every job done
    tol = 1e-6 * lengths.max() + 1e-6
    assert np.all(x.sum(axis=0) <= lp.count[:, None] * lengths[None, :] + tol)        # no type over capacity
    assert np.all(x.sum(axis=1) <= lp.cap_g[:, None] * lengths[None, :] + tol)        # nor a job over its GPUs
    assert np.all(x <= lp.cap_f[:, :, None] * lengths[None, None, :] + tol)
    now = x[:, :, 0] / lengths[0]
    for r, gpu_type in enumerate(lp.types):
        assert now[:, r].sum() <= cluster.gpus_by_type[gpu_type] + 1e-6


def plan_finish(lp: WorkLp, **options) -> np.ndarray:
    """Per job, the end of the last interval the LP's plan gives it work in (when the plan ends it)."""
    plan = solve(lp, **options)
    assert plan is not None
    work = np.einsum("jr,jrk->jk", lp.rho, plan.x)
    ends = np.cumsum(plan.lengths)
    return np.array([ends[np.flatnonzero(work[j] > 1e-6 * lp.rem[j])[-1]] for j in range(lp.rem.size)])


def test_the_completion_term_ends_a_job_early_instead_of_trailing_its_work_to_the_cap():
    # Mean busy time scores a job that does 90% of its work early and the rest at E almost as
    # well as one that is done early: here "c" (fast on one type only) trails to E under it.
    # Weighing each job's completion bound ends "c" at 32 with no job ending later.
    lp = WorkLp(types=["fast", "slow"], rho=np.array([[0.6, 0.5], [0.8, 0.5], [0.7, 0.1]]),
                rem=np.array([15.0, 19.0, 17.0]), cap_f=np.ones((3, 2)), cap_g=np.full(3, 2.0), count=np.ones(2))
    best = makespan(lp)
    assert best is not None
    options = {"round_s": 0.25, "horizon_s": 1.05 * best}
    busy = plan_finish(lp, **options)
    weighed = plan_finish(lp, completion_weight=COMPLETION_WEIGHT, **options)
    assert busy[2] == pytest.approx(1.05 * best, rel=1e-5)
    assert weighed[2] <= 32.0 + 1e-6
    assert np.all(weighed <= busy + 1e-6)


def test_budgets_carry_a_share_from_round_to_round_so_shares_are_met_over_time():
    # One GPU shared 0.6 / 0.4 every round. Rounding each round up, the job ahead took it
    # every time and the other never ran; carried, they run 6 and 4 rounds of 10.
    share, cap_f, count = np.array([[0.6], [0.4]]), np.ones((2, 1)), np.array([1.0])
    credit, rounds = np.zeros((2, 1)), np.zeros(2)
    for _ in range(10):
        got, credit = budgets(share, [[0], [1]], cap_f, count=count, credit=credit, finishing=np.zeros(2, bool))
        assert sum(g.get(0, 0) for g in got) == 1            # never more GPUs than the type has
        rounds += [g.get(0, 0) for g in got]
        assert np.all(np.abs(credit) <= 1.0)
    assert rounds.tolist() == [6.0, 4.0]


def test_budgets_drop_noise_hand_a_class_out_in_order_and_serve_a_finishing_job_first():
    share = np.array([[0.35, 1.0, 2.2, 1e-7], [2.5, 0.0, 0.0, 0.0]])
    cap_f = np.array([[1, 1, 4, 1], [2, 1, 1, 1], [2, 1, 1, 1], [2, 1, 1, 1]], dtype=float)
    count = np.array([3.0, 1.0, 3.0, 1.0])
    got, credit = budgets(share, [[0], [1, 2, 3]], cap_f, count=count, credit=np.zeros((2, 4)),
                          finishing=np.zeros(2, bool))
    # type 0: 2 whole GPUs to the class, the spare one to the larger remainder (0.5 over 0.35)
    assert got[0] == {1: 1, 2: 3} and got[1:] == [{0: 2}, {0: 1}, {}]
    assert credit[0].tolist() == pytest.approx([0.35, 0.0, -0.8, 0.0]) and credit[1, 0] == pytest.approx(-0.5)
    # the job the LP ends this round gets the spare GPU, whatever its remainder
    got, _ = budgets(share, [[0], [1, 2, 3]], cap_f, count=count, credit=np.zeros((2, 4)),
                     finishing=np.array([True, False]))
    assert got[0][0] == 1 and got[1:] == [{0: 2}, {}, {}]


def test_the_target_end_moves_only_for_arrivals_or_when_it_cannot_be_met():
    first = target_end_s(1000.0, now_s=0.0, previous=None, job_ids=frozenset({"a"}), slack=0.1)
    assert first == pytest.approx(1100.0)
    state = TimelineState(end_s=first, job_ids=frozenset({"a"}))
    # following the plan, T* falls by a round per round: E is kept, not re-derived (no compounding slack)
    assert target_end_s(900.0, now_s=100.0, previous=state, job_ids=frozenset({"a"}), slack=0.1) == first
    # a job arrived: E grows to the new (1 + slack) T* if that is later
    assert target_end_s(1500.0, now_s=100.0, previous=state, job_ids=frozenset({"a", "b"}),
                        slack=0.1) == pytest.approx(100.0 + 1650.0)
    # behind plan: E can no longer be met, so it is the makespan bound from now
    assert target_end_s(1050.0, now_s=100.0, previous=state, job_ids=frozenset({"a"}), slack=0.1) == 1150.0


def test_timeline_state_survives_a_scheduler_snapshot():
    state = TimelineState(end_s=12.5, job_ids=frozenset({"a", "b"}), credit={"a": {"v100": 0.25, "k80": -0.5}})
    assert unpack(pack(state)) == state


def run(cluster: str, seed: int, **options):
    metrics, bounds = run_generated("hadare", cluster, jobs=10, seed=seed, **options)
    return metrics, bounds.ttd_fork_s


@pytest.mark.parametrize("cluster,seed", [("lab-5", 1), ("aws-5", 2)])
def test_the_timeline_keeps_the_makespan_near_the_bound_and_shortens_jobs(cluster, seed):
    # The trade-off on whole runs: the makespan split alone meets the fork bound but
    # delays short jobs; the timeline ends within a few % of the bound too, and its jobs end sooner.
    timeline, bound = run(cluster, seed)
    split, _ = run(cluster, seed, split="makespan")
    assert timeline.jobs_completed == timeline.jobs_total
    assert timeline.ttd_s <= 1.08 * bound
    assert timeline.jct_mean_s < split.jct_mean_s


@pytest.mark.parametrize("cluster,seed", [("lab-5", 1), ("aws-5", 1)])
def test_the_makespan_ends_where_the_slack_says(cluster, seed):
    # Rounded up each round, the LP's shares went to the jobs first in Smith's order; the
    # others fell behind plan until E could not be met: 1.054x / 1.061x the fork bound at a
    # slack of 0.03. Carried from round to round, the rounding follows the plan.
    metrics, bounds = run_generated("hadare", cluster, jobs=20, seed=seed)
    assert metrics.jobs_completed == metrics.jobs_total
    assert metrics.ttd_s <= (1.0 + TIMELINE_SLACK + 0.005) * bounds.ttd_fork_s


def test_the_completion_term_shortens_mean_jct_on_a_whole_run():
    # lab-5 seed 2 (20 jobs): without it the long jobs' last work trails to E.
    weighed, _ = run_generated("hadare", "lab-5", jobs=20, seed=2)
    busy, _ = run_generated("hadare", "lab-5", jobs=20, seed=2, completion_weight=0.0)
    assert weighed.jct_mean_s <= 0.98 * busy.jct_mean_s


def test_the_policy_carries_its_target_end_from_round_to_round():
    cluster = Cluster(name="two", nodes=(Node(node_id="n0", gpus=("v100",)), Node(node_id="n1", gpus=("k80",))))
    jobs = (JobState(job_id="a", job_type=JOB_TYPES[0], workers=1, total_steps=2_000_000),
            JobState(job_id="b", job_type=JOB_TYPES[3], workers=1, total_steps=400_000))
    policy = make_policy("hadare")
    first = policy.plan(PlanRequest(round=0, now_s=0.0, round_s=360.0, cluster=cluster, jobs=jobs, throughput=TP))
    assert isinstance(first.state, TimelineState) and first.state.job_ids == {"a", "b"}
    again = policy.plan(PlanRequest(round=1, now_s=360.0, round_s=360.0, cluster=cluster, jobs=jobs, throughput=TP,
                                 previous=first))
    assert again.state.end_s == first.state.end_s       # nothing arrived, the plan is on time: E kept
    assert make_policy("hadare", split="makespan").plan(
        PlanRequest(round=0, now_s=0.0, round_s=360.0, cluster=cluster, jobs=jobs, throughput=TP)).state is None


def test_above_pool_above_jobs_the_plan_is_valid_and_the_shortest_run_first():
    cluster = Cluster(name="big", nodes=tuple(Node(node_id=f"n{i}", gpus=("v100",) * 4) for i in range(10)))
    per_round = TP.rate(JOB_TYPES[0], "v100", 1) * 360.0
    jobs = tuple(JobState(job_id=f"j{i:03d}", job_type=JOB_TYPES[0], workers=1, total_steps=int(per_round * (2 + i)))
                 for i in range(POOL_ABOVE + 20))
    req = PlanRequest(round=0, now_s=0.0, round_s=360.0, cluster=cluster, jobs=jobs, throughput=TP)
    plan = make_policy("hadare").plan(req)
    from services.scheduler.core.policy import check_plan
    check_plan(req, plan)
    placed = {p.job_id for p in plan.placements}
    assert len(plan.placements) == 40 and "j000" in placed and f"j{POOL_ABOVE + 19:03d}" not in placed


def test_of_two_equal_jobs_the_one_on_the_fast_type_keeps_it():
    # As Hadar's timeline rule (KEEP_ROUNDS): either job may have the V100 this round; the
    # one that ran there keeps it, since a move is a restart (Sia's eight workloads: mean JCT
    # 2,714 -> 2,137 s, restarts per job 2.79 -> 2.10). Models too big to be worth a second
    # copy (its consolidation would cost more than it trains) keep each job to one GPU.
    from services.scheduler.core.policy import Placement, Plan

    cluster = Cluster(name="two", nodes=(Node(node_id="n0", gpus=("v100",)), Node(node_id="n1", gpus=("k80",))))
    steps = int(TP.rate(JOB_TYPES[0], "v100", 1) * 360.0 * 50)
    jobs = tuple(JobState(job_id=f"j{i}", job_type=JOB_TYPES[0], workers=1, total_steps=steps,
                          model_bytes=20 * 10**9) for i in range(2))
    for on_v100, on_k80 in (("j0", "j1"), ("j1", "j0")):
        previous = Plan(placements=(Placement(job_id=on_v100, copy=0, node_id="n0", gpus=(0,)),
                                    Placement(job_id=on_k80, copy=0, node_id="n1", gpus=(0,))))
        plan = make_policy("hadare").plan(PlanRequest(round=1, now_s=360.0, round_s=360.0, cluster=cluster,
                                                      jobs=jobs, throughput=TP, previous=previous))
        assert {(p.job_id, p.node_id) for p in plan.placements} == {(on_v100, "n0"), (on_k80, "n1")}


def test_a_copy_keeps_its_node_when_another_is_as_good():
    # Two jobs, two equal nodes, each job on one last round, too big to fork: neither moves
    # (j, first in line, took the first node in cluster order).
    from services.scheduler.core.policy import Placement, Plan

    cluster = Cluster(name="two", nodes=tuple(Node(node_id=f"n{i}", gpus=("v100",) * 4) for i in range(2)))
    per_round = TP.rate(JOB_TYPES[0], "v100", 4) * 360.0
    jobs = tuple(JobState(job_id=job_id, job_type=JOB_TYPES[0], workers=4, total_steps=int(per_round * rounds),
                          model_bytes=20 * 10**9) for job_id, rounds in (("j", 40), ("k", 50)))
    previous = Plan(placements=(Placement(job_id="j", copy=0, node_id="n1", gpus=(0, 1, 2, 3)),
                                Placement(job_id="k", copy=0, node_id="n0", gpus=(0, 1, 2, 3))))
    plan = make_policy("hadare").plan(PlanRequest(round=1, now_s=360.0, round_s=360.0, cluster=cluster,
                                                  jobs=jobs, throughput=TP, previous=previous))
    assert {(p.job_id, p.node_id) for p in plan.placements} == {("j", "n1"), ("k", "n0")}


# ---------------------------------------------------------------------------- one copy per node

PAIRS = Cluster(name="pairs", nodes=(Node(node_id="a", gpus=("v100",) * 2), Node(node_id="b", gpus=("v100",) * 2)))


def lone_best(job: JobState, gpu_type: str, k: int) -> float:
    """A 2-worker job: a lone worker 1.0 job steps/s x 1/2, a copy of two 0.6 (per GPU the lone worker wins)."""
    return {1: 0.5, 2: 0.6}[k]


def test_with_node_slots_a_node_holds_one_copy_of_a_job_in_the_lp():
    # 1200 steps on two nodes of two V100s. Per GPU, four lone workers: 4 x 0.5 = 2.0 steps/s,
    # T = 600 s; one copy per node, the best is two copies of two: 1.2 steps/s, T = 1000 s.
    job = JobState(job_id="j", job_type="A", workers=2, total_steps=1200)
    assert makespan(fork_lp([job], PAIRS, lone_best)) == pytest.approx(600.0, rel=1e-6)
    assert makespan(fork_lp([job], PAIRS, lone_best, nodes=True)) == pytest.approx(1000.0, rel=1e-6)
    # With a second job of one worker (1000 steps at 1.0/s alone on a GPU), the forked one runs
    # lone workers while the other has a GPU on each node: the bound's 6500 / 3 on one node.
    other = JobState(job_id="o", job_type="A", workers=1, total_steps=1000)

    def rates(j: JobState, gpu_type: str, k: int) -> float:
        return lone_best(j, gpu_type, k) if j.workers == 2 else 1.0
    one_node = Cluster(name="one", nodes=(Node(node_id="a", gpus=("v100",) * 2),))
    assert makespan(fork_lp([job, other], one_node, rates, nodes=True)) == pytest.approx(6500 / 3, rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(nodes=st.lists(st.lists(st.sampled_from(TYPES), min_size=1, max_size=9), min_size=1, max_size=12),
       widths=st.lists(st.integers(1, 10), min_size=1, max_size=5))
def test_node_slots_are_one_per_count_below_w_and_one_for_w_or_more(nodes: list[list[str]], widths: list[int]) -> None:
    # the definition, per job and type: a slot per count c < W of the nodes holding exactly c
    # GPUs of it, and one for the nodes holding W or more; cap = how many such nodes
    cluster = Cluster(name="c", nodes=tuple(Node(node_id=f"n{i}", gpus=tuple(g)) for i, g in enumerate(nodes)))
    jobs = [JobState(job_id=f"j{i}", job_type="A", workers=w, total_steps=100) for i, w in enumerate(widths)]
    lp = fork_lp(jobs, cluster, lambda j, t, k: float(k), nodes=True)
    assert lp.nodes is not None
    want: list[tuple[int, int]] = []   # (job, cap) per slot, in job order then type order
    for j, w in enumerate(widths):
        for t in lp.types:
            held = [sum(1 for g in n if g == t) for n in nodes]
            for c in sorted({min(x, w) for x in held if x > 0}):
                want.append((j, sum(1 for x in held if (x >= w if c == w else x == c))))
    assert list(zip(lp.nodes.slot_job.tolist(), lp.nodes.cap.astype(int).tolist(), strict=True)) == want


def test_pooled_node_slots_stay_a_relaxation_of_their_jobs():
    from services.scheduler.policies.lp.timeline import pool

    jobs = [JobState(job_id=f"j{i}", job_type="A", workers=2, total_steps=600 * (i + 1)) for i in range(3)]
    full = fork_lp(jobs, PAIRS, lone_best, nodes=True)
    alone = makespan(full)
    pooled_lp = pool(full, [[0, 1, 2]])
    assert pooled_lp.nodes is not None and pooled_lp.nodes.cap.tolist() == [6.0]   # 2 nodes x 3 jobs
    together = makespan(pooled_lp)
    assert alone is not None and together is not None
    # three jobs may hold a node each: lone workers of two jobs per node, 3600 steps at 2.0/s
    assert alone == pytest.approx(1800.0, rel=1e-6)
    assert together <= alone * (1 + 1e-9)
    # one job alone is held to a copy per node: 3600 steps at 1.2/s at best
    assert makespan(fork_lp([JobState(job_id="x", job_type="A", workers=2, total_steps=3600)], PAIRS, lone_best,
                            nodes=True)) == pytest.approx(3000.0, rel=1e-6)


@pytest.mark.parametrize("options", [{}, {"node_slots": True}], ids=["default", "node_slots"])
def test_a_budget_of_gpus_goes_to_copies_on_several_nodes_where_lone_workers_earn_more_per_gpu(options):
    # Two nodes of four V100s. A (W = 2): a lone worker 0.5 job steps/s, a pair 0.6 (0.3 per GPU);
    # B (W = 4): 0.4 per GPU at any size. The node LP runs A as a lone worker on each node and B
    # on the other six GPUs, both ending together; A's budget of two V100s taken as one pair
    # on one node would earn 0.6 where two lone workers earn 1.0.
    model = ThroughputModel(rates={("A", "v100", 1): 1.0, ("A", "v100", 2): 0.6,
                                   **{("B", "v100", k): 1.6 for k in (1, 2, 3, 4)}}, cross_node=False)
    two = Cluster(name="two", nodes=tuple(Node(node_id=f"n{i}", gpus=("v100",) * 4) for i in range(2)))
    jobs = (JobState(job_id="a", job_type="A", workers=2, total_steps=360_000),
            JobState(job_id="b", job_type="B", workers=4, total_steps=864_000))
    plan = make_policy("hadare", **options).plan(
        PlanRequest(round=0, now_s=0.0, round_s=360.0, cluster=two, jobs=jobs, throughput=model))
    copies = {(p.job_id, p.node_id): len(p.gpus) for p in plan.placements}
    assert copies == {("a", "n0"): 1, ("a", "n1"): 1, ("b", "n0"): 3, ("b", "n1"): 3}


def test_the_timeline_lp_counts_the_copies_its_node_columns_hold_this_round():
    # The two nodes above: the node LP runs A as a lone worker on each node and B on the
    # other six GPUs; the first interval says so in GPUs and in copies (B's are as good at
    # any size: 1.5 copies of four or two of three, at most one per node).
    model = ThroughputModel(rates={("A", "v100", 1): 1.0, ("A", "v100", 2): 0.6,
                                   **{("B", "v100", k): 1.6 for k in (1, 2, 3, 4)}}, cross_node=False)
    two = Cluster(name="two", nodes=tuple(Node(node_id=f"n{i}", gpus=("v100",) * 4) for i in range(2)))
    jobs = [JobState(job_id="a", job_type="A", workers=2, total_steps=360_000),
            JobState(job_id="b", job_type="B", workers=4, total_steps=864_000)]
    def credited(job: JobState, gpu_type: str, k: int) -> float:
        return model.rate(job.job_type, gpu_type, k) * k / job.workers
    lp = fork_lp(jobs, two, credited, nodes=True)
    best = makespan(lp)
    assert best is not None
    plan = solve(lp, round_s=360.0, horizon_s=best)
    assert plan is not None
    share = plan.x[:, :, 0] / plan.lengths[0]
    assert share[:, 0] == pytest.approx([2.0, 6.0], abs=1e-6)
    assert plan.copies_now[0, 0] == pytest.approx(2.0, abs=1e-6)
    assert 1.5 - 1e-6 <= plan.copies_now[1, 0] <= 2.0 + 1e-6
    # without node columns the LP plans no copies
    assert not solve(fork_lp(jobs, two, credited), round_s=360.0, horizon_s=best).copies_now.any()


def test_the_keep_bonus_covers_the_gpus_a_job_held_not_every_gpu_of_their_type():
    # One node of four V100s; A held one of them last round, B (a little less work) none.
    # Valued a round earlier on every V100, A's work took all four this round -- three GPUs
    # it never ran on, each a restart, while B waited; on the GPU it held, A keeps that one.
    one = Cluster(name="one", nodes=(Node(node_id="n0", gpus=("v100",) * 4),))
    jobs = [JobState(job_id="a", job_type="A", workers=4, total_steps=4 * 3600),
            JobState(job_id="b", job_type="B", workers=4, total_steps=int(3.8 * 3600))]
    lp = fork_lp(jobs, one, lambda j, t, k: float(k), nodes=True)   # one step/s per GPU at any size
    best = makespan(lp)
    assert best is not None
    held = np.array([[1.0], [0.0]])

    def now(**cap: np.ndarray) -> list[float]:
        plan = solve(lp, round_s=360.0, horizon_s=best * 1.05, completion_weight=COMPLETION_WEIGHT, keep=held,
                     keep_rounds=1.0, **cap)
        assert plan is not None
        return (plan.x[:, 0, 0] / plan.lengths[0]).tolist()

    assert now() == pytest.approx([4.0, 0.0], abs=1e-6)          # uncapped (Hadar's timeline keeps this form)
    assert now(keep_gpus=held) == pytest.approx([1.0, 3.0], abs=1e-6)


def test_a_budgeted_copy_keeps_the_size_the_lp_planned_when_the_nodes_it_planned_are_taken():
    # Two nodes of four V100s. Four one-round jobs (c*, W = 1) go first in the budgeted pass
    # and fill n0. A (W = 2) earns 1.0 per GPU alone, 0.6 per GPU as a pair: the LP plans
    # it lone workers on two nodes, and only n1 is left. Sized to use A's budget up on the
    # free node, A ran a pair there at 0.6x its rate per GPU; at the LP's size it runs a lone
    # worker and B (W = 4, the same rate at any size) and D (W = 1) run the rest of n1 at
    # their best rates.
    model = ThroughputModel(rates={("A", "v100", 1): 1.0, ("A", "v100", 2): 0.6, ("C", "v100", 1): 1.0,
                                   ("D", "v100", 1): 1.0, **{("B", "v100", k): 1.6 for k in (1, 2, 3, 4)}},
                            cross_node=False)
    two = Cluster(name="two", nodes=tuple(Node(node_id=f"n{i}", gpus=("v100",) * 4) for i in range(2)))
    jobs = (JobState(job_id="a", job_type="A", workers=2, total_steps=360_000),
            JobState(job_id="b", job_type="B", workers=4, total_steps=864_000),
            JobState(job_id="d", job_type="D", workers=1, total_steps=36_000),
            *(JobState(job_id=f"c{i}", job_type="C", workers=1, total_steps=300) for i in range(4)))
    plan = make_policy("hadare").plan(
        PlanRequest(round=0, now_s=0.0, round_s=360.0, cluster=two, jobs=jobs, throughput=model))
    copies = {(p.job_id, p.node_id): len(p.gpus) for p in plan.placements}
    assert copies == {**{(f"c{i}", "n0"): 1 for i in range(4)}, ("a", "n1"): 1, ("b", "n1"): 2, ("d", "n1"): 1}


def test_free_groups_count_the_nodes_a_budget_may_spread_over():
    from services.scheduler.policies.hadare.groups import FreeGroups

    cluster = Cluster(name="c", nodes=(Node(node_id="a", gpus=("v100",) * 2), Node(node_id="b", gpus=("v100",) * 2),
                                       Node(node_id="c", gpus=("v100", "k80"))))
    free = FreeGroups(cluster)
    assert free.nodes_with_idle("v100", set(), up_to=5) == 3
    assert free.nodes_with_idle("v100", set(), up_to=2) == 2       # plainly that many: not counted
    free.take("a", "v100", 2)                                         # a has no idle V100 left
    assert free.nodes_with_idle("v100", {"a", "b"}, up_to=5) == 1     # only c: a is full, b is used
    assert free.nodes_with_idle("v100", {"c"}, up_to=5) == 1
    assert free.nodes_with_idle("k80", {"a"}, up_to=5) == 1


def test_hadare_with_node_slots_plans_valid_rounds_and_ends_above_its_bound():
    metrics, bounds = run_generated("hadare", "aws-5-multi", jobs=10, seed=1, multi_gpu=True, node_slots=True)
    assert metrics.jobs_completed == metrics.jobs_total
    assert bounds.ttd_fork_s is not None and metrics.ttd_s >= bounds.ttd_fork_s * (1 - 1e-6)
