"""Work accounting in samples (docs/architecture.md "Work accounting").

A job's work is ``total_steps`` steps of its global batch (W per-worker batches). A rate is
a copy's own steps per second; a copy on k of the job's W workers keeps the per-worker
batch, so each of its steps is k/W of a job step. Gavel's table counts one step per
worker (its scheduler sums the steps of a gang's workers), so its entries at n workers
are n times the copy's step rate. The simulator conserves samples: what the copies of a
job train, weighted by their workers, is what the job is credited.
"""

from __future__ import annotations

import json
from collections import defaultdict
from importlib import resources

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import (
    Placement,
    Plan,
    PlanRequest,
    Wait,
    WaitCode,
    copy_rate,
)
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies import make_policy
from services.scheduler.sim.cluster_spec import parse_cluster
from services.scheduler.sim.results import compute_results
from services.scheduler.sim.simulator import (
    RoundObservation,
    SimOptions,
    build_throughput,
    simulate,
)
from services.scheduler.sim.traces import TraceJob
from shared.domain.progress import credited_steps, worker_steps

RESNET18 = "ResNet-18 (batch size 64)"
RAW = json.loads(resources.files("shared.domain").joinpath("data/gavel_throughputs.json").read_text())
TABLE = ThroughputModel.from_gavel_table()
PROPS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def gavel_entry(job_type: str, table: str, n: int) -> float:
    return float(RAW[table][f"('{job_type}', {n})"]["null"])


class ForkOnEveryNode:
    """Every active job gets one copy per node it fits on, k = min(W, node size) GPUs each,
    nodes dealt out in job order (a job-level stand-in for HadarE's forking)."""

    name = "test-fork-all"

    def plan(self, request: PlanRequest) -> Plan:
        placements: list[Placement] = []
        waiting: list[Wait] = []
        nodes = list(request.cluster.nodes)
        share = max(1, len(nodes) // max(1, len(request.jobs)))
        for job in request.jobs:
            mine, nodes = nodes[:share], nodes[share:]
            if not mine:
                waiting.append(Wait(job_id=job.job_id, code=WaitCode.CAPACITY))
                continue
            placements += [Placement(job_id=job.job_id, copy=c, node_id=node.node_id,
                                     gpus=tuple(range(min(job.workers, node.size))))
                           for c, node in enumerate(mine)]
        return Plan(placements=tuple(placements), waiting=tuple(waiting))


# ---------------------------------------------------------------------------- the rule

def test_a_copy_step_is_k_over_w_job_steps_and_k_worker_steps() -> None:
    assert credited_steps(10.0, copy_workers=1, job_workers=4) == 2.5
    assert credited_steps(10.0, copy_workers=4, job_workers=4) == 10.0
    assert worker_steps(10, copy_workers=3) == 30
    with pytest.raises(ValueError):
        credited_steps(1.0, copy_workers=5, job_workers=4)
    with pytest.raises(ValueError):
        credited_steps(1.0, copy_workers=0, job_workers=4)


def test_table_rates_are_a_copys_own_steps_per_second() -> None:
    for n in (1, 2, 4, 8):
        assert TABLE.rate(RESNET18, "v100", n) == pytest.approx(gavel_entry(RESNET18, "v100", n) / n)
    # A worker count the table lacks keeps the step rate of the nearest smaller one (Gavel's
    # per-worker steps scale linearly with n, so the copy's steps do not change).
    assert TABLE.rate(RESNET18, "v100", 3) == TABLE.rate(RESNET18, "v100", 2)
    # The cross-node factor is a ratio: the same in either unit.
    unc = gavel_entry(RESNET18, "v100_unconsolidated", 4) / gavel_entry(RESNET18, "v100", 4)
    assert TABLE.cross_node_factor(RESNET18, ["v100"], 4) == pytest.approx(min(1.0, unc))


def test_forked_copies_on_k_of_w_workers_are_credited_k_over_w() -> None:
    # W=2 job on two single-V100 nodes: two copies of k=1 at 4 own steps/s each are credited
    # 2 job steps/s each; 1000 steps take 250 s, not 125 s.
    model = ThroughputModel(rates={("M", "v100", 1): 4.0, ("M", "v100", 2): 3.0}, cross_node=False)
    job = TraceJob(job_id="m", arrival_s=0.0, job_type="M", workers=2, total_steps=1000)
    result = simulate(policy=ForkOnEveryNode(), cluster=parse_cluster("v100:2"), jobs=[job], throughput=model,
                      model_bytes=lambda _: 0, options=SimOptions(round_s=1000, check=True))
    assert result.jobs[0].completion_s == pytest.approx(250.0)
    assert not result.gangs_only        # held to the fork bound (bounds.py)


def test_issue_11_example_counts_samples_for_gangs_and_copies_alike() -> None:
    # `a,0,ResNet-18 (batch size 64),4,200000` on v100:3,k80:3 (single-GPU nodes).
    tp = build_throughput()
    job = TraceJob(job_id="a", arrival_s=0.0, job_type=RESNET18, workers=4, total_steps=200_000)
    cluster = parse_cluster("v100:3,k80:3")
    ttd = {}
    for name in ("hadar", "hadare"):
        result = simulate(policy=make_policy(name), cluster=cluster, jobs=[job], throughput=tp,
                          options=SimOptions(check=True))
        ttd[name] = compute_results(result, tp).ttd_s
    # Hadar: one 4-worker copy that must mix types across nodes; it steps at the K80's pace
    # times the worse cross-node factor of the two types.
    factor = min(min(1.0, gavel_entry(RESNET18, f"{t}_unconsolidated", 4) / gavel_entry(RESNET18, t, 4))
                 for t in ("v100", "k80"))
    gang = gavel_entry(RESNET18, "k80", 4) / 4 * factor
    assert ttd["hadar"] == pytest.approx(200_000 / gang, rel=1e-6)          # about 25.7 h
    # HadarE: at best all six GPUs train single-worker copies, each step a quarter of a job
    # step (2.38 h; the issue's "about 2.7 h" adds consolidation to that). It keeps Hadar's
    # 4-worker copy 0 on 1 V100 + 3 K80 and forks the two V100s left idle: about 4 h.
    per_second_best = sum(gavel_entry(RESNET18, t, 1) for t in ("v100", "k80")) * 3 / 4
    assert ttd["hadare"] >= 200_000 / per_second_best
    assert ttd["hadare"] < ttd["hadar"] / 5


# ---------------------------------------------------------------------------- conservation

@st.composite
def fork_cases(draw) -> tuple[Cluster, list[TraceJob]]:
    nodes = [Node(node_id=f"n{i}", gpus=tuple(draw(st.lists(st.sampled_from(("k80", "p100", "v100")),
                                                           min_size=1, max_size=4))))
             for i in range(draw(st.integers(1, 4)))]
    jobs = []
    for i in range(draw(st.integers(1, 4))):
        workers = draw(st.sampled_from((1, 2, 4)))
        per_round = TABLE.rate(RESNET18, "v100", workers) * 360.0
        jobs.append(TraceJob(job_id=f"j{i}", arrival_s=draw(st.floats(0, 800)), job_type=RESNET18,
                             workers=workers, total_steps=max(1, int(per_round * draw(st.floats(0.1, 3.0))))))
    return Cluster(name="prop", nodes=tuple(nodes)), jobs


@PROPS
@given(case=fork_cases(), policy=st.sampled_from(("test-fork-all", "hadare")),
       restart_s=st.sampled_from((0.0, 40.0)))
def test_samples_are_conserved_every_round(case: tuple[Cluster, list[TraceJob]], policy: str,
                                           restart_s: float) -> None:
    cluster, jobs = case
    workers = {j.job_id: j.workers for j in jobs}
    credited: dict[str, float] = defaultdict(float)

    def observe(obs: RoundObservation) -> None:
        by_job: dict[str, float] = defaultdict(float)
        states = {j.job_id: j for j in obs.request.jobs}
        for (job_id, copy), parts in obs.plan.copies().items():
            k = sum(len(p.gpus) for p in parts)
            own = obs.copy_steps[(job_id, copy)]
            assert 0 <= own <= copy_rate(obs.request, states[job_id], parts) * obs.request.round_s + 1e-6
            by_job[job_id] += worker_steps(own, copy_workers=k)
        for job_id, steps in obs.steps.items():
            # samples / per-worker batch: the copies' worker-steps are the job's W x its credit
            assert by_job[job_id] == pytest.approx(steps * workers[job_id], rel=1e-9, abs=1e-6)
            credited[job_id] += steps

    model = ForkOnEveryNode() if policy == "test-fork-all" else make_policy(policy)
    result = simulate(policy=model, cluster=cluster, jobs=jobs, throughput=TABLE,
                      options=SimOptions(restart_s=restart_s, check=True, stall_rounds=3), observer=observe)
    for rec in result.jobs:
        assert credited[rec.job_id] == pytest.approx(rec.steps_done)
        if rec.completion_s is not None:
            assert rec.steps_done == rec.total_steps
