"""Team queues (services/scheduler/core/queues.py): quotas, borrowing and reclaim, priority
classes, user limits and fair share, for every policy through the one mechanism."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import JobState, Plan, PlanRequest, WaitCode, check_plan, mixes_types
from services.scheduler.core.queues import QueuedState, plan_with_queues
from services.scheduler.core.quota import entitlements, scaled_quotas, shortfall
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies import POLICY_NAMES, make_policy
from services.scheduler.sim.simulator import RoundObservation, SimOptions, simulate
from services.scheduler.sim.traces import TraceJob
from shared.wire.queues import QueueConfig, QueueSpec

ROUND_S = 360.0
TYPES = ("v100", "k80")
JOB = "resnet"
# One job type: twice as fast on a V100 as on a K80, scaling linearly on one node.
TABLE = ThroughputModel(rates={(JOB, t, n): (2.0 if t == "v100" else 1.0) * n for t in TYPES for n in range(1, 9)})


def cluster(*nodes: tuple[str, int]) -> Cluster:
    return Cluster(name="t", nodes=tuple(Node(node_id=f"n{i}", gpus=(t,) * k) for i, (t, k) in enumerate(nodes)))


def job(job_id: str, queue: str, *, workers: int = 1, steps: int = 10**6, arrival: float = 0.0, cls: int = 0,
        user: str = "u") -> JobState:
    return JobState(job_id=job_id, job_type=JOB, workers=workers, total_steps=steps, arrival_s=arrival,
                    queue=queue, user=user, priority_class=cls)


def config(*queues: QueueSpec, default: str | None = None, half_life_s: float = 86400.0) -> QueueConfig:
    return QueueConfig(queues=queues, default_queue=default or queues[0].name, fair_share_half_life_s=half_life_s)


def request(c: Cluster, jobs: list[JobState], queues: QueueConfig | None, *, round_: int = 0,
            previous: Plan | None = None) -> PlanRequest:
    return PlanRequest(round=round_, now_s=round_ * ROUND_S, round_s=ROUND_S, cluster=c, jobs=tuple(jobs),
                       throughput=TABLE, previous=previous, queues=queues)


def used(plan: Plan, jobs: list[JobState]) -> dict[str, int]:
    queue_of = {j.job_id: j.queue for j in jobs}
    out: dict[str, int] = defaultdict(int)
    for p in plan.placements:
        out[queue_of[p.job_id]] += len(p.gpus)
    return dict(out)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_without_queues_the_policy_plans_as_it_always_did(name: str) -> None:
    c = cluster(("v100", 4), ("k80", 4))
    jobs = [job(f"j{i}", "", workers=1 + i % 2) for i in range(6)]
    req = request(c, jobs, None)
    assert plan_with_queues(make_policy(name), req).decision() == make_policy(name).plan(req).decision()


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_an_idle_queues_quota_is_lent_and_reclaimed_at_the_next_round(name: str) -> None:
    c = cluster(("v100", 4), ("v100", 4))
    queues = config(QueueSpec(name="vision", quota={"v100": 4}), QueueSpec(name="audio", quota={"v100": 4}))
    audio = [job(f"a{i}", "audio") for i in range(8)]
    policy = make_policy(name)
    first = plan_with_queues(policy, request(c, audio, queues))
    assert used(first, audio) == {"audio": 8}                    # all of vision's quota borrowed
    assert isinstance(first.state, QueuedState)
    standing = {s.name: s for s in first.state.standings}
    assert standing["audio"].borrowed == 4 and standing["vision"].lent == 4
    vision = [job(f"v{i}", "vision", arrival=100.0) for i in range(4)]
    both = audio + vision
    second = plan_with_queues(policy, request(c, both, queues, round_=1, previous=first))
    check_plan(request(c, both, queues, round_=1), second)
    assert used(second, both) == {"audio": 4, "vision": 4}      # reclaimed within one round
    waiting = {w.job_id: w for w in second.waiting}
    # a job that lost its GPUs says it was reclaimed; one that had none, that its queue is full
    for j in audio:
        if j.job_id in waiting:
            detail = waiting[j.job_id].detail
            assert waiting[j.job_id].code is WaitCode.QUOTA
            assert detail == "reclaimed: audio gave back 4 GPUs it had borrowed" or detail.startswith("over quota")
    assert any(w.detail.startswith("reclaimed") for w in waiting.values())


def test_a_higher_priority_class_preempts_a_lower_one_in_its_queue() -> None:
    c = cluster(("v100", 2))
    queues = config(QueueSpec(name="vision", quota={"v100": 2}, borrowing_limit=0))
    low = [job("low", "vision", workers=2)]
    policy = make_policy("yarn-cs")
    first = plan_with_queues(policy, request(c, low, queues))
    assert {p.job_id for p in first.placements} == {"low"}
    both = [*low, job("urgent", "vision", workers=2, arrival=50.0, cls=5)]
    second = plan_with_queues(policy, request(c, both, queues, round_=1, previous=first))
    assert {p.job_id for p in second.placements} == {"urgent"}
    (wait,) = second.waiting
    assert wait.job_id == "low" and wait.code is WaitCode.QUOTA and "higher priority" in wait.detail


def test_user_limits_hold_jobs_back_with_the_reason() -> None:
    c = cluster(("v100", 8))
    queues = config(QueueSpec(name="vision", user_max_queued=2, user_max_gpus=3))
    jobs = [job("a1", "vision", user="alice", workers=2), job("a2", "vision", user="alice", workers=2, arrival=1),
            job("a3", "vision", user="alice", arrival=2), job("b1", "vision", user="bob", workers=3)]
    plan = plan_with_queues(make_policy("yarn-cs"), request(c, jobs, queues))
    waits = {w.job_id: w.detail for w in plan.waiting}
    assert waits["a2"].startswith("user limit: alice asks 2/3 GPUs")
    assert waits["a3"].startswith("user limit: alice has 2 jobs queued")
    assert {p.job_id for p in plan.placements} == {"a1", "b1"}


def test_a_job_of_an_unknown_queue_waits() -> None:
    plan = plan_with_queues(make_policy("gavel"), request(cluster(("v100", 2)), [job("x", "nope")],
                                                          config(QueueSpec(name="vision"))))
    assert [(w.job_id, w.code, w.detail) for w in plan.waiting] == [("x", WaitCode.QUOTA, "unknown queue 'nope'")]


def test_quotas_beyond_the_cluster_are_scaled_down_by_largest_remainder() -> None:
    queues = (QueueSpec(name="a", quota={"v100": 6}), QueueSpec(name="b", quota={"v100": 3}),
              QueueSpec(name="c", quota={"v100": 3, "t4": 2}))
    assert scaled_quotas(queues, {"v100": 8, "k80": 2}) == {"a": {"v100": 4}, "b": {"v100": 2}, "c": {"v100": 2}}


def test_idle_gpus_follow_the_weights_over_time() -> None:
    """Two queues without quota, weights 1 and 3, both always with more demand than the
    cluster: the fair-share order gives them idle GPUs in proportion to their weights."""
    c = cluster(("v100", 8))
    queues = config(QueueSpec(name="light", weight=1.0), QueueSpec(name="heavy", weight=3.0))
    jobs = [job(f"{q}{i}", q) for q in ("light", "heavy") for i in range(12)]
    policy, previous, got = make_policy("tiresias"), None, defaultdict(int)
    for r in range(40):
        plan = plan_with_queues(policy, request(c, jobs, queues, round_=r, previous=previous))
        for q, n in used(plan, jobs).items():
            got[q] += n
        previous = plan
    share = got["heavy"] / (got["heavy"] + got["light"])
    assert share == pytest.approx(0.75, abs=0.03)



# Beside JOB (which runs on both types at any scale): a job type that runs only on V100s,
# and one that runs on a K80 alone but not as a pair (too little memory for its share).
V100_ONLY, PAIR_ON_V100 = "bert", "wide"
MIXED_TABLE = ThroughputModel(rates={**TABLE.rates, **{(V100_ONLY, "v100", n): 1.5 * n for n in range(1, 9)},
                                     **{(PAIR_ON_V100, "v100", n): 1.5 * n for n in range(1, 9)},
                                     (PAIR_ON_V100, "k80", 1): 0.5,
                                     **{(PAIR_ON_V100, "k80", n): 0.0 for n in range(2, 9)}})


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("vision_jobs", [[(V100_ONLY, 1), (V100_ONLY, 1)], [(PAIR_ON_V100, 2)]],
                         ids=["v100-only", "pair-not-on-k80"])
def test_jobs_that_cannot_use_part_of_their_quota_borrow_idle_gpus_they_can_run_on(
        name: str, vision_jobs: list[tuple[str, int]]) -> None:
    """vision's quota is one V100 and two K80s but its jobs cannot run on K80s (at their
    number of workers); audio holds V100s of its quota idle. Counting GPUs alone, vision's
    quota covers its demand of two and the idle V100s go by fair share, to audio: a job of
    vision's would wait beside an idle V100 it could use. Counting what its jobs run on,
    vision borrows an idle V100."""
    c = cluster(("v100", 4), ("k80", 2))
    queues = config(QueueSpec(name="vision", quota={"v100": 1, "k80": 2}), QueueSpec(name="audio", quota={"v100": 3}))
    jobs = [replace(job(f"v{i}", "vision", workers=w), job_type=t) for i, (t, w) in enumerate(vision_jobs)]
    jobs.append(job("a", "audio"))
    req = replace(request(c, jobs, queues), throughput=MIXED_TABLE)
    plan = plan_with_queues(make_policy(name), req)
    check_plan(req, plan)
    assert {p.job_id for p in plan.placements} == {j.job_id for j in jobs}, plan.waiting
    vision = next(s for s in plan.state.standings if s.name == "vision")
    assert vision.entitled.get("v100", 0) >= 2 and vision.borrowed >= 1


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_gpus_no_job_needs_are_lent_only_to_a_policy_that_forks(name: str) -> None:
    """Two queues with one job each on eight V100s: HadarE forks jobs onto idle GPUs, so the
    six no job needs are lent (work conservation); any other policy cannot place a job on
    more than its W, so they stay out of every queue's partition, where the policy would
    only plan over them."""
    c = cluster(("v100", 4), ("v100", 4))
    queues = config(QueueSpec(name="a", quota={"v100": 4}), QueueSpec(name="b", quota={"v100": 4}))
    jobs = [job("a1", "a"), job("b1", "b")]
    policy = make_policy(name)
    plan = plan_with_queues(policy, request(c, jobs, queues))
    assert {p.job_id for p in plan.placements} == {"a1", "b1"}
    entitled = sum(sum(s.entitled.values()) for s in plan.state.standings)
    assert entitled == (8 if getattr(policy, "forks", False) else 2)
    assert getattr(policy, "forks", False) == (name == "hadare")

# ---------------------------------------------------------------- properties, every policy

@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Cluster, QueueConfig, list[TraceJob]]:
    nodes = draw(st.lists(st.tuples(st.sampled_from(TYPES), st.integers(1, 4)), min_size=1, max_size=4))
    c = cluster(*nodes)
    n_queues = draw(st.integers(1, 3))
    specs = tuple(QueueSpec(
        name=f"q{i}", weight=draw(st.sampled_from((1.0, 2.0, 3.0))),
        quota={t: draw(st.integers(0, 4)) for t in TYPES if draw(st.booleans())},
        borrowing_limit=draw(st.none() | st.integers(0, 4))) for i in range(n_queues))
    jobs = [TraceJob(job_id=f"j{i}", arrival_s=draw(st.sampled_from((0.0, 0.0, 700.0, 1500.0))), job_type=JOB,
                     workers=draw(st.sampled_from((1, 1, 2, 4))), total_steps=draw(st.integers(500, 6000)),
                     queue=f"q{draw(st.integers(0, n_queues - 1))}", priority_class=draw(st.sampled_from((0, 0, 3))),
                     user=draw(st.sampled_from(("alice", "bob"))))
            for i in range(draw(st.integers(1, 8)))]
    return c, config(*specs), jobs


PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", POLICY_NAMES)
@PROPS
@given(case=scenarios())
def test_every_policy_keeps_every_queue_within_its_entitlement(
        name: str, case: tuple[Cluster, QueueConfig, list[TraceJob]]) -> None:
    c, queues, jobs = case
    capacity = c.gpus_by_type
    nominal = scaled_quotas(queues.queues, capacity)
    policy = make_policy(name)
    one_type = not mixes_types(policy)   # then a job counts only if one type of its queue's quota holds it

    def check(obs: RoundObservation) -> None:
        state = obs.plan.state
        assert isinstance(state, QueuedState)
        standings = {s.name: s for s in state.standings}
        queue_of = {j.job_id: queues.queue_of(j.queue) for j in obs.request.jobs}
        held: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for p in obs.plan.placements:
            for g in p.gpus:
                held[queue_of[p.job_id]][c.by_id[p.node_id].gpus[g]] += 1
        for spec in queues.queues:
            s = standings[spec.name]
            # never more of a type than entitled, never more in all than quota + borrowing limit
            assert all(n <= s.entitled.get(t, 0) for t, n in held[spec.name].items()), (spec.name, held, s)
            limit = sum(nominal[spec.name].values()) + (spec.borrowing_limit if spec.borrowing_limit is not None
                                                        else sum(capacity.values()))
            assert sum(s.entitled.values()) <= limit
            # a queue with demand gets at least min(demand, quota), in every round (reclaim included)
            most = spec.nominal + spec.borrowing_limit if spec.borrowing_limit is not None else None
            demand = sum(j.workers for j in obs.request.jobs if queue_of[j.job_id] == spec.name
                         and (most is None or j.workers <= most)   # a job that never fits is held back
                         and (not one_type or j.workers <= max(nominal[spec.name].values(), default=0)))
            assert sum(s.entitled.values()) >= min(demand, sum(nominal[spec.name].values()))
        assert sum(sum(s.entitled.values()) for s in standings.values()) <= sum(capacity.values())

    simulate(policy=policy, cluster=c, jobs=jobs, throughput=TABLE,
             options=SimOptions(round_s=ROUND_S, check=True, queues=queues, stall_rounds=5, max_rounds=60),
             observer=check)


def test_a_queued_plan_survives_a_snapshot() -> None:
    from shared.persistence.codec import pack, unpack

    c = cluster(("v100", 4))
    jobs = [job("a", "vision", workers=2), job("b", "audio", workers=2)]
    queues = config(QueueSpec(name="vision", quota={"v100": 2}), QueueSpec(name="audio"))
    plan = plan_with_queues(make_policy("hadar"), request(c, jobs, queues))
    back = unpack(pack(plan))
    assert isinstance(back.state, QueuedState) and back.state.standings == plan.state.standings
    again = plan_with_queues(make_policy("hadar"), request(c, jobs, queues, round_=1, previous=back))
    assert again.decision() == plan_with_queues(make_policy("hadar"),
                                                request(c, jobs, queues, round_=1, previous=plan)).decision()
    assert replace(back.state, standings=()) is not None


def test_a_one_type_cover_takes_a_jobs_gpus_from_one_type_and_borrows_the_rest_of_it() -> None:
    quotas = config(QueueSpec(name="a", quota={"v100": 2, "k80": 2}),
                    QueueSpec(name="b", quota={"v100": 2, "k80": 2}))
    gang = job("gang", "a", workers=4)
    mixed = entitlements(quotas, {"v100": 4, "k80": 4}, {"a": [gang]}, lambda j, t: 1.0, usage={}, round_s=ROUND_S)
    assert dict(mixed["a"].gpus) == {"v100": 2, "k80": 2} and mixed["a"].borrowed == 0   # enough for Hadar
    one = entitlements(quotas, {"v100": 4, "k80": 4}, {"a": [gang]}, lambda j, t: 2.0 if t == "v100" else 1.0,
                       usage={}, round_s=ROUND_S, one_type=True)
    assert dict(one["a"].gpus) == {"v100": 4} and one["a"].borrowed == 2   # b's idle V100s complete one type


def test_a_one_type_cover_prefers_a_type_that_holds_the_whole_job() -> None:
    def faster_on_v100(j: JobState, t: str) -> float:
        return 2.0 if t == "v100" else 1.0

    taken, short = shortfall([job("j", "a", workers=3)], {"v100": 2, "k80": 3}, faster_on_v100, TYPES, one_type=True)
    assert (taken, short) == ({"k80": 3}, [])   # the slower type, whole, rather than 2 V100s + a K80
    taken, short = shortfall([job("j", "a", workers=3)], {"v100": 2, "k80": 3}, faster_on_v100, TYPES)
    assert taken == {"v100": 2, "k80": 1} and short == []


def test_a_job_no_single_type_can_hold_is_no_demand_for_a_one_type_policy() -> None:
    quotas = config(QueueSpec(name="a", quota={"v100": 4, "k80": 4}))
    wide = job("wide", "a", workers=6)
    ent = entitlements(quotas, {"v100": 4, "k80": 4}, {"a": [wide]}, lambda j, t: 1.0, usage={}, round_s=ROUND_S,
                       one_type=True)
    assert ent["a"].demand == 0 and ent["a"].borrowed == 0
