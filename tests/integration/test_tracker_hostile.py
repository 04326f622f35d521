"""The tracker service on hostile replicas (MemoryBus + LocalStore, no servers needed).

Each scenario used to stall the job: the round raised, stayed due and was retried forever.
Now the offending copy is rejected with a reason and the round is announced.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
from safetensors.numpy import load, save

from services.tracker.service import TrackerConfig, TrackerService
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.events import Assignment, CopyFinished, JobSpec, ModelConsolidated, RoundStarted
from shared.store import LocalStore

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
                    copies: list[tuple[int, bytes]]) -> ModelConsolidated:
    """Place ``copies`` (steps, checkpoint bytes) in round 0, finish them, await the model.

    Fails if any attempt to consolidate raised (the round must succeed the first time)."""
    job = JobSpec(job_id=job_id, user="u", model="resnet-8", dataset="digits", batch_size=32, workers=1,
                  iterations=10**12)
    service = TrackerService(bus=bus, store=store, clock=FakeClock(T0),
                             config=TrackerConfig(group=f"tracker-{job_id}", tick_s=0.05, chunk_bytes=256))
    await service.start()
    try:
        await bus.emit(RoundStarted(ts=T0, source="scheduler", round=0, policy="hadare", started_at=T0,
                                    ends_at=T0 + 360, assignments=len(copies)))
        for copy, (steps, data) in enumerate(copies):
            await bus.emit(Assignment(ts=T0, source="scheduler", round=0, job=job, copy=copy, node_id=f"n{copy}",
                                      gpus=(0,), gpu_type="V100", world_size=1, ranks=(0,), step_budget=100,
                                      deadline=T0 + 360))
            key = f"checkpoints/{job_id}/0/{copy}.safetensors"
            await store.put(key, data)
            await bus.emit(CopyFinished(ts=T0 + 350, source=f"agent/n{copy}", job_id=job_id, round=0, copy=copy,
                                        node_id=f"n{copy}", status="ok", steps_round=steps, checkpoint=key))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            found = [d.event async for d in bus.read("hadar.models")
                     if isinstance(d.event, ModelConsolidated) and d.event.job_id == job_id]
            if found:
                assert service.registry.get_sample_value("tracker_errors_total", {"stage": "consolidate"}) is None
                return found[0]
            await asyncio.sleep(0.05)
        raise AssertionError(f"round never announced; last error: {service.health()['last_error']}")
    finally:
        await service.stop()


async def test_a_copy_claiming_2_64_minus_1_steps_is_rejected_and_the_round_announced(
        memory_bus: MemoryBus, local_store: LocalStore) -> None:
    event = await run_round(memory_bus, local_store, "j-steps",
                            [(2**64 - 1, save(weights(0))), (10, save(weights(1))), (30, save(weights(2)))])
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
