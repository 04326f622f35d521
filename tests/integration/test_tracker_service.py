"""The tracker service end to end: placements and finished copies in, models and completions out.

Runs on MemoryBus + LocalStore, and on real Kafka + MinIO (markers ``kafka``/``s3``).
"""

from __future__ import annotations

import asyncio
import io
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from minio import Minio
from safetensors.numpy import load, save

from services.tracker.averaging.consolidate import (
    Replica,
    weigh_replicas,
    write_consolidated,
)
from services.tracker.averaging.safetensors_format import FileRangeReader
from services.tracker.service import TrackerConfig, TrackerService
from shared.bus import Bus, KafkaBus, MemoryBus
from shared.clock import FakeClock
from shared.domain.layout import checkpoint_key, final_key, model_key
from shared.store import LocalStore, MinioStore, ObjectStore
from shared.store.settings import S3Settings
from shared.wire.events import (
    Assignment,
    CopyFinished,
    Event,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    RoundStarted,
)
from shared.wire.topics import MODELS, PLACEMENTS

T0 = 1_700_000_000.0


def spec(job_id: str, iterations: int = 300) -> JobSpec:
    return JobSpec(job_id=job_id, user="alice", model="resnet-8", dataset="digits", batch_size=32,
                   workers=1, iterations=iterations)


def tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((16, 8)).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32),
            "steps": np.array([seed], dtype=np.int64)}


async def place(bus: Bus, job: JobSpec, round_: int, copies: list[int], *, others: int = 0) -> None:
    started = T0 + 360 * round_
    await bus.publish(RoundStarted(ts=started, source="scheduler", round=round_, policy="hadare",
                                started_at=started, ends_at=started + 360, assignments=len(copies) + others))
    for copy in copies:
        await bus.publish(Assignment(ts=started, source="scheduler", round=round_, job=job, copy=copy,
                                  node_id=f"n{copy}", gpus=(0,), gpu_type="V100", world_size=1, ranks=(0,),
                                  step_budget=1_000, deadline=started + 360))


async def finish(bus: Bus, store: ObjectStore, job_id: str, round_: int, copy: int, steps: int,
                 data: bytes | None = None) -> dict[str, np.ndarray]:
    key = checkpoint_key(job_id, round_, copy, node=f"n{copy}")
    weights = tensors(seed=100 * round_ + copy)
    await store.put(key, save(weights) if data is None else data)
    await bus.publish(CopyFinished(ts=T0 + 360 * round_ + 350, source=f"agent/n{copy}", job_id=job_id,
                                round=round_, copy=copy, node_id=f"n{copy}", status="ok", steps_round=steps,
                                checkpoint=key))
    return weights


async def models_events(bus: Bus, job_id: str) -> list[Event]:
    return [d.event for d in [x async for x in bus.read(MODELS)]
            if getattr(d.event, "job_id", None) == job_id]


async def wait_for(bus: Bus, job_id: str, predicate: Callable[[list[Event]], bool],
                   timeout_s: float = 20.0) -> list[Event]:
    deadline = time.monotonic() + timeout_s
    while True:
        events = await models_events(bus, job_id)
        if predicate(events):
            return events
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; hadar.models has {events}")
        await asyncio.sleep(0.05)


def consolidations(events: list[Event], round_: int | None = None) -> list[ModelConsolidated]:
    return [e for e in events if isinstance(e, ModelConsolidated) and (round_ is None or e.round == round_)]


def tracker(bus: Bus, store: ObjectStore, *, clock: FakeClock | None = None, timeout_s: float = 3600.0,
            group: str | None = None) -> TrackerService:
    config = TrackerConfig(group=group or f"tracker-{uuid.uuid4().hex[:8]}", tick_s=0.05,
                           finish_timeout_s=timeout_s, chunk_bytes=256)
    return TrackerService(bus=bus, store=store, config=config, clock=clock or FakeClock(T0))


async def full_scenario(bus: Bus, store: ObjectStore) -> None:
    """Two rounds, two copies then one; the job reaches its iterations in the second.

    Rounds are the scheduler's, global to the bus: on a broker shared with earlier runs the
    scenario takes the two round numbers after every round already placed there."""
    r0 = 1 + max([d.event.round async for d in bus.read(PLACEMENTS) if isinstance(d.event, RoundStarted)],
                 default=-1)
    r1 = r0 + 1
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    job = spec(job_id)
    await bus.publish(JobSubmitted(ts=T0 - 100, source="cli", job=job, submitted_at=T0 - 100))
    service = tracker(bus, store, clock=FakeClock(T0 + 1000))
    await service.start()
    try:
        await place(bus, job, r0, [0, 1])
        w0 = await finish(bus, store, job_id, r0, 0, steps=100)
        w1 = await finish(bus, store, job_id, r0, 1, steps=60)
        events = await wait_for(bus, job_id, lambda es: bool(consolidations(es, r0)))
        (first,) = consolidations(events, r0)
        assert first.key == model_key(job_id, r0) and first.total_steps == 160
        assert [(c.copy, c.steps) for c in first.copies] == [(0, 100), (1, 60)]
        assert [c.weight for c in first.copies] == pytest.approx([100 / 160, 60 / 160])
        model = load(await store.get(first.key))
        expected = (100 * w0["w"].astype(np.float64) + 60 * w1["w"]) / 160
        np.testing.assert_allclose(model["w"], expected, rtol=2e-6, atol=2e-7)
        assert model["steps"] == w0["steps"]  # integer tensor: from the copy with most steps

        await place(bus, job, r1, [0])
        w2 = await finish(bus, store, job_id, r1, 0, steps=200)
        events = await wait_for(bus, job_id, lambda es: any(isinstance(e, JobCompleted) for e in es))
        (second,) = consolidations(events, r1)
        assert second.total_steps == 300 and [c.weight for c in second.copies] == [1.0]
        (done,) = [e for e in events if isinstance(e, JobCompleted)]
        # 160 + 200 trained; credited up to its 300 iterations
        assert done.final_key == final_key(job_id) and done.total_steps == 300
        assert done.jct_s == pytest.approx(done.completed_at - (T0 - 100))
        # The final model is a copy of the last round model, which the tracker may already have
        # deleted (tests/integration/test_tracker_lifecycle.py): it holds the one copy's weights.
        final = load(await store.get(final_key(job_id)))
        np.testing.assert_allclose(final["w"], w2["w"], rtol=2e-6, atol=2e-7)
        written = service.registry.get_sample_value("hadar_tracker_models_written_total")
        assert written == 2
    finally:
        await service.stop()


@pytest.fixture
async def memory_bus() -> AsyncIterator[MemoryBus]:
    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()
    yield bus
    await bus.stop()


async def test_memory_bus_local_store_consolidates_and_completes(memory_bus: MemoryBus,
                                                                 local_store: LocalStore) -> None:
    await full_scenario(memory_bus, local_store)


async def test_bad_replica_is_rejected_and_the_rest_consolidated(memory_bus: MemoryBus,
                                                                 local_store: LocalStore) -> None:
    job = spec("j-bad")
    service = tracker(memory_bus, local_store)
    await service.start()
    try:
        await place(memory_bus, job, 0, [0, 1, 2])
        await finish(memory_bus, local_store, "j-bad", 0, 0, steps=10)
        await finish(memory_bus, local_store, "j-bad", 0, 1, steps=10, data=b"\x01\x02not safetensors")
        await finish(memory_bus, local_store, "j-bad", 0, 2, steps=30)
        events = await wait_for(memory_bus, "j-bad", lambda es: bool(consolidations(es)))
        (event,) = consolidations(events)
        assert [c.copy for c in event.copies] == [0, 2] and event.total_steps == 40
        assert [r.copy for r in event.rejected] == [1] and "not valid safetensors" in event.rejected[0].reason
        assert service.registry.get_sample_value("hadar_tracker_replicas_rejected_total") == 1
    finally:
        await service.stop()


async def test_missing_copies_are_left_out_after_the_timeout(memory_bus: MemoryBus, local_store: LocalStore) -> None:
    clock = FakeClock(T0 + 300)
    job = spec("j-late")
    service = tracker(memory_bus, local_store, clock=clock, timeout_s=60)
    await service.start()
    try:
        await place(memory_bus, job, 0, [0, 1])
        await finish(memory_bus, local_store, "j-late", 0, 0, steps=50)
        await asyncio.sleep(0.3)
        assert consolidations(await models_events(memory_bus, "j-late")) == []
        clock.advance(130)  # past the deadline (T0 + 360) plus the 60 s timeout
        events = await wait_for(memory_bus, "j-late", lambda es: bool(consolidations(es)))
        (event,) = consolidations(events)
        assert event.missing == (1,) and [c.copy for c in event.copies] == [0]
    finally:
        await service.stop()


async def test_restart_and_duplicates_never_count_twice_or_publish_again(memory_bus: MemoryBus,
                                                                          local_store: LocalStore) -> None:
    job = spec("j-restart", iterations=10_000)
    group = "tracker-restart"
    first = tracker(memory_bus, local_store, group=group)
    await first.start()
    await place(memory_bus, job, 0, [0, 1])
    await finish(memory_bus, local_store, "j-restart", 0, 0, steps=100)
    await finish(memory_bus, local_store, "j-restart", 0, 1, steps=100)
    await wait_for(memory_bus, "j-restart", lambda es: bool(consolidations(es, 0)))
    model_bytes = await local_store.get(model_key("j-restart", 0))
    await first.stop()

    # The agent re-reports copy 0 (new event id), then a fresh tracker replays everything.
    await finish(memory_bus, local_store, "j-restart", 0, 0, steps=100)
    second = tracker(memory_bus, local_store, group=group)
    await second.start()
    try:
        await place(memory_bus, job, 1, [0])
        await finish(memory_bus, local_store, "j-restart", 1, 0, steps=50)
        events = await wait_for(memory_bus, "j-restart", lambda es: bool(consolidations(es, 1)))
        await asyncio.sleep(0.3)  # a few more ticks: nothing else may appear
        events = await models_events(memory_bus, "j-restart")
        assert len(consolidations(events, 0)) == 1 and len(consolidations(events, 1)) == 1
        assert consolidations(events, 1)[0].total_steps == 250
        assert await local_store.get(model_key("j-restart", 0)) == model_bytes
    finally:
        await second.stop()


async def test_a_model_written_but_not_announced_is_announced_as_is(memory_bus: MemoryBus,
                                                                   local_store: LocalStore,
                                                                   tmp_path: Path) -> None:
    job = spec("j-crash")
    await place(memory_bus, job, 0, [0, 1])
    await finish(memory_bus, local_store, "j-crash", 0, 0, steps=90)
    await finish(memory_bus, local_store, "j-crash", 0, 1, steps=10)
    # An earlier tracker wrote the round's model (uniform weights) and crashed before announcing it.
    paths = []
    for copy in (0, 1):
        path = tmp_path / f"{copy}.safetensors"
        path.write_bytes(await local_store.get(checkpoint_key("j-crash", 0, copy, node=f"n{copy}")))
        paths.append(path)
    replicas = [Replica(copy=i, steps=s, reader=FileRangeReader(p)) for i, (p, s) in enumerate(zip(paths, (90, 10)))]
    buffer = io.BytesIO()
    weighing = weigh_replicas(replicas, mode="uniform")
    write_consolidated(weighing, buffer, metadata=weighing.model_metadata(job="j-crash", round_=0).to_metadata())
    await local_store.put(model_key("j-crash", 0), buffer.getvalue())

    service = tracker(memory_bus, local_store)  # steps mode: a recomputation would weigh 0.9 / 0.1
    await service.start()
    try:
        events = await wait_for(memory_bus, "j-crash", lambda es: bool(consolidations(es)))
        (event,) = consolidations(events)
        assert [c.weight for c in event.copies] == [0.5, 0.5] and event.total_steps == 100
        assert await local_store.get(model_key("j-crash", 0)) == buffer.getvalue()
    finally:
        await service.stop()


class FlakyStore:
    """A LocalStore whose first ``put_file`` fails, as a store that is briefly down would."""

    def __init__(self, inner: LocalStore) -> None:
        self._inner = inner
        self.failures = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def put_file(self, key: str, path: Path, *, owner: str | None = None) -> None:
        if self.failures == 0:
            self.failures += 1
            raise OSError("store unavailable")
        await self._inner.put_file(key, path, owner=owner)


async def test_a_failed_write_is_retried_and_announced_once(memory_bus: MemoryBus, local_store: LocalStore) -> None:
    store = FlakyStore(local_store)
    service = tracker(memory_bus, store)  # type: ignore[arg-type]
    await service.start()
    try:
        await place(memory_bus, spec("j-flaky"), 0, [0])
        await finish(memory_bus, local_store, "j-flaky", 0, 0, steps=10)
        await wait_for(memory_bus, "j-flaky", lambda es: bool(consolidations(es)))
        await asyncio.sleep(0.3)
        assert len(consolidations(await models_events(memory_bus, "j-flaky"))) == 1
        assert store.failures == 1
        assert service.registry.get_sample_value("hadar_tracker_errors_total", {"stage": "consolidate"}) == 1
        # /healthz names the stage and the kind of error, never the exception's text.
        assert service.health()["ok"] and service.health()["last_error"] == "consolidate: OSError"
    finally:
        await service.stop()


class OwnerRecordingStore:
    """A LocalStore that records the owner each object was written with."""

    def __init__(self, inner: LocalStore) -> None:
        self._inner = inner
        self.owners: dict[str, str | None] = {}

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def put(self, key: str, data: bytes, *, owner: str | None = None) -> None:
        self.owners[key] = owner
        await self._inner.put(key, data, owner=owner)

    async def put_file(self, key: str, path: Path, *, owner: str | None = None) -> None:
        self.owners[key] = owner
        await self._inner.put_file(key, path, owner=owner)


@pytest.mark.parametrize(("user", "owner"), [("alice", "alice"), ("Alice Smith (dev)", None)])
async def test_every_model_the_tracker_writes_is_owned_by_its_jobs_user(
        memory_bus: MemoryBus, local_store: LocalStore, user: str, owner: str | None) -> None:
    """With --secure a user may read a model only when it names them as its owner
    (shared/security/principals.py): round models, optimizer states and the final model all
    do. A development cluster's free-text user names no one: those models have no owner."""
    store = OwnerRecordingStore(local_store)
    job = replace(spec("j-owned", iterations=150), user=user)
    await memory_bus.publish(JobSubmitted(ts=T0, source="cli", job=job, submitted_at=T0))
    service = tracker(memory_bus, store)  # type: ignore[arg-type]
    await service.start()
    try:
        await place(memory_bus, job, 0, [0, 1])
        await finish(memory_bus, local_store, "j-owned", 0, 0, steps=100)
        await finish(memory_bus, local_store, "j-owned", 0, 1, steps=60)
        await wait_for(memory_bus, "j-owned", lambda es: any(isinstance(e, JobCompleted) for e in es))
    finally:
        await service.stop()
    models = {key: who for key, who in store.owners.items() if key.startswith("models/")}
    assert {model_key("j-owned", 0), final_key("j-owned")} <= set(models)
    assert set(models.values()) == {owner}


# ---------------------------------------------------------------- real Kafka + MinIO


def _remove_bucket(settings: S3Settings) -> None:
    client = Minio(settings.host_port, access_key=settings.access_key, secret_key=settings.secret_key,
                   secure=settings.secure)
    for obj in client.list_objects(settings.bucket, recursive=True):
        if obj.object_name is not None:
            client.remove_object(settings.bucket, obj.object_name)
    client.remove_bucket(settings.bucket)


@pytest.mark.kafka
@pytest.mark.s3
async def test_kafka_and_minio_consolidate_and_complete(kafka_bootstrap: str, s3_settings: S3Settings) -> None:
    bus = KafkaBus(kafka_bootstrap, source="tracker-test")
    settings = replace(s3_settings, bucket=f"test-{uuid.uuid4().hex}")
    store = MinioStore(settings)
    await bus.start()
    await store.start()
    try:
        await full_scenario(bus, store)
    finally:
        await store.stop()
        await bus.stop()
        await asyncio.to_thread(_remove_bucket, settings)


async def test_a_two_worker_job_forked_into_two_one_worker_copies_is_credited_half_their_steps(
        memory_bus: MemoryBus, local_store: LocalStore) -> None:
    """Samples, not copy steps (issue 11): two copies on 1 of the job's W=2 workers train
    (s0 + s1) x b samples, i.e. (s0 + s1) / 2 job steps; weights are by samples."""
    job = replace(spec("j-half", iterations=1_000), workers=2)
    await memory_bus.publish(JobSubmitted(ts=T0, source="cli", job=job, submitted_at=T0))
    await place(memory_bus, job, 0, [0, 1])
    await finish(memory_bus, local_store, "j-half", 0, 0, steps=90)
    await finish(memory_bus, local_store, "j-half", 0, 1, steps=31)
    service = tracker(memory_bus, local_store)
    await service.start()
    try:
        events = await wait_for(memory_bus, "j-half", lambda es: bool(consolidations(es)))
        (event,) = consolidations(events)
        assert event.total_steps == (90 + 31) // 2 == 60
        assert [c.weight for c in event.copies] == pytest.approx([90 / 121, 31 / 121])
        assert service.state.consolidated_worker_steps("j-half") == 121
    finally:
        await service.stop()


class SlowUploadStore:
    """A LocalStore whose model uploads take 0.3 s each, recording how many jobs upload at once."""

    def __init__(self, inner: LocalStore) -> None:
        self._inner = inner
        self.uploading: set[str] = set()
        self.most_at_once = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def put_file(self, key: str, path: Path, *, owner: str | None = None) -> None:
        if key.startswith("models/") and not key.endswith(".optim.safetensors"):
            job_id = key.split("/")[1]
            self.uploading.add(job_id)
            self.most_at_once = max(self.most_at_once, len(self.uploading))
            await asyncio.sleep(0.3)
            self.uploading.discard(job_id)
        await self._inner.put_file(key, path, owner=owner)


@pytest.mark.parametrize("jobs_at_once", [1, 3])
async def test_rounds_of_several_jobs_are_consolidated_at_once_up_to_the_setting(
        memory_bus: MemoryBus, local_store: LocalStore, jobs_at_once: int) -> None:
    """Three jobs' rounds due together: with ``consolidation_jobs`` 3 their uploads overlap
    (the next round does not wait for them one after another); with 1 they never do."""
    store = SlowUploadStore(local_store)
    config = TrackerConfig(group=f"tracker-{uuid.uuid4().hex[:8]}", tick_s=0.05, chunk_bytes=256,
                           consolidation_jobs=jobs_at_once)
    service = TrackerService(bus=memory_bus, store=store, config=config, clock=FakeClock(T0))  # type: ignore[arg-type]
    jobs = [spec(f"j-at-once-{i}") for i in range(3)]
    started = T0
    await memory_bus.publish(RoundStarted(ts=started, source="scheduler", round=0, policy="hadare",
                                          started_at=started, ends_at=started + 360, assignments=3))
    for copy, job in enumerate(jobs):   # one copy each, on nodes n0, n1, n2
        await memory_bus.publish(Assignment(ts=started, source="scheduler", round=0, job=job, copy=copy,
                                            node_id=f"n{copy}", gpus=(0,), gpu_type="V100", world_size=1,
                                            ranks=(0,), step_budget=1_000, deadline=started + 360))
        await finish(memory_bus, local_store, job.job_id, 0, copy, steps=10)
    await service.start()
    try:
        for job in jobs:
            await wait_for(memory_bus, job.job_id, lambda es: bool(consolidations(es)))
    finally:
        await service.stop()
    assert store.most_at_once == jobs_at_once
