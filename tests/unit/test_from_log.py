"""A recorded live run as a simulator workload (services/scheduler/sim/from_log.py), on a log built by hand.

One job of 300 steps on two single-GPU nodes, rounds of 100 s from T0. The profiler first rates
it 10 s into round 0 (so it can first be placed in round 1), then measures 2 and 4 steps/s on
the t4; it estimates 9 on the v100 and never measures it. The live scheduler placed it on the t4
in rounds 1 and 2; the live run completed it 250 s after its submission at T0 + 5.
"""

from __future__ import annotations

import dataclasses

import pytest

from services.scheduler.core.policy import JobState, Placement, PlanRequest
from services.scheduler.sim.from_log import RecordedPlacements, compare, live_workload
from services.scheduler.sim.simulator import SimOptions
from shared.domain.data_plane import DataPlane
from shared.wire.events import (
    Assignment,
    Event,
    GpuInfo,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    NodeRegistered,
    RoundStarted,
    ThroughputEstimate,
    UserCode,
)

T0 = 1_700_000_000.0
SPEC = JobSpec(job_id="j", user="u", model="resnet", dataset="digits", batch_size=32, workers=1, iterations=300)


def _log() -> list[Event]:
    def rate(ts: float, basis: str, rates: dict[str, float]) -> ThroughputEstimate:
        return ThroughputEstimate(ts=T0 + ts, source="profiler", job_id="j", basis=basis,  # type: ignore[arg-type]
                                  workers=1, rates=rates, model_bytes=1_000_000_000)

    def placed(r: int) -> Assignment:
        return Assignment(ts=T0 + 100 * r, source="scheduler", round=r, job=SPEC, copy=0, node_id="a",
                          gpus=(0,), gpu_type="t4", world_size=1, ranks=(0,), step_budget=300,
                          deadline=T0 + 100 * (r + 1))

    return [
        NodeRegistered(ts=T0 - 5, source="agent", node_id="b", gpus=(GpuInfo(index=0, type="v100"),)),
        NodeRegistered(ts=T0 - 5, source="agent", node_id="a", gpus=(GpuInfo(index=0, type="t4"),)),
        NodeRegistered(ts=T0 - 5, source="agent", node_id="gone", gpus=(GpuInfo(index=0, type="k80"),)),
        *[RoundStarted(ts=T0 + 100 * r, source="scheduler", round=r, policy="hadar", started_at=T0 + 100 * r,
                       nodes=("a", "b"), ends_at=T0 + 100 * (r + 1), round_s=100.0, seed=3) for r in range(3)],
        JobSubmitted(ts=T0 + 5, source="cli", job=SPEC, submitted_at=T0 + 5),
        rate(10, "estimate", {"t4": 1.0, "v100": 8.0}),
        rate(120, "measured", {"t4": 2.0}),
        rate(130, "estimate", {"v100": 10.0}),
        placed(1),
        rate(220, "measured", {"t4": 4.0}),
        placed(2),
        JobCompleted(ts=T0 + 255, source="tracker", job_id="j", final_key="k", total_steps=300, jct_s=250.0,
                     completed_at=T0 + 255),
    ]


def test_the_workload_is_what_the_live_run_saw() -> None:
    w = live_workload(_log())
    assert [(n.node_id, n.gpus) for n in w.cluster.nodes] == [("a", ("t4",)), ("b", ("v100",))]
    (job,) = w.jobs
    assert (job.job_id, job.arrival_s, job.workers, job.total_steps) == ("j", 10.0, 1, 300)
    # measured wherever measured (mean 3 on the t4, the estimate of 1 ignored); else the mean estimate
    assert w.throughput.rate("j", "t4", 1) == 3.0 and w.throughput.rate("j", "v100", 1) == 9.0
    assert (w.policy, w.seed, w.round_s, w.policy_options) == ("hadar", 3, 100.0, {})
    assert w.submitted_s == {"j": 5.0} and w.live_jct_s == {"j": 250.0} and w.model_bytes == {"j": 1_000_000_000}
    place = Placement(job_id="j", copy=0, node_id="a", gpus=(0,))
    assert w.placements == {1: (place,), 2: (place,)}


def test_replayed_placements_give_the_simulated_jct_from_submission() -> None:
    # Round 1 (t = 100) on the t4 at 3 steps/s: 100 s -> 300 steps, done at 200; 195 s after submission.
    (row,) = compare(live_workload(_log()), replay=True)
    assert (row.live_jct_s, row.simulated_jct_s) == (250.0, pytest.approx(195.0))
    # A data plane (checkpoint: 1 GB of weights + momentum = 2 GB) charges round 1 a cold start of
    # 10 s, an upload of 2 s and a one-replica consolidation: read 2 s, average 1 s, write 2 s.
    plane = DataPlane(store_upload_gbps=1.0, store_download_gbps=1.0, consolidate_gbps=2.0, intra_node_gbps=1.0,
                      inter_node_gbps=1.0, process_start_s=10.0, warm_start_s=0.0)
    (row,) = compare(live_workload(_log()), SimOptions(data_plane=plane), replay=True)
    # It trains [10, 100 - 7] = 83 s -> 249 steps. Round 2: warm, loads 2 GB (2 s), 51 left at 3/s -> 17 s,
    # done at 200 + 2 + 17 + tail (upload 2 + reads of the replica and the start model 4 + 1 + 2) = 228
    assert row.simulated_jct_s == pytest.approx(228.0 - 5.0)


def _ended_early(log: list[Event], by: float) -> list[Event]:
    """The same run had round 0, which placed nothing, ended ``by`` seconds early when the
    job's estimate came (services/scheduler/live/pacing.py): everything later is earlier."""
    shifted: list[Event] = []
    for e in log:
        if isinstance(e, RoundStarted) and e.round >= 1:
            e = dataclasses.replace(e, ts=e.ts - by, started_at=e.started_at - by, ends_at=e.ends_at - by)
        elif isinstance(e, Assignment):
            e = dataclasses.replace(e, ts=e.ts - by, deadline=e.deadline - by)
        elif isinstance(e, JobCompleted):
            e = dataclasses.replace(e, ts=e.ts - by, completed_at=e.completed_at - by, jct_s=e.jct_s - by)
        elif e.ts >= T0 + 100:
            e = dataclasses.replace(e, ts=e.ts - by)
        shifted.append(e)
    return shifted


def test_a_first_round_that_ended_early_moves_the_replay_with_it() -> None:
    """The simulator's rounds are a grid from t0: t0 is set so that the first round that placed
    anything (round 1, 12 s after round 0 began) lies on it, and the replay keeps the live times."""
    early = live_workload(_ended_early(_log(), 88.0))
    (job,) = early.jobs
    assert (job.arrival_s, early.submitted_s, early.live_jct_s) == (98.0, {"j": 93.0}, {"j": 162.0})
    (row,) = compare(early, replay=True)
    (full,) = compare(live_workload(_log()), replay=True)
    assert row.simulated_jct_s == pytest.approx(full.simulated_jct_s - 88.0)


def test_the_live_policy_decides_afresh_on_the_mean_rates() -> None:
    # hadar puts the job on its fastest type by the mean rates, the v100 (9/s): 300 / 9 s into round 1.
    (row,) = compare(live_workload(_log()), replay=False)
    assert row.simulated_jct_s == pytest.approx(100 + 300 / 9 - 5)


def test_only_the_run_from_since_counts() -> None:
    earlier = JobSubmitted(ts=T0 - 50, source="cli", job=SPEC.__class__(**{**SPEC.__dict__, "job_id": "old"}),
                           submitted_at=T0 - 50)
    rated = ThroughputEstimate(ts=T0 - 40, source="profiler", job_id="old", basis="measured", workers=1,
                               rates={"t4": 1.0})
    assert [j.job_id for j in live_workload([earlier, rated, *_log()]).jobs] == ["old", "j"]
    w = live_workload([earlier, rated, *_log()], since=T0)
    assert [j.job_id for j in w.jobs] == ["j"] and set(w.submitted_s) == {"j"}


def test_a_log_without_rounds_is_not_a_live_run() -> None:
    with pytest.raises(ValueError, match="not a live run"):
        live_workload([e for e in _log() if not isinstance(e, RoundStarted)])


def test_an_evaluation_copy_after_completion_is_not_a_placement() -> None:
    code = JobSpec(job_id="j", user="u", model="user", dataset="-", batch_size=32, workers=1, iterations=300,
                   code=UserCode(digest="a" * 64, size=1, entrypoint="train.py"))
    evaluation = Assignment(ts=T0 + 300, source="scheduler", round=3, job=code, copy=0, node_id="b", gpus=(0,),
                            gpu_type="v100", world_size=1, ranks=(0,), step_budget=0, deadline=T0 + 400,
                            start_from="models/j/final.safetensors", evaluation=True)
    assert set(live_workload([*_log(), evaluation]).placements) == {1, 2}


def test_a_job_the_live_run_finished_faster_than_its_mean_rate_keeps_its_last_placement() -> None:
    # Live, the job sped up once it ran alone (2 then 3.5 steps/s on the t4) and was done within
    # round 1. At the mean rate of 2.75 round 1 trains 275 steps: the recorded rounds end with 25 to
    # go, and the replay renews round 1's placement, as the live scheduler would have.
    log = [e for e in _log() if not (isinstance(e, Assignment) and e.round == 2)]
    log = [dataclasses.replace(e, rates={"t4": 3.5}) if isinstance(e, ThroughputEstimate) and e.ts == T0 + 220
           else e for e in log]
    (row,) = compare(live_workload(log), replay=True)
    assert row.simulated_jct_s == pytest.approx(200 + 25 / 2.75 - 5)


def test_a_renewed_placement_never_takes_a_gpu_the_recorded_round_placed() -> None:
    # The same run, but in round 2 the live scheduler gave the t4 to another job: the lingering job
    # waits for round 3, when the t4 is free again.
    other = dataclasses.replace(SPEC, job_id="k", iterations=1_000_000)
    log = [e for e in _log() if not (isinstance(e, Assignment) and e.round == 2)]
    log = [dataclasses.replace(e, rates={"t4": 3.5}) if isinstance(e, ThroughputEstimate) and e.ts == T0 + 220
           else e for e in log]
    log += [JobSubmitted(ts=T0 + 6, source="cli", job=other, submitted_at=T0 + 6),
            ThroughputEstimate(ts=T0 + 10, source="profiler", job_id="k", basis="measured", workers=1,  # type: ignore[arg-type]
                               rates={"t4": 1.0}),
            RoundStarted(ts=T0 + 300, source="scheduler", round=3, policy="hadar", started_at=T0 + 300,
                         nodes=("a", "b"), ends_at=T0 + 400, round_s=100.0, seed=3),
            Assignment(ts=T0 + 200, source="scheduler", round=2, job=other, copy=0, node_id="a", gpus=(0,),
                       gpu_type="t4", world_size=1, ranks=(0,), step_budget=100, deadline=T0 + 300)]
    rows = {r.job_id: r for r in compare(live_workload(log), replay=True)}
    assert rows["j"].simulated_jct_s == pytest.approx(300 + 25 / 2.75 - 5)


def test_a_renewed_placement_displaces_another_jobs_forked_copy() -> None:
    # As above, but in round 2 the live scheduler forked the other job onto the t4 freed by the
    # job's completion (copy 1 beside its copy 0 on the v100). A fork runs only on GPUs left
    # once the active jobs are placed, so had the job still been running it would have kept the
    # t4: the replay renews it there in round 2 and the other job trains on its copy 0 alone.
    other = dataclasses.replace(SPEC, job_id="k", iterations=1_000_000)
    log = [e for e in _log() if not (isinstance(e, Assignment) and e.round == 2)]
    log = [dataclasses.replace(e, rates={"t4": 3.5}) if isinstance(e, ThroughputEstimate) and e.ts == T0 + 220
           else e for e in log]

    def forked(copy: int, node: str, gpu_type: str) -> Assignment:
        return Assignment(ts=T0 + 200, source="scheduler", round=2, job=other, copy=copy, node_id=node, gpus=(0,),
                          gpu_type=gpu_type, world_size=1, ranks=(0,), step_budget=100, deadline=T0 + 300)

    log += [JobSubmitted(ts=T0 + 6, source="cli", job=other, submitted_at=T0 + 6),
            ThroughputEstimate(ts=T0 + 10, source="profiler", job_id="k", basis="measured", workers=1,  # type: ignore[arg-type]
                               rates={"t4": 1.0, "v100": 2.0}),
            forked(0, "b", "v100"), forked(1, "a", "t4")]
    w = live_workload(log)
    rows = {r.job_id: r for r in compare(w, replay=True)}
    assert rows["j"].simulated_jct_s == pytest.approx(200 + 25 / 2.75 - 5)
    # The other job's copy 0 stays where the live round put it; only its fork gives way.
    jobs = tuple(JobState(job_id=j.job_id, job_type=j.job_type, workers=1, total_steps=j.total_steps)
                 for j in w.jobs)
    request = PlanRequest(round=2, now_s=200.0, round_s=100.0, cluster=w.cluster, throughput=w.throughput,
                          jobs=jobs)
    plan = RecordedPlacements(w.placements, completed=w.live_jct_s).plan(request)
    assert sorted((p.job_id, p.copy, p.node_id) for p in plan.placements) == [("j", 0, "a"), ("k", 0, "b")]


def test_a_lingering_forked_job_renews_the_copies_whose_gpus_are_free() -> None:
    # Live, job j ran two copies (t4 and a2000) in round 1 and was done by its end; in round 2 the
    # live scheduler put job k's copy 0 on the t4 and forked k onto the a2000. The replay, a few
    # steps short, renews j's copy on the a2000 (k's fork gives way) instead of waiting, with the
    # whole placement, until a round that holds neither GPU (the failure of test_sim_vs_live:
    # 19.5 s live, 41.1 s replayed). Copies keep their GPUs whole and are numbered from 0.
    from services.scheduler.core.cluster import Cluster, Node
    from services.scheduler.core.throughput import ThroughputModel

    cluster = Cluster(name="two", nodes=(Node(node_id="t", gpus=("t4",)), Node(node_id="a", gpus=("a2000",))))

    def copy(job: str, n: int, node: str) -> Placement:
        return Placement(job_id=job, copy=n, node_id=node, gpus=(0,))
    rounds = {1: (copy("j", 0, "t"), copy("j", 1, "a")), 2: (copy("k", 0, "t"), copy("k", 1, "a"))}
    jobs = tuple(JobState(job_id=j, job_type="m", workers=1, total_steps=1000) for j in ("j", "k"))
    request = PlanRequest(round=2, now_s=20.0, round_s=10.0, cluster=cluster,
                          throughput=ThroughputModel(rates={("m", "t4", 1): 1.0, ("m", "a2000", 1): 1.0}), jobs=jobs)
    plan = RecordedPlacements(rounds, completed={"j": 19.5}).plan(request)
    assert sorted((p.job_id, p.copy, p.node_id) for p in plan.placements) == [("j", 0, "a"), ("k", 0, "t")]
