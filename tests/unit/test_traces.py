"""Traces: CSV, Gavel's 10-column TSV, the seeded generator, and line/field errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.sim.traces import (
    TraceError,
    TraceJob,
    generate_jobs,
    load_trace,
    parse_csv,
    parse_gavel_trace,
    parse_generator_spec,
)

TABLE = ThroughputModel.from_gavel_table()
TYPES = TABLE.job_types
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "traces" / "small.csv"


def gavel_line(job_type: str, total_steps: str, scale: str, priority: str, arrival: str) -> str:
    return "\t".join([job_type, "python3 train.py --batch_size 64", "workloads/pytorch/x", "--num_steps", "1",
                      total_steps, scale, priority, "-1.000000", arrival])


def test_csv_reads_columns_in_any_order_with_default_priority() -> None:
    text = ("total_steps,job_type,job_id,scale_factor,arrival_time_s\n"
            "500,ResNet-50 (batch size 64),b,2,30.5\n"
            "100,A3C,a,1,0\n")
    jobs = parse_csv(text, job_types=TYPES)
    assert jobs == (
        TraceJob(job_id="a", arrival_s=0.0, job_type="A3C", workers=1, total_steps=100, priority=1.0),
        TraceJob(job_id="b", arrival_s=30.5, job_type="ResNet-50 (batch size 64)", workers=2, total_steps=500),
    )


def test_csv_priority_column_and_stable_order_for_equal_arrivals() -> None:
    text = ("job_id,arrival_time_s,job_type,scale_factor,total_steps,priority\n"
            "x,10,CycleGAN,1,5,3\ny,10,CycleGAN,1,5,0.5\nz,0,CycleGAN,1,5,\n")
    jobs = parse_csv(text, job_types=TYPES)
    assert [(j.job_id, j.priority) for j in jobs] == [("z", 1.0), ("x", 3.0), ("y", 0.5)]


@pytest.mark.parametrize("row, line_field", [
    ("a,0,ResNet-50 (batch size 64),1,abc", ("line 3", "field total_steps")),
    ("a,0,ResNet-50 (batch size 64),0,10", ("line 3", "field scale_factor")),
    ("a,-5,ResNet-50 (batch size 64),1,10", ("line 3", "field arrival_time_s")),
    ("a,nan,ResNet-50 (batch size 64),1,10", ("line 3", "field arrival_time_s")),
    ("a,0,ResNet-51,1,10", ("line 3", "field job_type")),
    ("ok,0,A3C,1,10", ("line 3", "field job_id")),          # duplicate of line 2
    (",0,A3C,1,10", ("line 3", "field job_id")),
    ("a,0,A3C,1", ("line 3", "field total_steps: missing")),
    ("a,0,A3C,1,10,1,9", ("line 3", "7 fields, header has 5")),
])
def test_csv_bad_line_names_line_and_field(row: str, line_field: tuple[str, str]) -> None:
    text = "job_id,arrival_time_s,job_type,scale_factor,total_steps\nok,0,A3C,1,10\n" + row + "\n"
    with pytest.raises(TraceError) as info:
        parse_csv(text, job_types=TYPES, source="t.csv")
    message = str(info.value)
    assert message.startswith("t.csv: ") and "\n" not in message
    for fragment in line_field:
        assert fragment in message


def test_csv_header_errors() -> None:
    with pytest.raises(TraceError, match="line 1: field total_steps: missing column"):
        parse_csv("job_id,arrival_time_s,job_type,scale_factor\n", job_types=TYPES)
    with pytest.raises(TraceError, match="line 1: field gpus: unknown column"):
        parse_csv("job_id,arrival_time_s,job_type,scale_factor,total_steps,gpus\n", job_types=TYPES)
    with pytest.raises(TraceError, match="empty trace"):
        parse_csv("", job_types=TYPES)


def test_gavel_trace_maps_its_ten_columns() -> None:
    # Gavel counts a step per worker (its scheduler sums a gang's workers' steps): 346 of them
    # on 2 workers are 173 steps of the job's global batch.
    text = "\n".join([gavel_line("Transformer (batch size 128)", "346", "2", "1", "0"),
                      gavel_line("LM (batch size 10)", "8601", "1", "2.5", "12.000000"), ""])
    jobs = parse_gavel_trace(text, job_types=TYPES)
    assert jobs == (
        TraceJob(job_id="j1", arrival_s=0.0, job_type="Transformer (batch size 128)", workers=2, total_steps=173),
        TraceJob(job_id="j2", arrival_s=12.0, job_type="LM (batch size 10)", workers=1, total_steps=8601,
                 priority=2.5),
    )


@pytest.mark.parametrize("line, expected", [
    (gavel_line("LM (batch size 10)", "12.5", "1", "1", "0"), "line 2: field total_steps"),
    (gavel_line("LM (batch size 10)", "10", "two", "1", "0"), "line 2: field scale_factor"),
    (gavel_line("LM (batch size 10)", "10", "1", "0", "0"), "line 2: field priority_weight"),
    (gavel_line("LM (batch size 10)", "10", "1", "1", "soon"), "line 2: field arrival_time"),
    (gavel_line("LM (batch size 999)", "10", "1", "1", "0"), "line 2: field job_type"),
    ("LM (batch size 10)\tcmd\t10", "line 2: 3 tab-separated fields"),
])
def test_gavel_trace_bad_line_names_line_and_field(line: str, expected: str) -> None:
    text = gavel_line("A3C", "10", "1", "1", "0") + "\n" + line + "\n"
    with pytest.raises(TraceError, match=expected):
        parse_gavel_trace(text, job_types=TYPES, source="g.trace")


def test_load_trace_detects_file_format(tmp_path) -> None:
    tsv = tmp_path / "x.trace"
    tsv.write_text(gavel_line("A3C", "10", "1", "1", "7") + "\n")
    assert load_trace(str(tsv), throughput=TABLE)[0].arrival_s == 7.0
    example = load_trace(str(EXAMPLE), throughput=TABLE)
    assert len(example) == 8 and {j.workers for j in example} == {1, 2, 4}
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(str(tmp_path / "absent.csv"), throughput=TABLE)


def test_generator_spec_parsing_and_defaults() -> None:
    spec = parse_generator_spec("gen:jobs=5", default_seed=9)
    assert (spec.jobs, spec.rate_per_hour, spec.seed, spec.multi_gpu) == (5, 0.0, 9, False)
    spec = parse_generator_spec("gen:jobs=3,rate=2.5,seed=4,multi_gpu=true")
    assert (spec.jobs, spec.rate_per_hour, spec.seed, spec.multi_gpu) == (3, 2.5, 4, True)
    for bad, fragment in [("gen:rate=1", "field jobs: missing"), ("gen:jobs=0", "field jobs"),
                          ("gen:jobs=2,multi_gpu=yes", "field multi_gpu"), ("gen:jobs=2,speed=1", "field 'speed'"),
                          ("gen:jobs=2,rate=-1", "field rate"), ("gen:jobs=2,jobs=3", "given twice")]:
        with pytest.raises(TraceError, match=fragment):
            parse_generator_spec(bad)


def test_generator_is_reproducible_from_the_seed_and_differs_across_seeds() -> None:
    a = load_trace("gen:jobs=50,rate=4,seed=3,multi_gpu=true", throughput=TABLE)
    b = load_trace("gen:jobs=50,rate=4,seed=3,multi_gpu=true", throughput=TABLE)
    c = load_trace("gen:jobs=50,rate=4,seed=4,multi_gpu=true", throughput=TABLE)
    assert a == b and a != c


def test_generator_draws_gavel_distribution() -> None:
    jobs = generate_jobs(jobs=4000, rate_per_hour=10.0, multi_gpu=True, rng=np.random.default_rng(7),
                         throughput=TABLE)
    scales = np.array([j.workers for j in jobs])
    for scale, p in ((1, 0.70), (2, 0.10), (4, 0.15), (8, 0.05)):
        assert abs(np.mean(scales == scale) - p) < 0.03
    for job in jobs:  # distributed-capable: the table has a V100 entry at that scale
        assert job.workers in TABLE.scales(job.job_type, "v100")
    durations = np.array([j.total_steps / TABLE.rate(j.job_type, "v100", j.workers) for j in jobs])
    assert durations.min() >= 60 * 10 ** 1.5 - 1 and durations.max() <= 60 * 10 ** 4 + 1
    assert abs(np.mean(durations > 60 * 10 ** 3) - 0.2) < 0.03
    gaps = np.diff([j.arrival_s for j in jobs])
    assert jobs[0].arrival_s == 0.0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 360.0) < 25.0          # mean gap 3600/rate
    assert len({j.job_type for j in jobs}) == len(TYPES)


def test_generator_rate_zero_and_single_gpu() -> None:
    jobs = generate_jobs(jobs=30, rate_per_hour=0.0, multi_gpu=False, rng=np.random.default_rng(1),
                         throughput=TABLE)
    assert all(j.arrival_s == 0.0 and j.workers == 1 for j in jobs)
    assert len({j.job_id for j in jobs}) == 30
