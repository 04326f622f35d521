"""The estimator's scorers compare like with like (benchmarks/estimator_error.py, estimator_sia.py)."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import estimator_error, estimator_sia
from services.scheduler.core.throughput import ThroughputModel
from shared.domain.sia_figures import sia_figures
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
    assert len(result.mape_anchored_by_pair) == 6 and "t4->a100" in result.mape_anchored_by_pair


def test_the_sia_score_reads_each_applications_own_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    """An application whose figures say it does not run TF32 is scored so: the scorer used to
    force ``tf32`` on for every application, whatever its figures said."""
    without = estimator_sia.score(tf32=False)
    monkeypatch.setattr(estimator_sia, "sia_figures",
                        lambda app, batch, replicas=1: dataclasses.replace(sia_figures(app, batch, replicas),
                                                                           tf32=False))
    assert estimator_sia.score().mape == pytest.approx(without.mape)


def test_the_estimator_keeps_its_scores_on_data_it_was_not_fitted_on() -> None:
    """Regression guard at the levels reached (issue 29): Sia's pairs >= 0.8 is the issue's target,
    its MAPE 0.77 (target 0.5, not met) and factor 1.68 were 1.88 and 2.13, and 0.37 once one
    type was measured (the profiler's re-estimate); Gavel's table must not get worse than 69%
    ranked, MAPE 0.66, calibrated MAPE 0.37."""
    sia = estimator_sia.score()
    assert sia.pair_correct_frac >= 0.8 and sia.mape < 0.8 and sia.factor < 1.7 and sia.unfit == 0
    assert sia.mape_anchored < 0.38
    gavel = estimator_error.score(ThroughputModel.from_gavel_table())
    assert gavel.rank_correct_frac >= 0.69 and gavel.mape < 0.66 and gavel.calibrated_mape < 0.38
