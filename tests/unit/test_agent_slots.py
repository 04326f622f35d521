"""The warm worker slot rules (services/agent/slots.py): pure, no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.agent.slots import EMPTY, Slot, SlotBusy, on_assign, on_done, warm_key
from services.agent.spec import StoreTarget, WorkerSpec

SPEC = WorkerSpec(job_id="j1", round=3, copy=0, node_id="n1", gpu_type="v100", model="resnet", dataset="digits",
                  batch_size=32, optimizer="sgd", lr=0.05, seed=7, rank=0, world_size=1, rendezvous=None,
                  device="cpu", step_budget=100, deadline=1e9, start_from=None, checkpoint="checkpoints/j1/3/0",
                  store=StoreTarget.local("/tmp/x"), env={"CUDA_VISIBLE_DEVICES": "0"})


def test_first_use_spawns_and_the_same_job_next_round_reuses_the_process() -> None:
    key = warm_key(SPEC)
    first = on_assign(EMPTY, key)
    assert (first.action, first.reason, first.slot.state, first.slot.generation) == ("spawn", "first use", "busy", 1)
    idle = on_done(first.slot, reported=True, alive=True)
    assert (idle.slot.state, idle.crashed) == ("idle", False)
    # next round: another round number, copy, budget, deadline and start model -- same process
    later = warm_key(replace(SPEC, round=4, copy=1, step_budget=7, deadline=2e9, start_from="models/j1/3"))
    again = on_assign(idle.slot, later)
    assert (again.action, again.slot.generation, again.slot.specs) == ("reuse", 1, 2)


@pytest.mark.parametrize(("change", "reason"), [
    ({"job_id": "j2"}, "job changed (j1 -> j2)"),
    ({"model": "lstm", "dataset": "synthetic-text"}, "model changed (resnet/digits -> lstm/synthetic-text)"),
    ({"lr": 0.1}, "job settings changed"),
    ({"env": {"CUDA_VISIBLE_DEVICES": "1"}}, "job settings changed"),
])
def test_another_job_or_model_respawns(change: dict, reason: str) -> None:
    idle = on_done(on_assign(EMPTY, warm_key(SPEC)).slot, reported=True, alive=True).slot
    decision = on_assign(idle, warm_key(replace(SPEC, **change)))
    assert (decision.action, decision.reason, decision.slot.generation, decision.slot.specs) == \
        ("respawn", reason, 2, 1)


def test_a_copy_with_a_rendezvous_is_never_kept_warm() -> None:
    ddp = replace(SPEC, world_size=2, rendezvous="127.0.0.1:29500")
    assert warm_key(ddp) is None
    busy = on_assign(EMPTY, None).slot
    done = on_done(busy, reported=True, alive=False)
    assert (done.slot.state, done.crashed) == ("empty", False)   # a one-shot worker exits: no crash
    idle = on_done(on_assign(EMPTY, warm_key(SPEC)).slot, reported=True, alive=True).slot
    assert on_assign(idle, None).action == "respawn"


@pytest.mark.parametrize(("reported", "alive"), [(False, False), (False, True)])
def test_a_crash_empties_the_slot_and_is_reported(reported: bool, alive: bool) -> None:
    busy = on_assign(EMPTY, warm_key(SPEC)).slot
    done = on_done(busy, reported=reported, alive=alive)
    assert (done.slot.state, done.slot.key, done.crashed) == ("empty", None, True)
    respawn = on_assign(done.slot, warm_key(SPEC))
    assert (respawn.action, respawn.reason, respawn.slot.generation) == ("spawn", "slot was empty", 2)


def test_a_warm_worker_that_reported_but_exited_is_not_reused() -> None:
    done = on_done(on_assign(EMPTY, warm_key(SPEC)).slot, reported=True, alive=False)
    assert (done.slot.state, done.crashed) == ("empty", False)
    assert on_assign(done.slot, warm_key(SPEC)).action == "spawn"


def test_a_busy_slot_takes_no_second_spec() -> None:
    with pytest.raises(SlotBusy):
        on_assign(on_assign(EMPTY, warm_key(SPEC)).slot, warm_key(SPEC))


JOBS = st.sampled_from(["j1", "j2"])
EVENTS = st.lists(st.tuples(st.sampled_from(["assign", "done"]), JOBS, st.booleans(), st.booleans()), max_size=40)


@given(EVENTS)
def test_reuse_only_of_a_live_clean_process_bound_to_the_same_key(events: list) -> None:
    """Model: a process is reused iff the previous spec on the slot had the same key and
    ended with a clean report while the process stayed alive; generation counts spawns."""
    slot, spawned, last = EMPTY, 0, None   # last: key of a live, cleanly finished process
    for kind, job, reported, alive in events:
        key = warm_key(replace(SPEC, job_id=job))
        if kind == "assign":
            if slot.state == "busy":
                with pytest.raises(SlotBusy):
                    on_assign(slot, key)
                continue
            decision = on_assign(slot, key)
            assert (decision.action == "reuse") == (last == key)
            spawned += decision.action != "reuse"
            slot = decision.slot
            assert slot.generation == spawned and slot.state == "busy"
        else:
            was_busy = slot.state == "busy"
            done = on_done(slot, reported=reported, alive=alive)
            if was_busy:
                last = slot.key if reported and alive else None
                assert done.crashed == (not reported)
            slot = done.slot
        assert isinstance(slot, Slot) and (slot.state == "empty") == (slot.key is None)
