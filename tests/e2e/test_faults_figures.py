"""The fault benchmark's new figures and its misses, without servers (issue 28 item 5):
acknowledged records are journaled at ack time and looked up in what is read back; a
superseded scheduler's late records are counted; a fault that finds nothing to hit raises
:class:`Miss` and is reported as a miss with its reason, never as "0/2 jobs"."""

from __future__ import annotations

import time

import pytest

from benchmarks.fault_acks import (
    Ack,
    Journal,
    acked_lost,
    close_journal,
    fencing_violations,
    open_journal,
    read_acks,
    term_regressions,
)
from benchmarks.fault_harness import Cluster, Miss, Workload
from benchmarks.fault_replicated import acks_between, first_ack_after, held_between
from benchmarks.fault_report import meets_targets, table
from benchmarks.fault_scenarios import at_deadline, standby_kill, tracker_kill_consolidating
from shared.bus.base import Bus
from shared.bus.memory import MemoryBus
from shared.domain.layout import checkpoint_key, final_key, model_key
from shared.wire.events import (
    Assignment,
    CopyFinished,
    CopyWeight,
    JobCancelled,
    JobCompleted,
    JobSpec,
    ModelConsolidated,
)

SPEC = JobSpec(job_id="j", user="u", model="resnet", dataset="digits", batch_size=32, workers=1, iterations=100)


async def test_every_acknowledged_publish_is_journaled_with_its_place_and_the_bus_is_unwrapped_after(tmp_path):
    original = Bus.publish_pipelined
    open_journal(tmp_path / "acks" / "svc.1.jsonl")
    try:
        bus = MemoryBus()
        await bus.start()
        events = [JobCancelled(ts=1.0, source="t", job_id=f"j{i}") for i in range(3)]
        placed = [await bus.publish(e) for e in events]
        pending = await bus.publish_pipelined(JobCancelled(ts=1.0, source="t", job_id="never-awaited"))
        acks = read_acks(tmp_path / "acks")
        await pending   # acknowledged only now: journaled only now
        await bus.stop()
    finally:
        close_journal()
    assert Bus.publish_pipelined is original
    assert [(a.writer, a.id, a.topic, (a.partition, a.offset), a.created) for a in acks] == [
        ("svc.1", e.id, "hadar.jobs", p, 1.0) for e, p in zip(events, placed)]
    assert len(read_acks(tmp_path / "acks")) == 4


def test_an_acknowledged_id_missing_from_the_topics_read_back_is_lost(tmp_path):
    journal = Journal(tmp_path / "agent.1.jsonl")
    journal.record([("a", "hadar.progress", 0, 1, 0.5), ("b", "hadar.progress", 0, 2, 0.5)])
    journal.close()
    (tmp_path / "agent.1.jsonl").open("a").write('{"id": "torn')   # a line cut short by SIGKILL
    acks = read_acks(tmp_path)
    assert acked_lost(acks, ["a", "b", "c"]) == 0
    assert acked_lost(acks, ["a"]) == 1
    assert acked_lost(acks, []) == 2


def _ack(writer: str, offset: int, at: float, topic: str = "hadar.placements", partition: int = 0,
         created: float = 0.0) -> Ack:
    return Ack(writer=writer, id=f"{writer}-{topic}-{offset}", topic=topic, partition=partition, offset=offset, at=at,
               created=created)


def test_a_superseded_scheduler_publishing_after_its_successor_is_a_fencing_violation():
    acks = [_ack("scheduler.1", 10, 1.0), _ack("scheduler-b.1", 11, 2.0), _ack("scheduler-b.1", 12, 3.0)]
    assert fencing_violations(acks, "scheduler.1", "scheduler-b.1") == 0
    late = [*acks, _ack("scheduler.1", 13, 4.0), _ack("scheduler.1", 5, 4.0, partition=1),
            _ack("scheduler.1", 20, 4.0, topic="hadar.deadletter")]
    assert fencing_violations(late, "scheduler.1", "scheduler-b.1") == 1
    assert term_regressions([(0, 1, 1), (0, 2, 2), (0, 3, 2)]) == 0
    assert term_regressions([(0, 1, 1), (0, 2, 2), (0, 3, 1)]) == 1


def test_writes_resumed_and_acks_in_a_window_come_from_the_services_journals():
    acks = [_ack("harness", 1, 10.5), _ack("agent-f-t4.1", 2, 12.0, topic="hadar.progress"),
            _ack("scheduler.1", 3, 15.0)]
    assert first_ack_after(acks, 10.0, None) == 2.0                       # the harness's own acks do not count
    assert first_ack_after(acks, 10.0, frozenset({("hadar.placements", 0)})) == 5.0
    assert first_ack_after(acks, 20.0, None) is None
    assert acks_between(acks, 11.0, 14.0) == 1
    # made while two brokers of three were down (10-20), acknowledged once one was back
    held = [_ack("agent-f-t4.1", 4, 21.0, created=12.0), _ack("agent-f-t4.1", 5, 21.0, created=20.5),
            _ack("harness", 6, 21.0, created=12.0)]
    assert held_between([*acks, *held], 10.0, 20.0) == 1


def _cluster(tmp_path, records: list) -> Cluster:
    c = Cluster(tmp_path, Workload(round_s=1.0))
    c.job_ids = ["j"]
    c.log = lambda: list(records)   # type: ignore[method-assign]
    return c


def _model(r: int, ts: float) -> tuple:
    return ("m", ModelConsolidated(ts=ts, source="t", job_id="j", round=r, key=model_key("j", r), total_steps=10 * r,
                                   copies=(CopyWeight(copy=0, steps=10, weight=1.0),)))


def _assign(r: int, deadline: float) -> tuple:
    return ("p", Assignment(ts=1.0, source="s", round=r, job=SPEC, copy=0, node_id="n", gpus=(0,), gpu_type="t4",
                            world_size=1, ranks=(0,), step_budget=50, deadline=deadline))


DONE = ("m", JobCompleted(ts=5.0, source="t", job_id="j", final_key=final_key("j"), total_steps=100, jct_s=4.0,
                          completed_at=5.0))


def test_a_fault_whose_jobs_all_completed_first_is_a_miss_not_a_timeout(tmp_path):
    c = _cluster(tmp_path, [_model(1, 2.0), DONE])
    began = time.monotonic()
    with pytest.raises(Miss, match="every job completed first"):
        tracker_kill_consolidating(c, 30.0)
    with pytest.raises(Miss, match="every job completed first"):
        standby_kill(c, 30.0)
    assert time.monotonic() - began < 10   # not the scenario's timeout
    assert c.strikes == []                 # nothing was struck


def test_a_moment_that_never_comes_is_a_miss_with_its_reason(tmp_path):
    c = _cluster(tmp_path, [])   # no model ever, no job done
    with pytest.raises(Miss, match="not reached in 1 s"):
        c.wait_mid_work(c.mid_work, "a round consolidated", timeout_s=1.0, poll_s=0.2)


def test_a_deadline_timed_fault_strikes_just_after_a_running_jobs_deadline(tmp_path):
    deadline = time.time() + 1.5
    c = _cluster(tmp_path, [_model(1, time.time()), _assign(1, deadline - 10), _assign(2, deadline)])
    assert at_deadline(c, 10.0, after_s=0.2, look_s=1.0) == ("j", 2)
    assert deadline + 0.2 <= time.time() < deadline + 2.0


def test_a_round_whose_copies_already_finished_is_passed_over_for_the_next(tmp_path):
    now = time.time()
    finished = ("g", CopyFinished(ts=now, source="a", job_id="j", round=2, copy=0, node_id="n", status="ok",
                                  steps_round=10, checkpoint=checkpoint_key("j", 2, 0, node="n")))
    c = _cluster(tmp_path, [_model(1, now), _assign(2, now + 1.0), finished, _assign(3, now + 2.0)])
    assert at_deadline(c, 10.0, after_s=0.2, look_s=0.5) == ("j", 3)
    assert time.time() >= now + 2.2


def _figures(**changes) -> dict:
    good = {"jobs_completed": 2, "jobs_total": 2, "models_verified": 5, "models_total": 5, "events_lost": 0,
            "acked_records_lost": 0, "service_crashes": 0, "rounds_lost_max": 1, "recovery_s": 3.0, "faults": 1,
            "done_before_fault": 1, "miss": None, "round_s": 15.0}
    return {**good, **changes}


def test_a_miss_an_error_and_each_new_target_fail_and_are_spelled_out():
    assert meets_targets(_figures())
    assert not meets_targets(_figures(acked_records_lost=1))
    assert not meets_targets(_figures(acked_records_lost=None))          # nothing read back: not known to be 0
    assert not meets_targets(_figures(fencing_violations=1))
    assert not meets_targets(_figures(takeover_s=[31.0]))                 # beyond two round lengths
    assert meets_targets(_figures(takeover_s=[29.0]))
    assert not meets_targets(_figures(notes={"acked_while_minority": 2}))
    assert not meets_targets(_figures(notes={"writes_resumed_s": None}))
    missed = _figures(miss="tracker_kill: every job completed first", faults=0)
    assert not meets_targets(missed)
    error = {"jobs_completed": None, "jobs_total": 2, "error": "InfraError: no broker"}
    assert not meets_targets(error)
    shown = table({"tracker_kill": missed, "kafka_outage": error}).splitlines()
    assert "MISS: tracker_kill: every job completed first" in shown[1] and "2/2" in shown[1]
    assert "ERROR: InfraError: no broker" in shown[2] and "0/2" not in shown[2] and " - " in shown[2]
