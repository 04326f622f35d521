"""What a move costs a live job (``JobState.restart_s``): folded from its copies' measured
start-ups (``CopyFinished.start_s`` / ``start_warm``), as the simulator hands its own charge."""

from __future__ import annotations

import itertools
import math

import pytest

from services.scheduler.live.rounds import RoundTiming, build_request
from services.scheduler.live.snapshot import capture, restore
from services.scheduler.live.state import SchedulerState
from shared.persistence.snapshot import dump, load
from shared.wire.events import (
    CopyFinished,
    GpuInfo,
    InvalidEvent,
    JobSpec,
    JobSubmitted,
    NodeRegistered,
    decode,
    encode,
)

T0 = 1_700_000_000.0
TIMING = RoundTiming(round=3, started_at=T0 + 100, round_s=60.0, heartbeat_s=5.0)


def _report(n: int, start_s: float | None, *, warm: bool) -> CopyFinished:
    return CopyFinished(ts=T0 + n, source="agent", job_id="job-a", round=n, copy=0, node_id="n0", status="ok",
                        steps_round=10, checkpoint=f"ckpt/{n}", start_s=start_s, start_warm=warm)


def _state() -> SchedulerState:
    state = SchedulerState()
    state.apply(NodeRegistered(ts=T0, source="agent", node_id="n0", address="n0.lan",
                               gpus=(GpuInfo(index=0, type="v100"),)))
    state.apply(JobSubmitted(ts=T0, source="cli", submitted_at=T0,
                             job=JobSpec(job_id="job-a", user="u", model="resnet", dataset="digits", batch_size=32,
                                         workers=1, iterations=10_000)))
    return state


def _restart_s(state: SchedulerState) -> float:
    (job,) = build_request(state, TIMING, None, seed=0).jobs
    return job.restart_s


def test_a_move_costs_the_cold_start_ups_mean_over_the_warm_ones_whatever_their_order():
    reports = [_report(0, 5.0, warm=False), _report(1, 1.0, warm=True), _report(2, 7.0, warm=False),
               _report(3, 2.0, warm=True), _report(4, None, warm=False)]
    seen = set()
    for order in itertools.permutations(reports):
        state = _state()
        for event in order:
            state.apply(event)
        seen.add(_restart_s(state))
    assert seen == {6.0 - 1.5}


def test_unknown_until_both_a_cold_and_a_warm_copy_reported():
    state = _state()
    assert _restart_s(state) == 0.0
    state.apply(_report(0, 5.0, warm=False))
    assert _restart_s(state) == 0.0
    state.apply(_report(1, 9.0, warm=True))        # a warm start slower than the cold: no cost, never negative
    assert _restart_s(state) == 0.0


@pytest.mark.parametrize("start_s", [-1.0, 86_400.5, math.nan, math.inf])
def test_hostile_start_ups_are_refused(start_s: float):
    with pytest.raises(InvalidEvent, match="start_s"):
        _report(0, start_s, warm=False)


def test_a_report_from_an_agent_before_start_ups_decodes_as_unmeasured():
    event = decode(encode(_report(0, None, warm=False)))
    assert event.start_s is None and not event.start_warm


def test_a_snapshot_carries_the_measured_start_ups():
    state = _state()
    state.apply(_report(0, 5.0, warm=False))
    state.apply(_report(1, 1.0, warm=True))
    body = restore(load(dump(capture(state=state, previous=None, previous_key=None, next_round=1, folded={},
                                     placed={}, created_at=T0)), service="scheduler"))
    assert _restart_s(body.state) == pytest.approx(4.0)
