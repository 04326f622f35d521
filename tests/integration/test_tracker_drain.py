"""A drain cut short stops the round's averaging with it (issue #13, item 4; in-process).

``run_service`` gives ``stop()`` ``--drain-timeout-s`` and then cancels it. The averaging
runs in a worker thread that a cancelled coroutine cannot stop by itself: unless it is
told to, it keeps reading replicas from the store and writing into a staging directory
that the cancelled coroutine has already removed. Here a round is averaged from a store
whose ranged reads are slow (each read is counted), the drain is cut short while it
averages, and: no read starts after ``stop()`` returned, the staging directory is empty,
nothing is announced or stored, and the next tracker consolidates the round once.
(``test_tracker_sigterm.py`` does the same through SIGTERM to a real process.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from services.tracker.service import TrackerConfig, TrackerService
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.domain.layout import checkpoint_key, model_key, model_prefix
from shared.store import LocalStore
from shared.wire.events import CopyFinished, JobSubmitted, ModelConsolidated
from tests.integration.test_tracker_service import (
    T0,
    consolidations,
    models_events,
    place,
    spec,
    wait_for,
)

STEPS = (30, 20, 10)
READ_S = 0.005           # each ranged read of the slow store
CHUNK_BYTES = 4096       # 64 reads per replica of 256 KiB: about a second of averaging


class SlowReads:
    """A LocalStore whose ranged reads take READ_S each and are counted (a store far away)."""

    def __init__(self, inner: LocalStore) -> None:
        self._inner = inner
        self.reads = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        self.reads += 1
        await asyncio.sleep(READ_S)
        return await self._inner.get_range(key, offset, length)


@pytest.fixture
async def memory_bus() -> AsyncIterator[MemoryBus]:
    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()
    yield bus
    await bus.stop()


def tracker(bus: MemoryBus, store: object, staging: Path, chunk_bytes: int = CHUNK_BYTES) -> TrackerService:
    config = TrackerConfig(group="tracker-drain", tick_s=0.05, finish_timeout_s=3600.0, chunk_bytes=chunk_bytes,
                           temp_dir=str(staging), snapshot_every=0)
    return TrackerService(bus=bus, store=store, config=config, clock=FakeClock(T0 + 1000))  # type: ignore[arg-type]


async def test_a_drain_cut_short_stops_the_averaging_and_the_next_tracker_consolidates_once(
        memory_bus: MemoryBus, local_store: LocalStore, tmp_path: Path) -> None:
    job = spec("j-drain", iterations=sum(STEPS))
    staging = tmp_path / "staging"
    staging.mkdir()
    slow = SlowReads(local_store)
    first = tracker(memory_bus, slow, staging)
    await memory_bus.publish(JobSubmitted(ts=T0, source="cli", job=job, submitted_at=T0))
    await first.start()
    stopped = False
    try:
        await place(memory_bus, job, 0, list(range(len(STEPS))))
        for copy, steps in enumerate(STEPS):
            key = checkpoint_key("j-drain", 0, copy, node=f"n{copy}")
            weights = np.random.default_rng(copy).standard_normal(64 << 10).astype(np.float32)
            await local_store.put(key, save({"w": weights}))
            await memory_bus.publish(CopyFinished(ts=T0 + 350, source=f"agent/n{copy}", job_id="j-drain", round=0,
                                               copy=copy, node_id=f"n{copy}", status="ok", steps_round=steps,
                                               checkpoint=key))
        deadline = time.monotonic() + 30
        while slow.reads < 3 * len(STEPS) + 8:   # headers read, averaging under way
            assert time.monotonic() < deadline, "the round was never averaged"
            await asyncio.sleep(0.01)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(first.stop(), 0.05)   # what run_service does when the drain overruns
        stopped = True
        at_stop = slow.reads
        await asyncio.sleep(20 * READ_S)
        assert slow.reads == at_stop, "the averaging went on reading after the drain ended"
        assert list(staging.iterdir()) == []
        assert await models_events(memory_bus, "j-drain") == []
        assert await local_store.list(model_prefix("j-drain")) == []
    finally:
        if not stopped:
            await first.stop()

    second = tracker(memory_bus, local_store, staging, chunk_bytes=1 << 20)
    await second.start()
    try:
        events = await wait_for(memory_bus, "j-drain", lambda es: bool(consolidations(es)))
        (model,) = consolidations(events)
        assert isinstance(model, ModelConsolidated) and model.key == model_key("j-drain", 0)
        assert model.total_steps == sum(STEPS) and [c.copy for c in model.copies] == [0, 1, 2]
    finally:
        await second.stop()
