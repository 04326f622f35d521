"""Progress in samples on the live path (issue 11): the tracker credits a copy on k of a
job's W workers with k/W of a job step per copy step, exactly, and weighs it by samples.

The representation: the tracker keeps a job's progress as an exact integer count of
worker-steps (copy steps x k, i.e. samples / per-worker batch); a job step is W of them,
so ``total_steps`` (ModelConsolidated, JobCompleted) is ``worker_steps // W`` and the job
completes when ``worker_steps >= W x iterations`` (``shared.domain.progress``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from replica_bytes import BytesReader, entry, safetensors_bytes
from tracker_events import T0, assignment, finished, spec, started, submitted

from services.tracker.averaging.consolidate import Replica, weigh_replicas
from services.tracker.state import TrackerState
from shared.domain.layout import model_key
from shared.domain.progress import credited_steps
from shared.wire.events import CopyWeight, ModelConsolidated


def replica_bytes(seed: int) -> bytes:
    values = np.random.default_rng(seed).standard_normal(4).astype(np.float32)
    return safetensors_bytes({"w": entry("F32", [4], [0, 16])}, values.tobytes())


def _round(state: TrackerState, round_: int, job, copies: list[tuple[int, int, int]]) -> ModelConsolidated:
    """Place copies ``(k, budget, steps)`` of ``job`` in ``round_``, finish them, weighing the round
    from the state's work, fold the announcement; return it."""
    state.apply(started(round_, len(copies)))
    for i, (k, budget, steps) in enumerate(copies):
        state.apply(assignment(i, round_, node=f"n{i}", job=job, budget=budget, ranks=tuple(range(k)), world_size=k))
        state.apply(finished(i, steps, round_, node=f"n{i}"))
    (work,) = state.due_rounds(T0 + round_ * 360 + 351, timeout_s=3600)
    replicas = [Replica(copy=f.copy, steps=f.steps, max_steps=f.budget, workers=f.workers,
                        reader=BytesReader(replica_bytes(f.copy))) for f in work.usable]
    weighing = weigh_replicas(replicas, prior_worker_steps=work.prior_worker_steps, job_workers=work.job_workers)
    event = ModelConsolidated(ts=T0 + 400 + round_ * 360, source="tracker", job_id=job.job_id, round=round_,
                              key=model_key(job.job_id, round_), total_steps=weighing.total_steps,
                              copies=tuple(CopyWeight(copy=r.copy, steps=r.steps, weight=r.weight)
                                           for r in weighing.accepted))
    assert state.apply(event)
    assert state.drain_refusals() == []
    return event


copy_st = st.integers(1, 4).flatmap(lambda w: st.tuples(
    st.just(w),
    st.lists(st.lists(st.tuples(st.integers(1, w), st.integers(0, 50)).flatmap(
        lambda kb: st.tuples(st.just(kb[0]), st.just(kb[1]), st.integers(0, kb[1]))), min_size=1, max_size=4),
        min_size=1, max_size=3)))


@settings(max_examples=150, deadline=None)
@given(job_rounds=copy_st)
def test_credited_progress_is_the_copies_samples_and_weights_are_proportional_to_them(job_rounds) -> None:
    workers, rounds = job_rounds
    job = replace(spec(iterations=10**6), workers=workers)
    state = TrackerState()
    state.apply(submitted(job))
    worker_steps = 0
    for round_, copies in enumerate(rounds):
        event = _round(state, round_, job, copies)
        round_samples = [steps * k for k, _, steps in copies]
        worker_steps += sum(round_samples)
        # Exact: the state keeps integer worker-steps; job steps are their floor over W.
        assert state.consolidated_worker_steps("j1") == worker_steps
        assert state.consolidated_steps("j1") == worker_steps // workers == event.total_steps
        assert math.fsum(credited_steps(s, copy_workers=k, job_workers=workers) for r in rounds[:round_ + 1]
                         for k, _, s in r) == pytest.approx(worker_steps / workers)
        weights = [c.weight for c in event.copies]
        if sum(round_samples):
            assert weights == pytest.approx([s / sum(round_samples) for s in round_samples])
        else:
            assert weights == pytest.approx([1 / len(copies)] * len(copies))


def test_two_half_copies_of_a_two_worker_job_make_half_their_steps() -> None:
    job = replace(spec(iterations=60), workers=2)
    state = TrackerState()
    state.apply(submitted(job))
    event = _round(state, 0, job, [(1, 100, 70), (1, 100, 51)])
    # 121 worker-steps trained; credited up to W x iterations = 120 (never more than the job asked)
    assert event.total_steps == 60 and state.consolidated_worker_steps("j1") == 120
    assert [c.weight for c in event.copies] == pytest.approx([70 / 121, 51 / 121])
    (done,) = state.due_completions()
    assert done.total_steps == 60


def test_a_job_is_not_complete_until_its_worker_steps_reach_w_times_its_iterations() -> None:
    job = replace(spec(iterations=60), workers=2)
    state = TrackerState()
    state.apply(submitted(job))
    _round(state, 0, job, [(1, 100, 70), (1, 100, 49)])   # 119 worker-steps: 59 job steps
    assert state.consolidated_steps("j1") == 59 and state.due_completions() == []
    _round(state, 1, job, [(1, 100, 1)])                  # 120: exactly 60, not 59 + 0
    assert state.consolidated_steps("j1") == 60 and [w.total_steps for w in state.due_completions()] == [60]


def test_live_steps_credit_running_copies_by_their_workers() -> None:
    job = replace(spec(iterations=1000), workers=4)
    state = TrackerState()
    state.apply(submitted(job))
    state.apply(started(0, 2))
    state.apply(assignment(0, 0, node="n0", job=job, ranks=(0, 1, 2), world_size=3))
    state.apply(assignment(1, 0, node="n1", job=job, ranks=(0,), world_size=1))
    state.apply(finished(0, 40, 0, node="n0"))
    state.apply(finished(1, 41, 0, node="n1"))
    assert state.live_steps("j1") == (40 * 3 + 41) // 4
