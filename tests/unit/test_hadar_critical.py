"""Hadar's makespan target and critical jobs (``hadar/critical``): properties and a simulated check."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core.policy import JobState, check_plan
from services.scheduler.policies.hadar.critical import (
    critical_jobs,
    rounds_needed,
    target_end,
)
from services.scheduler.policies.hadar.policy import Hadar
from services.scheduler.policies.hadar.profile import ProfileBook
from tests.unit.test_hadar import (
    RESNET,
    TP,
    advance,
    assert_ledger_consistent,
    clusters,
    job,
    job_lists,
    request,
    single_gpu_nodes,
)

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
needs = st.dictionaries(st.sampled_from([f"j{i}" for i in range(8)]), st.integers(0, 2000), max_size=8)


@PROPS
@given(need=needs, round_=st.integers(0, 500), previous=st.one_of(st.none(), st.integers(0, 3000)),
       slack=st.floats(0, 1), new=st.lists(st.sampled_from([f"j{i}" for i in range(8)]), max_size=4))
def test_target_end_is_never_below_the_single_job_bound(need, round_, previous, slack, new):
    target = target_end(need, new, round_=round_, previous=previous, slack=slack)
    assert target >= round_ + max(need.values(), default=0)
    if previous is None:
        # ceil with critical.py's 1e-9 tolerance: (1 + 6.7e-13) x 1 rounds to 1, not 2
        assert target == round_ + math.ceil((1 + slack) * max(need.values(), default=0) - 1e-9)
    else:
        assert target >= previous
        if not new:   # without arrivals E moves only to the bound, never by the slack again
            assert target == max(previous, round_ + max(need.values(), default=0))


@PROPS
@given(need=needs, round_=st.integers(0, 100), extra=st.integers(-50, 400), margin=st.integers(0, 5),
       limit=st.integers(1, 8))
def test_critical_jobs_are_exactly_those_out_of_laxity(need, round_, extra, margin, limit):
    jobs = [job(j) for j in sorted(need)]
    target = round_ + max(need.values(), default=0) + extra
    got = critical_jobs(jobs, need, round_=round_, target=target, margin=margin, limit=limit)
    late = [j.job_id for j in jobs if need[j.job_id] > 0 and target - round_ - need[j.job_id] <= margin]
    assert set(got) <= set(late) and len(got) == min(limit, len(late))
    assert [need[j] for j in got] == sorted((need[j] for j in got), reverse=True)
    assert all(need[j] >= need[k] for j in got for k in late if k not in got)   # the longest go first


def test_rounds_needed_uses_the_fastest_option():
    cluster = single_gpu_nodes(k80=2, v100=1)
    layout_book = ProfileBook(TP, types=cluster.types, row_type=_row_type(cluster), row_cap=_row_cap(cluster))
    prof = layout_book.get(RESNET, 1)
    j = job("a", steps=100_000)
    assert rounds_needed(j, prof, 360.0) == math.ceil(100_000 / (TP.rate(RESNET, "v100", 1) * 360.0))
    assert rounds_needed(JobState(job_id="b", job_type=RESNET, workers=1, total_steps=5, steps_done=5), prof,
                         360.0) == 0


def _row_type(cluster):
    from services.scheduler.policies.hadar.ledger import RowLayout
    return RowLayout.of(cluster).row_type


def _row_cap(cluster):
    from services.scheduler.policies.hadar.ledger import RowLayout
    return RowLayout.of(cluster).row_cap


def test_long_job_among_short_ones_runs_without_a_break_once_critical_and_ends_by_the_target():
    """One V100 and one K80: a long job and more short ones than the V100 can serve in the
    long job's laxity. The short jobs use the V100 while the long job has laxity (density
    order would keep it waiting until all of them are done); then the long job runs every
    round and finishes by the target end round."""
    cluster = single_gpu_nodes(v100=1, k80=1)
    rate = TP.rate(RESNET, "v100", 1) * 360.0
    jobs = [job("long", steps=int(40 * rate))] + [job(f"s{i:02d}", steps=int(2 * rate)) for i in range(40)]
    policy = Hadar(horizon=8, critical_slack=0.1, critical_rule="laxity")
    req = request(cluster, jobs)
    target, critical_since, short_on_v100 = None, None, 0
    for _ in range(200):
        plan = policy.plan(req)
        check_plan(req, plan)
        assert_ledger_consistent(req, plan.state)
        target = plan.state.target_end if target is None else target
        assert plan.state.target_end == target            # no arrivals: E stays where it was set
        placed = {p.job_id: p.node_id for p in plan.placements}
        if plan.explain["long"].get("critical") and critical_since is None:
            critical_since = req.round
        if critical_since is not None:
            left = next(j for j in req.jobs if j.job_id == "long").remaining
            if left > 2 * rate:   # it needs more rounds than any short job: it is planned first
                assert placed["long"] == "v100-0", f"round {req.round}: critical job not on its V100"
        short_on_v100 += sum(1 for j, n in placed.items() if j != "long" and n == "v100-0")
        req = advance(req, plan)
        if "long" not in {j.job_id for j in req.jobs}:
            break
    assert critical_since is not None and critical_since > 0   # it waited while it had laxity
    assert short_on_v100 > 0                                    # and the short jobs used the V100 then
    assert req.round <= target                                 # it ended by E


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=clusters(), jobs=job_lists(max_jobs=6), rounds=st.integers(2, 6), slack=st.floats(0, 0.5))
def test_critical_planning_never_over_allocates(cluster, jobs, rounds, slack):
    policy = Hadar(horizon=8, critical_slack=slack)
    req = request(cluster, jobs)
    for _ in range(rounds):
        plan = policy.plan(req)
        check_plan(req, plan)
        assert_ledger_consistent(req, plan.state)
        req = advance(req, plan)
        if not req.jobs:
            break


@PROPS
@given(rounds=st.lists(st.lists(st.one_of(st.floats(1, 500), st.just(math.inf)), min_size=3, max_size=3),
                       min_size=1, max_size=6).filter(lambda g: all(any(math.isfinite(x) for x in r) for r in g)),
       workers=st.lists(st.sampled_from((1, 2, 4)), min_size=6, max_size=6),
       caps=st.lists(st.integers(1, 8), min_size=3, max_size=3))
def test_capacity_rounds_lies_between_the_simple_bounds_and_any_assignment(rounds, workers, caps):
    import numpy as np

    from services.scheduler.policies.hadar.critical import capacity_rounds
    g = np.array(rounds)
    w = np.array(workers[: g.shape[0]], dtype=float)
    c = np.array(caps)
    got = capacity_rounds(g, w, c)
    best = g.min(axis=1)
    assert got >= (best / w).max() * (1 - 1e-6)                      # a job alone, on W GPUs of its best type
    assert got >= best.sum() / c.sum() * (1 - 1e-6)                   # all GPU-rounds on all GPUs
    choice = g.argmin(axis=1)                                         # every job on its best type
    load = np.bincount(choice, weights=best, minlength=3) / c
    assert got <= max(load.max(), (best / w).max()) * (1 + 1e-6)
