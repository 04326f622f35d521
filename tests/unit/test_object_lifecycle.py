"""The object lifecycle's rules, pure: which keys may go after which events (services/tracker/lifecycle.py)."""

from __future__ import annotations

from dataclasses import replace

from services.tracker.lifecycle import MAX_JOBS_PER_SWEEP, ObjectLifecycle
from shared.domain.layout import checkpoint_key, final_key, model_key, optim_key
from shared.wire.events import JobCancelled, RoundAbandoned
from tests.unit.tracker_events import T0, assignment, completed, consolidated

NODE = "n1"   # where tracker_events.assignment places every copy: the node that writes its checkpoints
CK = [checkpoint_key("j1", r, c, node=NODE) for r in range(6) for c in range(2)]
MODELS = [model_key("j1", r) for r in range(6)] + [final_key("j1")]
ALL = CK + MODELS + [checkpoint_key("j2", 0, 0, node=NODE), model_key("j2", 0), "checkpoints/j1/0/notes.txt"]


def doomed(life: ObjectLifecycle) -> set[str]:
    return {key for key, _ in life.doomed("j1", ALL)}


def decide(life: ObjectLifecycle, *rounds: int) -> None:
    for r in rounds:
        life.observe(consolidated(r, {0: 10}, total=10 * (r + 1)), 0.0)


def test_nothing_goes_before_a_round_is_decided() -> None:
    life = ObjectLifecycle()
    life.observe(assignment(0, round_=0), 0.0)
    assert doomed(life) == set() and life.due(10.0) == []


def test_checkpoints_of_decided_rounds_and_models_older_than_the_last_k_go() -> None:
    life = ObjectLifecycle(keep_round_models=2)
    decide(life, 0, 1, 2, 3)
    assert life.due(0.0) == ["j1"]
    assert doomed(life) == {checkpoint_key("j1", r, c, node=NODE) for r in range(4) for c in range(2)} | {
        model_key("j1", 0), model_key("j1", 1)}


def test_an_abandoned_round_decides_its_checkpoints_but_keeps_the_models() -> None:
    life = ObjectLifecycle(keep_round_models=1)
    decide(life, 0)
    life.observe(RoundAbandoned(ts=T0, source="tracker", job_id="j1", round=1, reason="no usable replica"), 0.0)
    assert doomed(life) == {checkpoint_key("j1", r, c, node=NODE) for r in range(2) for c in range(2)}


def test_a_model_or_checkpoint_an_open_round_starts_from_is_kept() -> None:
    life = ObjectLifecycle(keep_round_models=1)
    life.observe(replace(assignment(0, round_=3), start_from=model_key("j1", 0)), 0.0)
    life.observe(replace(assignment(1, round_=3), start_from=checkpoint_key("j1", 1, 1, node=NODE)), 0.0)
    decide(life, 0, 1, 2)
    assert {model_key("j1", 0), checkpoint_key("j1", 1, 1, node=NODE)}.isdisjoint(doomed(life))
    assert {model_key("j1", 1), checkpoint_key("j1", 1, 0, node=NODE)} <= doomed(life)
    decide(life, 3)   # round 3 decided: its starts are not needed any more
    assert {model_key("j1", 0), checkpoint_key("j1", 1, 1, node=NODE)} <= doomed(life)


def test_a_completed_job_keeps_only_its_final_model() -> None:
    life = ObjectLifecycle(keep_round_models=3)
    decide(life, 0, 1)
    life.observe(completed(20), 0.0)
    assert doomed(life) == set(CK) | set(MODELS[:-1])
    kept = ObjectLifecycle(keep_round_models=1, delete_completed_models=False, delete_checkpoints=False)
    decide(kept, 0, 1)
    kept.observe(completed(20), 0.0)
    assert doomed(kept) == {model_key("j1", 0)}


def test_a_completed_job_is_swept_once_more_after_the_grace_then_forgotten() -> None:
    life = ObjectLifecycle(straggler_sweep_s=100.0)
    decide(life, 0)
    life.observe(completed(10), 5.0)
    assert life.swept("j1", 6.0, ok=True, begun=life.begin("j1"))
    assert life.due(50.0) == [] and life.due(106.0) == ["j1"]
    life.swept("j1", 106.0, ok=True, begun=life.begin("j1"))
    assert len(life) == 0 and doomed(life) == set()


def test_a_cancelled_job_keeps_its_latest_models_and_is_forgotten_after_one_sweep() -> None:
    life = ObjectLifecycle(keep_round_models=2)
    decide(life, 0, 1, 2)
    life.observe(JobCancelled(ts=T0, source="cli", job_id="j1"), 0.0)
    assert {model_key("j1", 1), model_key("j1", 2)}.isdisjoint(doomed(life))
    life.swept("j1", 1.0, ok=True, begun=life.begin("j1"))
    assert len(life) == 0


def test_failures_back_off_and_give_up_until_the_next_decision() -> None:
    life = ObjectLifecycle(base_s=1.0, max_s=4.0, max_attempts=4)
    decide(life, 0)
    delays = []
    now = 0.0
    for _ in range(3):
        assert life.swept("j1", now, ok=False, begun=life.begin("j1"))
        (due_s,) = [s for s in [life._jobs["j1"].due_s] if s is not None]
        delays.append(due_s - now)
        now = due_s
    assert delays == [1.0, 2.0, 4.0]
    assert not life.swept("j1", now, ok=False, begun=life.begin("j1"))      # the 4th failure in a row: given up
    assert life.due(now + 1e6) == []
    decide(life, 1)                                  # the next decision tries again
    assert life.due(now) == ["j1"]


def test_a_sweep_takes_a_bounded_number_of_jobs() -> None:
    life = ObjectLifecycle()
    for n in range(3 * MAX_JOBS_PER_SWEEP):
        life.observe(consolidated(0, {0: 10}, total=10, job=f"job{n}"), float(n))
    assert life.due(1e9) == [f"job{n}" for n in range(MAX_JOBS_PER_SWEEP)]


def test_nothing_goes_unless_the_model_the_rules_rely_on_is_stored() -> None:
    life = ObjectLifecycle(keep_round_models=1)
    decide(life, 0, 1, 2)   # e.g. a well-formed but false ModelConsolidated of round 2
    assert life.required("j1") == model_key("j1", 2)
    assert life.doomed("j1", [k for k in ALL if k != model_key("j1", 2)]) == []
    life.observe(completed(30), 0.0)   # completed, but no final model stored
    assert life.required("j1") == final_key("j1")
    assert life.doomed("j1", [k for k in ALL if k != final_key("j1")]) == []
    assert final_key("j1") not in doomed(life) and len(doomed(life)) == len(ALL) - 4   # j2's, notes, final


def test_a_round_models_optimizer_state_goes_and_stays_with_its_model() -> None:
    optim = [optim_key("j1", r) for r in range(6)]
    life = ObjectLifecycle(keep_round_models=2)
    life.observe(replace(assignment(0, round_=4), start_from=model_key("j1", 0)), 0.0)
    decide(life, 0, 1, 2, 3)
    gone = {key for key, _ in life.doomed("j1", ALL + optim)}
    assert optim_key("j1", 1) in gone and model_key("j1", 1) in gone
    # round 0's model is what an open round starts from: its optimizer state is kept with it
    assert {optim_key("j1", 0), model_key("j1", 0), optim_key("j1", 2), optim_key("j1", 3)}.isdisjoint(gone)
    assert {kind for key, kind in life.doomed("j1", ALL + optim) if key in optim} == {"model"}


def test_a_decision_that_arrives_during_a_sweep_is_swept_again_at_once() -> None:
    # The race CI caught (test_a_completed_job_keeps_only_its_final_model): the sweep of round
    # 2's model listed the store, JobCompleted arrived while it ran, and the sweep's end then
    # put the completed job's sweep 600 s away, so its checkpoints and models stayed.
    life = ObjectLifecycle(straggler_sweep_s=600.0)
    decide(life, 0, 1, 2)
    begun = life.begin("j1")             # the janitor lists the job's objects...
    life.observe(completed(30), 1.0)     # ... and the job completes before it is done
    assert life.swept("j1", 2.0, ok=True, begun=begun)
    assert life.due(2.0) == ["j1"]
    life.swept("j1", 2.0, ok=True, begun=life.begin("j1"))
    assert life.due(2.0) == [] and life.due(602.0) == ["j1"]   # then once more after the grace
