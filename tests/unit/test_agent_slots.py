"""The warm worker slot rules (services/agent/slots.py): pure, no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.agent.protocol import StoreTarget, WorkerSpec
from services.agent.slots import (
    EMPTY,
    Slot,
    SlotBusy,
    on_assign,
    on_assign_copy,
    on_copy_done,
    on_done,
    stale_peers,
    warm_key,
)

SPEC = WorkerSpec(job_id="j1", round=3, copy=0, node_id="n1", gpu_type="v100", model="resnet", dataset="digits",
                  batch_size=32, optimizer="sgd", lr=0.05, seed=7, rank=0, world_size=1, rendezvous=None,
                  device="cpu", step_budget=100, deadline=1e9, start_from=None,
                  checkpoint="checkpoints/j1/3/n1/0.safetensors", store=StoreTarget.local("/tmp/x"),
                  env={"CUDA_VISIBLE_DEVICES": "0"})


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


def ddp(rank: int, *, node: str = "n1", gpus: tuple[int, ...] = (0, 1), ranks: tuple[int, ...] = (0, 1),
        peers: tuple[str, ...] = ("n1", "n1"), **change: object) -> WorkerSpec:
    """Rank ``rank`` of a DDP copy; by default both ranks of a 2-rank copy on node n1."""
    return replace(SPEC, node_id=node, rank=rank, world_size=len(peers), rendezvous="127.0.0.1:29500",
                   local_gpus=gpus, local_ranks=ranks, peers=peers, **change)


def kept(specs: list[WorkerSpec]) -> list[Slot]:
    """The copy's slots after a first round that ended cleanly."""
    first = on_assign_copy([EMPTY] * len(specs), [warm_key(s) for s in specs])
    return [d.slot for d in on_copy_done([d.slot for d in first], reported=[True] * len(specs),
                                         alive=[True] * len(specs))]


def test_a_ddp_copy_with_the_same_rank_set_next_round_reuses_every_rank() -> None:
    slots = kept([ddp(0), ddp(1)])
    assert [s.state for s in slots] == ["idle", "idle"]
    # next round: another round, copy, budget, deadline, start model -- and a new rendezvous port
    later = [replace(ddp(r), round=4, copy=2, step_budget=7, deadline=2e9, start_from="models/j1/3",
                     rendezvous="127.0.0.1:31000") for r in (0, 1)]
    again = on_assign_copy(slots, [warm_key(s) for s in later])
    assert [(d.action, d.slot.generation, d.slot.specs) for d in again] == [("reuse", 1, 2)] * 2


@pytest.mark.parametrize(("next_round", "reason"), [
    ([SPEC], "world size changed (2 -> 1)"),   # one rank next round: no rendezvous
    ([ddp(0, peers=("n1", "n1", "n1")), ddp(1, peers=("n1", "n1", "n1"))], "world size changed (2 -> 3)"),
    ([ddp(1, gpus=(0, 1), ranks=(1, 0)), ddp(0, gpus=(0, 1), ranks=(1, 0))],
     "rank set changed (rank 0 -> 1, (gpu, rank) here [(0, 0), (1, 1)] -> [(0, 1), (1, 0)])"),
    ([ddp(0, job_id="j2"), ddp(1, job_id="j2")], "job changed (j1 -> j2)"),
])
def test_a_changed_rank_set_or_job_respawns_the_copy(next_round: list, reason: str) -> None:
    slots = kept([ddp(0), ddp(1)])[:len(next_round)]
    decisions = on_assign_copy(slots, [warm_key(s) for s in next_round])
    assert decisions[0].action == "respawn" and decisions[0].reason == reason
    assert all(d.action == "respawn" and d.slot.generation == 2 for d in decisions)


def test_a_spanning_copy_is_bound_to_its_peers_and_unknown_peers_are_never_warm() -> None:
    here = [ddp(2, node="n2", gpus=(0,), ranks=(2,), peers=("n1", "n1", "n2"))]
    slots = kept(here)
    assert slots[0].state == "idle"
    same = on_assign_copy(slots, [warm_key(replace(here[0], round=9))])
    assert same[0].action == "reuse"
    moved = warm_key(ddp(2, node="n2", gpus=(0,), ranks=(2,), peers=("n3", "n3", "n2")))
    decision = on_assign_copy(slots, [moved])[0]
    assert (decision.action, decision.reason) == ("respawn", "peers changed (['n1', 'n1', 'n2'] -> ['n3', 'n3', 'n2'])")
    # an Assignment that does not name the peers: the worker runs one spec and exits, as before
    unknown = replace(SPEC, node_id="n2", rank=2, world_size=3, rendezvous="n1:29500", local_gpus=(0,),
                      local_ranks=(2,), peers=())
    assert warm_key(unknown) is None
    assert warm_key(replace(unknown, peers=("n1", "n1", "n1"))) is None   # peers that leave this node out
    assert warm_key(replace(SPEC, world_size=2, rank=1, rendezvous="h:29500")) is None
    done = on_copy_done([on_assign(EMPTY, None).slot], reported=[True], alive=[False])[0]
    assert (done.slot.state, done.crashed) == ("empty", False)   # a one-shot worker exits: no crash
    idle = on_done(on_assign(EMPTY, warm_key(SPEC)).slot, reported=True, alive=True).slot
    assert on_assign(idle, None).action == "respawn"


def test_a_peer_rank_that_must_be_replaced_takes_the_others_with_it() -> None:
    slots = kept([ddp(0), ddp(1)])
    slots[1] = Slot(generation=slots[1].generation)   # rank 1's process died while idle
    decisions = on_assign_copy(slots, [warm_key(ddp(0)), warm_key(ddp(1))])
    assert [(d.action, d.reason) for d in decisions] == [
        ("respawn", "a peer rank needs a new process (a group cannot be rejoined)"), ("spawn", "slot was empty")]
    assert all(d.slot.state == "busy" and d.slot.specs == 1 for d in decisions)


def test_replacing_one_rank_of_a_kept_group_retires_its_idle_peers_here() -> None:
    pair = kept([ddp(0), ddp(1)])
    single = kept([SPEC])[0]
    slots = {0: pair[0], 1: pair[1], 2: single}
    # next round the copy runs on GPU 1 alone: GPU 0's process is left in a group that lost a member
    assert stale_peers(slots, [1]) == [0]
    assert stale_peers(slots, [0, 1]) == []          # both replaced already
    assert stale_peers(slots, [2]) == []             # a single-rank process has no group
    other_job = kept([ddp(0, job_id="j2"), ddp(1, job_id="j2")])
    assert stale_peers({0: other_job[0], 1: pair[1]}, [1]) == []   # GPU 0 holds another group
    busy = on_assign(pair[0], pair[0].key).slot
    assert stale_peers({0: busy, 1: pair[1]}, [1]) == []             # only idle processes are retired here


@pytest.mark.parametrize(("reported", "alive"), [([True, False], [True, False]), ([True, False], [True, True]),
                                                 ([False, True], [True, True])])
def test_a_crashed_rank_tears_down_its_peers_and_the_copy_respawns(reported: list, alive: list) -> None:
    busy = [d.slot for d in on_assign_copy(kept([ddp(0), ddp(1)]), [warm_key(ddp(0)), warm_key(ddp(1))])]
    done = on_copy_done(busy, reported=reported, alive=alive)
    assert all(d.slot.state == "empty" and d.slot.key is None for d in done)
    assert [d.crashed for d in done] == [not r for r in reported]
    assert [d.torn_down for d in done] == reported   # the rank that ended cleanly is ended by the shell
    again = on_assign_copy([d.slot for d in done], [warm_key(ddp(0)), warm_key(ddp(1))])
    assert [(d.action, d.slot.generation) for d in again] == [("spawn", 2), ("spawn", 2)]


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
