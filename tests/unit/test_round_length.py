"""Round length never below the measured overhead x factor (services/scheduler/live/round_length.py),
and a round that left no replica does not count against its job."""

from __future__ import annotations

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.live.round_length import (
    WINDOW,
    RoundCosts,
    copy_startup_s,
    stretched_round_s,
)
from services.scheduler.live.state import SchedulerState
from shared.runtime.config import FieldError
from shared.wire.events import JobSubmitted, RoundAbandoned
from tests.unit.test_scheduler_state import T0, _round, node, spec


def test_a_round_is_stretched_to_the_overhead_times_the_factor() -> None:
    quick = stretched_round_s(15.0, [1.0, 2.0], factor=3.0)
    assert (quick.round_s, quick.stretched, quick.overhead_s) == (15.0, False, 1.0)
    slow = stretched_round_s(15.0, [6.0, 12.0, 7.0], factor=3.0)
    assert (slow.round_s, slow.stretched, slow.overhead_s) == (21.0, True, 7.0)
    assert stretched_round_s(15.0, [], factor=3.0).round_s == 15.0
    assert stretched_round_s(15.0, [100.0], factor=0.0).round_s == 15.0   # off


def test_startup_is_the_time_before_the_first_step() -> None:
    # reported 10 s after the start, 50 steps of 32 samples at 320 samples/s: 5 s training, 5 s start-up
    assert copy_startup_s(ts=110.0, started_at=100.0, steps_round=50, samples_per_s=320.0,
                          batch_size=32, workers=1) == pytest.approx(5.0)
    assert copy_startup_s(ts=101.0, started_at=100.0, steps_round=500, samples_per_s=320.0,
                          batch_size=32, workers=1) == 0.0   # never negative (clock skew, rate noise)
    assert copy_startup_s(ts=104.0, started_at=100.0, steps_round=0, samples_per_s=0.0,
                          batch_size=32, workers=1) == 4.0


def test_costs_keep_the_slowest_copy_first_report_and_a_window_of_rounds() -> None:
    costs = RoundCosts()
    costs.startup(0, "a", 0, 2.0)
    costs.startup(0, "a", 0, 9.0)    # a later report of the same copy: ignored
    costs.startup(0, "b", 0, 3.0)
    costs.consolidation(0, 1.5)
    assert costs.overheads() == [4.5]
    for r in range(1, 10):
        costs.startup(r, "a", 0, 0.5)
        costs.consolidation(r, 0.5)
    assert costs.overheads() == [1.0] * WINDOW   # a slow start long ago no longer stretches rounds


def test_one_slow_round_does_not_stretch_the_next_but_a_lasting_slowdown_does() -> None:
    """A broker outage made one round's consolidation 21 s, and the next round was stretched
    to 64 s with nothing assigned (issue 13, faults after an outage). One outlier among the
    recent rounds is ignored (the lower median); two slow rounds of three are a lasting cost."""
    costs = RoundCosts()
    for r in range(3):
        costs.startup(r, "a", 0, 1.0)
        costs.consolidation(r, 1.0)
    costs.startup(3, "a", 0, 1.0)
    costs.consolidation(3, 21.0)     # the outage
    assert stretched_round_s(15.0, costs.overheads(), factor=3.0).stretched is False
    costs.startup(4, "a", 0, 10.0)   # the machine really is slower now
    costs.consolidation(4, 2.0)
    assert stretched_round_s(15.0, costs.overheads(), factor=3.0).round_s == 36.0
    first = RoundCosts()             # a first start's spawn, then warm rounds
    first.startup(0, "a", 0, 20.0)
    first.consolidation(0, 1.0)
    first.startup(1, "a", 0, 0.5)
    first.consolidation(1, 1.0)
    assert stretched_round_s(15.0, first.overheads(), factor=3.0).stretched is False


def test_config_rejects_a_negative_factor() -> None:
    assert SchedulerConfig().round_overhead_factor == 3.0
    with pytest.raises(FieldError, match="round_overhead_factor"):
        SchedulerConfig(round_overhead_factor=-1.0)


def test_an_abandoned_round_does_not_count_against_the_job() -> None:
    state = SchedulerState()
    state.apply(node("n1", "v100"))
    state.apply(JobSubmitted(ts=T0, source="cli", job=spec("a"), submitted_at=T0))
    _round(state, 0)
    after_one = (state.jobs["a"].attained_gpu_s, dict(state.jobs["a"].time_by_type))
    _round(state, 1)
    assert state.jobs["a"].attained_gpu_s == 2 * after_one[0] > 0
    state.apply(RoundAbandoned(ts=T0 + 30, source="tracker", job_id="a", round=1, reason="no usable replica"))
    assert (state.jobs["a"].attained_gpu_s, state.jobs["a"].time_by_type) == after_one
    # the same news again (another id, as a restarted tracker might send) refunds nothing more
    state.apply(RoundAbandoned(ts=T0 + 31, source="tracker", job_id="a", round=1, reason="no usable replica"))
    assert (state.jobs["a"].attained_gpu_s, state.jobs["a"].time_by_type) == after_one
