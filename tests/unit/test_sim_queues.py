"""Per-queue results of simulated runs (services/scheduler/sim/fairness.py), the gen:
trace's queues option and ``hadar sim --queues`` end to end."""

from __future__ import annotations

import json

import pytest

from services.cli.main import main
from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies import make_policy
from services.scheduler.sim.fairness import QueueObserver, alone_jct_s, jain_index, queue_fairness, queues_of
from services.scheduler.sim.report import format_text_table, queue_rows
from services.scheduler.sim.simulator import JobRecord, SimOptions, build_throughput, simulate
from services.scheduler.sim.traces import TraceError, TraceJob, load_trace, parse_generator_spec
from shared.wire.queues import QueueConfig, QueueSpec

ROUND_S = 360.0
JOB = "resnet"
# One job type: 2 steps/s on a V100, 1 on a K80, linear in the workers.
TABLE = ThroughputModel(rates={(JOB, t, n): (2.0 if t == "v100" else 1.0) * n for t in ("v100", "k80")
                               for n in range(1, 5)})


def cluster(*types: str) -> Cluster:
    return Cluster(name="t", nodes=tuple(Node(node_id=f"n{i}", gpus=(t,)) for i, t in enumerate(types)))


def run(c: Cluster, queues: QueueConfig, jobs: list[TraceJob], policy: str = "yarn-cs"):
    observer = QueueObserver(queues)
    result = simulate(policy=make_policy(policy), cluster=c, jobs=jobs, throughput=TABLE,
                      options=SimOptions(round_s=ROUND_S, queues=queues, check=True), observer=observer)
    return result, queue_fairness(result, queues, observer.rounds, queue_of=queues_of(jobs, queues), throughput=TABLE)


def test_jain_index() -> None:
    assert jain_index([0.7, 0.7, 0.7]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0]) == pytest.approx(0.5)
    assert jain_index([4 / 3, 2 / 3]) == pytest.approx(0.9)
    assert jain_index([]) is None and jain_index([0.0, 0.0]) is None


def test_alone_on_one_nth_of_the_cluster_closed_form() -> None:
    def record(workers: int = 1) -> JobRecord:
        return JobRecord(job_id="j", job_type=JOB, workers=workers, total_steps=3000, priority=1.0, arrival_s=0.0,
                         first_start_s=0.0, completion_s=None, steps_done=0.0, gpu_s=0.0, rounds_run=0)
    four = cluster("v100", "v100", "v100", "v100")
    assert alone_jct_s(record(), four, TABLE, 2) == pytest.approx(1500.0)       # 2 V100s: one is enough
    assert alone_jct_s(record(2), four, TABLE, 8) == pytest.approx(3000.0)     # half a V100 for 2 workers, 1/4 time
    mixed = cluster("v100", "k80")
    assert alone_jct_s(record(), mixed, TABLE, 2) == pytest.approx(3000 / (0.5 * 2 + 0.5 * 1))   # fastest first
    assert alone_jct_s(record(), cluster("t4"), TABLE, 1) is None                # no rate


def test_two_queues_known_shares_contended_interval_and_rho() -> None:
    """a holds the V100 (quota), b the K80; a's job takes 1000 s (3 rounds), b's runs on. While
    both are active a is charged 360 s a round and b 180 (a K80 second is half a V100's)."""
    c = cluster("v100", "k80")
    queues = QueueConfig(queues=(QueueSpec(name="a", quota={"v100": 1}), QueueSpec(name="b", quota={"k80": 1})),
                         default_queue="a")
    jobs = [TraceJob(job_id="short", arrival_s=0.0, job_type=JOB, workers=1, total_steps=2000, queue="a"),
            TraceJob(job_id="long", arrival_s=0.0, job_type=JOB, workers=1, total_steps=5000, queue="b")]
    result, fair = run(c, queues, jobs)
    assert {j.job_id: j.completion_s for j in result.jobs}["short"] == pytest.approx(1000.0)
    a, b = fair.queues
    assert fair.contended_s == pytest.approx(3 * ROUND_S) and fair.backlogged_s == pytest.approx(3 * ROUND_S)
    assert (a.share, b.share) == (pytest.approx(2 / 3), pytest.approx(1 / 3))
    assert (a.gpu_share, b.gpu_share) == (pytest.approx(0.5), pytest.approx(0.5))
    assert (a.weight_share, a.share_ratio, b.share_ratio) == (0.5, pytest.approx(4 / 3), pytest.approx(2 / 3))
    assert fair.jain == pytest.approx(0.9)
    assert (a.jobs, a.completed, a.jct_mean_s, a.jct_p95_s) == (1, 1, pytest.approx(1000.0), pytest.approx(1000.0))
    # alone on half the cluster: half a V100 and half a K80, 1.5 steps/s -> 2000/1.5 s
    assert a.rho_mean == pytest.approx(1000.0 / (2000 / 1.5)) and a.rho_max == a.rho_mean
    assert a.usage_gpu_s == pytest.approx(3 * ROUND_S)
    assert b.completed == 1 and b.rho_max is not None and fair.rho_max == max(a.rho_max, b.rho_max)


def test_weighted_queues_on_one_type_attain_their_weights() -> None:
    c = cluster(*["v100"] * 4)
    queues = QueueConfig(queues=(QueueSpec(name="a", weight=1.0, quota={"v100": 1}),
                                 QueueSpec(name="b", weight=3.0, quota={"v100": 3})), default_queue="a")
    jobs = [TraceJob(job_id=f"{q}{i}", arrival_s=0.0, job_type=JOB, workers=1, total_steps=4000, queue=q)
            for q in "ab" for i in range(6)]
    _, fair = run(c, queues, jobs, policy="tiresias")
    a, b = fair.queues
    assert (a.share, b.share) == (pytest.approx(0.25), pytest.approx(0.75))
    assert (a.share_ratio, b.share_ratio, fair.jain) == (pytest.approx(1.0), pytest.approx(1.0), pytest.approx(1.0))
    assert fair.contended_s > 0 and fair.backlogged_s > 0


def test_a_job_that_ran_alone_has_rho_one() -> None:
    queues = QueueConfig(queues=(QueueSpec(name="solo"),), default_queue="solo")
    jobs = [TraceJob(job_id="j", arrival_s=0.0, job_type=JOB, workers=1, total_steps=3000)]
    result, fair = run(cluster("v100", "k80"), queues, jobs, policy="gavel")
    (solo,) = fair.queues
    assert result.jobs[0].completion_s == pytest.approx(1500.0)
    assert solo.rho_mean == pytest.approx(1.0) and solo.rho_max == pytest.approx(1.0)
    assert solo.share == pytest.approx(1.0) and fair.jain == pytest.approx(1.0)


def test_generator_queues_are_seeded_weighted_and_leave_the_jobs_alone() -> None:
    table = build_throughput()
    plain = load_trace("gen:jobs=300,rate=4,seed=5", throughput=table)
    queued = load_trace("gen:jobs=300,rate=4,seed=5,queues=a/b/b", throughput=table)
    assert [j.queue for j in plain] == [""] * 300
    assert [(j.job_id, j.job_type, j.total_steps, j.arrival_s) for j in queued] == \
        [(j.job_id, j.job_type, j.total_steps, j.arrival_s) for j in plain]
    assert queued == load_trace("gen:jobs=300,rate=4,seed=5,queues=a/b/b", throughput=table)
    assert abs(sum(j.queue == "b" for j in queued) / 300 - 2 / 3) < 0.08
    other = load_trace("gen:jobs=300,rate=4,seed=6,queues=a/b/b", throughput=table)
    assert [j.queue for j in other] != [j.queue for j in queued]
    assert parse_generator_spec("gen:jobs=2,queues=x").queues == ("x",)
    for bad in ("gen:jobs=2,queues=", "gen:jobs=2,queues=Vision", "gen:jobs=2,queues=a//b"):
        with pytest.raises(TraceError, match="field queues"):
            parse_generator_spec(bad)


def test_no_queue_rows_without_queues() -> None:
    assert queue_rows({"gavel": {"ttd_s": 1.0}}) == []


def test_sim_with_queues_end_to_end(tmp_path, capsys) -> None:
    qfile = tmp_path / "teams.yaml"
    qfile.write_text("default_queue: small\nqueues:\n  small: {weight: 1, quota: {v100: 1, k80: 1}}\n"
                     "  big: {weight: 3, quota: {v100: 3, k80: 3}}\n")
    out = tmp_path / "out"
    trace = "gen:jobs=24,rate=0,seed=3,queues=small/big/big/big"
    assert main(["sim", "--cluster", "v100:4,k80:4", "--trace", trace, "--policies", "yarn-cs,gavel",
                 "--queues", str(qfile), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["queues"]["queues"]["big"] == {"weight": 3.0, "quota": {"v100": 3, "k80": 3},
                                                  "borrowing_limit": None}
    for name, m in summary["policies"].items():
        q = m["queues"]
        assert list(q["queues"]) == ["small", "big"], name
        assert sum(f["jobs"] for f in q["queues"].values()) == 24 == m["jobs_total"]
        assert sum(f["completed"] for f in q["queues"].values()) == m["jobs_completed"] == 24
        assert sum(f["share"] for f in q["queues"].values()) == pytest.approx(1.0)
        assert q["queues"]["big"]["weight_share"] == 0.75 and 0 < q["jain"] <= 1
        assert q["contended_s"] > 0 and q["rho_max"] >= q["rho_mean"] > 0
    assert "## Queues" in (out / "report.md").read_text()
    printed = capsys.readouterr().out
    assert "Jain (share / weight)" in printed and "big: share (weight 0.750)" in printed
    assert "Jain" not in format_text_table({k: {x: y for x, y in v.items() if x != "queues"}
                                            for k, v in summary["policies"].items()})


def test_sim_queues_errors_are_one_line(tmp_path, capsys) -> None:
    qfile = tmp_path / "q.yaml"
    qfile.write_text("default_queue: a\nqueues:\n  a: {}\n")
    base = ["sim", "--cluster", "v100:2", "--policies", "yarn-cs", "--out", str(tmp_path / "o")]
    assert main([*base, "--trace", "gen:jobs=4,queues=a/zz", "--queues", str(qfile)]) == 2
    assert "--queues: the trace names queue 'zz'" in capsys.readouterr().err
    assert main([*base, "--trace", "gen:jobs=4", "--queues", str(tmp_path / "absent.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hadar sim: error: --queues: ") and "\n" not in err
    assert not (tmp_path / "o" / "summary.json").exists()
