"""The tracker service on hostile replicas and hostile events (MemoryBus + LocalStore, no servers).

Replicas: each scenario used to stall the job (the round raised, stayed due and was retried
forever); now the offending copy is rejected with a reason and the round is announced.
Events (issue 12): a forged, misdirected or over-budget event is dead-lettered with its
reason and counted, and changes nothing; a round that always fails ends after a bound.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load, save

from services.tracker.service import TrackerConfig, TrackerService
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.domain.layout import checkpoint_key, final_key, model_key
from shared.store import LocalStore
from shared.wire.events import (
    Assignment,
    CopyFinished,
    CopyWeight,
    DeadLetter,
    Event,
    JobCompleted,
    JobSpec,
    ModelConsolidated,
    Progress,
    RoundAbandoned,
    RoundStarted,
)
from shared.wire.topics import DEADLETTER, MODELS, PROGRESS

T0 = 1_700_000_000.0


@pytest.fixture
async def memory_bus() -> AsyncIterator[MemoryBus]:
    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()
    yield bus
    await bus.stop()


def weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((16, 8)).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32)}


def list_dtype_replica() -> bytes:
    header = json.dumps({"w": {"dtype": ["F32"], "shape": [16, 8], "data_offsets": [0, 512]},
                         "b": {"dtype": "F32", "shape": [8], "data_offsets": [512, 544]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(544)


async def run_round(bus: MemoryBus, store: LocalStore, job_id: str,
                    copies: list[tuple[int, bytes]], budget: int = 1_000) -> ModelConsolidated:
    """Place ``copies`` (steps, checkpoint bytes) in round 0, finish them, await the model.

    Fails if any attempt to consolidate raised (the round must succeed the first time)."""
    job = JobSpec(job_id=job_id, user="u", model="resnet-8", dataset="digits", batch_size=32, workers=1,
                  iterations=10**12)
    service = TrackerService(bus=bus, store=store, clock=FakeClock(T0),
                             config=TrackerConfig(group=f"tracker-{job_id}", tick_s=0.05, chunk_bytes=256))
    await service.start()
    try:
        await bus.publish(RoundStarted(ts=T0, source="scheduler", round=0, policy="hadare", started_at=T0,
                                    ends_at=T0 + 360, assignments=len(copies)))
        for copy, (steps, data) in enumerate(copies):
            await bus.publish(Assignment(ts=T0, source="scheduler", round=0, job=job, copy=copy, node_id=f"n{copy}",
                                      gpus=(0,), gpu_type="V100", world_size=1, ranks=(0,), step_budget=budget,
                                      deadline=T0 + 360))
            key = checkpoint_key(job_id, 0, copy, node=f"n{copy}")
            await store.put(key, data)
            await bus.publish(CopyFinished(ts=T0 + 350, source=f"agent/n{copy}", job_id=job_id, round=0, copy=copy,
                                        node_id=f"n{copy}", status="ok", steps_round=steps, checkpoint=key))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            found = [d.event async for d in bus.read("hadar.models")
                     if isinstance(d.event, ModelConsolidated) and d.event.job_id == job_id]
            if found:
                assert service.registry.get_sample_value("hadar_tracker_errors_total", {"stage": "consolidate"}) == 0
                return found[0]
            await asyncio.sleep(0.05)
        raise AssertionError(f"round never announced; last error: {service.health()['last_error']}")
    finally:
        await service.stop()


async def test_a_copy_claiming_2_64_minus_1_steps_is_rejected_and_the_round_announced(
        memory_bus: MemoryBus, local_store: LocalStore) -> None:
    # A budget as large as the claim: the event is accepted, and consolidation bounds the steps.
    event = await run_round(memory_bus, local_store, "j-steps",
                            [(2**64 - 1, save(weights(0))), (10, save(weights(1))), (30, save(weights(2)))],
                            budget=2**64 - 1)
    assert [c.copy for c in event.copies] == [1, 2] and [c.weight for c in event.copies] == [0.25, 0.75]
    assert [r.copy for r in event.rejected] == [0] and event.total_steps == 40


async def test_a_nan_replica_is_rejected_and_the_model_is_the_average_of_the_others(
        memory_bus: MemoryBus, local_store: LocalStore) -> None:
    poisoned = weights(5)
    poisoned["b"][3] = np.nan
    event = await run_round(memory_bus, local_store, "j-nan",
                            [(500, save(weights(0))), (1, save(poisoned)), (500, save(weights(1)))])
    assert [c.copy for c in event.copies] == [0, 2] and [r.copy for r in event.rejected] == [1]
    assert "non-finite" in event.rejected[0].reason and event.total_steps == 1000
    model = load(await local_store.get(event.key))
    for name in ("w", "b"):
        expected = (weights(0)[name].astype(np.float64) + weights(1)[name]) / 2
        np.testing.assert_allclose(model[name], expected, rtol=2e-6, atol=2e-7)
        assert np.isfinite(model[name]).all()


async def test_a_malformed_header_rejects_that_copy_and_the_round_is_announced(
        memory_bus: MemoryBus, local_store: LocalStore) -> None:
    event = await run_round(memory_bus, local_store, "j-header",
                            [(10, save(weights(0))), (10, list_dtype_replica()), (30, save(weights(1)))])
    assert [c.copy for c in event.copies] == [0, 2] and [r.copy for r in event.rejected] == [1]
    assert "not valid safetensors" in event.rejected[0].reason


async def test_a_forged_model_object_with_deeply_nested_metadata_is_recomputed_over(
        memory_bus: MemoryBus, local_store: LocalStore) -> None:
    forged = save(weights(9), metadata={"job": "j-forged", "round": "0", "total_steps": "1",
                                        "copies": "[" * 100_000 + "]" * 100_000})
    await local_store.put("models/j-forged/0.safetensors", forged)
    event = await run_round(memory_bus, local_store, "j-forged", [(10, save(weights(0)))])
    assert [c.copy for c in event.copies] == [0] and event.total_steps == 10
    assert await local_store.get(event.key) != forged


# ---------------------------------------------------------------- forged and misdirected events (issue 12)


class Cluster:
    """A tracker on a MemoryBus + LocalStore, and the scheduler's and agents' side of one job."""

    def __init__(self, bus: MemoryBus, store: LocalStore, job_id: str, *, iterations: int = 10**12,
                 store_for_tracker: object | None = None, max_attempts: int = 6, group: str | None = None) -> None:
        self.bus, self.store, self.job_id = bus, store, job_id
        self.job = JobSpec(job_id=job_id, user="u", model="resnet-8", dataset="digits", batch_size=32, workers=1,
                           iterations=iterations)
        self.service = TrackerService(
            bus=bus, store=store_for_tracker or store, clock=FakeClock(T0),  # type: ignore[arg-type]
            # Completion keeps the round models here, so the final can be compared with the last one.
            config=TrackerConfig(group=group or f"tracker-{job_id}", tick_s=0.05, chunk_bytes=256,
                                 max_attempts=max_attempts, delete_completed_models=False))

    async def place(self, round_: int, nodes: list[str], budget: int = 1_000) -> None:
        at = T0 + 360 * round_
        await self.bus.publish(RoundStarted(ts=at, source="scheduler", round=round_, policy="hadare", started_at=at,
                                         ends_at=at + 360, assignments=len(nodes)))
        for copy, node in enumerate(nodes):
            await self.bus.publish(self.assignment(round_, copy, node, budget))

    def assignment(self, round_: int, copy: int, node: str, budget: int = 1_000) -> Assignment:
        at = T0 + 360 * round_
        return Assignment(ts=at, source="scheduler", round=round_, job=self.job, copy=copy, node_id=node, gpus=(0,),
                          gpu_type="V100", world_size=1, ranks=(0,), step_budget=budget, deadline=at + 360)

    async def finish(self, round_: int, copy: int, node: str, steps: int, data: bytes | None,
                     checkpoint: str | None = None, job_id: str | None = None) -> None:
        job_id = job_id or self.job_id
        key = checkpoint or checkpoint_key(job_id, round_, copy, node=node)
        if data is not None:
            await self.store.put(key, data)
        await self.bus.publish(CopyFinished(ts=T0 + 360 * round_ + 350, source=f"agent/{node}", job_id=job_id,
                                         round=round_, copy=copy, node_id=node, status="ok", steps_round=steps,
                                         checkpoint=key))

    async def models(self) -> list[Event]:
        return [d.event async for d in self.bus.read(MODELS) if getattr(d.event, "job_id", None) == self.job_id]

    async def wait_model(self, round_: int, timeout_s: float = 10.0) -> ModelConsolidated:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [e for e in await self.models() if isinstance(e, ModelConsolidated) and e.round == round_
                     and e.source == "tracker"]
            if found:
                return found[0]
            await asyncio.sleep(0.05)
        raise AssertionError(f"round {round_} never announced; health: {self.service.health()}")

    async def dead_letters(self) -> list[DeadLetter]:
        return [d.event async for d in self.bus.read(DEADLETTER) if isinstance(d.event, DeadLetter)]

    def rejected(self, reason: str) -> float:
        return self.service.registry.get_sample_value("hadar_tracker_events_rejected_total", {"reason": reason}) or 0.0


async def settle(seconds: float = 0.3) -> None:
    await asyncio.sleep(seconds)


async def test_a_copyfinished_pointing_at_another_jobs_final_model_is_dead_lettered(
        memory_bus: MemoryBus, local_store: LocalStore) -> None:
    await local_store.put(final_key("victim"), save(weights(66)))
    cluster = Cluster(memory_bus, local_store, "j-key")
    await cluster.service.start()
    try:
        await cluster.place(0, ["n0"])
        await cluster.finish(0, 0, "n0", 10, None, checkpoint=final_key("victim"))
        await settle()
        await cluster.finish(0, 0, "n0", 10, save(weights(1)))
        event = await cluster.wait_model(0)
        assert [c.copy for c in event.copies] == [0]
        assert load(await local_store.get(event.key))["w"].tobytes() == weights(1)["w"].tobytes()
        (letter,) = await cluster.dead_letters()
        assert letter.topic == PROGRESS and "bad_key" in letter.reason and "victim" in letter.reason
        assert cluster.rejected("bad_key") == 1
    finally:
        await cluster.service.stop()


async def test_copies_nobody_assigned_cannot_outvote_the_real_one(memory_bus: MemoryBus,
                                                                 local_store: LocalStore) -> None:
    other_layout = save({"x": np.ones((3, 3), dtype=np.float32)})
    cluster = Cluster(memory_bus, local_store, "j-vote")
    await cluster.service.start()
    try:
        await cluster.place(0, ["n0"])
        await cluster.finish(0, 1, "n1", 500, other_layout)
        await cluster.finish(0, 2, "n2", 500, other_layout)
        await cluster.finish(0, 0, "n0", 10, save(weights(3)))
        event = await cluster.wait_model(0)
        assert [c.copy for c in event.copies] == [0] and event.rejected == () and event.total_steps == 10
        assert sorted(d.reason.split(":")[0] for d in await cluster.dead_letters()) == ["unassigned"] * 2
        assert cluster.rejected("unassigned") == 2
    finally:
        await cluster.service.stop()


async def test_a_copy_reported_by_the_wrong_node_or_over_budget_is_dead_lettered(
        memory_bus: MemoryBus, local_store: LocalStore) -> None:
    cluster = Cluster(memory_bus, local_store, "j-node")
    await cluster.service.start()
    try:
        await cluster.place(0, ["n0"], budget=50)
        await cluster.finish(0, 0, "n7", 10, save(weights(8)))
        await cluster.finish(0, 0, "n0", 51, None)
        await settle()
        assert [e for e in await cluster.models() if isinstance(e, ModelConsolidated)] == []
        await cluster.finish(0, 0, "n0", 50, save(weights(4)))
        event = await cluster.wait_model(0)
        assert event.total_steps == 50
        assert load(await local_store.get(event.key))["w"].tobytes() == weights(4)["w"].tobytes()
        assert cluster.rejected("wrong_node") == 1 and cluster.rejected("over_budget") == 1
        assert len(await cluster.dead_letters()) == 2
    finally:
        await cluster.service.stop()


async def test_a_copyfinished_read_before_its_assignment_still_counts(memory_bus: MemoryBus,
                                                                     local_store: LocalStore) -> None:
    cluster = Cluster(memory_bus, local_store, "j-early")
    await cluster.service.start()
    try:
        await memory_bus.publish(RoundStarted(ts=T0, source="scheduler", round=0, policy="hadare", started_at=T0,
                                           ends_at=T0 + 360, assignments=2))
        await memory_bus.publish(cluster.assignment(0, 0, "n0"))
        await cluster.finish(0, 0, "n0", 30, save(weights(1)))
        await cluster.finish(0, 1, "n1", 10, save(weights(2)))   # its Assignment is still unread
        await settle()
        await memory_bus.publish(cluster.assignment(0, 1, "n1"))
        event = await cluster.wait_model(0)
        assert [(c.copy, c.steps) for c in event.copies] == [(0, 30), (1, 10)] and event.missing == ()
        assert await cluster.dead_letters() == []
    finally:
        await cluster.service.stop()


@pytest.mark.parametrize("forged", [
    dict(key="models/victim/final.safetensors"),
    dict(weights=(4.0, -3.0)),
    dict(round=2**62),
], ids=["victims-final", "weight-3", "round-2**62"])
async def test_a_forged_model_consolidated_changes_nothing(memory_bus: MemoryBus, local_store: LocalStore,
                                                           forged: dict) -> None:
    await local_store.put(final_key("victim"), save(weights(66)))
    cluster = Cluster(memory_bus, local_store, "j-forged-model", iterations=10)
    await cluster.service.start()
    try:
        await cluster.place(0, ["n0", "n1"])
        round_ = forged.get("round", 0)
        first, second = forged.get("weights", (0.5, 0.5))
        await memory_bus.publish(ModelConsolidated(
            ts=T0, source="forger", job_id="j-forged-model", round=round_,
            key=forged.get("key", model_key("j-forged-model", round_)), total_steps=10,
            copies=(CopyWeight(copy=0, steps=5, weight=first), CopyWeight(copy=1, steps=5, weight=second))))
        await settle()
        assert not await local_store.exists(final_key("j-forged-model"))
        await cluster.finish(0, 0, "n0", 5, save(weights(1)))
        await cluster.finish(0, 1, "n1", 5, save(weights(2)))
        event = await cluster.wait_model(0)
        assert event.total_steps == 10
        deadline = time.monotonic() + 10
        while not any(isinstance(e, JobCompleted) for e in await cluster.models()):
            assert time.monotonic() < deadline, "the job never completed"
            await asyncio.sleep(0.05)
        assert await local_store.get(final_key("j-forged-model")) == await local_store.get(event.key)
        (letter,) = await cluster.dead_letters()
        assert letter.topic == MODELS and sum(cluster.rejected(r) for r in
                                              ("bad_key", "bad_weights", "future_round")) == 1
    finally:
        await cluster.service.stop()


async def test_a_forged_job_completed_is_dead_lettered_and_the_job_completes_for_real(
        memory_bus: MemoryBus, local_store: LocalStore) -> None:
    await local_store.put(final_key("victim"), save(weights(66)))
    cluster = Cluster(memory_bus, local_store, "j-forged-done", iterations=10)
    await cluster.service.start()
    try:
        await memory_bus.publish(JobCompleted(ts=T0, source="forger", job_id="j-forged-done",
                                           final_key=final_key("victim"), total_steps=10, jct_s=1.0,
                                           completed_at=T0))
        await settle()
        await cluster.place(0, ["n0"])
        await cluster.finish(0, 0, "n0", 10, save(weights(1)))
        event = await cluster.wait_model(0)
        deadline = time.monotonic() + 10
        while not [e for e in await cluster.models() if isinstance(e, JobCompleted) and e.source == "tracker"]:
            assert time.monotonic() < deadline, "the job never completed"
            await asyncio.sleep(0.05)
        assert await local_store.get(final_key("j-forged-done")) == await local_store.get(event.key)
        assert cluster.rejected("bad_key") == 1 and len(await cluster.dead_letters()) == 1
    finally:
        await cluster.service.stop()


class FailingModelStore:
    """A LocalStore whose writes of one key always fail, as a store refusing that object would."""

    def __init__(self, inner: LocalStore, failing_key: str) -> None:
        self._inner = inner
        self.failing_key = failing_key
        self.failures = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def put_file(self, key: str, path: Path, *, owner: str | None = None) -> None:
        if key == self.failing_key:
            self.failures += 1
            raise OSError("store refuses this object")
        await self._inner.put_file(key, path, owner=owner)


async def test_a_round_that_fails_every_time_ends_after_the_bound_and_the_next_round_comes_due(
        memory_bus: MemoryBus, local_store: LocalStore) -> None:
    store = FailingModelStore(local_store, model_key("j-fail", 0))
    cluster = Cluster(memory_bus, local_store, "j-fail", store_for_tracker=store, max_attempts=3)
    await cluster.service.start()
    try:
        await cluster.place(0, ["n0"])
        await cluster.finish(0, 0, "n0", 10, save(weights(1)))
        await cluster.place(1, ["n0"])
        await cluster.finish(1, 0, "n0", 20, save(weights(2)))
        event = await cluster.wait_model(1)
        assert event.total_steps == 20 and store.failures == 3
        await settle()
        assert store.failures == 3    # given up: never tried again
        registry = cluster.service.registry
        assert registry.get_sample_value("hadar_tracker_errors_total", {"stage": "consolidate"}) == 3
        assert registry.get_sample_value("hadar_tracker_rounds_given_up_total") == 1
        assert [e.round for e in await cluster.models() if isinstance(e, ModelConsolidated)] == [1]
        abandoned = [e for e in await cluster.models() if isinstance(e, RoundAbandoned)]
        assert [(e.job_id, e.round) for e in abandoned] == [("j-fail", 0)]
        assert "gave up after 3 attempts" in abandoned[0].reason
    finally:
        await cluster.service.stop()
    # A restarted tracker reads the abandonment back: the round stays closed, never retried.
    again = Cluster(memory_bus, local_store, "j-fail", store_for_tracker=store, max_attempts=3, group="tracker-2")
    await again.service.start()
    try:
        await settle()
        assert store.failures == 3 and again.service.state.due_rounds(T0 + 10**6, 0) == []
    finally:
        await again.service.stop()


async def test_a_restart_counts_what_it_refuses_again_but_does_not_dead_letter_it_again(
        memory_bus: MemoryBus, local_store: LocalStore) -> None:
    ghost = Progress(ts=T0, source="forger", job_id="ghost", round=0, copy=0, node_id="n0", gpu_type="V100",
                     workers=1, steps_round=1, steps_total=1, samples_per_s=1.0, loss=1.0)
    first = Cluster(memory_bus, local_store, "j-replay", group="tracker-replay")
    await first.service.start()
    await first.place(0, ["n0"])
    await memory_bus.publish(ghost)
    await first.finish(0, 0, "n9", 10, save(weights(1)))
    await first.finish(0, 0, "n0", 10, save(weights(1)))
    await first.wait_model(0)
    await first.service.stop()
    assert first.rejected("unassigned") == 1 and first.rejected("wrong_node") == 1
    assert len(await first.dead_letters()) == 2

    second = Cluster(memory_bus, local_store, "j-replay", group="tracker-replay")
    await second.service.start()
    try:
        await settle()
        # The ghost is refused again; the misdirected report is merely late now (its round is decided).
        assert second.rejected("unassigned") == 1 and second.rejected("wrong_node") == 0
        assert len(await second.dead_letters()) == 2
        assert len([e for e in await second.models() if isinstance(e, ModelConsolidated)]) == 1
    finally:
        await second.service.stop()


async def test_progress_for_many_unknown_jobs_is_dead_lettered_and_leaves_the_state_bounded(
        memory_bus: MemoryBus, local_store: LocalStore) -> None:
    cluster = Cluster(memory_bus, local_store, "j-flood")
    await cluster.service.start()
    try:
        before = cluster.service.state.sizes()
        for i in range(500):
            await memory_bus.publish(Progress(ts=T0, source="forger", job_id=f"ghost-{i}", round=0, copy=0,
                                           node_id="n0", gpu_type="V100", workers=1, steps_round=1, steps_total=1,
                                           samples_per_s=1.0, loss=1.0))
        deadline = time.monotonic() + 10
        while cluster.rejected("unassigned") < 500:
            assert time.monotonic() < deadline, cluster.rejected("unassigned")
            await asyncio.sleep(0.05)
        after = cluster.service.state.sizes()
        assert (after["jobs"], after["open_rounds"], after["pending"]) == (before["jobs"], 0, 0)
        assert len(await cluster.dead_letters()) == 500
    finally:
        await cluster.service.stop()


async def test_a_round_with_no_usable_replica_is_announced_as_abandoned_and_the_next_round_comes_due(
        memory_bus: MemoryBus, local_store: LocalStore) -> None:
    cluster = Cluster(memory_bus, local_store, "j-empty")
    await cluster.service.start()
    try:
        await cluster.place(0, ["n0"])
        await cluster.finish(0, 0, "n0", 10, b"not a safetensors file at all")
        await cluster.place(1, ["n0"])
        await cluster.finish(1, 0, "n0", 20, save(weights(2)))
        assert (await cluster.wait_model(1)).total_steps == 20
        abandoned = [e for e in await cluster.models() if isinstance(e, RoundAbandoned)]
        assert [(e.round, e.reason) for e in abandoned] == [(0, "no usable replica")]
        assert [r.copy for r in abandoned[0].rejected] == [0]
    finally:
        await cluster.service.stop()
