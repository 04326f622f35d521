"""A tracker restarted from a state snapshot decides what an uninterrupted tracker decides.

The scenario (:func:`scenario`) is run once by one tracker throughout (the reference) and
once with a restart in the middle, from a snapshot written while a report was held (its
Assignment not read yet: the snapshot may not cover that report's record) and a round was
still open. Both must announce the same rounds, once each, with the same copies and steps,
the same models, and complete the job with the same credited steps. On MemoryBus +
LocalStore, with the newest snapshot intact or damaged (the restart falls back to the
previous one), and on real Kafka + MinIO (markers ``kafka``/``s3``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load, save

from services.tracker.service import TrackerConfig, TrackerService
from shared.bus import Bus, BusError, KafkaBus, MemoryBus
from shared.clock import FakeClock
from shared.domain.layout import final_key, model_key
from shared.persistence.snapshot import SnapshotStore
from shared.store import LocalStore, MinioStore, ObjectStore
from shared.store.settings import S3Settings
from shared.wire.events import (
    Assignment,
    CopyFinished,
    JobCompleted,
    JobSubmitted,
    ModelConsolidated,
    RoundAbandoned,
    RoundStarted,
)
from shared.wire.topics import PLACEMENTS
from tests.integration.test_tracker_service import (
    T0,
    _remove_bucket,
    models_events,
    spec,
    tensors,
)
from tests.integration.test_tracker_service import finish as finish_copy

PLAIN_ROUNDS = 4                   # rounds of job A before the one decided with a report held
STEPS = 100                        # A's steps per round; it completes after PLAIN_ROUNDS + 2 rounds


def tracker(bus: Bus, store: ObjectStore, group: str) -> TrackerService:
    config = TrackerConfig(group=group, tick_s=0.05, finish_timeout_s=3600.0, chunk_bytes=256,
                           snapshot_every=1, snapshots_kept=3)
    return TrackerService(bus=bus, store=store, config=config, clock=FakeClock(T0 + 1000))


async def started(bus: Bus, round_: int, assignments: int) -> None:
    at = T0 + 360 * round_
    await bus.publish(RoundStarted(ts=at, source="scheduler", round=round_, policy="hadare", started_at=at,
                                ends_at=at + 360, assignments=assignments))


async def assign(bus: Bus, job_id: str, iterations: int, round_: int, copy: int) -> None:
    at = T0 + 360 * round_
    await bus.publish(Assignment(ts=at, source="scheduler", round=round_, job=spec(job_id, iterations), copy=copy,
                              node_id=f"n{copy}", gpus=(0,), gpu_type="V100", world_size=1, ranks=(0,),
                              step_budget=1_000, deadline=at + 360))


async def until(what: str, predicate: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = await predicate()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def consolidated(bus: Bus, job_id: str, round_: int) -> bool:
    return any(isinstance(e, ModelConsolidated) and e.round == round_ for e in await models_events(bus, job_id))


def written(service: TrackerService) -> float:
    return service.registry.get_sample_value("hadar_tracker_snapshots_total", {"outcome": "written"}) or 0.0


async def scenario(bus: Bus, store: ObjectStore, *, restart: bool, damage: bool = False) -> dict[str, Any]:
    """Drive jobs A and B through rounds; ``restart``: replace the tracker mid-way (``damage``:
    flip a byte of its newest snapshot first). Returns what was announced and stored."""
    base = 1 + max([d.event.round async for d in bus.read(PLACEMENTS) if isinstance(d.event, RoundStarted)],
                   default=-1)
    tag = uuid.uuid4().hex[:8]
    a, b = f"a-{tag}", f"b-{tag}"

    async def finish(bus: Bus, store: ObjectStore, job_id: str, round_: int, copy: int, steps: int) -> None:
        # Weights by the round's place in the scenario, not its number: a shared broker starts
        # the scenario at a later round than a fresh bus, and both runs must store equal models.
        weights = tensors(seed=100 * (round_ - base) + copy)
        await finish_copy(bus, store, job_id, round_, copy, steps=steps, data=save(weights))

    a_iterations = STEPS * (PLAIN_ROUNDS + 2)
    group = f"tracker-snap-{tag}"
    for job_id, iterations in ((a, a_iterations), (b, 10_000)):
        await bus.publish(JobSubmitted(ts=T0 - 100, source="cli", job=spec(job_id, iterations), submitted_at=T0 - 100))
    service = tracker(bus, store, group)
    await service.start()
    info: dict[str, Any] = {}
    try:
        for r in range(base, base + PLAIN_ROUNDS):
            await started(bus, r, 1)
            await assign(bus, a, a_iterations, r, 0)
            await finish(bus, store, a, r, 0, steps=STEPS)
            await until(f"round {r}", lambda r=r: consolidated(bus, a, r))
        p = base + PLAIN_ROUNDS
        await started(bus, p, 1)
        await assign(bus, a, a_iterations, p, 0)
        await started(bus, p + 1, 2)
        await assign(bus, a, a_iterations, p + 1, 0)
        await finish(bus, store, b, p + 1, 0, steps=70)    # held: B's Assignment is not on the bus yet
        await finish(bus, store, a, p, 0, steps=STEPS)      # decides round p: a snapshot with B's report held
        await until(f"round {p}", lambda: consolidated(bus, a, p))
        await until("the snapshot of round p", lambda: asyncio.sleep(0, written(service) >= PLAIN_ROUNDS + 1))
        assert service.state.sizes()["pending"] == 1
        if restart:
            await service.stop()
            snapshots = SnapshotStore(store, owner=group, service="tracker")
            keys = [key for _, key in await snapshots.keys()]
            if damage:
                data = bytearray(await store.get(keys[0]))
                data[len(data) // 2] ^= 0xFF
                await store.put(keys[0], bytes(data))
        await assign(bus, b, 10_000, p + 1, 0)
        await finish(bus, store, a, p + 1, 0, steps=STEPS)
        if restart:
            service = tracker(bus, store, group)
            await service.start()
            info = dict(service.recovery)
            assert info["snapshot"] == (keys[1] if damage else keys[0])
            assert info["skipped"] == ([keys[0]] if damage else [])
        await until("B's round", lambda: consolidated(bus, b, p + 1))
        await until("A's completion", lambda: _completed(bus, a))
        await asyncio.sleep(0.3)   # a few more ticks: nothing else may be announced
        events = await models_events(bus, a) + await models_events(bus, b)
        final = load(await store.get(final_key(a)))
        b_model = load(await store.get(model_key(b, p + 1)))
    finally:
        await service.stop()
    renamed = {a: "A", b: "B"}
    return {"announced": sorted(_described(e, renamed, base) for e in events), "final": final, "b_model": b_model,
            "recovery": info}


async def _completed(bus: Bus, job_id: str) -> bool:
    return any(isinstance(e, JobCompleted) for e in await models_events(bus, job_id))


def _described(event: Any, renamed: dict[str, str], base: int) -> tuple[Any, ...]:
    """What an announcement decides, without its ids, times and the run's names."""
    if isinstance(event, ModelConsolidated):
        return ("model", renamed[event.job_id], event.round - base, event.total_steps,
                tuple((c.copy, c.steps, c.weight) for c in event.copies), event.missing)
    return (type(event).__name__, renamed[event.job_id], getattr(event, "total_steps", None))


def assert_same(reference: dict[str, Any], restarted: dict[str, Any]) -> None:
    assert restarted["announced"] == reference["announced"]
    rounds = [d[:3] for d in reference["announced"] if d[0] == "model"]
    assert len(rounds) == len(set(rounds)) == PLAIN_ROUNDS + 3     # none twice, none lost (B's held one too)
    assert ("JobCompleted", "A", STEPS * (PLAIN_ROUNDS + 2)) in reference["announced"]
    for name in ("final", "b_model"):
        assert restarted[name].keys() == reference[name].keys()
        for tensor in reference[name]:
            np.testing.assert_array_equal(restarted[name][tensor], reference[name][tensor])


async def _memory_run(tmp_path: Any, name: str, **kwargs: Any) -> dict[str, Any]:
    bus = MemoryBus(clock=FakeClock(T0))
    store = LocalStore(tmp_path / name)
    await bus.start()
    await store.start()
    try:
        return await scenario(bus, store, **kwargs)
    finally:
        await bus.stop()


@pytest.mark.parametrize("damage", [False, True], ids=["newest", "newest-damaged"])
async def test_a_restart_from_a_snapshot_decides_as_an_uninterrupted_tracker(tmp_path: Any, damage: bool) -> None:
    reference = await _memory_run(tmp_path, "reference", restart=False)
    restarted = await _memory_run(tmp_path, "restarted", restart=True, damage=damage)
    assert_same(reference, restarted)
    # It did start from a snapshot: only the records after it were replayed.
    assert 0 < restarted["recovery"]["records"] < 40


@pytest.mark.kafka
@pytest.mark.s3
@pytest.mark.slow
async def test_kafka_and_minio_restart_from_a_snapshot(tmp_path: Any, kafka_bootstrap: str,
                                                       s3_settings: S3Settings) -> None:
    reference = await _memory_run(tmp_path, "reference", restart=False)
    bus = KafkaBus(kafka_bootstrap, source="tracker-snapshot-test")
    settings = replace(s3_settings, bucket=f"test-{uuid.uuid4().hex}")
    store = MinioStore(settings)
    await bus.start()
    await store.start()
    try:
        restarted = await scenario(bus, store, restart=True)
    finally:
        await store.stop()
        await bus.stop()
        await asyncio.to_thread(_remove_bucket, settings)
    assert_same(reference, restarted)
    assert restarted["recovery"]["snapshot"] is not None


class AbandonmentsLost(MemoryBus):
    """A MemoryBus that refuses every RoundAbandoned, as a broker away at that moment would."""

    async def publish_pipelined(self, event: Any, *, topic: str | None = None,
                                key: str | None = None) -> Awaitable[tuple[int, int]]:
        if isinstance(event, RoundAbandoned):
            raise BusError("broker away", retriable=True)
        return await super().publish_pipelined(event, topic=topic, key=key)


async def test_no_snapshot_keeps_a_round_closed_that_the_log_does_not_close(local_store: LocalStore) -> None:
    bus = AbandonmentsLost(clock=FakeClock(T0))
    await bus.start()
    config = TrackerConfig(group="tracker-unannounced", tick_s=0.05, finish_timeout_s=3600.0, chunk_bytes=256,
                           max_attempts=1, snapshot_every=1)
    service = TrackerService(bus=bus, store=local_store, config=config, clock=FakeClock(T0 + 1000))
    await service.start()
    snapshots = SnapshotStore(local_store, owner="tracker-unannounced", service="tracker")
    try:
        await started(bus, 0, 2)
        await assign(bus, "x", 10_000, 0, 0)
        await assign(bus, "y", 10_000, 0, 1)
        await bus.publish(CopyFinished(ts=T0 + 300, source="agent/n0", job_id="x", round=0, copy=0, node_id="n0",
                                    status="failed", steps_round=0, checkpoint=None, reason="oom"))
        await until("x's round closed here", lambda: asyncio.sleep(0, service.state.open_rounds() <= 1))
        await finish_copy(bus, local_store, "y", 0, 1, steps=STEPS)
        await until("y's round", lambda: consolidated(bus, "y", 0))
        await asyncio.sleep(0.3)   # a few ticks: y's decision would have been snapshot
        assert await snapshots.keys() == [] and written(service) == 0
        # x's next round is announced: the log now closes round 0 too, and snapshots resume.
        await started(bus, 1, 1)
        await assign(bus, "x", 10_000, 1, 0)
        await finish_copy(bus, local_store, "x", 1, 0, steps=STEPS)
        await until("a snapshot", lambda: asyncio.sleep(0, written(service) >= 1))
        assert len(await snapshots.keys()) == 1
    finally:
        await service.stop()
        await bus.stop()
