"""Sia's public workloads: the job-list loader, the measured throughput table, the work rule,
the sia-64 preset, and one policy run on a truncated workload."""

from __future__ import annotations

import csv
from importlib import resources
from pathlib import Path

import pytest

from services.scheduler.core.throughput import Part
from services.scheduler.policies import make_policy
from services.scheduler.sim.cluster_spec import parse_cluster
from services.scheduler.sim.sia_profiles import canonical_placement, packed_placement
from services.scheduler.sim.sia_table import build_sia_throughput, parse_job_type
from services.scheduler.sim.sia_traces import restart_s_by_job_type
from services.scheduler.sim.sia_work import (
    CALIBRATION_SLOWDOWN,
    iterations_to_finish,
    naive_iterations,
    total_steps,
    validation_curves,
)
from services.scheduler.sim.simulator import SimOptions, simulate
from services.scheduler.sim.traces import TraceError, load_trace
from shared.domain.progress import credited_steps

DATA = resources.files("shared.domain").joinpath("data/sia")
HEADER = "name,time,application,num_replicas,batch_size\n"


@pytest.fixture(scope="module")
def table():
    return build_sia_throughput()


def _row(app: str, cluster: str, placement: str, local_bsz: int) -> dict[str, str]:
    rows = csv.DictReader(DATA.joinpath(f"profiles/{app}/placements-{cluster}.csv").read_text().splitlines())
    return next(r for r in rows if r["placement"] == placement and int(r["local_bsz"]) == local_bsz)


# ------------------------------------------------------------------ loader

def test_a_sia_workload_loads_as_rigid_jobs_with_the_work_rule(table) -> None:
    jobs = load_trace(str(DATA.joinpath("workloads/philly/workload-1.csv")), throughput=table)
    assert len(jobs) == 160
    assert [j.arrival_s for j in jobs] == sorted(j.arrival_s for j in jobs)
    first = jobs[0]   # cifar10-0,107,cifar10,6,2048
    assert (first.job_id, first.arrival_s, first.job_type, first.workers) == (
        "cifar10-0", 107.0, "cifar10 (batch size 2048, W=6)", 6)
    assert first.total_steps == total_steps("cifar10", 2048)
    apps = {parse_job_type(j.job_type).application for j in jobs}
    assert apps <= {"bert", "cifar10", "deepspeech2", "imagenet", "yolov3"}


@pytest.mark.parametrize(("row", "field"), [
    ("a,1,cifar10,0,2048", "num_replicas"),
    ("a,-1,cifar10,2,2048", "time"),
    ("a,1,resnet,2,2048", "application"),
    ("a,1,cifar10,2,100", "batch_size"),
    ("a,1,cifar10,2,many", "batch_size"),
    ("a,1,cifar10,200,2048", "num_replicas"),     # more than any GPU type has
    (",1,cifar10,2,2048", "name"),
])
def test_a_bad_row_names_file_line_and_field(table, tmp_path: Path, row: str, field: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(HEADER + "ok,0,cifar10,2,2048\n" + row + "\n")
    with pytest.raises(TraceError) as err:
        load_trace(str(path), throughput=table)
    message = str(err.value)
    assert message.startswith(f"{path}: line 3: field {field}") and "\n" not in message


def test_a_sia_job_list_needs_sia_s_table(tmp_path: Path) -> None:
    from services.scheduler.sim.simulator import build_throughput

    path = tmp_path / "w.csv"
    path.write_text(HEADER + "a,0,cifar10,2,2048\n")
    with pytest.raises(TraceError, match="line 2: field batch_size"):
        load_trace(str(path), throughput=build_throughput())


# ------------------------------------------------------------------ throughput table

def test_a_rate_is_one_over_the_measured_step_time_of_its_placement_row(table) -> None:
    job_type = "cifar10 (batch size 2048, W=2)"    # 2 GPUs: 1024 each, the largest measured: no accumulation
    one_node = _row("cifar10", "aws", "2", 1024)
    assert table.rate(job_type, "t4", 2) == pytest.approx(1.0 / float(one_node["step_time"]))
    # 4096 on 2 GPUs: 2048 each, twice the largest measured batch -> one accumulation step,
    # which computes without synchronising: step + (step - sync).
    step, sync = float(one_node["step_time"]), float(one_node["sync_time"])
    assert table.rate("cifar10 (batch size 4096, W=2)", "t4", 2) == pytest.approx(1.0 / (2 * step - sync))


def test_a_copy_on_fewer_gpus_than_w_keeps_the_gang_s_per_gpu_work(table) -> None:
    # HadarE forks a gang into copies, one per node. A copy keeps the per-worker batch (as
    # the live system does): imagenet at 1600 over W=8 is 200 per GPU, so a copy on one
    # node's 4 A100s steps 4 x 200 samples in what the 4-GPU placement measures at 200 per
    # GPU, and is credited 4/8 of a job step per step.
    job_type = "imagenet (batch size 1600, W=8)"
    profile = table.profiles[("imagenet", "a100")]
    assert table.rate(job_type, "a100", 4) == pytest.approx(1.0 / profile.step_and_sync_s((4,), 200)[0])
    # Two such copies train what the gang of 8 does, or more: they do not synchronise with
    # each other. (Timing a copy at the full 1600 on 4 GPUs credited them 0.58x the gang.)
    gang = table.rate(job_type, "a100", 8)
    copies = 2 * credited_steps(table.rate(job_type, "a100", 4), copy_workers=4, job_workers=8)
    assert copies >= 0.9 * gang
    # The gang's gradient accumulation carries over: cifar10 at 4096 over W=2 on T4s is
    # 2048 per GPU, twice the largest measured, so a copy on one GPU accumulates once too.
    one = table.profiles[("cifar10", "t4")].step_and_sync_s((1,), 1024)
    assert one is not None
    step, sync = one
    assert table.rate("cifar10 (batch size 4096, W=2)", "t4", 1) == pytest.approx(1.0 / (2 * step - sync))


def test_two_nodes_pay_the_measured_cross_node_placement(table) -> None:
    job_type = "cifar10 (batch size 4096, W=4)"    # 4 GPUs: 1024 each
    split = float(_row("cifar10", "aws", "22", 1024)["step_time"])
    together = float(_row("cifar10", "aws", "4", 1024)["step_time"])
    assert split != together
    assert table.placement_rate(job_type, [Part("a", "t4", 2), Part("b", "t4", 2)]) == pytest.approx(1.0 / split)
    assert table.placement_rate(job_type, [Part("a", "t4", 4)]) == pytest.approx(1.0 / together)
    assert table.rate(job_type, "t4", 4) == pytest.approx(1.0 / together)   # rate(): packed on one node


def test_table_types_shapes_and_limits(table) -> None:
    assert canonical_placement((2, 1, 0, 3)) == (1, 3, 2) and packed_placement(10, 4) == (4, 4, 2)
    job_type = "imagenet (batch size 1600, W=8)"
    assert all(table.rate(job_type, t, 8) > 0 for t in ("t4", "rtx2080ti", "a100"))
    assert table.rate(job_type, "a100", 8) > table.rate(job_type, "rtx2080ti", 8) > table.rate(job_type, "t4", 8)
    assert table.rate(job_type, "a100", 17) == 0.0      # beyond the 2 profiled DGX nodes
    assert table.rate(job_type, "v100", 1) == 0.0       # no profile, no estimate
    assert job_type in table.job_types and table.scales(job_type, "rtx2080ti") == tuple(range(1, 25))
    mixed = table.placement_rate(job_type, [Part("a", "a100", 4), Part("b", "t4", 4)])
    assert mixed == pytest.approx(table.shape_rate(job_type, "t4", (4, 4)))   # the slowest type sets the pace


def test_the_spanning_bound_covers_every_shape_across_nodes(table) -> None:
    from services.scheduler.sim.bounds import ttd_bounds

    for job_type, gpu_type in (("cifar10 (batch size 4096, W=4)", "t4"), ("imagenet (batch size 1600, W=4)", "a100")):
        bound = table.spanning_bound(job_type, gpu_type, 4)
        for shape in ((2, 2), (1, 3), (1, 1, 2), (1, 1, 1, 1)):
            assert table.shape_rate(job_type, gpu_type, shape) <= bound + 1e-12
    # (2, 2) measured faster than one node of 4 for cifar10 at 1024 per GPU: the bound sees it.
    cifar = "cifar10 (batch size 4096, W=4)"
    assert table.spanning_bound(cifar, "t4", 4) > table.rate(cifar, "t4", 4)
    jobs = load_trace(str(DATA.joinpath("workloads/philly/workload-3.csv")), throughput=table)[:10]
    bounds = ttd_bounds(jobs, parse_cluster("sia-64"), table)
    assert 0 < bounds.ttd_fork_s <= bounds.ttd_nofork_s


def test_a_gang_wider_than_a_node_is_not_charged_its_spanning_twice(table) -> None:
    # rate(job, t, n) beyond a node's size is already the packed placement across nodes, so
    # a planner's factor for spanning is 1 there: Hadar plans a 10-GPU A100 gang at what
    # 8 + 2 A100s measure, not 0.8 of it.
    from services.scheduler.policies.hadar.ledger import RowLayout
    from services.scheduler.policies.hadar.profile import ProfileBook

    job_type = "imagenet (batch size 1600, W=10)"
    assert table.cross_node_factor(job_type, ["a100"], 10) == 1.0
    layout = RowLayout.of(parse_cluster("sia-64"))
    book = ProfileBook(table, types=layout.types, row_type=layout.row_type, row_cap=layout.row_cap)
    spread = {o.label: o.rate for o in book.get(job_type, 10).options}
    assert spread["a100+@spread"] == pytest.approx(
        table.placement_rate(job_type, [Part("a", "a100", 8), Part("b", "a100", 2)]))
    # Within a node's size: what the slower two-node shape measures against one node (at
    # most 1: for some, two nodes measure faster).
    for app, gpu_type, below_one in (("bert (batch size 384, W=4)", "t4", True),
                                     ("imagenet (batch size 1600, W=4)", "a100", False)):
        two_nodes = min(table.shape_rate(app, gpu_type, (3, 1)), table.shape_rate(app, gpu_type, (2, 2)))
        ratio = two_nodes / table.rate(app, gpu_type, 4)
        assert table.cross_node_factor(app, [gpu_type], 4) == pytest.approx(min(1.0, ratio))
        assert (ratio < 1.0) == below_one
    # Several types: the smallest factor of theirs.
    assert table.cross_node_factor(job_type, ["a100", "t4"], 4) == min(
        table.cross_node_factor(job_type, [t], 4) for t in ("a100", "t4"))


# ------------------------------------------------------------------ work rule

def test_at_the_smallest_batch_the_work_is_the_progress_column() -> None:
    curves = validation_curves("cifar10")
    assert curves[0].batch == 128
    epochs_end = min(c.progress[99] for c in curves)      # 100 epochs
    assert iterations_to_finish("cifar10", 128) == pytest.approx(epochs_end)
    assert naive_iterations("cifar10", 128) == pytest.approx(100 * 391, rel=1e-3)   # 50,000 images / 128


def test_large_batches_need_more_iterations_than_perfect_scaling() -> None:
    for app, batch in (("cifar10", 4096), ("imagenet", 3200), ("bert", 384)):
        assert iterations_to_finish(app, batch) >= naive_iterations(app, batch) * (1 - 1e-9)
    calibrated = iterations_to_finish("cifar10", 2048) * CALIBRATION_SLOWDOWN["cifar10"]
    assert total_steps("cifar10", 2048) == round(calibrated)
    assert total_steps("cifar10", 2048, calibrated=False) == round(iterations_to_finish("cifar10", 2048))
    with pytest.raises(ValueError):
        iterations_to_finish("cifar10", 8192)


# ------------------------------------------------------------------ presets

def test_sia_64_is_sia_s_default_cluster_and_scales_by_nodes() -> None:
    c = parse_cluster("sia-64")
    assert c.total_gpus == 64 and dict(c.gpus_by_type) == {"a100": 16, "rtx2080ti": 24, "t4": 24}
    sizes = {(n.gpus[0], n.size) for n in c.nodes}
    assert sizes == {("t4", 4), ("rtx2080ti", 8), ("a100", 8)} and len(c.nodes) == 11
    big = parse_cluster("sia-64x4")
    assert big.total_gpus == 256 and len(big.nodes) == 44 and big.name == "sia-64x4"


# ------------------------------------------------------------------ one run

def test_gavel_throughput_sia_finishes_a_truncated_workload_with_valid_plans(table) -> None:
    jobs = load_trace(str(DATA.joinpath("workloads/philly/workload-3.csv")), throughput=table)[:20]
    options = SimOptions(round_s=360.0, restart_s_by_job_type=restart_s_by_job_type(jobs), check=True)
    result = simulate(policy=make_policy("gavel-throughput-sia"), cluster=parse_cluster("sia-64"), jobs=jobs,
                      throughput=table, options=options)
    assert result.stop_reason == "completed"
    assert all(j.completion_s is not None and j.completion_s > j.arrival_s for j in result.jobs)
    assert restart_s_by_job_type(jobs)["cifar10 (batch size 2048, W=6)"] == 50.0
