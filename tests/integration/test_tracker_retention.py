"""A tracker restarted from its snapshot after retention deleted the old segments of its input
topics ends in the state an uninterrupted tracker reaches (issue 13 item 2), on a real broker.

Rounds 0..OLD_ROUNDS-1 of jobs A and B happen "ten days ago" (the bus's fake clock stamps the
records), each decided round snapshotted. The tracker stops; its input topics get one day of
retention; ten days later the next round is published while it is down (a third job, C, is
submitted, so hadar.jobs rolls too), and the broker deletes every old segment of hadar.jobs,
hadar.placements and hadar.progress: A's and B's submissions, the old rounds and reports.
A restart from the whole log would no longer know A or B. Restarted from the snapshot, it
decides the waiting round and the next, completes A, and must announce, store and credit
exactly what one tracker that never stopped does on a MemoryBus with the same script
(hadar.models keeps its old segment until the restarted tracker's own announcements roll it;
the snapshot's offsets skip it either way).

The broker is this module's own, in a private run directory that checks retention every
500 ms (see tests/integration/test_topic_retention.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load, save

from services.tracker.service import INPUT_TOPICS, TrackerConfig, TrackerService
from shared.bus import Bus, KafkaBus, MemoryBus
from shared.clock import FakeClock
from shared.domain.layout import final_key, model_key
from shared.store import LocalStore, ObjectStore
from shared.wire.events import JobSubmitted, RoundStarted
from shared.wire.topics import JOBS, MODELS, PLACEMENTS, PROGRESS
from tests.integration.retention_kafka import set_retention
from tests.integration.test_tracker_service import T0, spec, tensors
from tests.integration.test_tracker_service import finish as finish_copy
from tests.integration.test_tracker_snapshot import (
    _completed,
    _described,
    assign,
    consolidated,
    until,
    written,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

OLD_ROUNDS = 3
STEPS = 100
DAY_S = 86_400.0
A_ITERATIONS = STEPS * (OLD_ROUNDS + 2)     # A completes in the second round after the restart


def tracker(bus: Bus, store: ObjectStore, group: str) -> TrackerService:
    config = TrackerConfig(group=group, tick_s=0.05, finish_timeout_s=3600.0, chunk_bytes=256, snapshot_every=1,
                           snapshots_kept=3)
    return TrackerService(bus=bus, store=store, config=config, clock=FakeClock(T0 + 1000))


async def started(bus: Bus, round_: int, assignments: int) -> None:
    at = T0 + 360 * round_
    await bus.publish(RoundStarted(ts=at, source="scheduler", round=round_, policy="hadare", started_at=at,
                                ends_at=at + 360, assignments=assignments))


async def one_round(bus: Bus, store: ObjectStore, jobs: dict[str, int], round_: int) -> None:
    """Round ``round_``: one copy of each job in ``jobs`` (id -> iterations), each finishing
    STEPS steps with weights seeded by the round and the job's place."""
    await started(bus, round_, len(jobs))
    for job_id, iterations in jobs.items():
        await assign(bus, job_id, iterations, round_, 0)
    for place, job_id in enumerate(jobs):
        await finish_copy(bus, store, job_id, round_, 0, steps=STEPS, data=save(tensors(seed=10 * round_ + place)))


async def _old_records_left(bus: Bus, ids: set[str]) -> dict[str, int]:
    """Per deleted-from topic, how many records of the old rounds (< OLD_ROUNDS) or of A's and
    B's submissions it still holds."""
    left = {}
    for topic in (JOBS, PLACEMENTS, PROGRESS):
        old = 0
        async for d in bus.read(topic):
            e = d.event
            if isinstance(e, JobSubmitted):
                old += e.job.job_id in ids
            elif getattr(e, "round", OLD_ROUNDS) < OLD_ROUNDS:
                old += 1
        left[topic] = old
    return left


def _state(service: TrackerService, renamed: dict[str, str]) -> dict[str, Any]:
    """What the tracker holds per job that is still running: credited worker-steps, the last
    decided round and the latest model (names renamed), and how many jobs it finished."""
    jobs = {}
    for job_id, job in service.state._jobs.items():
        if job_id in renamed:
            jobs[renamed[job_id]] = (job.consolidated_worker_steps, job.floor,
                                     None if job.model_key is None else job.model_key.replace(job_id, renamed[job_id]))
    return {"jobs": jobs, "finished": sorted(renamed[j] for j in renamed if j in service.state._finished)}


async def scenario(bus: Bus, store: ObjectStore, *, retention: tuple[str, FakeClock] | None = None) -> dict[str, Any]:
    """Drive A, B (and C after the gap) through OLD_ROUNDS + 2 rounds. ``retention`` (the
    broker's address and the bus's clock): stop the tracker after the old rounds, give its
    input topics one day of retention, move the clock ten days on, publish the next round,
    wait until the old segments are gone, then start a new tracker."""
    tag = uuid.uuid4().hex[:8]
    a, b, c = f"a-{tag}", f"b-{tag}", f"c-{tag}"
    renamed = {a: "A", b: "B", c: "C"}
    group = f"tracker-retention-{tag}"
    for job_id, iterations in ((a, A_ITERATIONS), (b, 10_000)):
        await bus.publish(JobSubmitted(ts=T0 - 100, source="cli", job=spec(job_id, iterations), submitted_at=T0 - 100))
    service = tracker(bus, store, group)
    await service.start()
    info: dict[str, Any] = {}
    seen: dict[str, Any] = {}
    try:
        for r in range(OLD_ROUNDS):
            await one_round(bus, store, {a: A_ITERATIONS, b: 10_000}, r)
            await until(f"round {r}", lambda r=r: _both(bus, a, b, r))
        # Snapshots are written at the end of a tick that decided rounds: a few ticks on, none
        # is owed, so the newest covers the last old round of both jobs.
        await asyncio.sleep(0.3)
        await until("the last old round's snapshot",
                    lambda: asyncio.sleep(0, written(service) >= 1 and service._decided == 0))
        if retention is not None:
            bootstrap, clock = retention
            await service.stop()
            seen = await _announced(bus, renamed)   # retention deletes these: read them now
            await set_retention(bootstrap, INPUT_TOPICS, int(DAY_S * 1000))
            clock.advance(10 * DAY_S)
        await bus.publish(JobSubmitted(ts=T0 + 360 * OLD_ROUNDS, source="cli", job=spec(c, 10_000),
                                    submitted_at=T0 + 360 * OLD_ROUNDS))
        await one_round(bus, store, {a: A_ITERATIONS, b: 10_000}, OLD_ROUNDS)
        if retention is not None:
            async with asyncio.timeout(90):   # the broker deletes the old segments once they rolled
                while any((left := await _old_records_left(bus, {a, b})).values()):
                    await asyncio.sleep(0.5)
            info["left"] = left
            service = tracker(bus, store, group)
            await service.start()
            info["recovery"] = dict(service.recovery)
        await until("the round after the gap", lambda: _both(bus, a, b, OLD_ROUNDS))
        await one_round(bus, store, {a: A_ITERATIONS, b: 10_000, c: 10_000}, OLD_ROUNDS + 1)
        await until("A's completion", lambda: _completed(bus, a))
        await until("the last round", lambda: _both(bus, b, c, OLD_ROUNDS + 1))
        await asyncio.sleep(0.3)   # a few more ticks: nothing else may be announced
        events = list({**seen, **await _announced(bus, renamed)}.values())
        state = _state(service, renamed)
        models = {"final A": load(await store.get(final_key(a))),
                  "B": load(await store.get(model_key(b, OLD_ROUNDS + 1))),
                  "C": load(await store.get(model_key(c, OLD_ROUNDS + 1)))}
    finally:
        await service.stop()
    return {"announced": sorted(_described(e, renamed, 0) for e in events), "state": state, "models": models,
            **info}


async def _announced(bus: Bus, renamed: dict[str, str]) -> dict[str, Any]:
    """The scenario's announcements on hadar.models, by event id."""
    return {d.event.id: d.event async for d in bus.read(MODELS) if getattr(d.event, "job_id", None) in renamed}


async def _both(bus: Bus, first: str, second: str, round_: int) -> bool:
    return await consolidated(bus, first, round_) and await consolidated(bus, second, round_)


async def test_a_tracker_restarted_from_its_snapshot_after_retention_deleted_its_input_ends_as_one_that_never_stopped(
        private_bootstrap: str, tmp_path: Path) -> None:
    clock = FakeClock(start=time.time() - 10 * DAY_S - 3600)
    # One partition: a partition that gets no new record never rolls, and its old segment stays.
    bus = KafkaBus(private_bootstrap, partitions=1, clock=clock, source="tracker-retention")
    store = LocalStore(tmp_path / "kafka-run")
    await bus.start()
    await store.start()
    try:
        await bus.ensure_topics()
        restarted = await scenario(bus, store, retention=(private_bootstrap, clock))
    finally:
        await bus.stop()
    memory = MemoryBus(clock=FakeClock(T0))
    reference_store = LocalStore(tmp_path / "reference")
    await memory.start()
    await reference_store.start()
    try:
        reference = await scenario(memory, reference_store)
    finally:
        await memory.stop()

    assert restarted["left"] == {JOBS: 0, PLACEMENTS: 0, PROGRESS: 0}
    assert restarted["recovery"]["snapshot"] is not None
    assert restarted["recovery"]["records"] < 20      # the round after the gap, not the old ones
    assert restarted["announced"] == reference["announced"]
    models = [d for d in reference["announced"] if d[0] == "model"]
    assert len(models) == len(set(models)) == 2 * OLD_ROUNDS + 5   # every round once, none lost
    assert ("JobCompleted", "A", A_ITERATIONS) in reference["announced"]
    assert restarted["state"] == reference["state"]
    assert reference["state"]["finished"] == ["A"] and set(reference["state"]["jobs"]) == {"B", "C"}
    for name, tensors_ in reference["models"].items():
        assert restarted["models"][name].keys() == tensors_.keys(), name
        for tensor, value in tensors_.items():
            np.testing.assert_array_equal(restarted["models"][name][tensor], value)
