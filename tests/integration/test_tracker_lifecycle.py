"""The tracker deletes what nothing can need any more (issue 13 item 3, "Object lifecycle").

On MemoryBus + LocalStore (the first and the completion test on MinIO too, marker
``s3``): checkpoints of decided rounds, round models older than the last
``keep_round_models`` (and not a start of an open round), and, once a job completed,
every checkpoint and round model of it but ``final.safetensors``. Never before the
round's model is announced; a failing delete is counted and retried; a restarted tracker
finishes the job.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from safetensors.numpy import save

from services.tracker.service import TrackerConfig, TrackerService
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.domain.layout import checkpoint_key, final_key, model_key
from shared.store import LocalStore, ObjectStore
from shared.wire.events import (
    Assignment,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    RoundStarted,
)
from tests.integration.test_tracker_service import (
    T0,
    consolidations,
    finish,
    models_events,
    spec,
    tensors,
    wait_for,
)


@pytest.fixture
async def memory_bus() -> AsyncIterator[MemoryBus]:
    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()
    yield bus
    await bus.stop()


def tracker(bus: MemoryBus, store: ObjectStore, **config: object) -> TrackerService:
    settings: dict[str, object] = {"group": f"tracker-{uuid.uuid4().hex[:8]}", "tick_s": 0.05,
                                   "finish_timeout_s": 3600.0, "chunk_bytes": 256}
    settings.update(config)
    return TrackerService(bus=bus, store=store, config=TrackerConfig(**settings),  # type: ignore[arg-type]
                          clock=FakeClock(T0))


async def place(bus: MemoryBus, job: JobSpec, round_: int, copies: list[int], *,
                start_from: str | None = None) -> None:
    started = T0 + 360 * round_
    await bus.publish(RoundStarted(ts=started, source="scheduler", round=round_, policy="hadare",
                                started_at=started, ends_at=started + 360, assignments=len(copies)))
    for copy in copies:
        await bus.publish(Assignment(ts=started, source="scheduler", round=round_, job=job, copy=copy,
                                  node_id=f"n{copy}", gpus=(0,), gpu_type="V100", world_size=1, ranks=(0,),
                                  step_budget=1_000, deadline=started + 360, start_from=start_from))


async def keys(store: ObjectStore, job_id: str) -> set[str]:
    return set(await store.list(f"checkpoints/{job_id}/")) | set(await store.list(f"models/{job_id}/"))


async def eventually(probe: Callable[[], object], timeout_s: float = 60.0) -> None:
    # Generous: the tracker's first held-out evaluation imports torch (2-5 s quiet), and
    # make test's load made 10 s too short (test_a_completed_job_keeps_only_its_final_model).
    deadline = time.monotonic() + timeout_s
    while True:
        result = probe()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.05)


async def run_rounds(bus: MemoryBus, store: ObjectStore, job: JobSpec, rounds: range, steps: int = 10) -> None:
    for r in rounds:
        await place(bus, job, r, [0], start_from=model_key(job.job_id, r - 1) if r else None)
        await finish(bus, store, job.job_id, r, 0, steps=steps)
        await wait_for(bus, job.job_id, lambda es, r=r: bool(consolidations(es, r)))


async def submit(bus: MemoryBus, job: JobSpec) -> None:
    await bus.publish(JobSubmitted(ts=T0 - 100, source="cli", job=job, submitted_at=T0 - 100))


async def test_decided_rounds_checkpoints_and_old_round_models_are_deleted(memory_bus: MemoryBus,
                                                                           store: ObjectStore) -> None:
    job = spec("j-life", iterations=10_000)
    await submit(memory_bus, job)
    service = tracker(memory_bus, store)   # keep_round_models defaults to 2
    await service.start()
    try:
        await run_rounds(memory_bus, store, job, range(3))
        # A straggler: a copy's checkpoint uploaded after its round (0) was decided.
        await store.put(checkpoint_key("j-life", 0, 7, node="n7"), save(tensors(7)))
        # Round 4 is planned before round 3 is decided, and one of its two copies has finished
        # when round 3 is decided: that sweep must leave round 4's checkpoint alone.
        await place(memory_bus, job, 3, [0], start_from=model_key("j-life", 2))
        await place(memory_bus, job, 4, [0, 1], start_from=model_key("j-life", 2))
        await finish(memory_bus, store, "j-life", 4, 0, steps=10)
        await finish(memory_bus, store, "j-life", 3, 0, steps=10)
        await wait_for(memory_bus, "j-life", lambda es: bool(consolidations(es, 3)))
        expected = {checkpoint_key("j-life", 4, 0, node="n0"), model_key("j-life", 2), model_key("j-life", 3)}
        await eventually(lambda: _equals(keys(store, "j-life"), expected))
        # Counted once the janitor resumes after its last delete: rounds 0..3, and the straggler.
        await eventually(lambda: counts(service) == (5, 2, 0))
    finally:
        await service.stop()


async def test_a_model_an_open_round_starts_from_is_kept(memory_bus: MemoryBus, local_store: LocalStore) -> None:
    job = spec("j-start", iterations=10_000)
    await submit(memory_bus, job)
    service = tracker(memory_bus, local_store, keep_round_models=1)
    await service.start()
    try:
        await run_rounds(memory_bus, local_store, job, range(1))
        await place(memory_bus, job, 1, [0], start_from=model_key("j-start", 0))
        # Round 2 is planned before model 1 is announced: its copies start from model 0.
        await place(memory_bus, job, 2, [0, 1], start_from=model_key("j-start", 0))
        await finish(memory_bus, local_store, "j-start", 1, 0, steps=10)
        await finish(memory_bus, local_store, "j-start", 2, 0, steps=10)
        await wait_for(memory_bus, "j-start", lambda es: bool(consolidations(es, 1)))
        await eventually(lambda: _equals(keys(local_store, "j-start"), {
            model_key("j-start", 0), model_key("j-start", 1), checkpoint_key("j-start", 2, 0, node="n0")}))
        await finish(memory_bus, local_store, "j-start", 2, 1, steps=10)   # round 2 decided: model 0 unneeded
        await eventually(lambda: _equals(keys(local_store, "j-start"), {model_key("j-start", 2)}))
    finally:
        await service.stop()


async def test_a_completed_job_keeps_only_its_final_model(memory_bus: MemoryBus, store: ObjectStore) -> None:
    job = spec("j-done", iterations=30)
    await submit(memory_bus, job)
    service = tracker(memory_bus, store)
    await service.start()
    try:
        await run_rounds(memory_bus, store, job, range(3))
        events = await wait_for(memory_bus, "j-done", lambda es: any(isinstance(e, JobCompleted) for e in es))
        final = await store.get(final_key("j-done"))
        assert [e.round for e in consolidations(events)] == [0, 1, 2]
        await eventually(lambda: _equals(keys(store, "j-done"), {final_key("j-done")}))
        assert await store.get(final_key("j-done")) == final
    finally:
        await service.stop()


class NoModelWrites:
    """A LocalStore that cannot write models (put_file always fails)."""

    def __init__(self, inner: LocalStore) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def put_file(self, key: str, path: Path, *, owner: str | None = None) -> None:
        raise OSError("store unavailable")


async def test_checkpoints_stay_while_their_round_model_is_not_announced(memory_bus: MemoryBus,
                                                                        local_store: LocalStore) -> None:
    job = spec("j-keep", iterations=10_000)
    await submit(memory_bus, job)
    service = tracker(memory_bus, NoModelWrites(local_store), max_attempts=1000)  # type: ignore[arg-type]
    await service.start()
    try:
        await place(memory_bus, job, 0, [0, 1])
        await finish(memory_bus, local_store, "j-keep", 0, 0, steps=10)
        await finish(memory_bus, local_store, "j-keep", 0, 1, steps=10)
        await eventually(lambda: (service.registry.get_sample_value("hadar_tracker_errors_total",
                                                                   {"stage": "consolidate"}) or 0) >= 3)
        await asyncio.sleep(0.3)
        assert await keys(local_store, "j-keep") == {checkpoint_key("j-keep", 0, c, node=f"n{c}") for c in (0, 1)}
        assert not consolidations(await models_events(memory_bus, "j-keep"))
    finally:
        await service.stop()


class FailingDeletes:
    """A LocalStore whose deletes fail while ``failing`` (a store outage), counted in ``failures``."""

    def __init__(self, inner: LocalStore, failing: int) -> None:
        self._inner = inner
        self.failing = failing
        self.failures = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def delete(self, key: str) -> None:
        if self.failures < self.failing:
            self.failures += 1
            raise OSError("store unavailable")
        await self._inner.delete(key)


async def test_a_failing_delete_is_counted_and_retried_without_blocking_rounds(memory_bus: MemoryBus,
                                                                              local_store: LocalStore) -> None:
    job = spec("j-retry", iterations=10_000)
    await submit(memory_bus, job)
    store = FailingDeletes(local_store, failing=3)
    service = tracker(memory_bus, store)  # type: ignore[arg-type]
    await service.start()
    try:
        await run_rounds(memory_bus, local_store, job, range(2))   # consolidation goes on meanwhile
        await eventually(lambda: _equals(keys(local_store, "j-retry"),
                                         {model_key("j-retry", 0), model_key("j-retry", 1)}))
        await eventually(lambda: counts(service) == (2, 0, 3))
        assert store.failures == 3
    finally:
        await service.stop()


async def test_a_restarted_tracker_deletes_what_was_missed(memory_bus: MemoryBus, local_store: LocalStore) -> None:
    job = spec("j-restart", iterations=30)
    await submit(memory_bus, job)
    store = FailingDeletes(local_store, failing=10**9)
    first = tracker(memory_bus, store)  # type: ignore[arg-type]
    await first.start()
    try:
        await run_rounds(memory_bus, local_store, job, range(3))
        await wait_for(memory_bus, "j-restart", lambda es: any(isinstance(e, JobCompleted) for e in es))
        failed = "hadar_tracker_object_deletions_failed_total"
        await eventually(lambda: (first.registry.get_sample_value(failed) or 0) > 0)
    finally:
        await first.stop()
    assert len(await keys(local_store, "j-restart")) == 7   # 3 checkpoints, 3 round models, final
    second = tracker(memory_bus, local_store)
    await second.start()
    try:
        await eventually(lambda: _equals(keys(local_store, "j-restart"), {final_key("j-restart")}))
        assert len(consolidations(await models_events(memory_bus, "j-restart"))) == 3   # nothing announced again
    finally:
        await second.stop()


def counts(service: TrackerService) -> tuple[float | None, ...]:
    """Checkpoints deleted, models deleted, failed listings or deletions."""
    value = service.registry.get_sample_value
    return (value("hadar_tracker_objects_deleted_total", {"kind": "checkpoint"}),
            value("hadar_tracker_objects_deleted_total",
                  {"kind": "model"}), value("hadar_tracker_object_deletions_failed_total"))


async def _equals(found: object, expected: set[str]) -> bool:
    return await found == expected  # type: ignore[misc]
