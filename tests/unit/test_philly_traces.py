"""Pollux's Philly trace -> simulator jobs (services/scheduler/sim/philly_traces.py), and the
philly-2000 preset it is replayed on."""

from __future__ import annotations

from collections import Counter
from importlib import resources

import pytest

from services.scheduler.sim.cluster_spec import parse_cluster
from services.scheduler.sim.philly_traces import REFERENCE_GPU, job_type_candidates, parse_philly_jobs
from services.scheduler.sim.simulator import build_throughput
from services.scheduler.sim.traces import TraceError, load_trace

TABLE = build_throughput()
HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"
ROWS = ("2017-10-09 07:01:55,66.0,1,66.0,11cb48\n"
        "2017-10-09 06:13:03,2951.0,8,23608.0,6214e9\n"
        "2017-10-09 06:13:36,2759.0,16,44144.0,6214e9\n")


def test_rows_become_rigid_jobs_with_the_stated_work_rule() -> None:
    jobs = parse_philly_jobs(HEADER + ROWS, throughput=TABLE, seed=0)
    by_id = {j.job_id: j for j in jobs}
    assert [j.job_id for j in jobs] == ["philly-1", "philly-2", "philly-0"]   # sorted by arrival
    assert by_id["philly-1"].arrival_s == 0.0
    assert by_id["philly-2"].arrival_s == 33.0
    assert by_id["philly-0"].arrival_s == 2932.0
    single, multi = job_type_candidates(TABLE)
    for job_id, duration, gpus in (("philly-0", 66.0, 1), ("philly-1", 2951.0, 8), ("philly-2", 2759.0, 16)):
        job = by_id[job_id]
        assert job.workers == gpus
        assert job.job_type in (single if gpus == 1 else multi)
        assert job.total_steps == max(1, round(duration * TABLE.rate(job.job_type, REFERENCE_GPU, gpus)))


def test_the_type_draw_is_seeded_uniform_and_multi_gpu_jobs_get_distributed_types() -> None:
    rows = HEADER + "".join(f"2017-10-09 {i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d},600,{1 + (i % 2) * 3},0,c\n"
                            for i in range(8000))
    first = parse_philly_jobs(rows, throughput=TABLE, seed=7)
    assert first == parse_philly_jobs(rows, throughput=TABLE, seed=7)
    assert first != parse_philly_jobs(rows, throughput=TABLE, seed=8)
    single, multi = job_type_candidates(TABLE)
    assert set(multi) < set(single)
    assert all(any(s > 1 for s in TABLE.scales(t, REFERENCE_GPU)) for t in multi)
    ones = Counter(j.job_type for j in first if j.workers == 1)
    fours = Counter(j.job_type for j in first if j.workers == 4)
    assert set(ones) == set(single) and set(fours) == set(multi)
    expected = 4000 / len(single)                            # about 154 draws each; 40% is 5 sigma
    assert all(0.6 * expected < n < 1.4 * expected for n in ones.values())


@pytest.mark.parametrize("row, fragment", [
    ("2017-10-09,66,1,66,c", "line 2: field timestamp"),
    ("2017-10-09 07:01:55,0,1,0,c", "line 2: field duration"),
    ("2017-10-09 07:01:55,66,0,0,c", "line 2: field num_gpus"),
    ("2017-10-09 07:01:55,66,1,66", "line 2: 4 fields"),
])
def test_a_bad_row_names_line_and_field(row: str, fragment: str) -> None:
    with pytest.raises(TraceError, match=fragment):
        parse_philly_jobs(HEADER + row + "\n", throughput=TABLE, source="t.csv")


def test_the_bundled_trace_loads_through_the_cli_path_onto_philly_2000() -> None:
    path = str(resources.files("shared.domain").joinpath("data/philly/philly.csv"))
    jobs = load_trace(path, throughput=TABLE, default_seed=0)
    assert len(jobs) == 82_247
    assert Counter(j.workers for j in jobs)[1] == 76_627
    assert max(j.arrival_s for j in jobs) / 86_400 == pytest.approx(108.9, abs=0.1)
    cluster = parse_cluster("philly-2000")
    assert cluster.total_gpus == 2_000
    assert cluster.gpus_by_type == {"v100": 672, "p100": 672, "k80": 656}
    assert all(n.size == 8 for n in cluster.nodes)
    assert max(j.workers for j in jobs) <= min(cluster.gpus_by_type.values())   # every gang fits one type
