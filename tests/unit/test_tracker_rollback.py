"""A job whose model is ruined is never stuck for good (services/tracker/rollback.py): after
three rounds in a row that ran and left no usable replica, the tracker announces the job's
last model that trained as the next round's model, with the steps that model holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import numpy as np
import pytest
from safetensors.numpy import load, save
from tracker_events import T0, assignment, consolidated, finished, fold, spec, started, submitted

from services.tracker.due import RollbackTarget
from services.tracker.lifecycle import ObjectLifecycle
from services.tracker.rollback import ROLLBACK_AFTER_ROUNDS
from services.tracker.service import TrackerConfig, TrackerService
from services.tracker.snapshot import capture, restore
from services.tracker.state import TrackerState
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.domain.layout import checkpoint_key, model_key
from shared.persistence.snapshot import dump
from shared.persistence.snapshot import load as load_snapshot
from shared.store import LocalStore
from shared.wire.events import (
    CopyFinished,
    Event,
    JobSubmitted,
    ModelConsolidated,
    RoundAbandoned,
    RoundStarted,
)
from shared.wire.records import Rejection
from shared.wire.topics import MODELS

JOB = spec(iterations=10_000)
DIVERGED = "copy failed: DivergedError: training diverged: loss is nan"


def placed(round_: int, copies: int = 2, start: int | None = None) -> list[Event]:
    """Round ``round_``'s RoundStarted and Assignments, from model ``start`` (None: seed)."""
    key = None if start is None else model_key("j1", start)
    return [started(round_, copies), *(replace(assignment(c, round_=round_, job=JOB), start_from=key)
                                      for c in range(copies))]


def barren(round_: int, start: int) -> list[Event]:
    """A round whose two copies diverged, and its RoundAbandoned."""
    return [*placed(round_, start=start), finished(0, 3, round_=round_, status="failed"),
            finished(1, 2, round_=round_, status="failed"),
            RoundAbandoned(ts=T0 + 400 + round_ * 360, source="tracker", job_id="j1", round=round_,
                           reason="no usable replica", rejected=(Rejection(copy=0, reason=DIVERGED),
                                                                 Rejection(copy=1, reason=DIVERGED)))]


# Round 0 trains from seed (model 0: 200 steps); round 1 from model 0 takes a planted replica
# credited 500 steps (model 1, ruined); rounds 2.. from model 1 diverge.
HISTORY: list[Event] = [
    submitted(JOB), *placed(0), finished(0, 100), finished(1, 100), consolidated(0, {0: 100, 1: 100}, 200),
    *placed(1, start=0), finished(0, 100, round_=1), finished(1, 500, round_=1),
    consolidated(1, {0: 100, 1: 500}, 800),
    *barren(2, start=1), *barren(3, start=1),
]


def due(state: TrackerState, round_: int) -> object:
    for event in [*placed(round_, start=1), finished(0, 3, round_=round_, status="failed"),
                  finished(1, 2, round_=round_, status="failed")]:
        state.apply(event)
    (work,) = state.due_rounds(T0 + 1e6, 60.0)
    assert work.round == round_ and work.start_from == model_key("j1", 1)
    return work.rollback


def rolled_back(round_: int, total: int) -> ModelConsolidated:
    return consolidated(round_, {0: 0}, total, weights={0: 1.0})


def test_the_third_barren_round_in_a_row_rolls_back_to_the_last_model_that_trained() -> None:
    assert ROLLBACK_AFTER_ROUNDS == 3
    state = fold(HISTORY[:-len(barren(3, 1))])
    assert due(state, 3) is None   # the second barren round: not yet
    state = fold(HISTORY)
    assert due(state, 4) == RollbackTarget(key=model_key("j1", 0), worker_steps=200)


def test_a_rollback_takes_the_steps_back_and_is_not_repeated() -> None:
    state = fold(HISTORY)
    assert state.consolidated_steps("j1") == 800
    due(state, 4)
    state.apply(rolled_back(4, 200))
    assert state.consolidated_steps("j1") == 200
    # the rolled-back model fails as well: rounds are abandoned as before, never rolled back again
    for round_ in (5, 6, 7, 8):
        for event in barren(round_, start=4):
            state.apply(event)
        assert state.drain_refusals() == []
    for event in [*placed(9, start=4), finished(0, 1, round_=9, status="failed")]:
        state.apply(event)
    (work,) = state.due_rounds(T0 + 1e6, 60.0)
    assert work.rollback is None
    # ... until it trains: then a ruin after it rolls back to it
    state.apply(finished(1, 50, round_=9))
    state.apply(consolidated(9, {1: 50}, 250))
    assert state.consolidated_steps("j1") == 250
    for round_ in (10, 11):
        for event in barren(round_, start=9):
            state.apply(event)
    for event in [*placed(12, start=9), finished(0, 1, round_=12, status="failed")]:
        state.apply(event)
    (work,) = state.due_rounds(T0 + 1e6, 60.0)
    assert work.rollback == RollbackTarget(key=model_key("j1", 4), worker_steps=200)


def test_rounds_whose_copies_never_reported_do_not_count() -> None:
    lost = [RoundAbandoned(ts=T0 + 3000, source="tracker", job_id="j1", round=r, reason="no usable replica",
                           missing=(0, 1)) for r in (2, 3)]
    state = fold([*HISTORY[:-2 * len(barren(2, 1))], *placed(2, start=1), lost[0], *placed(3, start=1), lost[1]])
    assert due(state, 4) is None


def test_the_rollback_state_survives_a_snapshot() -> None:
    whole = fold(HISTORY)
    snap = capture(whole, ObjectLifecycle(), {"hadar.models:0": len(HISTORY)}, wall_now=T0, mono_now=1.0)
    assert snap is not None
    resumed = TrackerState()
    restore(load_snapshot(dump(snap), service="tracker"), resumed, ObjectLifecycle(), wall_now=T0, mono_now=1.0)
    assert due(resumed, 4) == due(whole, 4) == RollbackTarget(key=model_key("j1", 0), worker_steps=200)


# ---------------------------------------------------------------- the tracker service, end to end


@pytest.fixture
async def memory_bus() -> AsyncIterator[MemoryBus]:
    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()
    yield bus
    await bus.stop()


def weights(seed: int, base: dict[str, np.ndarray] | None = None, scale: float = 0.01) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if base is None:
        return {"w": rng.standard_normal((16, 8)).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32)}
    return {k: (v + scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()}


class Cluster:
    """Places rounds and reports copies on a MemoryBus + LocalStore, as scheduler and agents."""

    def __init__(self, bus: MemoryBus, store: LocalStore) -> None:
        self.bus, self.store = bus, store
        self.job = replace(JOB, job_id="jr")

    async def place(self, round_: int, copies: int, start: int | None) -> None:
        at = T0 + 360 * round_
        await self.bus.publish(RoundStarted(ts=at, source="scheduler", round=round_, policy="hadare", started_at=at,
                                            ends_at=at + 360, assignments=copies))
        for c in range(copies):
            await self.bus.publish(replace(assignment(c, round_=round_, node=f"n{c}", job=self.job), ts=at,
                                           start_from=None if start is None else model_key("jr", start)))

    async def finish(self, round_: int, copy: int, steps: int, tensors: dict[str, np.ndarray] | None) -> None:
        key = checkpoint_key("jr", round_, copy, node=f"n{copy}") if tensors is not None else None
        if tensors is not None:
            assert key is not None
            await self.store.put(key, save(tensors))
        await self.bus.publish(CopyFinished(
            ts=T0 + 360 * round_ + 350, source=f"agent/n{copy}", job_id="jr", round=round_, copy=copy,
            node_id=f"n{copy}", status="ok" if tensors is not None else "failed", steps_round=steps,
            checkpoint=key, reason="" if tensors is not None else "DivergedError: training diverged: loss is nan"))

    async def decided(self, round_: int) -> ModelConsolidated | RoundAbandoned:
        return (await self.wait(lambda es: [e for e in es if getattr(e, "round", None) == round_]))[0]

    async def wait(self, pick: Callable[[list[Event]], list[Event]]) -> list:
        deadline = time.monotonic() + 20
        while True:
            events = [d.event for d in [x async for x in self.bus.read(MODELS)]
                      if getattr(d.event, "job_id", None) == "jr"]
            if found := pick(events):
                return found
            assert time.monotonic() < deadline, f"timed out; hadar.models has {events}"
            await asyncio.sleep(0.05)


async def test_a_planted_replica_is_screened_out_and_a_ruined_job_is_rolled_back(memory_bus: MemoryBus,
                                                                                 local_store: LocalStore) -> None:
    cluster = Cluster(memory_bus, local_store)
    await memory_bus.publish(JobSubmitted(ts=T0 - 100, source="cli", job=cluster.job, submitted_at=T0 - 100))
    service = TrackerService(bus=memory_bus, store=local_store, clock=FakeClock(T0 + 1000), config=TrackerConfig(
        group="tracker-rollback", tick_s=0.05, finish_timeout_s=3600.0, chunk_bytes=256))
    await service.start()
    try:
        init = weights(0)
        await cluster.place(0, 2, None)
        for c in (0, 1):
            await cluster.finish(0, c, 100, weights(10 + c, init))
        model0 = await cluster.decided(0)
        assert isinstance(model0, ModelConsolidated) and model0.total_steps == 200
        start0 = load(await local_store.get(model0.key))

        # Round 1: copy 1's checkpoint holds another job's weights and claims 5x the steps.
        await cluster.place(1, 2, 0)
        await cluster.finish(1, 0, 100, weights(20, start0))
        await cluster.finish(1, 1, 500, weights(99))
        model1 = await cluster.decided(1)
        assert isinstance(model1, ModelConsolidated) and [c.copy for c in model1.copies] == [0]
        assert model1.total_steps == 300 and [r.copy for r in model1.rejected] == [1]
        assert "more than 4x the round's median" in model1.rejected[0].reason
        metrics = service.registry.get_sample_value
        assert metrics("hadar_tracker_replicas_screened_total", {"rule": "out_of_line"}) == 1
        good = load(await local_store.get(model1.key))

        # Round 2: one copy, moved within the cap, is averaged (a ruin the screen cannot see) ...
        await cluster.place(2, 1, 1)
        await cluster.finish(2, 0, 100, weights(30, good, scale=1.0))
        assert isinstance(await cluster.decided(2), ModelConsolidated)
        # ... and every copy started from it diverges: two rounds abandoned, the third rolled back.
        for round_ in (3, 4, 5):
            await cluster.place(round_, 2, 2)
            await cluster.finish(round_, 0, 0, None)
            await cluster.finish(round_, 1, 0, None)
        assert isinstance(await cluster.decided(3), RoundAbandoned)
        assert isinstance(await cluster.decided(4), RoundAbandoned)
        rollback = await cluster.decided(5)
        assert isinstance(rollback, ModelConsolidated) and rollback.key == model_key("jr", 5)
        assert rollback.total_steps == 300 and [(c.copy, c.steps, c.weight) for c in rollback.copies] == [(0, 0, 1.0)]
        assert [(r.copy, r.reason) for r in rollback.rejected] == [
            (1, "copy failed: DivergedError: training diverged: loss is nan")]
        restored = load(await local_store.get(rollback.key))
        for name, tensor in good.items():
            np.testing.assert_array_equal(restored[name], tensor)
        assert metrics("hadar_tracker_rollbacks_total") == 1

        # The job trains again from the rolled-back model.
        await cluster.place(6, 1, 5)
        await cluster.finish(6, 0, 50, weights(40, good))
        model6 = await cluster.decided(6)
        assert isinstance(model6, ModelConsolidated) and model6.total_steps == 350 and not model6.rejected
        assert service.state.consolidated_steps("jr") == 350
    finally:
        await service.stop()
