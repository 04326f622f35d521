"""The reclaim order (services/scheduler/core/queues.py, "Reclaim order"): a queue that must
give borrowed GPUs back keeps its running jobs' GPUs whole in keep order, and gives back
those of the lowest priority class first, then of the job whose preemption loses least
(``model_bytes x workers``), then of the latest arrival, then of the greatest job id."""

from __future__ import annotations

import pytest

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import JobState, Plan, PlanRequest, check_plan
from services.scheduler.core.queues import QueuedState, keep_order, plan_with_queues
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies import POLICY_NAMES, make_policy
from shared.wire.queues import QueueConfig, QueueSpec

ROUND_S = 360.0
JOB = "resnet"
TABLE = ThroughputModel(rates={(JOB, "v100", n): 2.0 * n for n in range(1, 9)})
GB = 10**9
# HadarE forks a job over several GPUs (two of these six jobs take all six), so "each job on
# W GPUs" is not the round these tests start from; the properties cover it.
ONE_COPY = [n for n in POLICY_NAMES if n != "hadare"]


def job(job_id: str, queue: str, *, cls: int = 0, gb: int = 1, arrival: float = 0.0, workers: int = 1) -> JobState:
    return JobState(job_id=job_id, job_type=JOB, workers=workers, total_steps=10**7, arrival_s=arrival,
                    queue=queue, priority_class=cls, model_bytes=gb * GB)


def request(c: Cluster, jobs: list[JobState], queues: QueueConfig, round_: int, previous: Plan | None) -> PlanRequest:
    return PlanRequest(round=round_, now_s=round_ * ROUND_S, round_s=ROUND_S, cluster=c, jobs=tuple(jobs),
                       throughput=TABLE, previous=previous, queues=queues)


def gpus(plan: Plan) -> dict[str, set[tuple[str, int]]]:
    out: dict[str, set[tuple[str, int]]] = {}
    for p in plan.placements:
        out.setdefault(p.job_id, set()).update((p.node_id, g) for g in p.gpus)
    return out


# audio's jobs, in the reclaim order the rules give: the one class-0 job, then by the
# checkpoint a resume restores (1, 4, 4, 4, 8 GB), then among the three 4 GB jobs the
# latest arrival, then the greatest id.
AUDIO = [job("low", "audio", cls=0, gb=8, arrival=0.0), job("small", "audio", cls=1, gb=1, arrival=1.0),
         job("mid-c", "audio", cls=1, gb=4, arrival=5.0), job("mid-b", "audio", cls=1, gb=4, arrival=4.0),
         job("mid-a", "audio", cls=1, gb=4, arrival=4.0), job("big", "audio", cls=1, gb=8, arrival=9.0)]
RECLAIM_ORDER = ["low", "small", "mid-c", "mid-b", "mid-a", "big"]


def test_keep_order_is_the_reclaim_order_reversed() -> None:
    shuffled = [AUDIO[i] for i in (3, 0, 5, 1, 4, 2)]
    assert [j.job_id for j in sorted(shuffled, key=keep_order, reverse=True)] == RECLAIM_ORDER
    assert [j.job_id for j in sorted(shuffled, key=keep_order)] == RECLAIM_ORDER[::-1]
    # progress lost counts the GPUs a resume restores onto: 3 GB on two GPUs loses more than 4 GB on one
    assert keep_order(job("pair", "a", gb=3, workers=2)) < keep_order(job("one", "a", gb=4))


@pytest.mark.parametrize("name", ONE_COPY)
@pytest.mark.parametrize("owner_jobs", [1, 2, 3, 4])
def test_borrowed_gpus_are_reclaimed_in_the_stated_order(name: str, owner_jobs: int) -> None:
    """audio (no quota) borrows all six V100s; vision (quota 4) then submits ``owner_jobs``
    jobs: audio keeps the GPUs of its last 6 - owner_jobs jobs in reclaim order and gives
    back the GPUs of the first ones."""
    c = Cluster(name="t", nodes=tuple(Node(node_id=f"n{i}", gpus=("v100",) * 2) for i in range(3)))
    queues = QueueConfig(queues=(QueueSpec(name="vision", quota={"v100": 4}), QueueSpec(name="audio")),
                         default_queue="audio")
    policy = make_policy(name)
    first = plan_with_queues(policy, request(c, AUDIO, queues, 0, None))
    ran = gpus(first)
    assert set(ran) == {j.job_id for j in AUDIO} and all(len(g) == 1 for g in ran.values())
    vision = [job(f"v{i}", "vision", arrival=100.0) for i in range(owner_jobs)]
    req = request(c, AUDIO + vision, queues, 1, first)
    second = plan_with_queues(policy, req)
    check_plan(req, second)
    kept = RECLAIM_ORDER[owner_jobs:]
    assert isinstance(second.state, QueuedState)
    assert set(second.state.held["audio"]) == set().union(*(ran[j] for j in kept))
    if name == "yarn-cs":   # non-preemptive: exactly the jobs whose GPUs audio kept still run
        assert {j for j in gpus(second) if not j.startswith("v")} == set(kept)


@pytest.mark.parametrize("name", ONE_COPY)
def test_a_job_whose_gpus_no_longer_fit_is_passed_over(name: str) -> None:
    """audio must shrink to one GPU: its pair comes first in keep order but needs two, so the
    GPU of the next job in keep order is kept instead."""
    c = Cluster(name="t", nodes=(Node(node_id="n0", gpus=("v100",) * 2), Node(node_id="n1", gpus=("v100",) * 2)))
    queues = QueueConfig(queues=(QueueSpec(name="vision", quota={"v100": 3}), QueueSpec(name="audio")),
                         default_queue="audio")
    audio = [job("pair", "audio", gb=8, workers=2), job("one", "audio", gb=4, arrival=1.0),
             job("two", "audio", gb=1, arrival=2.0)]
    policy = make_policy(name)
    first = plan_with_queues(policy, request(c, audio, queues, 0, None))
    ran = gpus(first)
    assert set(ran) == {"pair", "one", "two"}
    vision = [job(f"v{i}", "vision", arrival=100.0) for i in range(3)]
    second = plan_with_queues(policy, request(c, audio + vision, queues, 1, first))
    assert isinstance(second.state, QueuedState)
    assert set(second.state.held["audio"]) == ran["one"]
    if name == "yarn-cs":
        assert {j for j in gpus(second) if not j.startswith("v")} == {"one"}
