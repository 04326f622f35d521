"""Step weights: bounded per copy, finite, summing to 1, and a total any event can carry.

Steps are what a copy *claims* (CopyFinished.steps_round, up to 2**64-1 on the wire). A
claim beyond reason must not take the whole weight, and a round whose steps would push
the job's total past 2**64-1 (ModelConsolidated cannot carry it) must leave out the
offending copies rather than fail to announce forever.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from replica_bytes import BytesReader, entry, safetensors_bytes

from services.tracker.averaging.consolidate import (
    MAX_REPLICA_STEPS,
    MAX_TOTAL_STEPS,
    NoUsableReplica,
    Replica,
    weigh_replicas,
)
from shared.wire.events import CopyWeight, ModelConsolidated, Rejection, decode, encode


def replica_bytes(seed: int) -> bytes:
    values = np.random.default_rng(seed).standard_normal(4).astype(np.float32)
    return safetensors_bytes({"w": entry("F32", [4], [0, 16])}, values.tobytes())


def replica(copy: int, steps: int, max_steps: int | None = None) -> Replica:
    return Replica(copy=copy, steps=steps, reader=BytesReader(replica_bytes(copy)), max_steps=max_steps)


def event_of(weighing) -> ModelConsolidated:
    return ModelConsolidated(
        ts=1.0, source="tracker", job_id="j1", round=0, key="models/j1/0.safetensors",
        total_steps=weighing.total_steps,
        copies=tuple(CopyWeight(copy=r.copy, steps=r.steps, weight=r.weight) for r in weighing.accepted),
        rejected=tuple(Rejection(copy=r.copy, reason=r.reason) for r in weighing.rejected))


def test_limits_are_what_the_wire_and_a_float_can_carry() -> None:
    assert MAX_TOTAL_STEPS == 2**64 - 1
    assert MAX_REPLICA_STEPS <= 2**53  # every accepted count is exact as a float


def test_a_copy_claiming_2_64_minus_1_steps_is_rejected_not_given_all_the_weight() -> None:
    weighing = weigh_replicas([replica(0, 2**64 - 1), replica(1, 10), replica(2, 30)])
    assert [r.copy for r in weighing.rejected] == [0] and "steps" in weighing.rejected[0].reason
    assert [(r.copy, r.weight) for r in weighing.accepted] == [(1, 0.25), (2, 0.75)]
    assert weighing.round_steps == 40
    event = event_of(weighing)
    assert decode(encode(event)) == event


def test_steps_beyond_the_copy_budget_are_clamped_to_it() -> None:
    weighing = weigh_replicas([replica(0, 10**12, max_steps=100), replica(1, 100, max_steps=100),
                               replica(2, 2**64 - 1, max_steps=300)])
    assert weighing.rejected == ()
    assert [(r.steps, r.weight) for r in weighing.accepted] == [(100, 0.2), (100, 0.2), (300, 0.6)]


def test_a_round_overflowing_the_jobs_total_leaves_out_the_largest_claims() -> None:
    prior = MAX_TOTAL_STEPS - 50
    weighing = weigh_replicas([replica(0, 40), replica(1, 2**53), replica(2, 10)], prior_worker_steps=prior)
    assert [r.copy for r in weighing.accepted] == [0, 2]
    assert [r.copy for r in weighing.rejected] == [1] and "2**64-1" in weighing.rejected[0].reason
    assert weighing.total_steps == MAX_TOTAL_STEPS == prior + weighing.round_steps
    event = event_of(weighing)
    assert decode(encode(event)) == event


def test_a_job_at_the_step_limit_keeps_only_copies_of_zero_steps() -> None:
    weighing = weigh_replicas([replica(0, 0), replica(1, 5)], prior_worker_steps=MAX_TOTAL_STEPS)
    assert [(r.copy, r.weight) for r in weighing.accepted] == [(0, 1.0)] and [r.copy for r in weighing.rejected] == [1]
    with pytest.raises(NoUsableReplica):
        weigh_replicas([replica(0, 3), replica(1, 5)], prior_worker_steps=MAX_TOTAL_STEPS)


def test_negative_steps_reject_that_copy_only() -> None:
    weighing = weigh_replicas([replica(0, -1), replica(1, 5)])
    assert [r.copy for r in weighing.rejected] == [0] and [r.copy for r in weighing.accepted] == [1]


def test_prior_worker_steps_out_of_range_is_a_caller_error() -> None:
    with pytest.raises(ValueError):
        weigh_replicas([replica(0, 1)], prior_worker_steps=-1)


huge_or_small = st.one_of(st.integers(0, 1000), st.integers(0, 2**64 - 1),
                          st.sampled_from([0, 1, 2**53, 2**53 + 1, 2**63, 2**64 - 1]))


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(huge_or_small, min_size=1, max_size=8),
       budgets=st.lists(st.none() | st.integers(0, 2**64 - 1), min_size=8, max_size=8),
       prior=st.one_of(st.integers(0, 10**6), st.integers(0, 2**64 - 1), st.just(2**64 - 1)),
       mode=st.sampled_from(["steps", "uniform"]))
def test_weights_are_finite_bounded_sum_to_one_and_the_total_fits_an_event(
        steps: list[int], budgets: list[int | None], prior: int, mode: str) -> None:
    replicas = [replica(i, s, budgets[i]) for i, s in enumerate(steps)]
    try:
        weighing = weigh_replicas(replicas, mode=mode, prior_worker_steps=prior)  # type: ignore[arg-type]
    except NoUsableReplica as exc:
        assert {r.copy for r in exc.rejected} == set(range(len(steps)))
        return
    weights = [r.weight for r in weighing.accepted]
    assert all(math.isfinite(w) and 0.0 <= w <= 1.0 for w in weights)
    assert math.fsum(weights) == pytest.approx(1.0, abs=1e-12)
    assert all(0 <= r.steps <= MAX_REPLICA_STEPS for r in weighing.accepted)
    for r in weighing.accepted:
        budget = budgets[r.copy]
        assert r.steps == min(steps[r.copy], budget if budget is not None else steps[r.copy])
    assert weighing.total_steps == prior + weighing.round_steps <= MAX_TOTAL_STEPS
    assert {r.copy for r in weighing.accepted} | {r.copy for r in weighing.rejected} == set(range(len(steps)))
    event = event_of(weighing)
    assert decode(encode(event)) == event


def test_copies_on_fewer_workers_weigh_and_count_by_samples() -> None:
    """A copy on k of W workers: steps x k worker-steps; the job's total is their sum // W."""
    replicas = [Replica(copy=0, steps=30, workers=1, reader=BytesReader(replica_bytes(0))),
                Replica(copy=1, steps=10, workers=3, reader=BytesReader(replica_bytes(1)))]
    weighing = weigh_replicas(replicas, prior_worker_steps=7, job_workers=4)
    assert [r.weight for r in weighing.accepted] == [0.5, 0.5]
    assert (weighing.round_steps, weighing.round_worker_steps, weighing.total_worker_steps,
            weighing.total_steps) == (40, 60, 67, 16)
    with pytest.raises(ValueError):
        weigh_replicas(replicas, job_workers=2)   # a copy on 3 workers of a 2-worker job


def test_the_total_that_must_fit_an_event_is_in_job_steps() -> None:
    prior = 2 * MAX_TOTAL_STEPS - 10     # MAX - 5 job steps of a W=2 job
    replicas = [Replica(copy=0, steps=10, workers=2, reader=BytesReader(replica_bytes(0))),
                Replica(copy=1, steps=5, workers=2, reader=BytesReader(replica_bytes(1)))]
    weighing = weigh_replicas(replicas, prior_worker_steps=prior, job_workers=2)
    assert [r.copy for r in weighing.accepted] == [1] and weighing.total_steps == MAX_TOTAL_STEPS


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.integers(0, 10**6), min_size=1, max_size=4), prior=st.integers(0, 10**7),
       limit=st.integers(0, 10**7), workers=st.integers(1, 8))
def test_the_credit_is_clipped_to_the_limit_and_the_weights_are_not(steps: list[int], prior: int, limit: int,
                                                                   workers: int) -> None:
    """A job is never credited more than ``limit_worker_steps`` (W x iterations) by a round
    (issue 17: 300 iterations reported as 368); a job already past it keeps what it had.
    The copies' steps and weights are those of the unclipped weighing."""
    replicas = [replica(i, s) for i, s in enumerate(steps)]
    free = weigh_replicas(replicas, prior_worker_steps=prior, job_workers=workers)
    clipped = weigh_replicas(replicas, prior_worker_steps=prior, job_workers=workers, limit_worker_steps=limit)
    assert clipped.total_worker_steps == min(prior + sum(steps), max(limit, prior))
    assert clipped.total_steps == clipped.total_worker_steps // workers
    assert [(r.copy, r.steps, r.weight) for r in clipped.accepted] == [(r.copy, r.steps, r.weight)
                                                                       for r in free.accepted]
    with pytest.raises(ValueError, match="limit_worker_steps"):
        weigh_replicas(replicas, limit_worker_steps=-1)
