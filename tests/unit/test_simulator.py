"""Simulator semantics and invariants, and metrics on hand-computed examples.

Small policies defined here (greedy FIFO, a forking policy, a task-level mixer) pin the
semantics; every registered policy whose module exists runs the invariant checks too.
"""

from __future__ import annotations

import importlib.util
from collections import defaultdict

import numpy as np
import pytest

from services.scheduler.core.policy import (
    Placement,
    Plan,
    PlanRequest,
    Wait,
    WaitCode,
    copy_rate,
)
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies import _REGISTRY, make_policy
from services.scheduler.sim.cluster_spec import parse_cluster
from services.scheduler.sim.results import compute_results, utilization_series
from services.scheduler.sim.simulator import (
    RoundObservation,
    SimOptions,
    finish_time,
    simulate,
)
from services.scheduler.sim.traces import TraceJob, generate_jobs

TABLE = ThroughputModel.from_gavel_table()


def free_slots(request: PlanRequest) -> dict[str, list[tuple[str, int]]]:
    slots: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for node in request.cluster.nodes:
        for i, t in enumerate(node.gpus):
            slots[t].append((node.node_id, i))
    return slots


def placements_of(job_id: str, copy: int, taken: list[tuple[str, int]]) -> list[Placement]:
    by_node: dict[str, list[int]] = defaultdict(list)
    for node_id, g in taken:
        by_node[node_id].append(g)
    return [Placement(job_id=job_id, copy=copy, node_id=n, gpus=tuple(gs)) for n, gs in by_node.items()]


class GreedyFifo:
    """Job-level FIFO: each job in arrival order gets W GPUs of its fastest type with W free."""

    name = "test-greedy-fifo"

    def plan(self, request: PlanRequest) -> Plan:
        free = free_slots(request)
        placements: list[Placement] = []
        waiting: list[Wait] = []
        for job in request.jobs:
            options = [(request.throughput.rate(job.job_type, t, job.workers), t) for t, s in free.items()
                       if len(s) >= job.workers]
            rate, gpu_type = max(options, default=(0.0, ""))
            if rate <= 0:
                waiting.append(Wait(job_id=job.job_id, code=WaitCode.CAPACITY))
                continue
            taken, free[gpu_type] = free[gpu_type][:job.workers], free[gpu_type][job.workers:]
            placements += placements_of(job.job_id, 0, taken)
        return Plan(placements=tuple(placements), waiting=tuple(waiting))


class ForkEverywhere:
    """HadarE-like: the first job takes one copy per node (up to W GPUs of that node each);
    the rest wait. Exercises multi-copy progress and consolidation."""

    name = "test-fork"

    def plan(self, request: PlanRequest) -> Plan:
        if not request.jobs:
            return Plan()
        head, rest = request.jobs[0], request.jobs[1:]
        placements = [Placement(job_id=head.job_id, copy=c, node_id=node.node_id,
                                gpus=tuple(range(min(head.workers, node.size))))
                      for c, node in enumerate(request.cluster.nodes)]
        return Plan(placements=tuple(placements),
                    waiting=tuple(Wait(job_id=j.job_id, code=WaitCode.PRIORITY) for j in rest))


class TaskLevelMixer:
    """Task-level: each job takes any W free GPUs, mixing types and nodes, rotating the
    starting GPU every round (so copies are re-placed and pay restarts)."""

    name = "test-mixer"

    def plan(self, request: PlanRequest) -> Plan:
        pool = [(n.node_id, i) for n in request.cluster.nodes for i in range(n.size)]
        shift = request.round % len(pool)
        pool = pool[shift:] + pool[:shift]
        placements: list[Placement] = []
        waiting: list[Wait] = []
        for job in request.jobs:
            if len(pool) < job.workers:
                waiting.append(Wait(job_id=job.job_id, code=WaitCode.CAPACITY))
                continue
            taken, pool = pool[:job.workers], pool[job.workers:]
            placements += placements_of(job.job_id, 0, taken)
        return Plan(placements=tuple(placements), waiting=tuple(waiting))


def registered_policies() -> list[str]:
    """Registered policies whose module is present in this tree."""
    return [name for name, (module, _) in _REGISTRY.items() if importlib.util.find_spec(module) is not None]


POLICY_FACTORIES = {"test-greedy-fifo": GreedyFifo, "test-fork": ForkEverywhere, "test-mixer": TaskLevelMixer}
POLICY_FACTORIES |= {name: (lambda name=name: make_policy(name)) for name in registered_policies()}


def tiny_model(rates: dict[tuple[str, str, int], float]) -> ThroughputModel:
    return ThroughputModel(rates=rates, cross_node=False)


def job(job_id: str, arrival: float, job_type: str, steps: int, workers: int = 1) -> TraceJob:
    return TraceJob(job_id=job_id, arrival_s=arrival, job_type=job_type, workers=workers, total_steps=steps)


# ---------------------------------------------------------------------------- invariants

@pytest.mark.parametrize("policy_name", sorted(POLICY_FACTORIES))
def test_invariants_hold_every_round_and_every_job_completes(policy_name: str) -> None:
    cluster = parse_cluster("v100:2x4,p100:2x4,k80:8")
    jobs = generate_jobs(jobs=16, rate_per_hour=6.0, multi_gpu=True, rng=np.random.default_rng(5),
                         throughput=TABLE)
    jobs = tuple(TraceJob(job_id=j.job_id, arrival_s=j.arrival_s, job_type=j.job_type, workers=j.workers,
                          total_steps=max(1, j.total_steps // 20)) for j in jobs)  # keep rounds few
    round_s = 360.0
    steps_seen: dict[str, float] = defaultdict(float)

    def observe(obs: RoundObservation) -> None:
        states = {j.job_id: j for j in obs.request.jobs}
        bound: dict[str, float] = defaultdict(float)
        for (job_id, _), parts in obs.plan.copies().items():
            bound[job_id] += copy_rate(obs.request, states[job_id], parts) * round_s
        for job_id, steps in obs.steps.items():
            assert 0 <= steps <= bound[job_id] + 1e-6, (job_id, steps, bound[job_id])
            assert steps <= states[job_id].remaining + 1e-6
            steps_seen[job_id] += steps
        for _job_id, done_at in obs.completions.items():
            assert obs.request.now_s < done_at <= obs.request.now_s + round_s

    result = simulate(policy=POLICY_FACTORIES[policy_name](), cluster=cluster, jobs=jobs, throughput=TABLE,
                      options=SimOptions(round_s=round_s, check=True), observer=observe)
    assert result.stop_reason == "completed"
    for rec in result.jobs:
        assert rec.completion_s is not None and rec.steps_done == rec.total_steps
        assert steps_seen[rec.job_id] == pytest.approx(rec.total_steps)
        assert rec.arrival_s <= rec.first_start_s < rec.completion_s
    for rnd in result.rounds:
        assert sum(rnd.busy_gpu_s.values()) <= cluster.total_gpus * round_s + 1e-6
        assert sum(rnd.placed_gpus.values()) <= cluster.total_gpus
    metrics = compute_results(result, TABLE)
    assert metrics.jobs_completed == metrics.jobs_total == len(jobs)
    assert 0 < metrics.cru <= 1


# ---------------------------------------------------------------------------- exact semantics

def test_two_job_example_metrics_are_exact() -> None:
    # One V100. A (rate 1, 150 steps) at t=0; B (rate 2, 100 steps) at t=50; rounds of 100 s.
    # r0 [0,100): A does 100. r1 [100,200): A finishes at 150, GPU held to 200. r2: B 50 s -> 250.
    model = tiny_model({("A", "v100", 1): 1.0, ("B", "v100", 1): 2.0})
    result = simulate(policy=GreedyFifo(), cluster=parse_cluster("v100:1"), throughput=model,
                      jobs=[job("b", 50, "B", 100), job("a", 0, "A", 150)], options=SimOptions(round_s=100, check=True))
    records = {r.job_id: r for r in result.jobs}
    assert (records["a"].first_start_s, records["a"].completion_s) == (0.0, 150.0)
    assert (records["b"].first_start_s, records["b"].completion_s) == (200.0, 250.0)
    assert [r.start_s for r in result.rounds] == [0.0, 100.0, 200.0] and result.gangs_only
    assert [r.busy_gpu_s["v100"] for r in result.rounds] == [100.0, 50.0, 50.0]
    m = compute_results(result, model)
    assert m.ttd_s == 250.0
    assert m.cru == pytest.approx(200 / 250) and m.gru == {"v100": pytest.approx(0.8)}
    assert (m.jct_mean_s, m.jct_median_s) == (175.0, 175.0)
    assert m.jct_p95_s == pytest.approx(150 + 0.95 * 50)
    assert m.queue_delay_mean_s == 75.0                  # A: 0, B: 200 - 50
    assert m.ftf_mean == pytest.approx((150 / 150 + 200 / 50) / 2)
    assert (m.jobs_total, m.jobs_completed) == (2, 2)
    assert m.decision_ms_p50 is not None and m.decision_ms_max >= m.decision_ms_p50 >= 0
    times, util = utilization_series(result)
    assert list(times) == [0.0, 100.0, 200.0] and list(util) == [1.0, 0.5, 0.5]


def _forked_run(policy, model: ThroughputModel):
    """One 200-step job of a 5 GB model on two single-V100 nodes: 100 s rounds, 10 s restarts,
    consolidation through 1 GB/s."""
    return simulate(policy=policy, cluster=parse_cluster("v100:2"), jobs=[job("m", 0, "M", 200)],
                    throughput=model, model_bytes=lambda job_type: 5 * 10**9,
                    options=SimOptions(round_s=100, restart_s=10, store_gbps=1.0, check=True))


def test_forked_copies_pay_restart_once_and_consolidation_every_round() -> None:
    # Two single-V100 nodes, one job forked into 2 copies at rate 1 each, 200 steps, rounds of
    # 100 s, restart 10 s, 5 GB model + 5 GB momentum at 1 GB/s -> 50 s consolidation while
    # forked: 2 uploads, 2 downloads, 1 write of 10 GB (shared.domain.fork_cost).
    # r0: copies train [10,50] -> 80 steps. r1: same GPUs, no restart, [0,50] -> 100 (180).
    # r2: 20 left at rate 2 -> T=10, completion 200 + 10 + 50 = 260, GPUs held 60 s each.
    model = tiny_model({("M", "v100", 1): 1.0})
    result = _forked_run(ForkEverywhere(), model)
    (rec,) = result.jobs
    assert rec.completion_s == pytest.approx(260.0)
    assert [r.busy_gpu_s["v100"] for r in result.rounds] == pytest.approx([200.0, 200.0, 120.0])
    assert rec.gpu_s == pytest.approx(520.0)
    m = compute_results(result, model)
    assert m.ttd_s == pytest.approx(260.0) and m.cru == pytest.approx(1.0)
    assert m.ftf_mean == pytest.approx(260.0 / 200.0)   # isolated: 200 steps at rate 1


def test_a_copy_on_the_gpus_another_copy_of_its_job_held_is_warm() -> None:
    # The same two copies as above, numbered the other way round every round (copy 0 on the
    # second node in odd rounds). A warm process is the job's on those GPUs whatever the
    # copy's number (the agent's warm key has no copy index), so the restart is paid once,
    # as when the numbers stay: completion 260 s, not 260 + 2 x 10.
    class Renumbering(ForkEverywhere):
        def plan(self, request: PlanRequest) -> Plan:
            base = super().plan(request)
            if request.round % 2 == 0:
                return base
            last = len(base.placements) - 1
            return Plan(placements=tuple(Placement(job_id=p.job_id, copy=last - p.copy, node_id=p.node_id,
                                                   gpus=p.gpus) for p in base.placements), waiting=base.waiting)

    (rec,) = _forked_run(Renumbering(), tiny_model({("M", "v100", 1): 1.0})).jobs
    assert rec.completion_s == pytest.approx(260.0)


def test_replaced_copy_pays_restart_every_round() -> None:
    # Task-level mixer rotates GPUs each round: 30 s restart per round on a rate-1 job.
    model = tiny_model({("M", "v100", 1): 1.0})
    result = simulate(policy=TaskLevelMixer(), cluster=parse_cluster("v100:2"), jobs=[job("m", 0, "M", 150)],
                      throughput=model, options=SimOptions(round_s=100, restart_s=30, check=True))
    (rec,) = result.jobs
    # r0: 70 steps, r1: 70 (140), r2: restart 30 then 10 steps -> 200 + 40
    assert rec.completion_s == pytest.approx(240.0)


def test_snapshots_carry_progress_previous_plan_and_seed() -> None:
    model = tiny_model({("A", "v100", 1): 2.0, ("A", "k80", 1): 1.0, ("A", "k80", 2): 1.5})
    seen: list[PlanRequest] = []

    class Recording(TaskLevelMixer):
        def plan(self, request: PlanRequest) -> Plan:
            seen.append(request)
            return super().plan(request)

    simulate(policy=Recording(), cluster=parse_cluster("v100:1,k80:1"), jobs=[job("a", 0, "A", 1000, workers=2)],
             throughput=model, model_bytes=lambda t: 1234, options=SimOptions(round_s=10, seed=42))
    first, second = seen[0], seen[1]
    assert first.previous is None and second.previous is not None
    assert (first.seed, second.seed, second.round, second.now_s) == (42, 42, 1, 10.0)
    (a0,), (a1,) = first.jobs, second.jobs
    assert (a0.steps_done, a0.attained_gpu_s) == (0.0, 0.0)
    # mixed v100 + k80 placement: 2 x min(2.0/2, 1.5/2) = 1.5 steps/s for 10 s
    assert a1.steps_done == pytest.approx(15.0)
    assert a1.attained_gpu_s == 20.0


def test_rounds_align_to_round_multiples_and_skip_idle_gaps() -> None:
    model = tiny_model({("A", "v100", 1): 1.0})
    result = simulate(policy=GreedyFifo(), cluster=parse_cluster("v100:1"), throughput=model,
                      jobs=[job("a", 500, "A", 100), job("b", 5000, "A", 100)], options=SimOptions(round_s=360))
    # t0 = 360; a is active from the round at 720; b from the round at 5040.
    assert [(r.round, r.start_s) for r in result.rounds] == [(1, 720.0), (13, 5040.0)]
    m = compute_results(result, model)
    assert m.ttd_s == 5140.0 - 500.0
    assert m.queue_delay_mean_s == pytest.approx(((720 - 500) + (5040 - 5000)) / 2)
    times, util = utilization_series(result)
    assert len(times) == 13 and util[0] == util[-1] == pytest.approx(100 / 360) and util[1:-1].sum() == 0


def test_finish_time_with_staggered_starts() -> None:
    assert finish_time([(2.0, 0.0)], 50.0) == 25.0
    # rate 2 from 0, rate 1 from 10: 20 steps by t=10, then 3/s -> 50 steps at t=20
    assert finish_time([(1.0, 10.0), (2.0, 0.0)], 50.0) == pytest.approx(20.0)
    assert finish_time([(1.0, 10.0), (2.0, 0.0)], 15.0) == pytest.approx(7.5)
    assert finish_time([(0.0, 0.0), (4.0, 5.0)], 8.0) == pytest.approx(7.0)


# ---------------------------------------------------------------------------- termination

def test_job_no_policy_can_place_stalls_without_looping_forever() -> None:
    # 8 workers of v100 on a 4-V100 cluster: runnable in principle (rate(v100, 4) > 0) but
    # never placed by a job-level policy. The other job completes; the run stops "stalled".
    jobs = [job("big", 0, "ResNet-18 (batch size 64)", 1000, workers=8),
            job("small", 0, "ResNet-18 (batch size 64)", 1000)]
    result = simulate(policy=GreedyFifo(), cluster=parse_cluster("v100:4"), jobs=jobs, throughput=TABLE,
                      options=SimOptions(stall_rounds=5, check=True))
    assert result.stop_reason == "stalled"
    assert len(result.rounds) == 1 + 5
    m = compute_results(result, TABLE)
    assert (m.jobs_total, m.jobs_completed, m.stop_reason) == (2, 1, "stalled")
    assert m.ttd_s is None                             # it never drained the trace
    (left,) = m.unfinished
    assert (left.job_id, left.placed, left.reason) == ("big", False, "capacity")
    assert m.cru == pytest.approx(sum(sum(r.busy_gpu_s.values()) for r in result.rounds) / (4 * result.end_s))


def test_job_with_zero_rate_everywhere_is_unrunnable_and_never_planned() -> None:
    model = tiny_model({("ok", "v100", 1): 1.0, ("never", "v100", 1): 0.0})
    calls: list[int] = []

    class Counting(GreedyFifo):
        def plan(self, request: PlanRequest) -> Plan:
            calls.append(len(request.jobs))
            return super().plan(request)

    result = simulate(policy=Counting(), cluster=parse_cluster("v100:1"), throughput=model,
                      jobs=[job("n", 0, "never", 10), job("o", 0, "ok", 150), job("n2", 10_000, "never", 10)],
                      options=SimOptions(round_s=100))
    assert result.stop_reason == "unrunnable"
    assert calls == [2, 2]                             # no plan() once only unrunnable jobs are left
    assert [r.completion_s for r in result.jobs] == [None, 150.0, None]
    # n2 arrived after the last plan(): the simulator's own reason stands
    assert result.jobs[0].last_wait == "capacity" and result.jobs[2].last_wait.startswith("infeasible: ")


def test_max_rounds_bounds_the_run() -> None:
    model = tiny_model({("A", "v100", 1): 1.0})
    result = simulate(policy=GreedyFifo(), cluster=parse_cluster("v100:1"), jobs=[job("a", 0, "A", 10**9)],
                      throughput=model, options=SimOptions(round_s=100, max_rounds=3))
    assert result.stop_reason == "max_rounds" and len(result.rounds) == 3
    assert result.jobs[0].steps_done == 300.0 and result.end_s == 300.0


def test_options_and_inputs_are_validated() -> None:
    for bad in ({"round_s": 0}, {"restart_s": -1}, {"store_gbps": 0}, {"max_rounds": 0}):
        with pytest.raises(ValueError):
            SimOptions(**bad)
    with pytest.raises(ValueError, match="duplicate job id"):
        simulate(policy=GreedyFifo(), cluster=parse_cluster("v100:1"), throughput=TABLE,
                 jobs=[job("a", 0, "A3C", 1), job("a", 1, "A3C", 1)])


def test_empty_trace() -> None:
    result = simulate(policy=GreedyFifo(), cluster=parse_cluster("v100:1"), jobs=[], throughput=TABLE)
    assert (result.rounds, result.stop_reason) == ((), "completed")
    m = compute_results(result, TABLE)
    assert (m.ttd_s, m.cru, m.jct_mean_s, m.jobs_total) == (0.0, None, None, 0)


def test_build_throughput_cross_node_switch_and_fallback_for_types_the_table_lacks() -> None:
    from services.scheduler.core.throughput import Part
    from services.scheduler.sim.simulator import build_throughput, default_model_bytes
    from shared.domain import workloads

    job_type = "ResNet-18 (batch size 64)"
    spanning = [Part("v100-0", "v100", 1), Part("v100-1", "v100", 1)]
    table, off = build_throughput(cross_node=True), build_throughput(cross_node=False)
    assert off.placement_rate(job_type, spanning) == TABLE.rate(job_type, "v100", 2)
    assert table.placement_rate(job_type, spanning) < off.placement_rate(job_type, spanning)
    assert table.rate(job_type, "t4", 1) > 0 and TABLE.rate(job_type, "t4", 1) == 0
    assert default_model_bytes(job_type) == workloads.model_bytes(job_type) > 0
    assert default_model_bytes("not a job type") == 0
