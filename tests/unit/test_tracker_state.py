"""Tracker bookkeeping: when a round is due, what counts as steps, idempotence under replay."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st
from tracker_events import (
    T0,
    assignment,
    completed,
    consolidated,
    finished,
    fold,
    progress,
    started,
    submitted,
)

from shared.domain.layout import final_key, model_key
from shared.wire.events import CopyFinished, JobCancelled, JobSpec, ModelConsolidated, UserCode


def test_round_is_due_once_every_assigned_copy_finished() -> None:
    state = fold([submitted(), assignment(0), assignment(1), assignment(2), finished(0, 100), finished(1, 80)])
    assert state.due_rounds(T0 + 360, timeout_s=60) == []
    state.apply(finished(2, 60))
    (work,) = state.due_rounds(T0 + 360, timeout_s=60)
    assert (work.job_id, work.round, work.missing, work.timed_out) == ("j1", 0, (), False)
    assert [(c.copy, c.steps) for c in work.usable] == [(0, 100), (1, 80), (2, 60)]
    assert work.prior_steps == 0


def test_after_the_timeout_missing_copies_are_recorded_and_left_out() -> None:
    state = fold([submitted(), assignment(0), assignment(1), assignment(2), finished(0, 100),
                  finished(1, 5, status="failed")])
    assert state.due_rounds(T0 + 360 + 59, timeout_s=60) == []
    (work,) = state.due_rounds(T0 + 360 + 60, timeout_s=60)
    assert work.timed_out and work.missing == (2,)
    assert [c.copy for c in work.usable] == [0] and [c.copy for c in work.failed] == [1]


def test_a_round_waits_for_all_of_its_assignments_when_roundstarted_says_how_many() -> None:
    # Copy 1's Assignment is still unread on hadar.placements: the round must not look complete.
    state = fold([submitted(), started(0, assignments=2), assignment(0), finished(0, 100)])
    assert state.due_rounds(T0 + 360, timeout_s=60) == []
    state.apply(assignment(1))
    assert state.due_rounds(T0 + 360, timeout_s=60) == []
    state.apply(finished(1, 90))
    assert [w.round for w in state.due_rounds(T0 + 360, timeout_s=60)] == [0]


def test_duplicate_copyfinished_never_counts_twice() -> None:
    state = fold([submitted(), assignment(0), finished(0, 100)])
    assert not state.apply(finished(0, 100))
    assert not state.apply(finished(0, 250))  # a second report for the same copy: the first wins
    (work,) = state.due_rounds(T0, timeout_s=60)
    assert [c.steps for c in work.usable] == [100]
    assert state.live_steps("j1") == 100


def test_steps_are_the_sum_over_copies_and_accumulate_over_consolidated_rounds() -> None:
    state = fold([submitted(), assignment(0), assignment(1), progress(0, 40), progress(1, 30), progress(0, 20)])
    assert state.live_steps("j1") == 70  # max per copy, summed over copies
    state.apply(finished(0, 100))
    state.apply(finished(1, 50))
    state.apply(consolidated(0, {0: 100, 1: 50}, total=150))
    assert state.consolidated_steps("j1") == 150 and state.live_steps("j1") == 150
    state.apply(assignment(0, round_=1))
    state.apply(finished(0, 70, round_=1))
    (work,) = state.due_rounds(T0 + 720, timeout_s=60)
    assert work.round == 1 and work.prior_steps == 150


def test_consolidated_round_is_not_due_again_and_late_reports_are_ignored() -> None:
    state = fold([submitted(), assignment(0), assignment(1), finished(0, 100)])
    state.apply(consolidated(0, {0: 100}, total=100))  # consolidated at the timeout without copy 1
    assert not state.apply(finished(1, 80))
    assert state.due_rounds(T0 + 10_000, timeout_s=60) == []
    assert state.consolidated_steps("j1") == 100


def test_rounds_of_a_job_come_due_in_order() -> None:
    state = fold([submitted(), assignment(0, round_=0), assignment(0, round_=1), finished(0, 10, round_=1)])
    assert state.due_rounds(T0 + 400, timeout_s=60) == []  # round 0 still open and not timed out
    (work,) = state.due_rounds(T0 + 420, timeout_s=60)
    assert work.round == 0 and work.usable == () and work.missing == (0,)
    state.abandon("j1", 0)
    assert [w.round for w in state.due_rounds(T0 + 420, timeout_s=60)] == [1]


def test_completion_is_due_when_steps_reach_iterations_and_happens_once() -> None:
    state = fold([submitted(at=T0 - 50), assignment(0), finished(0, 300)])
    state.apply(consolidated(0, {0: 300}, total=300))
    assert state.due_completions() == []
    state.apply(assignment(0, round_=1))
    state.apply(finished(0, 250, round_=1))
    state.apply(consolidated(1, {0: 250}, total=500))
    (work,) = state.due_completions()
    # 550 steps trained, credited up to the job's 500 iterations (issue 17: never more than its total)
    assert (work.model_key, work.total_steps, work.submitted_at) == (model_key("j1", 1), 500, T0 - 50)
    state.apply(completed(500))
    assert state.due_completions() == [] and state.is_completed("j1")
    state.apply(assignment(0, round_=2))
    state.apply(finished(0, 10, round_=2))
    assert state.due_rounds(T0 + 10_000, timeout_s=0) == []


def test_iterations_come_from_the_assignment_when_jobsubmitted_was_not_seen() -> None:
    state = fold([assignment(0), finished(0, 600)])
    assert state.iterations("j1") == 500
    state.apply(consolidated(0, {0: 600}, total=600))
    (work,) = state.due_completions()
    assert work.submitted_at == T0  # first time the tracker heard of the job


def test_cancelled_jobs_are_not_consolidated() -> None:
    state = fold([submitted(), assignment(0), finished(0, 10),
                  JobCancelled(ts=T0 + 1, source="cli", job_id="j1")])
    assert state.due_rounds(T0 + 10_000, timeout_s=0) == []


_HISTORY = [submitted(), assignment(0), assignment(1), progress(0, 30), finished(0, 100), finished(1, 60),
            consolidated(0, {0: 100, 1: 60}, total=160), assignment(0, round_=1), progress(0, 20, round_=1),
            finished(0, 90, round_=1)]


@settings(max_examples=60, deadline=None)
@given(st.permutations(list(range(len(_HISTORY)))), st.lists(st.integers(0, len(_HISTORY) - 1), max_size=8))
def test_replaying_events_in_any_order_with_duplicates_gives_the_same_decisions(order: list[int],
                                                                              repeats: list[int]) -> None:
    # Any order, except that a round's model comes after the placements it names: the tracker
    # replays hadar.placements before hadar.models, and live it announces only rounds it placed.
    shuffled = [_HISTORY[i] for i in order] + [_HISTORY[i] for i in repeats]
    models = [e for e in shuffled if isinstance(e, ModelConsolidated)]
    reference = fold(_HISTORY)
    replayed = fold([e for e in shuffled if not isinstance(e, ModelConsolidated)] + models)
    now = T0 + 760
    assert replayed.due_rounds(now, 60) == reference.due_rounds(now, 60)
    assert replayed.consolidated_steps("j1") == reference.consolidated_steps("j1") == 160
    assert replayed.due_completions() == reference.due_completions()


def test_a_model_of_a_later_round_closes_the_jobs_earlier_open_rounds() -> None:
    # Round 0 was abandoned by the tracker (no event says so); on replay it is open again
    # until round 1's model shows the tracker had moved past it.
    state = fold([submitted(), started(0, 1), assignment(0), started(1, 1), assignment(0, round_=1),
                  finished(0, 40, round_=1), consolidated(1, {0: 40}, total=40)])
    assert state.due_rounds(T0 + 10_000, timeout_s=60) == []
    assert state.consolidated_steps("j1") == 40 and state.sizes()["open_rounds"] == 0


def test_abandoning_a_round_that_is_gone_changes_nothing() -> None:
    state = fold([submitted(), assignment(0), finished(0, 10), JobCancelled(ts=T0, source="cli", job_id="j1")])
    state.abandon("j1", 0)
    state.abandon("nobody", 7)
    assert state.due_rounds(T0 + 10_000, timeout_s=0) == []


def test_a_refusal_carries_the_origin_it_was_applied_with() -> None:
    state = fold([submitted(), started(0, 1), assignment(0)])
    origin = ("hadar.progress", 2, 41)
    assert not state.apply(finished(0, 10, node="elsewhere"), origin=origin)
    (refusal,) = state.drain_refusals()
    assert (refusal.origin, refusal.reason, refusal.event.node_id) == (origin, "wrong_node", "elsewhere")
    assert "elsewhere" in refusal.detail and state.drain_refusals() == []


def test_check_announcement_says_what_apply_would_refuse_without_changing_anything() -> None:
    state = fold([submitted(), started(0, 1), assignment(0), finished(0, 100)])
    good = consolidated(0, {0: 100}, total=100)
    bad = consolidated(0, {0: 100}, total=100, weights={0: -3.0})
    assert state.check_announcement(good) is None
    assert state.check_announcement(bad).reason == "bad_weights"
    assert state.drain_refusals() == [] and len(state.due_rounds(T0 + 360, timeout_s=60)) == 1
    assert state.apply(good) and state.consolidated_steps("j1") == 100


def test_a_late_copyfinished_of_a_decided_round_is_ignored_not_refused() -> None:
    state = fold([submitted(), assignment(0), assignment(1), finished(0, 100),
                  consolidated(0, {0: 100}, total=100)])
    assert not state.apply(finished(1, 80))
    assert state.drain_refusals() == []


def test_an_evaluation_copy_is_never_a_round_of_its_job_but_counts_toward_its_round() -> None:
    """An evaluation copy (a completed user-code job's final model, measured on an agent)
    trains nothing: the tracker opens no round for it and takes no report of it, whether it
    still remembers the job or not; the round it shares with a training copy still comes due."""
    code = UserCode(digest="a" * 64, size=1, entrypoint="train.py")
    old = JobSpec(job_id="old", user="u", model="user", dataset="-", batch_size=32, workers=1, iterations=10,
                  code=code)
    evaluation = replace(assignment(0, round_=1, node="n2", job=old, budget=0), start_from=final_key("old"),
                         evaluation=True)
    report = CopyFinished(ts=T0 + 700, source="agent", job_id="old", round=1, copy=0, node_id="n2", status="ok",
                          steps_round=0, evaluation=True, metric_name="accuracy", start_metric=0.9)
    state = fold([submitted(), started(1, 2), assignment(0, round_=1), evaluation, report, finished(0, 100, round_=1)])
    assert state.jobs() == 1 and state.open_rounds() == 1 and not state.drain_refusals()
    (work,) = state.due_rounds(T0 + 720, timeout_s=60)
    assert (work.job_id, work.round) == ("j1", 1)
