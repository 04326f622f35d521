"""TrackerState on forged, misdirected and flooding input (issue 12): each finding as a test.

A refused event changes nothing and is reported, with a reason label, by ``drain_refusals``.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tracker_events import (
    BUDGET,
    SPEC,
    T0,
    assignment,
    completed,
    consolidated,
    finished,
    fold,
    progress,
    spec,
    started,
    submitted,
)

from services.tracker.state import DueRound, TrackerState
from shared.domain.layout import checkpoint_key, final_key, model_key
from shared.wire.events import (
    Assignment,
    CopyWeight,
    Event,
    JobCancelled,
    ModelConsolidated,
    RoundStarted,
)


def reasons(state: TrackerState) -> list[str]:
    return [r.reason for r in state.drain_refusals()]


def refused_alone(state: TrackerState, event: Event) -> str:
    """Apply ``event``; it must change nothing and be refused exactly once. Returns the reason."""
    before = (state.due_rounds(T0 + 10_000, 60), state.due_completions(), state.sizes())
    assert not state.apply(event)
    (reason,) = reasons(state)
    assert (state.due_rounds(T0 + 10_000, 60), state.due_completions()) == before[:2]
    return reason


# ---------------------------------------------------------------- CopyFinished


def test_a_checkpoint_key_naming_another_jobs_final_model_is_refused() -> None:
    state = fold([submitted(), started(0, 1), assignment(0)])
    forged = finished(0, 100, checkpoint=final_key("victim"))
    assert refused_alone(state, forged) == "bad_key"
    assert refused_alone(state, finished(0, 100, checkpoint=checkpoint_key("j1", 0, 1, node="n1"))) == "bad_key"
    assert state.apply(finished(0, 100))   # the real report still counts: the forged one did not win
    (work,) = state.due_rounds(T0 + 360, timeout_s=60)
    assert [c.checkpoint for c in work.usable] == [checkpoint_key("j1", 0, 0, node="n1")]


def test_the_copys_own_key_under_another_nodes_segment_is_refused_as_bad_key() -> None:
    """n1 reports copy 0 but names the file n0 would write: the key must carry the reporter's node."""
    state = fold([submitted(), started(0, 1), assignment(0, node="n1")])
    assert refused_alone(state, finished(0, 100, node="n1", checkpoint=checkpoint_key("j1", 0, 0, node="n0"))) \
        == "bad_key"
    assert state.apply(finished(0, 100, node="n1"))
    (work,) = state.due_rounds(T0 + 360, timeout_s=60)
    assert [c.checkpoint for c in work.usable] == [checkpoint_key("j1", 0, 0, node="n1")]


def test_copies_nobody_assigned_are_refused_and_never_averaged() -> None:
    state = fold([submitted(), started(0, 1), assignment(0, node="n0")])
    assert refused_alone(state, finished(1, 100, node="n1")) == "unassigned"
    assert refused_alone(state, finished(2, 100, node="n2")) == "unassigned"
    assert refused_alone(state, finished(0, 100, job="other", node="n0")) == "unassigned"
    state.apply(finished(0, 50, node="n0"))
    (work,) = state.due_rounds(T0 + 360, timeout_s=60)
    assert [c.copy for c in work.usable] == [0] and work.missing == ()


def test_a_copy_reported_from_a_node_it_was_not_assigned_to_is_refused() -> None:
    state = fold([submitted(), started(0, 1), assignment(0, node="n0")])
    assert refused_alone(state, finished(0, 100, node="n9")) == "wrong_node"
    assert state.apply(finished(0, 100, node="n0"))


def test_a_copy_spanning_nodes_reports_its_checkpoint_from_rank_0s_node_and_fails_from_any() -> None:
    rank0 = assignment(0, node="n0", ranks=(0,), world_size=2)
    rank1 = assignment(0, node="n1", ranks=(1,), world_size=2)
    state = fold([submitted(), started(0, 2), rank0, rank1])
    assert refused_alone(state, finished(0, 100, node="n1")) == "wrong_node"
    assert state.apply(finished(0, 100, node="n0"))
    other = fold([submitted(), started(0, 2), rank0, rank1])
    assert other.apply(finished(0, 3, node="n1", status="failed"))
    (work,) = other.due_rounds(T0 + 360, timeout_s=60)
    assert work.usable == () and [c.node_id for c in work.failed] == ["n1"]


def test_steps_over_the_copys_budget_are_refused_and_the_budget_bounds_the_replica() -> None:
    state = fold([submitted(), started(0, 1), assignment(0, budget=80)])
    assert refused_alone(state, finished(0, 2**64 - 1)) == "over_budget"
    assert refused_alone(state, finished(0, 81)) == "over_budget"
    assert refused_alone(state, progress(0, 81)) == "over_budget"
    assert state.apply(finished(0, 80))
    (work,) = state.due_rounds(T0 + 360, timeout_s=60)
    assert [(c.steps, c.budget) for c in work.usable] == [(80, 80)]


def test_a_copyfinished_read_before_its_assignment_is_held_and_then_counted() -> None:
    state = fold([submitted(), started(0, 2), assignment(0)])
    state.apply(finished(1, 70, node="n2"))         # hadar.progress is ahead of hadar.placements
    assert state.sizes()["pending"] == 1 and reasons(state) == []
    state.apply(finished(0, 100))
    assert state.due_rounds(T0 + 360, timeout_s=60) == []
    state.apply(assignment(1, node="n2"))
    (work,) = state.due_rounds(T0 + 360, timeout_s=60)
    assert [(c.copy, c.steps) for c in work.usable] == [(0, 100), (1, 70)]
    assert state.sizes()["pending"] == 0 and reasons(state) == []


def test_a_held_copyfinished_is_refused_once_its_rounds_placements_are_all_known() -> None:
    state = fold([submitted(), started(0, 2), assignment(0)])
    state.apply(finished(3, 70, node="n3"))
    assert state.sizes()["pending"] == 1
    state.apply(assignment(1, node="n2"))            # the last of the round's 2 assignments
    assert reasons(state) == ["unassigned"] and state.sizes()["pending"] == 0


def test_a_held_copyfinished_is_refused_when_its_round_is_decided() -> None:
    state = fold([submitted(), assignment(0)])       # no RoundStarted: placements never "complete"
    state.apply(finished(4, 70, node="n4"))
    assert state.sizes()["pending"] == 1
    state.apply(finished(0, 100))
    state.apply(consolidated(0, {0: 100}, total=100))
    assert reasons(state) == ["unassigned"] and state.sizes()["pending"] == 0


def test_a_copyfinished_for_a_round_far_ahead_is_refused_at_once() -> None:
    state = fold([submitted(), started(5, 1), assignment(0, round_=5)])
    assert refused_alone(state, finished(0, 10, round_=5 + 3)) == "future_round"
    assert refused_alone(state, finished(0, 10, round_=2**62)) == "future_round"
    state.apply(finished(0, 10, round_=5 + 2))       # within the lead: held for its Assignment
    assert state.sizes()["pending"] == 1 and reasons(state) == []


# ---------------------------------------------------------------- ModelConsolidated / JobCompleted


def ready_round() -> TrackerState:
    return fold([submitted(), started(0, 2), assignment(0), assignment(1, node="n2"), finished(0, 100),
                 finished(1, 50, node="n2")])


@pytest.mark.parametrize(("event", "reason"), [
    (consolidated(0, {0: 100, 1: 50}, total=150, weights={0: 4.0, 1: -3.0}), "bad_weights"),
    (consolidated(0, {0: 100, 1: 50}, total=150, weights={0: 0.5, 1: 0.4}), "bad_weights"),
    (consolidated(0, {0: 100, 1: 50}, total=150, weights={0: 1e308, 1: -1e308}), "bad_weights"),
    (consolidated(0, {0: 100, 1: 50}, total=150, weights={0: 1.0, 1: 1e-5}), "bad_weights"),
    (consolidated(0, {}, total=0), "bad_weights"),
    (consolidated(0, {0: 100, 1: 50}, total=150, key="models/victim/final.safetensors"), "bad_key"),
    (consolidated(0, {0: 100, 1: 50}, total=150, key=model_key("j1", 1)), "bad_key"),
    (consolidated(0, {0: 100, 7: 50}, total=150), "unassigned"),
    (consolidated(0, {0: 100}, total=100, job="other"), "unassigned"),
    (consolidated(0, {0: BUDGET + 1}, total=BUDGET + 1), "over_budget"),
    (consolidated(2**62, {0: 100}, total=100), "future_round"),
    (consolidated(3, {0: 100}, total=100), "future_round"),
], ids=["weight-3", "sum-0.9", "huge", "sum-1.00001", "no-copies", "victims-final", "other-round", "unassigned-copy",
        "unknown-job", "over-budget", "round-2**62", "round-3"])
def test_a_forged_model_consolidated_is_refused(event: Event, reason: str) -> None:
    state = ready_round()
    assert refused_alone(state, event) == reason
    (work,) = state.due_rounds(T0 + 360, timeout_s=60)   # the round is still ours to consolidate
    assert work.round == 0 and state.consolidated_steps("j1") == 0


def test_a_round_model_within_the_rounds_lead_but_never_assigned_does_not_freeze_the_job() -> None:
    state = ready_round()
    assert refused_alone(state, consolidated(2, {0: 100}, total=100)) == "unassigned"
    state.apply(consolidated(0, {0: 100, 1: 50}, total=150))
    state.apply(assignment(0, round_=1))
    state.apply(finished(0, 10, round_=1))
    assert [w.round for w in state.due_rounds(T0 + 720, timeout_s=60)] == [1]


def test_a_forged_job_completed_is_refused() -> None:
    state = fold([submitted(spec(iterations=100)), started(0, 1), assignment(0), finished(0, 100)])
    assert refused_alone(state, completed(100)) == "inconsistent"        # no model yet
    state.apply(consolidated(0, {0: 100}, total=100))
    assert refused_alone(state, completed(100, key=model_key("j1", 0))) == "bad_key"
    assert refused_alone(state, completed(100, key=final_key("victim"))) == "bad_key"
    assert refused_alone(state, completed(7)) == "inconsistent"          # not the job's steps
    assert refused_alone(state, completed(100, job="other")) == "unassigned"
    assert state.apply(completed(100)) and state.is_completed("j1")


def test_a_job_completed_before_its_iterations_are_reached_is_refused() -> None:
    state = fold([submitted(spec(iterations=1_000)), started(0, 1), assignment(0), finished(0, 100),
                  consolidated(0, {0: 100}, total=100)])
    assert refused_alone(state, completed(100)) == "inconsistent"
    assert not state.is_completed("j1")


# ---------------------------------------------------------------- bounded state


def test_progress_for_ten_thousand_unknown_jobs_leaves_the_state_bounded() -> None:
    state = fold([submitted(), started(0, 1), assignment(0)])
    before = state.sizes()
    refused = []
    for i in range(10_000):
        state.apply(progress(0, 5, job=f"ghost-{i}"))
        refused += reasons(state)
    assert refused == ["unassigned"] * 10_000
    after = state.sizes()
    assert {k: v for k, v in after.items() if k != "remembered_ids"} == \
        {k: v for k, v in before.items() if k != "remembered_ids"}
    assert after["remembered_ids"] <= 8192


def test_copyfinished_for_unknown_jobs_is_held_only_up_to_a_bound() -> None:
    state = TrackerState(max_pending=100)
    fold([submitted(), assignment(0)], state)                 # no RoundStarted: nothing completes round 0
    for i in range(1_000):
        state.apply(finished(0, 5, job=f"ghost-{i}", node="n1"))
    assert state.sizes()["pending"] == 100
    assert [r.reason for r in state.drain_refusals()] == ["overflow"] * 900
    state.apply(finished(1, 5, node="n2"))                    # a known job's report evicts a ghost's
    assert state.sizes()["pending"] == 100
    assert reasons(state) == ["overflow"]
    state.apply(assignment(1, node="n2"))
    (work,) = state.due_rounds(T0 + 10_000, timeout_s=60)
    assert [c.copy for c in work.usable] == [1] and work.missing == (0,)


def test_decided_rounds_and_finished_jobs_are_pruned() -> None:
    state = fold([submitted(spec(iterations=10**9))])
    for r in range(300):
        fold([started(r, 1), assignment(0, round_=r), finished(0, 10, round_=r)], state)
        if r % 2:
            state.apply(consolidated(r, {0: 10}, total=10 * (r // 2 + 1)))
        else:
            state.abandon("j1", r)
        sizes = state.sizes()
        assert sizes["open_rounds"] == 0 and sizes["round_index"] <= 20 and sizes["pending"] == 0
    assert state.consolidated_steps("j1") == 1500
    # late reports of pruned rounds change nothing and are not refused (they are merely late)
    assert not state.apply(finished(0, 10, round_=3)) and reasons(state) == []
    state.apply(cancelled("j1"))
    assert state.sizes()["jobs"] == 0 and state.sizes()["finished_jobs"] == 1
    assert not state.apply(assignment(0, round_=300)) and state.sizes()["open_rounds"] == 0


def cancelled(job: str) -> JobCancelled:
    return JobCancelled(ts=T0, source="cli", job_id=job)


def test_finished_jobs_are_remembered_up_to_a_bound() -> None:
    state = TrackerState(max_finished_jobs=50)
    for i in range(500):
        state.apply(cancelled(f"gone-{i}"))
    assert state.sizes()["finished_jobs"] == 50 and state.sizes()["jobs"] == 0


def test_remembered_event_ids_are_a_bounded_window() -> None:
    state = TrackerState(max_ids=64)
    fold([submitted(), started(0, 1), assignment(0)], state)
    event = progress(0, 5, job="ghost")
    state.apply(event)
    state.apply(event)                  # a redelivery: same id, not refused twice
    assert reasons(state) == ["unassigned"]
    for i in range(1_000):
        state.apply(progress(0, i % BUDGET))
    assert state.sizes()["remembered_ids"] == 64


def test_sizes_counts_what_the_state_holds() -> None:
    state = fold([submitted(), submitted(spec("j2")), started(0, 3), assignment(0), assignment(0, job=spec("j2"))])
    state.apply(finished(1, 10, node="n5"))
    sizes = state.sizes()
    assert (sizes["jobs"], sizes["open_rounds"], sizes["pending"]) == (2, 2, 1)
    assert sizes["round_index"] == 1 and sizes["finished_jobs"] == 0 and sizes["remembered_ids"] == 6


def test_no_event_refused_changes_the_iterations_or_steps_of_the_job() -> None:
    state = fold([submitted(SPEC), started(0, 1), assignment(0), finished(0, 100),
                  consolidated(0, {0: 100}, total=100)])
    for event in (consolidated(0, {0: 100}, total=100, weights={0: -3.0}), completed(1),
                  finished(0, 999, round_=0, node="n7"), progress(0, 10**9)):
        state.apply(event)
    assert state.consolidated_steps("j1") == 100 and state.iterations("j1") == 500


# ---------------------------------------------------------------- stateful: hostile input at random

JOBS = ("a", "b")
NODES = ("n0", "n1", "n2")


class HostileTracker(RuleBasedStateMachine):
    """Valid rounds for jobs a and b, delivered late and out of order, mixed with forged,
    misdirected, far-future, duplicated and extreme events. The placements (RoundStarted,
    Assignment) are the truth the tracker checks against; everything else may lie."""

    def __init__(self) -> None:
        super().__init__()
        self.state = TrackerState(max_pending=16, max_ids=64, max_finished_jobs=4)
        self.now = T0
        self.next_round = 0
        self.backlog: list[Event] = []                 # emitted, not yet delivered
        self.applied: list[Event] = []
        # (job, round, copy) -> node -> (ranks, budget): every Assignment planned / delivered so far
        self.planned: dict[tuple[str, int, int], dict[str, tuple[tuple[int, ...], int]]] = {}
        self.assigned: dict[tuple[str, int, int], dict[str, tuple[tuple[int, ...], int]]] = {}
        self.decided: dict[str, int] = {}
        for job in JOBS:
            self.deliver_now(submitted(spec(job, iterations=100)))

    def deliver_now(self, event: Event) -> None:
        self.state.apply(event)
        self.applied.append(event)
        if isinstance(event, Assignment):
            self.assigned.setdefault((event.job_id, event.round, event.copy), {})[event.node_id] = (
                event.ranks, event.step_budget)

    @rule(data=st.data())
    def plan_round(self, data: st.DataObject) -> None:
        r, self.next_round = self.next_round, self.next_round + 1
        at = self.now
        events = []
        for job in data.draw(st.lists(st.sampled_from(JOBS), unique=True, min_size=1, max_size=2)):
            for copy in range(data.draw(st.integers(1, 2))):
                nodes = data.draw(st.lists(st.sampled_from(NODES), unique=True, min_size=1, max_size=2))
                budget = data.draw(st.integers(0, 200))
                for rank, node in enumerate(nodes):
                    self.planned.setdefault((job, r, copy), {})[node] = ((rank,), budget)
                    events.append(Assignment(
                        ts=at, source="scheduler", round=r, job=spec(job, iterations=100), copy=copy,
                        node_id=node, gpus=(0,), gpu_type="V100", world_size=len(nodes), ranks=(rank,),
                        step_budget=budget, deadline=at + 360, rendezvous="n0:1" if len(nodes) > 1 else None))
        self.deliver_now(RoundStarted(ts=at, source="scheduler", round=r, policy="hadar", started_at=at,
                                      ends_at=at + 360, assignments=len(events)))
        self.backlog.extend(events)

    @precondition(lambda self: bool(self.backlog))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        for _ in range(data.draw(st.integers(1, len(self.backlog)))):
            self.deliver_now(self.backlog.pop(data.draw(st.integers(0, len(self.backlog) - 1))))

    @precondition(lambda self: bool(self.planned))
    @rule(data=st.data(), later=st.booleans())
    def report_honestly(self, data: st.DataObject, later: bool) -> None:
        """What the agents of a planned copy say, delivered now or later (maybe before its Assignment)."""
        recent = sorted(k for k in self.planned if k[1] >= self.next_round - 2)
        job, round_, copy = data.draw(st.sampled_from(recent or sorted(self.planned)))
        nodes = self.planned[(job, round_, copy)]
        status = data.draw(st.sampled_from(("ok", "ok", "preempted", "failed")))
        rank0 = next(n for n, (ranks, _) in nodes.items() if 0 in ranks)
        node = data.draw(st.sampled_from(sorted(nodes))) if status == "failed" else rank0
        budget = max(b for _, b in nodes.values())
        event = finished(copy, data.draw(st.integers(0, budget)), round_=round_, status=status, job=job, node=node)
        if data.draw(st.booleans()):
            self.deliver_now(progress(copy, event.steps_round, round_=round_, job=job, node=rank0))
        if later:
            self.backlog.append(event)
        else:
            self.deliver_now(event)

    @rule(data=st.data(), kind=st.sampled_from(("report", "progress", "model", "completion")))
    def forge(self, data: st.DataObject, kind: str) -> None:
        """An event that lies: about its key, node, steps, round, job, weights or copies."""
        getattr(self, f"forge_{kind}")(data)

    def forge_report(self, data: st.DataObject) -> None:
        later = data.draw(st.booleans())
        known = sorted(self.assigned)
        if known and data.draw(st.booleans()):
            job, round_, copy = data.draw(st.sampled_from(known))
        else:
            job = data.draw(st.sampled_from((*JOBS, "ghost")))
            round_ = data.draw(st.sampled_from((0, 1, self.next_round, self.next_round + 2, self.next_round + 5,
                                                2**62)))
            copy = data.draw(st.integers(0, 3))
        node = data.draw(st.sampled_from(NODES))
        status = data.draw(st.sampled_from(("ok", "preempted", "failed")))
        steps = data.draw(st.one_of(st.integers(0, 250), st.just(2**64 - 1)))
        other = NODES[(NODES.index(node) + 1) % len(NODES)]
        key = data.draw(st.sampled_from(("", None, final_key("a"), checkpoint_key(job, round_, copy + 1, node=node),
                                         checkpoint_key(job, round_, copy, node=other), model_key(job, round_))))
        if key is None and status != "failed":
            key = ""
        event = finished(copy, steps, round_=round_, status=status, job=job, node=node, checkpoint=key)
        if later:
            self.backlog.append(event)
        else:
            self.deliver_now(event)

    def forge_progress(self, data: st.DataObject) -> None:
        job = data.draw(st.sampled_from((*JOBS, "ghost")))
        self.deliver_now(progress(data.draw(st.integers(0, 3)), data.draw(st.integers(0, 10**6)),
                                  round_=data.draw(st.integers(0, self.next_round + 3)), job=job,
                                  node=data.draw(st.sampled_from(NODES))))

    def forge_model(self, data: st.DataObject) -> None:
        job = data.draw(st.sampled_from((*JOBS, "ghost")))
        round_ = data.draw(st.sampled_from((0, self.next_round, self.next_round + 1, 2**62)))
        copies = data.draw(st.dictionaries(st.integers(0, 3), st.integers(0, 300), max_size=3))
        weights = data.draw(st.one_of(st.none(), st.dictionaries(
            st.integers(0, 3), st.floats(-1e308, 1e308), max_size=3)))
        key = data.draw(st.sampled_from((None, final_key(job), model_key(job, round_ + 1))))
        self.deliver_now(consolidated(round_, copies, total=sum(copies.values()), job=job, key=key,
                                      weights=weights))

    def forge_completion(self, data: st.DataObject) -> None:
        job = data.draw(st.sampled_from((*JOBS, "ghost")))
        key = data.draw(st.sampled_from((None, "models/a/0.safetensors", "models/ghost/final.safetensors")))
        self.deliver_now(completed(data.draw(st.integers(0, 2**64 - 1)), job=job, key=key))

    @precondition(lambda self: bool(self.applied))
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        self.deliver_now(data.draw(st.sampled_from(self.applied)))

    @rule(job=st.sampled_from(JOBS), dice=st.integers(0, 9))
    def cancel(self, job: str, dice: int) -> None:
        if dice == 0:     # rarely: a cancelled job takes no further part
            self.deliver_now(cancelled(job))

    @rule(seconds=st.sampled_from((0.0, 30.0, 200.0, 450.0, 5_000.0)), consolidate=st.booleans())
    def decide(self, seconds: float, consolidate: bool) -> None:
        """What the service does with due work: announce a model of the usable copies, or abandon."""
        self.now += seconds
        for work in self.state.due_rounds(self.now, timeout_s=60):
            if consolidate and work.usable:
                whole = sum(c.steps for c in work.usable)
                event = ModelConsolidated(
                    ts=self.now, source="tracker", job_id=work.job_id, round=work.round,
                    key=model_key(work.job_id, work.round), total_steps=work.prior_steps + whole,
                    copies=tuple(CopyWeight(copy=c.copy, steps=c.steps,
                                            weight=c.steps / whole if whole else 1 / len(work.usable))
                                 for c in work.usable))
                assert self.state.check_announcement(event) is None
                self.deliver_now(event)
            else:
                self.state.abandon(work.job_id, work.round)
            self.decided[work.job_id] = max(self.decided.get(work.job_id, -1), work.round)
        for done in self.state.due_completions():
            event = completed(done.total_steps, job=done.job_id, at=self.now)
            assert self.state.check_announcement(event) is None
            self.deliver_now(event)

    @invariant()
    def due_work_holds_only_assigned_copies_within_their_budgets(self) -> None:
        for work in self.state.due_rounds(self.now + 10_000, timeout_s=60):
            assert work.round > self.decided.get(work.job_id, -1), "rounds come due in order"
            for copy in (*work.usable, *work.failed):
                nodes = self.assigned.get((work.job_id, work.round, copy.copy))
                assert nodes is not None and copy.node_id in nodes, (work, copy)
                assert copy.steps <= copy.budget <= max(b for _, b in nodes.values())
            for copy in work.usable:
                assert 0 in nodes_of(self.assigned, work, copy.copy)[copy.node_id][0]
                assert copy.checkpoint == checkpoint_key(work.job_id, work.round, copy.copy, node=copy.node_id)

    @invariant()
    def the_state_stays_within_its_bounds(self) -> None:
        sizes = self.state.sizes()
        assert sizes["pending"] <= 16 and sizes["remembered_ids"] <= 64 and sizes["finished_jobs"] <= 4
        assert sizes["round_index"] <= self.next_round + 1


def nodes_of(assigned: dict[tuple[str, int, int], dict[str, tuple[tuple[int, ...], int]]],
             work: DueRound, copy: int) -> dict[str, tuple[tuple[int, ...], int]]:
    return assigned[(work.job_id, work.round, copy)]


HostileTracker.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_hostile_tracker_state_machine = HostileTracker.TestCase
