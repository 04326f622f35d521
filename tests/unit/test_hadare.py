"""HadarE: first-class copies (hadare/copies) and the leftover mode (Hadar + copies on idle GPUs)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import JobState, PlanRequest, check_plan, copy_rate
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies import make_policy
from services.scheduler.policies.hadar.policy import Hadar
from shared.domain import workloads

TP = ThroughputModel.from_gavel_table()
RESNET = "ResNet-18 (batch size 64)"
MULTI = ("ResNet-18 (batch size 64)", "ResNet-50 (batch size 32)", "Transformer (batch size 32)")
SINGLE = MULTI + ("Recommendation (batch size 512)", "A3C")
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def clusters(draw) -> Cluster:
    nodes = []
    for i in range(draw(st.integers(1, 5))):
        gpus = draw(st.lists(st.sampled_from(("k80", "p100", "v100")), min_size=1, max_size=4))
        nodes.append(Node(node_id=f"n{i}", gpus=tuple(gpus)))
    return Cluster(name="prop", nodes=tuple(nodes))


@st.composite
def job_lists(draw) -> list[JobState]:
    jobs = []
    for i in range(draw(st.integers(1, 6))):
        workers = draw(st.sampled_from((1, 1, 2, 4)))
        total = draw(st.integers(100, 2_000_000))
        jobs.append(JobState(job_id=f"j{i}", job_type=draw(st.sampled_from(MULTI if workers > 1 else SINGLE)),
                             workers=workers, total_steps=total, steps_done=draw(st.floats(0, 0.9)) * total,
                             arrival_s=draw(st.floats(0, 300))))
    return jobs


def advance(req: PlanRequest, plan) -> PlanRequest:
    """Next round: every copy progresses at its placement rate for one round."""
    progress: dict[str, float] = defaultdict(float)
    by_id = {j.job_id: j for j in req.jobs}
    for (job_id, _), parts in plan.copies().items():
        progress[job_id] += copy_rate(req, by_id[job_id], parts) * req.round_s
    jobs = tuple(replace(j, steps_done=j.steps_done + progress[j.job_id]) for j in req.jobs
                 if j.steps_done + progress[j.job_id] < j.total_steps)
    return replace(req, round=req.round + 1, now_s=req.now_s + req.round_s, jobs=jobs, previous=plan)


def request_of(cluster: Cluster, jobs: list[JobState]) -> PlanRequest:
    return PlanRequest(round=0, now_s=0.0, round_s=360.0, cluster=cluster, jobs=tuple(jobs), throughput=TP)


@pytest.mark.parametrize("mode", ["first-class", "leftover"])
def test_lone_job_forks_onto_every_idle_node(mode):
    cluster = Cluster(name="three", nodes=tuple(Node(node_id=f"n{i}", gpus=("v100", "v100")) for i in range(3)))
    req = request_of(cluster, [JobState(job_id="a", job_type=RESNET, workers=2, total_steps=10_000_000)])
    plan = make_policy("hadare", fork=mode).plan(req)
    check_plan(req, plan)
    copies = plan.copies()
    assert sorted(c for _, c in copies) == [0, 1, 2]
    assert {p.node_id for p in plan.placements} == {"n0", "n1", "n2"}
    assert all(len(parts) == 1 and len(parts[0].gpus) == 2 for parts in copies.values())
    assert plan.explain["a"]["forked_copies"] == 2


def test_copies_go_to_the_job_the_gpus_advance_most_relative_to_its_remaining_work():
    cluster = Cluster(name="three", nodes=tuple(Node(node_id=f"n{i}", gpus=("v100",)) for i in range(3)))
    per_round = TP.rate(RESNET, "v100", 1) * 360.0
    big = JobState(job_id="big", job_type=RESNET, workers=1, total_steps=int(200 * per_round))
    small = JobState(job_id="small", job_type=RESNET, workers=1, total_steps=int(20 * per_round))
    req = request_of(cluster, [big, small])
    base = Hadar(critical=False).plan(req)   # HadarE's primary (no critical-first planning)
    assert {p.job_id for p in base.placements} == {"big", "small"}
    plan = make_policy("hadare", fork="leftover").plan(req)
    extra = [p for p in plan.placements if p.copy > 0]
    assert len(extra) == 1 and extra[0].job_id == "small"      # 1/19 of its rest beats 1/199 of big's


def test_copies_use_only_gpus_hadar_left_idle_and_fewest_that_finish():
    cluster = Cluster(name="one", nodes=(Node(node_id="a", gpus=("v100",) * 4), Node(node_id="b", gpus=("v100",) * 4)))
    tiny = JobState(job_id="tiny", job_type=RESNET, workers=4, total_steps=int(1.5 * TP.rate(RESNET, "v100", 4) * 360))
    req = request_of(cluster, [tiny])
    plan = make_policy("hadare", fork="leftover").plan(req)
    check_plan(req, plan)
    copies = plan.copies()
    primary = {p.node_id for p in copies[("tiny", 0)]}
    (copy1,) = [parts for (j, c), parts in copies.items() if c == 1]
    assert copy1[0].node_id not in primary
    # what copy 0 leaves is half a round of 4 V100s; 2 V100s do that (ResNet-18 scales superlinearly)
    assert len(copy1[0].gpus) == 2


@PROPS
@given(cluster=clusters(), jobs=job_lists())
def test_forked_plans_are_valid_and_extend_hadars(cluster, jobs):
    req = request_of(cluster, jobs)
    base = Hadar(critical=False).plan(req)   # leftover mode's primary (no critical-first planning)
    plan = make_policy("hadare", fork="leftover").plan(req)
    check_plan(req, plan)
    assert set(base.placements) <= set(plan.placements)
    used = {(p.node_id, g) for p in base.placements for g in p.gpus}
    nodes_of: dict[str, list[str]] = defaultdict(list)
    workers = {j.job_id: j.workers for j in jobs}
    for (job_id, _copy), parts in plan.copies().items():
        nodes_of[job_id] += [p.node_id for p in parts]
        if any(p not in base.placements for p in parts):
            assert len(parts) == 1 and len(parts[0].gpus) <= workers[job_id]    # one node, <= W GPUs
            assert not used & {(parts[0].node_id, g) for g in parts[0].gpus}    # only idle GPUs
    for _job_id, nodes in nodes_of.items():
        assert len(nodes) == len(set(nodes)) and len(nodes) <= len(cluster.nodes)


@PROPS
@given(cluster=clusters(), jobs=job_lists(), seed=st.integers(0, 3))
def test_hadare_is_deterministic_over_rounds(cluster, jobs, seed):
    req = replace(request_of(cluster, jobs), seed=seed)
    first, again = make_policy("hadare").plan(req), make_policy("hadare").plan(req)
    assert first.decision() == again.decision()
    nxt = advance(req, first)
    if nxt.jobs:
        plan = make_policy("hadare").plan(nxt)
        check_plan(nxt, plan)
        assert plan.decision() == make_policy("hadare").plan(nxt).decision()


# ---------------------------------------------------------------- first-class forking


def one_gpu_nodes(*types: str) -> Cluster:
    return Cluster(name="ones", nodes=tuple(Node(node_id=f"n{i}", gpus=(t,)) for i, t in enumerate(types)))


@PROPS
@given(cluster=clusters(), jobs=job_lists())
def test_first_class_copies_never_overallocate_and_each_sits_on_one_node(cluster, jobs):
    req = request_of(cluster, jobs)
    plan = make_policy("hadare").plan(req)
    check_plan(req, plan)      # no GPU twice, <= W workers per copy, copies of a job on distinct nodes
    workers = {j.job_id: j.workers for j in jobs}
    types = {n.node_id: n.gpus for n in cluster.nodes}
    for (job_id, _), parts in plan.copies().items():
        assert len(parts) == 1                                           # each copy on one node
        (p,) = parts
        assert 1 <= len(p.gpus) <= workers[job_id]
        assert len({types[p.node_id][g] for g in p.gpus}) == 1          # of one GPU type
    per_job = defaultdict(list)
    for job_id, copy in plan.copies():
        per_job[job_id].append(copy)
    assert all(sorted(c) == list(range(len(c))) for c in per_job.values())   # copies 0..n-1


def test_shortest_job_takes_every_node_first():
    cluster = one_gpu_nodes("v100", "v100", "v100")
    per_round = TP.rate(RESNET, "v100", 1) * 360.0
    jobs = [JobState(job_id="long", job_type=RESNET, workers=1, total_steps=int(100 * per_round)),
            JobState(job_id="short", job_type=RESNET, workers=1, total_steps=int(10 * per_round), arrival_s=1.0)]
    plan = make_policy("hadare").plan(request_of(cluster, jobs))
    assert {p.job_id for p in plan.placements} == {"short"}
    assert len(plan.placements) == 3
    assert [w.job_id for w in plan.waiting] == ["long"]


def test_a_narrow_job_gets_its_gpus_on_distinct_nodes_before_a_wide_one_packs_them():
    # Two nodes of two V100s. The single-GPU job is on the critical path (ten times the work),
    # so the LP gives it a GPU of each node and the 2-GPU job the other two. The 2-GPU job
    # comes first in Smith's order; realized first, it took both GPUs of one node as one copy
    # and left the narrow job, one copy per node, a single GPU.
    cluster = Cluster(name="two", nodes=(Node(node_id="a", gpus=("v100",) * 2), Node(node_id="b", gpus=("v100",) * 2)))
    wide_type = "ResNet-50 (batch size 32)"
    jobs = [JobState(job_id="wide", job_type=wide_type, workers=2,
                     total_steps=int(20 * TP.rate(wide_type, "v100", 2) * 360.0)),
            JobState(job_id="narrow", job_type=RESNET, workers=1,
                     total_steps=int(200 * TP.rate(RESNET, "v100", 1) * 360.0))]
    req = request_of(cluster, jobs)
    plan = make_policy("hadare").plan(req)
    check_plan(req, plan)
    assert sorted(p.node_id for p in plan.placements if p.job_id == "narrow") == ["a", "b"]
    assert sorted((p.node_id, len(p.gpus)) for p in plan.placements if p.job_id == "wide") == [("a", 1), ("b", 1)]


def test_a_job_that_one_copy_finishes_is_not_forked_until_leftovers():
    cluster = one_gpu_nodes("v100", "v100")
    per_round = TP.rate(RESNET, "v100", 1) * 360.0
    jobs = [JobState(job_id="tiny", job_type=RESNET, workers=1, total_steps=int(0.5 * per_round)),
            JobState(job_id="big", job_type=RESNET, workers=1, total_steps=int(50 * per_round))]
    plan = make_policy("hadare").plan(request_of(cluster, jobs))
    assert sorted((p.job_id, p.copy) for p in plan.placements) == [("big", 0), ("tiny", 0)]


def test_consolidation_cost_decides_how_many_copies():
    # A store so slow that consolidating 2 copies would eat the round: one copy is worth more.
    cluster = one_gpu_nodes("v100", "v100", "v100")
    job = JobState(job_id="a", job_type=RESNET, workers=1, total_steps=10_000_000,
                   model_bytes=workloads.model_bytes(RESNET))
    req = request_of(cluster, [job])
    fast = make_policy("hadare", store_gbps=100.0).plan(req)
    slow = make_policy("hadare", store_gbps=1e-5).plan(req)
    assert len(fast.placements) == 3
    assert [(p.job_id, p.copy) for p in slow.placements] == [("a", 0)]


def test_a_jobs_own_optimizer_slots_override_the_policys_default():
    # ResNet-18's 45 MB of weights at 2 MB/s: with no optimizer state two or three copies
    # pay (consolidating 3 takes 164 s of the 360 s round); with Adam's two slots one does.
    cluster = one_gpu_nodes("v100", "v100", "v100")
    size = workloads.model_bytes(RESNET)

    def copies(slots: int | None, **options) -> int:
        job = JobState(job_id="a", job_type=RESNET, workers=1, total_steps=10_000_000, model_bytes=size,
                       optimizer_slots=slots)
        return len(make_policy("hadare", store_gbps=0.002, **options).plan(request_of(cluster, [job])).placements)

    assert copies(0) == 3 and copies(2) == 1
    assert copies(None, optimizer_slots=0) == 3 and copies(None, optimizer_slots=2) == 1


def test_fork_cost_is_n_uploads_n_downloads_one_write_with_optimizer_state():
    from shared.domain.fork_cost import consolidation_s
    assert consolidation_s(10**9, 1) == 0.0
    assert consolidation_s(10**9, 3, store_gbps=1.0, optimizer_slots=1) == pytest.approx(7 * 2.0)
    assert consolidation_s(10**9, 2, store_gbps=2.0, optimizer_slots=2) == pytest.approx(5 * 3.0 / 2)
    with pytest.raises(ValueError):
        consolidation_s(1, 2, store_gbps=0)


def test_bad_options_are_refused():
    for bad in ({"fork": "sometimes"}, {"store_gbps": 0}, {"price_share": -1}, {"split": "sometimes"},
                {"timeline_slack": -0.1}, {"completion_weight": 1.0}, {"completion_weight": -0.1},
                {"node_slot": True}, {"horizon": 10}):
        with pytest.raises((ValueError, TypeError)):
            make_policy("hadare", **bad)   # a misspelt option, or one only leftover mode's Hadar takes
    make_policy("hadare", fork="leftover", horizon=10)


def test_makespan_split_keeps_the_slow_type_for_the_job_efficient_on_it():
    # Recommendation runs about as fast on a K80 as on a V100; ResNet-50 ~6x slower there.
    # Smith's order alone would let the short Recommendation job take the V100 first.
    from services.scheduler.policies.hadare.split import type_split
    cluster = one_gpu_nodes("v100", "k80")
    rec, resnet = "Recommendation (batch size 8192)", "ResNet-50 (batch size 32)"
    jobs = [JobState(job_id="rec", job_type=rec, workers=1, total_steps=int(TP.rate(rec, "k80", 1) * 3600 * 10)),
            JobState(job_id="r50", job_type=resnet, workers=1, total_steps=int(TP.rate(resnet, "v100", 1) * 3600 * 20))]

    def credited(job, gpu_type, k):
        return TP.rate(job.job_type, gpu_type, k) * k / job.workers

    split = type_split(jobs, cluster, credited)
    assert split["rec"] == {"k80"} and "v100" in split["r50"]
    plan = make_policy("hadare", split="makespan").plan(request_of(cluster, jobs))
    assert sorted((p.job_id, p.node_id) for p in plan.placements) == [("r50", "n0"), ("rec", "n1")]
