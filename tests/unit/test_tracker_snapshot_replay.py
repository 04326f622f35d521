"""Tracker snapshots: what they cover, and that state + replay from them equals the whole log."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.tracker.lifecycle import ObjectLifecycle
from services.tracker.snapshot import Position, capture, covered_offsets, restore
from services.tracker.state import TrackerState
from shared.persistence.snapshot import SnapshotCorrupt, StateSnapshot, dump, load
from shared.wire.events import Event
from tests.unit.tracker_events import (
    T0,
    assignment,
    completed,
    consolidated,
    finished,
    progress,
    spec,
    started,
    submitted,
)

TP = "hadar.progress:0"
SMALL = spec(iterations=150)

# One partition, offset = index. Copy 1's report (offset 3) is read before its Assignment
# (offset 6), so every state between them holds it.
LOG: list[Event] = [
    submitted(SMALL), started(0, 2), assignment(0, node="n1", job=SMALL),
    finished(1, 50, node="n2"), progress(0, 30), finished(0, 40),
    assignment(1, node="n2", job=SMALL), finished(1, 50, node="n2"),   # a re-report (new id)
    consolidated(0, {0: 40, 1: 50}, 90), started(1, 1), assignment(0, round_=1, job=SMALL),
    progress(0, 20, round_=1), finished(0, 60, round_=1), consolidated(1, {0: 60}, 150), completed(150),
]


def folded(events: list[tuple[int, Event]], state: TrackerState) -> TrackerState:
    for offset, event in events:
        state.apply(event, Position(topic="hadar.progress", partition=0, offset=offset))
    return state


def view(state: TrackerState) -> tuple[object, ...]:
    sizes = {k: v for k, v in state.sizes().items() if k not in ("remembered_ids", "refusals")}
    return (state.due_rounds(T0 + 1e6, 0.0), state.due_completions(), state.consolidated_steps("j1"),
            state.live_steps("j1"), state.is_completed("j1"), sizes)


def test_covered_offsets_stop_at_the_first_held_report_of_each_partition() -> None:
    held = [Position(topic="p", partition=0, offset=7), Position(topic="p", partition=0, offset=4),
            Position(topic="p", partition=2, offset=9)]
    assert covered_offsets({"p:0": 12, "p:1": 5, "p:2": 10, "j:0": 3}, held) == {"p:0": 4, "p:1": 5, "p:2": 9,
                                                                                  "j:0": 3}
    assert covered_offsets({"p:0": 12}, [None]) is None   # a held report that cannot be re-read


@pytest.mark.parametrize("cut", range(len(LOG) + 1))
def test_a_snapshot_at_any_point_then_its_replay_equals_the_whole_log(cut: int) -> None:
    state = folded(list(enumerate(LOG[:cut])), TrackerState())
    snap = capture(state, ObjectLifecycle(), {TP: cut}, wall_now=T0, mono_now=5.0)
    assert snap is not None
    if 3 <= cut <= 6:                      # copy 1's report is held: it is not covered
        assert snap.offsets == {TP: 3}
    loaded = load(dump(snap), service="tracker")
    resumed = TrackerState()
    restore(loaded, resumed, ObjectLifecycle(), wall_now=T0 + 50, mono_now=1.0)
    folded([(o, e) for o, e in enumerate(LOG[:cut]) if o >= loaded.offsets[TP]], resumed)
    assert resumed.drain_refusals() == []  # nothing was applied twice, nothing refused as a repeat
    # From here on, record by record, the resumed state decides as the one that never stopped.
    whole = folded(list(enumerate(LOG[:cut])), TrackerState())
    for offset in range(cut, len(LOG)):
        assert view(resumed) == view(whole), offset
        folded([(offset, LOG[offset])], resumed)
        folded([(offset, LOG[offset])], whole)
    assert view(resumed) == view(whole)


def test_a_tracker_snapshot_written_before_names_were_stable_restores() -> None:
    # LOG folded up to offset 10 by the code before the layout change (tests/data/snapshots).
    data = (Path(__file__).resolve().parents[1] / "data" / "snapshots" / "tracker.snapshot").read_bytes()
    assert b"services.tracker." in data
    loaded = load(data, service="tracker")
    resumed = TrackerState()
    restore(loaded, resumed, ObjectLifecycle(), wall_now=T0 + 50, mono_now=1.0)
    whole = folded(list(enumerate(LOG[:10])), TrackerState())
    folded([(o, e) for o, e in enumerate(LOG[:10]) if o >= loaded.offsets[TP]], resumed)
    for offset in range(10, len(LOG)):
        assert view(resumed) == view(whole), offset
        folded([(offset, LOG[offset])], resumed)
        folded([(offset, LOG[offset])], whole)
    assert view(resumed) == view(whole) and resumed.is_completed("j1")


def test_lifecycle_sweeps_keep_their_wall_clock_time_and_given_up_completions_are_retried() -> None:
    state = folded(list(enumerate(LOG[:14])), TrackerState())
    state.give_up_completion("j1")
    assert state.due_completions() == []
    lifecycle = ObjectLifecycle()
    lifecycle.observe(LOG[13], now_s=100.0)          # due at monotonic 100 = wall T0 + 40 below
    snap = capture(state, lifecycle, {TP: 14}, wall_now=T0 + 40, mono_now=100.0)
    assert snap is not None
    resumed, later = TrackerState(), ObjectLifecycle()
    restore(load(dump(snap), service="tracker"), resumed, later, wall_now=T0 + 70, mono_now=2.0)
    assert later.due(-29.0) == [] and later.due(-28.0) == ["j1"]    # 30 s ago, in this process's clock
    assert [c.job_id for c in resumed.due_completions()] == ["j1"]


def test_a_body_that_is_not_a_tracker_snapshot_is_corrupt_and_changes_nothing() -> None:
    state = folded(list(enumerate(LOG[:5])), TrackerState())
    before = view(state)
    for body in (None, {"jobs": {}}, [1, 2]):
        with pytest.raises(SnapshotCorrupt):
            restore(StateSnapshot(service="tracker", seq=1, created_at=T0, body=body), state, ObjectLifecycle(),
                    wall_now=T0, mono_now=0.0)
    assert view(state) == before
