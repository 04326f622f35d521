"""The replica screen's rule (shared/domain/replica_screen.py): honest rounds keep their
replicas, non-finite and planted ones are rejected, and no round loses every peer."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain.replica_screen import (
    OUT_OF_LINE,
    ReplicaUpdate,
    per_step,
    screen,
    step_floor,
)


def honest_round(seed: int, *, copies: int, spread: float, dim: int = 500,
                 preempted: tuple[int, ...] = ()) -> tuple[list[int], np.ndarray, float]:
    """Steps, updates (copies x dim) and ``||w_0||`` of an honest round: drift s x g plus noise
    sqrt(s) x z, a drift/noise ratio from noise- to drift-dominated, budgets within ``spread``;
    the ``preempted`` copies stop at 1..5 % of their budget."""
    rng = np.random.default_rng(seed)
    top = int(rng.integers(50, 3000))
    steps = [max(1, round(top * spread ** -rng.random())) for _ in range(copies)]
    for c in preempted:
        steps[c] = max(1, round(steps[c] * rng.uniform(0.01, 0.05)))
    drift = rng.standard_normal(dim)
    drift *= 10 ** rng.uniform(-3, 2) / np.linalg.norm(drift)
    s = np.array(steps, dtype=np.float64)[:, None]
    updates = s * drift + np.sqrt(s) * rng.standard_normal((copies, dim)) / math.sqrt(dim)
    start_norm = float(np.linalg.norm(updates, axis=1).max() * 10 ** rng.uniform(0, 3))
    return steps, updates, start_norm


def as_updates(steps: list[int], norms: list[float]) -> list[ReplicaUpdate]:
    return [ReplicaUpdate(copy=i, steps=s, update_norm=float(d)) for i, (s, d) in enumerate(zip(steps, norms))]


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), copies=st.integers(1, 8))
def test_honest_rounds_with_budgets_within_9x_keep_every_replica(seed: int, copies: int) -> None:
    steps, updates, start_norm = honest_round(seed, copies=copies, spread=9.0)
    assert screen(as_updates(steps, list(np.linalg.norm(updates, axis=1))), start_norm=start_norm) == ()


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), copies=st.integers(3, 8))
def test_a_preempted_copy_below_the_median_steps_is_kept(seed: int, copies: int) -> None:
    steps, updates, start_norm = honest_round(seed, copies=copies, spread=2.0, preempted=(0,))
    assert screen(as_updates(steps, list(np.linalg.norm(updates, axis=1))), start_norm=start_norm) == ()


def test_many_seeds_of_honest_rounds_lose_nothing() -> None:
    lost = 0
    for seed in range(3000):
        steps, updates, start_norm = honest_round(seed, copies=1 + seed % 8, spread=9.0, dim=200)
        lost += len(screen(as_updates(steps, list(np.linalg.norm(updates, axis=1))), start_norm=start_norm))
    assert lost == 0


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), copies=st.integers(2, 8))
def test_a_planted_unrelated_model_claiming_the_largest_budget_is_rejected(seed: int, copies: int) -> None:
    """Honest copies move the model by at most 5 % of its norm; the planted replica is a model
    of the same norm unrelated to it (so ~1.4x the norm away) and claims the most steps."""
    steps, updates, _ = honest_round(seed, copies=copies, spread=4.0)
    rng = np.random.default_rng(seed + 1)
    w0 = rng.standard_normal(updates.shape[1])
    w0 *= float(np.linalg.norm(updates, axis=1).max()) / 0.05 / float(np.linalg.norm(w0))
    planted = rng.standard_normal(w0.size)
    planted *= float(np.linalg.norm(w0)) / float(np.linalg.norm(planted))
    norms = [float(np.linalg.norm(planted - w0)), *np.linalg.norm(updates[1:], axis=1)]
    verdicts = screen(as_updates([max(steps), *steps[1:]], norms), start_norm=float(np.linalg.norm(w0)))
    assert [(v.copy, v.rule) for v in verdicts] == [(0, "out_of_line")]
    assert "more than 4x the round's median" in verdicts[0].reason


def test_non_finite_replicas_are_rejected_and_judge_nobody() -> None:
    updates = [ReplicaUpdate(copy=0, steps=100, update_norm=1.0),
               ReplicaUpdate(copy=1, steps=100, update_norm=math.nan, non_finite="fc.weight"),
               ReplicaUpdate(copy=2, steps=100, update_norm=1.1)]
    (verdict,) = screen(updates, start_norm=10.0)
    assert (verdict.copy, verdict.rule) == (1, "non_finite")
    assert verdict.reason == "non-finite values (NaN or inf) in tensor 'fc.weight'"


def test_too_far_from_the_starting_model_is_rejected_even_alone() -> None:
    (verdict,) = screen([ReplicaUpdate(copy=3, steps=10, update_norm=101.0)], start_norm=10.0)
    assert (verdict.copy, verdict.rule) == (3, "too_far")
    assert screen([ReplicaUpdate(copy=3, steps=10, update_norm=99.0)], start_norm=10.0) == ()
    assert screen([ReplicaUpdate(copy=3, steps=10, update_norm=1e9)], start_norm=0.0) == ()   # no norm: no cap
    (overflow,) = screen([ReplicaUpdate(copy=1, steps=10, update_norm=math.inf)], start_norm=0.0)
    assert overflow.rule == "too_far"


def test_of_two_only_the_one_that_moved_further_per_step_can_be_rejected() -> None:
    # the round: the planted copy claims 5x the honest one's steps (83% of the weight)
    honest, planted = ReplicaUpdate(copy=0, steps=200, update_norm=0.5), ReplicaUpdate(copy=1, steps=1000,
                                                                                       update_norm=14.0)
    assert [(v.copy, v.rule) for v in screen([honest, planted], start_norm=10.0)] == [(1, "out_of_line")]
    assert screen([honest, ReplicaUpdate(copy=1, steps=1000, update_norm=9.0)], start_norm=10.0) == ()
    # the documented limit: a forged copy that did not move the model leaves the honest one out of line
    idle = ReplicaUpdate(copy=1, steps=1000, update_norm=0.0)
    assert [v.copy for v in screen([honest, idle], start_norm=10.0)] == [0]


def test_copies_below_the_median_steps_are_judged_at_the_median() -> None:
    updates = as_updates([100, 100, 100, 2], [1.0, 1.1, 0.9, 0.3])
    assert step_floor(updates) == 100
    assert per_step(updates[3], step_floor(updates)) == pytest.approx(0.003)
    assert screen(updates, start_norm=50.0) == ()
    # ... but one that moved the model further than OUT_OF_LINE median copies is still out of line
    far = as_updates([100, 100, 100, 2], [1.0, 1.1, 0.9, 5.0])
    assert [v.copy for v in screen(far, start_norm=50.0)] == [3]


def test_zero_step_replicas_are_judged_but_set_no_reference() -> None:
    updates = as_updates([100, 120, 0], [1.0, 1.1, 0.0])
    assert screen(updates, start_norm=50.0) == ()
    moved = as_updates([100, 120, 0], [1.0, 1.1, 30.0])
    assert [(v.copy, v.rule) for v in screen(moved, start_norm=50.0)] == [(2, "out_of_line")]
    assert screen(as_updates([0, 0], [5.0, 0.0]), start_norm=50.0) == ()   # no peer: nothing to compare


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**6), st.floats(0, 1e30)), min_size=1, max_size=12))
def test_the_rule_never_rejects_every_peer(claims: list[tuple[int, float]]) -> None:
    """Whatever the replicas hold, one that did steps and is within the cap stays."""
    updates = [ReplicaUpdate(copy=i, steps=s, update_norm=d) for i, (s, d) in enumerate(claims)]
    kept = {u.copy for u in updates} - {v.copy for v in screen(updates, start_norm=0.0)}
    assert kept or all(u.steps == 0 for u in updates)
    assert kept >= {u.copy for u in updates if u.steps == 0 and u.update_norm == 0.0}


def test_factor_and_norm_are_checked() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        screen([], start_norm=1.0, out_of_line=0.5)
    with pytest.raises(ValueError, match="start_norm"):
        screen([], start_norm=math.nan)
    with pytest.raises(ValueError, match="update_norm"):
        screen([ReplicaUpdate(copy=0, steps=1, update_norm=-1.0)], start_norm=1.0)
    assert OUT_OF_LINE == 4.0
