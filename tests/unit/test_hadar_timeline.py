"""Hadar's timeline critical rule (hadar_timeline): which jobs it forces this round, on
which GPU types, the target end it keeps, and what it does over whole simulated runs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.cluster import Cluster, Node
from services.scheduler.policies.hadar_ledger import RowLayout
from services.scheduler.policies.hadar_profile import ProfileBook
from services.scheduler.policies.hadar_timeline import POOL_ABOVE, _transport, critical_types, end_round
from services.scheduler.policy import JobState
from services.scheduler.throughput import ThroughputModel
from tests.unit.generated_runs import run_generated

TP = ThroughputModel.from_gavel_table()
RESNET50, RECO = "ResNet-50 (batch size 32)", "Recommendation (batch size 8192)"
RESNET18 = "ResNet-18 (batch size 64)"


def critical(cluster: Cluster, jobs: list[JobState], **kw) -> tuple[int, dict[str, set[str]]]:
    layout = RowLayout.of(cluster)
    book = ProfileBook(TP, types=layout.types, row_type=layout.row_type, row_cap=layout.row_cap)
    profiles = {j.job_id: book.get(j.job_type, j.workers) for j in jobs}
    count = np.bincount(layout.row_type, weights=layout.row_cap, minlength=len(layout.types))
    args = dict(round_=0, round_s=360.0, previous=None, arrived=True, slack=0.05) | kw
    end, chosen = critical_types(jobs, profiles, count, **args)
    return end, {job_id: {layout.types[r] for r in types} for job_id, types in chosen}


def nodes(*types: str) -> Cluster:
    return Cluster(name="t", nodes=tuple(Node(node_id=f"n{i}", gpus=(t,)) for i, t in enumerate(types)))


def steps(job_type: str, gpu: str, rounds: float) -> int:
    return int(TP.rate(job_type, gpu, 1) * 360.0 * rounds)


def test_end_round_is_kept_raised_for_arrivals_and_never_before_the_bound():
    assert end_round(100.0, round_=0, previous=None, arrived=True, slack=0.05) == 105
    assert end_round(90.0, round_=10, previous=105, arrived=False, slack=0.05) == 105
    assert end_round(120.0, round_=10, previous=105, arrived=True, slack=0.05) == 136
    assert end_round(99.5, round_=10, previous=105, arrived=False, slack=0.05) == 110


def test_two_long_jobs_get_the_type_each_is_efficient_on():
    # ResNet-50 is ~6x slower on a K80; Recommendation about as fast on either. Each alone would
    # take the V100 (laxity counts each job on its fastest type); together the makespan needs the split.
    _, chosen = critical(nodes("v100", "k80"), [
        JobState(job_id="r50", job_type=RESNET50, workers=1, total_steps=steps(RESNET50, "v100", 100)),
        JobState(job_id="rec", job_type=RECO, workers=1, total_steps=steps(RECO, "k80", 100))])
    assert chosen == {"r50": {"v100"}, "rec": {"k80"}}


def test_a_job_about_to_finish_is_not_starved_by_its_sliver_of_a_share():
    # It needs a tenth of a round: its LP share is a sliver, but all it can use, so it gets the GPU.
    _, chosen = critical(nodes("v100"), [
        JobState(job_id="long", job_type=RESNET18, workers=1, total_steps=steps(RESNET18, "v100", 50)),
        JobState(job_id="soon", job_type=RESNET18, workers=1, total_steps=steps(RESNET18, "v100", 0.1))])
    assert chosen == {"soon": {"v100"}}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.lists(st.lists(st.floats(0, 1), min_size=3, max_size=3), min_size=1, max_size=6),
       workers=st.lists(st.integers(1, 4), min_size=6, max_size=6), count=st.lists(st.integers(0, 5), min_size=3,
                                                                                     max_size=3))
def test_the_rounding_is_integral_and_within_every_cap(value, workers, count):
    value = np.array(value)
    w = np.array(workers[: len(value)], dtype=float)
    c = np.array(count, dtype=float)
    cap = np.minimum(w[:, None], c[None, :])
    got = _transport(value, w, cap, c)
    assert got is not None
    assert np.all(got == np.round(got)) and np.all(got >= 0)
    assert np.all(got.sum(axis=1) <= w) and np.all(got.sum(axis=0) <= c)
    assert np.all(got[value <= 0] == 0)


def test_pooled_jobs_fit_the_cluster_and_the_shortest_of_a_class_go_first():
    cluster = nodes(*(["v100"] * 20 + ["k80"] * 20))
    jobs = [JobState(job_id=f"j{i:03d}", job_type=RESNET18, workers=1, total_steps=steps(RESNET18, "v100", 10 + i % 7))
            for i in range(POOL_ABOVE + 44)]
    _, chosen = critical(cluster, jobs)
    assert 0 < len(chosen) <= 40
    for t in ("v100", "k80"):
        assert sum(1 for types in chosen.values() if types == {t}) <= 20
    shortest = min(j.remaining for j in jobs if j.job_id not in chosen)
    assert max(j.remaining for j in jobs if j.job_id in chosen) <= shortest * 4    # one bucket of rounds


def run(cluster: str, seed: int, **options):
    metrics, bounds = run_generated("hadar", cluster, jobs=12, seed=seed, **options)
    return metrics, bounds.ttd_nofork_s


@pytest.mark.parametrize("cluster,seed", [("aws-5", 1), ("lab-5", 2)])
def test_the_timeline_keeps_the_makespan_target_and_shortens_jobs_against_laxity(cluster, seed):
    # Both rules end within the 5% slack of the no-fork bound (plus rounding); the timeline
    # lets short jobs use the types the long ones can spare, so they end sooner.
    timeline, bound = run(cluster, seed)
    laxity, _ = run(cluster, seed, critical_rule="laxity")
    assert timeline.jobs_completed == timeline.jobs_total
    assert timeline.ttd_s <= 1.06 * bound
    assert timeline.jct_mean_s < 0.97 * laxity.jct_mean_s
