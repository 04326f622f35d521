"""Profiler restarts from a state snapshot (MemoryBus + LocalStore): only the records after
the snapshot are replayed, no job is estimated twice, smoothing resumes from the saved EWMA,
and a damaged snapshot falls back to the whole topics."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from services.profiler.service import ProfilerConfig, ProfilerService
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.domain.layout import snapshot_key
from shared.persistence.snapshot import dump, load
from shared.store import LocalStore
from shared.wire.events import JobSpec, JobSubmitted, Progress, ThroughputEstimate
from shared.wire.topics import THROUGHPUT

CONFIG = ProfilerConfig(group="prof-snap", snapshot_interval_s=0, alpha=0.5, threshold=0.0)
# Estimates per job: one at submission, and one from each of a's two published measurements (on
# a real V100: they re-estimate its other types). A restart that estimated a job again adds one.
ESTIMATED = {"a": 3, "b": 1, "c": 1, "d": 1}


def spec(job: str) -> JobSpec:
    return JobSpec(job_id=job, user="u", model="resnet", dataset="digits", batch_size=32, workers=1, iterations=100)


def progress(clock: FakeClock, job: str, steps: int) -> Progress:
    return Progress(ts=clock.time(), source="agent", job_id=job, round=0, copy=0, node_id="n1", gpu_type="v100",
                    workers=1, steps_round=steps, steps_total=steps, samples_per_s=0.0, loss=0.5)


async def estimates(bus: MemoryBus) -> dict[str, int]:
    found: dict[str, int] = {}
    async for d in bus.read(THROUGHPUT):
        if isinstance(d.event, ThroughputEstimate) and d.event.basis == "estimate":
            found[d.event.job_id] = found.get(d.event.job_id, 0) + 1
    return found


async def until(predicate) -> None:
    """Wait (generously: estimates run in a thread on a loaded machine) for ``predicate``."""
    async with asyncio.timeout(60):
        while not await predicate():
            await asyncio.sleep(0.01)


async def run_and_restart(tmp_path, damage=None) -> tuple[ProfilerService, MemoryBus, float]:
    bus, clock, store = MemoryBus(), FakeClock(), LocalStore(tmp_path)
    await bus.start()
    await store.start()
    first = ProfilerService(bus=bus, config=CONFIG, clock=clock, store=store)
    await first.start()
    for job in ("a", "b", "c"):
        await bus.publish(JobSubmitted(ts=clock.time(), source="cli", job=spec(job), submitted_at=clock.time()))
    await until(lambda: _has(bus, {"a", "b", "c"}))
    for steps in (0, 100, 300):            # 10 then 20 steps/s: EWMA 15 with alpha 0.5
        await bus.publish(progress(clock, "a", steps))
        await until(lambda steps=steps: _true(first.state.rate("a", "v100", 1) is not None or steps == 0))
        clock.advance(10)
    await until(lambda: _true(first.state.rate("a", "v100", 1) == pytest.approx(15.0)))
    await first.write_snapshot()
    await first.stop()
    if damage is not None:
        await damage(store)
    await bus.publish(JobSubmitted(ts=clock.time(), source="cli", job=spec("d"), submitted_at=clock.time()))
    again = ProfilerService(bus=bus, config=CONFIG, clock=clock, store=store)
    await again.start()
    await until(lambda: _has(bus, {"a", "b", "c", "d"}))
    await again.stop()
    return again, bus, again.state.rate("a", "v100", 1)


async def _has(bus: MemoryBus, jobs: set[str]) -> bool:
    return set(await estimates(bus)) >= jobs


async def _true(value: bool) -> bool:
    return value


async def test_restart_replays_only_what_follows_the_snapshot(tmp_path):
    again, bus, rate = await run_and_restart(tmp_path)
    assert again.recovery["snapshot"] is not None
    assert again.recovery["records"] == 1          # only d's submission follows the snapshot
    assert await estimates(bus) == ESTIMATED   # none estimated twice
    assert rate == pytest.approx(15.0)


async def test_a_profiler_snapshot_written_before_names_were_stable_restores(tmp_path):
    # The same first run's snapshot, as the code before the layout change wrote it
    # (classes named by module path: tests/data/snapshots/README.md).
    legacy = (Path(__file__).resolve().parents[1] / "data" / "snapshots" / "profiler.snapshot").read_bytes()
    assert b"services.profiler." in legacy

    async def written_before(store):
        (key,) = await store.list("snapshots/")
        await store.put(key, legacy)

    again, bus, rate = await run_and_restart(tmp_path, damage=written_before)
    assert again.recovery["snapshot"] is not None and again.recovery["skipped"] == []
    # d's submission, and the two re-estimates of a past the offsets that snapshot covers (the
    # code that wrote it published no re-estimate from a measurement on a real GPU)
    assert again.recovery["records"] == 3
    assert await estimates(bus) == ESTIMATED
    assert rate == pytest.approx(15.0)             # the EWMA the old snapshot carried


async def test_a_damaged_snapshot_falls_back_to_the_whole_topics(tmp_path):
    async def flip(store):
        (key,) = await store.list("snapshots/")
        data = bytearray(await store.get(key))
        data[-3] ^= 0xFF
        await store.put(key, bytes(data))

    again, bus, rate = await run_and_restart(tmp_path, damage=flip)
    assert again.recovery["snapshot"] is None and len(again.recovery["skipped"]) == 1
    assert again.recovery["records"] >= 8          # 3 estimates, a measured rate, 4 jobs
    assert await estimates(bus) == ESTIMATED
    assert rate == pytest.approx(15.0)             # the last published rate, seeded from the topic


async def test_a_snapshot_named_by_the_old_scheme_still_loads_and_new_ones_come_after(tmp_path):
    old_key = snapshot_key("prof-snap", 1_764_612_345_678)

    async def old_name(store):   # as the profiler named it before one scheme: by clock milliseconds
        (key,) = await store.list("snapshots/")
        snap = load(await store.get(key), service="profiler")
        await store.put(old_key, dump(replace(snap, seq=1_764_612_345_678)))
        await store.delete(key)

    again, bus, rate = await run_and_restart(tmp_path, damage=old_name)
    assert again.recovery["snapshot"] == old_key and again.recovery["records"] == 1
    assert await estimates(bus) == ESTIMATED
    assert rate == pytest.approx(15.0)
    await again.write_snapshot()
    keys = [key for _, key in await again.snapshots.keys()]
    assert keys == [snapshot_key("prof-snap", 1_764_612_345_679), old_key]   # the new one is the newest
