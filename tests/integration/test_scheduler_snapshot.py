"""Scheduler restarts from state snapshots (MemoryBus + LocalStore): it replays only what
follows the newest valid snapshot, falls back past a damaged one, keeps a bounded number,
and decides every round exactly as a scheduler that never stopped."""

from __future__ import annotations

import asyncio
import struct
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.live.rerun import assignment_decision
from services.scheduler.live.scripted_cluster import ScriptedCluster
from services.scheduler.live.service import SchedulerService
from services.scheduler.policies import POLICY_NAMES
from shared.bus import MemoryBus
from shared.bus.base import dead_letter
from shared.clock import FakeClock
from shared.domain.layout import snapshot_key
from shared.persistence.snapshot import MAGIC, SnapshotStore, dump, load
from shared.store import LocalStore
from shared.wire.events import Assignment, QueueConfig, QueuesApplied, QueueSpec
from shared.wire.topics import JOBS, PLACEMENTS

ROUND_S = 60.0
# With snapshot_every=3 and a stop after round 7, snapshots were taken after rounds 2 and 5:
# the store numbers them 1 and 2.
AFTER_ROUND_2, AFTER_ROUND_5 = snapshot_key("sched-snap", 1), snapshot_key("sched-snap", 2)


def config(policy: str, **extra) -> SchedulerConfig:
    return SchedulerConfig(policy=policy, round_s=ROUND_S, heartbeat_s=ROUND_S, consolidation_wait_s=0,
                           group="sched-snap", **extra)


def contended(bus: MemoryBus, clock: FakeClock, queues: tuple[str, ...] = ()) -> ScriptedCluster:
    """A job a round, each needing many rounds: queues form, so carried policy state matters
    (a restart that dropped it decides differently: checked by hand for every policy)."""
    return ScriptedCluster(bus=bus, clock=clock, job_every=1, steps_per_copy=15, queues=queues)


TEAMS = QueueConfig(queues=(QueueSpec(name="vision", weight=2.0, quota={"v100": 2}, borrowing_limit=2),
                            QueueSpec(name="audio")), default_queue="audio")


async def _teams(bus: MemoryBus, clock: FakeClock) -> ScriptedCluster:
    await bus.publish(QueuesApplied(ts=clock.time(), source="cli/admin", config=TEAMS))
    return contended(bus, clock, queues=("vision", "audio", "vision"))


async def settle(predicate) -> None:
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("the scheduler did not fold its inputs")


async def play(service: SchedulerService, cluster: ScriptedCluster, clock: FakeClock, rounds: range) -> None:
    for r in rounds:
        kept = service.state.rounds.get(r - 1)
        await cluster.before_round(r, list(kept.assignments) if kept is not None else [])
        await settle(lambda: service.records_folded >= cluster.published)
        await service.plan_round()
        clock.advance(ROUND_S)


async def decisions(bus: MemoryBus) -> dict[int, tuple]:
    by_round: dict[int, list[Assignment]] = defaultdict(list)
    async for d in bus.read(PLACEMENTS):
        if isinstance(d.event, Assignment):
            by_round[d.event.round].append(d.event)
    return {r: assignment_decision(a) for r, a in sorted(by_round.items())}


async def uninterrupted(policy: str, rounds: int, teams: bool = False) -> dict[int, tuple]:
    bus, clock = MemoryBus(), FakeClock()
    await bus.start()
    service = SchedulerService(bus=bus, config=config(policy), clock=clock, run_rounds=False)
    await service.start()
    cluster = await _teams(bus, clock) if teams else contended(bus, clock)
    await play(service, cluster, clock, range(rounds))
    await service.stop()
    return await decisions(bus)


async def interrupted(policy: str, rounds: int, stop_after: int, tmp_path, damage=None, teams: bool = False,
                      **extra):
    """Run ``stop_after`` rounds, stop, optionally damage the newest snapshot, restart, run the rest."""
    bus, clock = MemoryBus(), FakeClock()
    store = LocalStore(tmp_path)
    await bus.start()
    await store.start()
    cfg = config(policy, **extra)
    cluster = await _teams(bus, clock) if teams else contended(bus, clock)
    first = SchedulerService(bus=bus, config=cfg, clock=clock, run_rounds=False, store=store)
    await first.start()
    await play(first, cluster, clock, range(stop_after))
    await first.stop()
    if damage is not None:
        await damage(store)
    again = SchedulerService(bus=bus, config=cfg, clock=clock, run_rounds=False, store=store)
    await again.start()
    assert again.next_round == stop_after
    await play(again, cluster, clock, range(stop_after, rounds))
    await again.stop()
    return again, await decisions(bus), store


@pytest.mark.parametrize("policy", POLICY_NAMES)
async def test_restart_from_a_snapshot_replays_only_what_follows_and_decides_identically(policy, tmp_path):
    # Snapshots after rounds 2 and 5; stopped after round 7: rounds 6 and 7 are re-derived.
    again, got, _ = await interrupted(policy, 14, 8, tmp_path, snapshot_every=3)
    assert again.recovery["snapshot"] == AFTER_ROUND_5
    assert again.recovery["rounds_rederived"] == 2 and again.recovery["differing_rounds"] == []
    reference = await uninterrupted(policy, 14)
    assert got == reference
    assert any(got.values()), "the workload must place jobs"


@pytest.mark.parametrize("policy", POLICY_NAMES)
async def test_under_team_queues_a_restart_from_a_snapshot_decides_identically(policy, tmp_path):
    again, got, _ = await interrupted(policy, 14, 8, tmp_path, snapshot_every=3, teams=True)
    assert again.recovery["snapshot"] == AFTER_ROUND_5
    assert again.recovery["rounds_rederived"] == 2 and again.recovery["differing_rounds"] == []
    assert again.state.queues == TEAMS
    assert got == await uninterrupted(policy, 14, teams=True)
    assert got != await uninterrupted(policy, 14), "the queues must change the decisions"


LEGACY = Path(__file__).resolve().parents[1] / "data" / "snapshots"
# The policies the code of tests/data/snapshots/README.md had (later ones have no legacy snapshot).
LEGACY_POLICIES = ("yarn-cs", "tiresias", "gavel", "gavel-makespan", "hadar", "hadare")
# Policies that decide this scenario differently since then: their old state is still
# adopted, but what today's code decides from it is not what today's code decided from its own.
DECIDES_DIFFERENTLY_SINCE = {
    "hadar": "2026-12-06: its LPs' per-type-set gang rows (lp/gang_cuts.py) change rounds 1-5 here",
    "hadare": "2026-12-06: its timeline keeps each job on the types its copies ran on (KEEP_ROUNDS), "
              "which changes rounds 1-5 here",
}


@pytest.mark.parametrize("policy", LEGACY_POLICIES)
async def test_a_snapshot_written_before_names_were_stable_restores(policy, tmp_path):
    """The snapshot after round 5 as the code before the layout change wrote it (classes
    named by module path: tests/data/snapshots/README.md) stands in for today's: the
    restarted scheduler takes it, re-derives rounds 6 and 7 identically and then decides
    every round as a scheduler that never stopped -- for a policy that decides this
    scenario as it did then; one that does not still takes the old state, and finds the
    rounds that followed it differ (DECIDES_DIFFERENTLY_SINCE)."""
    legacy = (LEGACY / f"scheduler-{policy}.snapshot").read_bytes()
    assert b"services.scheduler." in legacy            # the old, module-path names

    async def written_before(store):
        await store.put(AFTER_ROUND_5, legacy)

    again, got, _ = await interrupted(policy, 14, 8, tmp_path, damage=written_before, snapshot_every=3)
    assert again.recovery["snapshot"] == AFTER_ROUND_5 and again.recovery["skipped"] == []
    assert again.recovery["rounds_rederived"] == 2
    if policy in DECIDES_DIFFERENTLY_SINCE:
        assert again.recovery["differing_rounds"] == [6, 7], DECIDES_DIFFERENTLY_SINCE[policy]
        return
    assert again.recovery["differing_rounds"] == []
    assert got == await uninterrupted(policy, 14)


async def _truncate(store):
    key = AFTER_ROUND_5
    data = await store.get(key)
    await store.put(key, data[: len(data) - 7])


async def _flip(store):
    key = AFTER_ROUND_5
    data = bytearray(await store.get(key))
    data[len(data) // 2] ^= 0x40
    await store.put(key, bytes(data))


async def _version(store):
    key = AFTER_ROUND_5
    data = await store.get(key)
    await store.put(key, MAGIC + struct.pack(">H", 99) + data[10:])


@pytest.mark.parametrize("damage", [_truncate, _flip, _version], ids=["truncated", "flipped", "version"])
async def test_a_damaged_snapshot_falls_back_to_the_previous_one(damage, tmp_path):
    again, got, _ = await interrupted("hadar", 12, 8, tmp_path, damage=damage, snapshot_every=3)
    assert again.recovery["snapshot"] == AFTER_ROUND_2
    assert again.recovery["skipped"] == [AFTER_ROUND_5]
    assert again.recovery["rounds_rederived"] == 5 and again.recovery["differing_rounds"] == []
    assert got == await uninterrupted("hadar", 12)


async def test_without_a_valid_snapshot_the_whole_log_is_replayed(tmp_path):
    async def ruin_all(store):
        for key in await store.list("snapshots/"):
            await store.put(key, b"garbage")

    again, got, _ = await interrupted("gavel", 9, 7, tmp_path, damage=ruin_all, snapshot_every=2)
    assert again.recovery["snapshot"] is None and len(again.recovery["skipped"]) == 3
    assert again.recovery["rounds_rederived"] == 7
    assert got == await uninterrupted("gavel", 9)


async def _old_names(store):
    """Rewrite the snapshots as the scheduler wrote them before one numbering scheme: named
    by the round they follow (the number in the file too), without dead-letter origins or
    hadar.deadletter offsets."""
    for _, key in await SnapshotStore(store, owner="sched-snap", service="scheduler").keys():
        snap = load(await store.get(key), service="scheduler")
        offsets = {tp: o for tp, o in snap.offsets.items() if not tp.startswith("hadar.deadletter:")}
        by_round = replace(snap, seq=snap.body.next_round - 1, offsets=offsets,
                           body=replace(snap.body, dead_letters=None))
        await store.put(snapshot_key("sched-snap", by_round.seq), dump(by_round))
        await store.delete(key)


async def test_a_store_named_by_the_old_scheme_still_loads(tmp_path):
    again, got, store = await interrupted("hadare", 12, 8, tmp_path, damage=_old_names, snapshot_every=3)
    assert again.recovery["snapshot"] == snapshot_key("sched-snap", 5) and again.recovery["skipped"] == []
    assert again.recovery["rounds_rederived"] == 2 and again.recovery["differing_rounds"] == []
    assert got == await uninterrupted("hadare", 12)
    # Snapshots written after it (rounds 8 and 11) are numbered past the old names: newest.
    keys = [key for _, key in await SnapshotStore(store, owner="sched-snap", service="scheduler").keys()]
    assert keys == [snapshot_key("sched-snap", 7), snapshot_key("sched-snap", 6), snapshot_key("sched-snap", 5)]


async def test_snapshots_kept_are_bounded(tmp_path):
    _, _, store = await interrupted("yarn-cs", 12, 6, tmp_path, snapshot_every=1, snapshots_kept=2)
    # One a round, rounds 0-11: numbered 1-12, the newest two kept.
    assert sorted(await store.list("snapshots/")) == [snapshot_key("sched-snap", 11), snapshot_key("sched-snap", 12)]


async def test_a_restart_under_another_policy_keeps_the_state_but_not_the_plan(tmp_path):
    bus, clock, store = MemoryBus(), FakeClock(), LocalStore(tmp_path)
    await bus.start()
    await store.start()
    cluster = contended(bus, clock)
    first = SchedulerService(bus=bus, config=config("hadar", snapshot_every=3), clock=clock, run_rounds=False,
                             store=store)
    await first.start()
    await play(first, cluster, clock, range(6))
    await first.stop()
    again = SchedulerService(bus=bus, config=config("gavel", snapshot_every=3), clock=clock, run_rounds=False,
                             store=store)
    await again.start()
    assert again.recovery["snapshot"] == AFTER_ROUND_5 and again.next_round == 6
    assert again.previous is None                 # Hadar's ledger means nothing to Gavel
    assert set(again.state.jobs) == set(first.state.jobs)
    await play(again, cluster, clock, range(6, 8))
    assert again.next_round == 8


async def test_a_failing_snapshot_write_is_counted_and_the_rounds_go_on(tmp_path):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the store's root should be")
    bus, clock = MemoryBus(), FakeClock()
    await bus.start()
    service = SchedulerService(bus=bus, config=config("yarn-cs", snapshot_every=1), clock=clock, run_rounds=False,
                               store=LocalStore(blocked))
    await service.start()
    await play(service, contended(bus, clock), clock, range(3))
    assert service.next_round == 3
    failed = service.registry.get_sample_value("hadar_scheduler_snapshots_total", {"outcome": "failed"})
    assert failed == 3
    await service.stop()


async def test_a_restart_counts_dead_letters_from_the_snapshot_not_from_the_topic_start(tmp_path):
    """The snapshot carries the dead-letter origins counted and the hadar.deadletter offsets
    they cover: a restart reads only the letters after them, and still counts each bad
    record once (a letter after the snapshot naming an origin counted before adds nothing)."""
    bus, clock, store = MemoryBus(), FakeClock(), LocalStore(tmp_path)
    await bus.start()
    await store.start()

    def letter(offset: int, group: str):
        return dead_letter(topic=JOBS, partition=0, offset=offset, reason="bad", raw=b"x", ts=clock.time(),
                           source=f"bus/{group}")

    def counted(service: SchedulerService) -> float | None:
        return service.registry.get_sample_value("hadar_scheduler_dead_letters", {"topic": JOBS})

    for offset, group in ((1, "a"), (2, "a"), (1, "b")):
        await bus.publish(letter(offset, group))
    first = SchedulerService(bus=bus, config=config("yarn-cs", snapshot_every=1), clock=clock, run_rounds=False,
                             store=store)
    await first.start()
    assert first.recovery["dead_letters"] == 3 and counted(first) == 2
    await play(first, contended(bus, clock), clock, range(1))     # a snapshot after round 0
    await first.stop()
    for offset, group in ((2, "b"), (3, "a")):
        await bus.publish(letter(offset, group))
    again = SchedulerService(bus=bus, config=config("yarn-cs", snapshot_every=1), clock=clock, run_rounds=False,
                             store=store)
    await again.start()
    assert again.recovery["snapshot"] == snapshot_key("sched-snap", 1)
    assert again.recovery["dead_letters"] == 2                    # not all 5 of the topic
    assert counted(again) == 3                                    # origins 1, 2, 3 of hadar.jobs
    await again.stop()
