"""The estimator's scorers compare like with like (benchmarks/estimator_error.py, estimator_sia.py)."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import estimator_error, estimator_sia
from services.scheduler.core.throughput import ThroughputModel
from shared.domain.workloads import estimate


def test_a_table_equal_to_the_estimate_scores_zero_error_at_every_scale() -> None:
    """The model counts a copy's steps, the estimator a step per worker: a table holding
    exactly the estimate in the model's unit must score 0 at n > 1 too."""
    base = ThroughputModel.from_gavel_table()
    exact = {(j, t, n): estimate(j, t, n) / n for (j, t, n) in base.rates if t in estimator_error.SCORED_TYPES}
    result = estimator_error.score(dataclasses.replace(base, rates=exact))
    assert result.entries > 26 and any(n > 1 for (_, _, n) in exact)
    assert result.mape == pytest.approx(0.0, abs=1e-12)
    assert result.calibrated_mape == pytest.approx(0.0, abs=1e-12)


def test_the_sia_score_covers_every_application_and_type_pair() -> None:
    result = estimator_sia.score()
    assert result.pairs == 15 and result.unfit == 0
    assert set(result.mape_by_type) == {"t4", "rtx2080ti", "a100"}
    assert result.mape > 0 and result.factor >= 1
