"""Scheduler restart time with a long history, from a state snapshot, and its decisions.

Two schedulers are fed the same scripted cluster (``services/scheduler/live/scripted_cluster.py``:
nodes, heartbeats, a job every few rounds, the tracker's models and completions), each on
its own MemoryBus, for ``--rounds`` rounds (default 10,000): the *reference* runs on
without a stop; the *restarted* one writes a snapshot to a LocalStore every
``--snapshot-every`` rounds, is stopped after the last round and started again (timed:
``restart_s``, from a new ``SchedulerService.start()`` to ready). Both then plan
``--after`` more rounds, and their Assignments for those rounds are compared
(``identical``). The restart ends at a round that is not a snapshot's, so the rounds after
the newest snapshot are re-derived and checked too (``rederived``, ``differing``).
``--baseline`` also times a restart without snapshots (the whole log re-derived, as
before snapshots existed). ``--dead-letters N`` puts N dead letters (N distinct bad
records) on the restarted side's ``hadar.deadletter`` before the history: a restart from a
snapshot reads none of them again (``dead_letters_replayed``; before snapshots carried the
count, every start read them all) and still counts N (``dead_letters_counted``).

Goal (issue 13): ``restart_s`` < 5 s with 10,000 rounds of history, ``identical`` true.
Last line: one JSON object. The real-Kafka path is exercised by
``tests/integration/test_topic_retention.py``.

    .venv/bin/python benchmarks/recovery.py                      # 10,000 rounds
    .venv/bin/python benchmarks/recovery.py --rounds 2000 --baseline
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import structlog

from services.scheduler.config import SchedulerConfig
from services.scheduler.live.rerun import assignment_decision
from services.scheduler.live.scripted_cluster import ScriptedCluster
from services.scheduler.live.service import SchedulerService
from shared.bus import MemoryBus
from shared.bus.base import dead_letter
from shared.clock import FakeClock
from shared.store import LocalStore
from shared.wire.events import Assignment
from shared.wire.topics import JOBS, PLACEMENTS

ROUND_S = 60.0


class Side:
    """One scheduler with its own bus and scripted cluster."""

    def __init__(self, config: SchedulerConfig, store: LocalStore | None) -> None:
        self.bus, self.clock, self.store, self.config = MemoryBus(), FakeClock(), store, config
        self.cluster = ScriptedCluster(bus=self.bus, clock=self.clock)
        self.service: SchedulerService | None = None

    async def start(self) -> float:
        t0 = time.perf_counter()
        self.service = SchedulerService(bus=self.bus, config=self.config, clock=self.clock, run_rounds=False,
                                        store=self.store)
        await self.service.start()
        return time.perf_counter() - t0

    async def play(self, rounds: range) -> None:
        service = self.service
        assert service is not None
        for r in rounds:
            kept = service.state.rounds.get(r - 1)
            await self.cluster.before_round(r, list(kept.assignments) if kept is not None else [])
            while service.records_folded < self.cluster.published:
                await asyncio.sleep(0)
            await service.plan_round()
            self.clock.advance(ROUND_S)

    async def decisions(self, first: int) -> dict[int, tuple]:
        found: dict[int, list[Assignment]] = {}
        async for d in self.bus.read(PLACEMENTS):
            if isinstance(d.event, Assignment) and d.event.round >= first:
                found.setdefault(d.event.round, []).append(d.event)
        return {r: assignment_decision(a) for r, a in sorted(found.items())}


async def run(args: argparse.Namespace) -> dict:
    def config(every: int) -> SchedulerConfig:
        return SchedulerConfig(policy=args.policy, round_s=ROUND_S, heartbeat_s=ROUND_S, consolidation_wait_s=0,
                               snapshot_every=every, group="bench-recovery")

    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp))
        await store.start()
        reference, restarted = Side(config(0), None), Side(config(args.snapshot_every), store)
        for side in (reference, restarted):
            await side.bus.start()
        for i in range(args.dead_letters):
            await restarted.bus.publish(dead_letter(topic=JOBS, partition=0, offset=i, reason="bench", raw=b"x",
                                                 ts=restarted.clock.time(), source="bus/bench"))
        for side in (reference, restarted):
            await side.start()
        t0 = time.perf_counter()
        for lo in range(0, args.rounds, 100):   # in lock-step, so neither side's bus grows alone
            for side in (reference, restarted):
                await side.play(range(lo, min(lo + 100, args.rounds)))
        history_s = time.perf_counter() - t0
        assert restarted.service is not None
        await restarted.service.stop()
        snapshots = await store.list("snapshots/")
        snapshot_bytes = max([len(await store.get(k)) for k in snapshots], default=0)
        restart_s = await restarted.start()
        recovery = dict(restarted.service.recovery)
        for side in (reference, restarted):
            await side.play(range(args.rounds, args.rounds + args.after))
        ref, got = await reference.decisions(args.rounds), await restarted.decisions(args.rounds)
        result = {
            "rounds": args.rounds, "policy": args.policy, "snapshot_every": args.snapshot_every,
            "restart_s": round(restart_s, 3), "goal_s": 5.0,
            "identical": ref == got and len(ref) > 0, "rounds_compared": args.after,
            "rounds_with_assignments": sum(1 for d in got.values() if d),
            "rederived": recovery.get("rounds_rederived"), "differing": recovery.get("differing_rounds"),
            "records_replayed": recovery.get("records"), "input_records_total": restarted.cluster.published,
            "snapshot": recovery.get("snapshot"), "snapshots_kept": len(snapshots),
            "snapshot_bytes": snapshot_bytes,
            "dead_letters_replayed": recovery.get("dead_letters"),
            "dead_letters_counted": restarted.service.registry.get_sample_value(
                "hadar_scheduler_dead_letters", {"topic": JOBS}) or 0,
            "history_build_s": round(history_s, 1),
        }
        for side in (reference, restarted):
            assert side.service is not None
            await side.service.stop()
        if args.baseline:
            whole = Side(config(0), None)
            whole.bus = restarted.bus     # the same log, no store: the whole log is re-derived
            result["restart_without_snapshot_s"] = round(await whole.start(), 3)
            assert whole.service is not None
            await whole.service.stop()
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10_000)
    parser.add_argument("--after", type=int, default=50, help="rounds planned after the restart and compared")
    parser.add_argument("--snapshot-every", type=int, default=100)
    parser.add_argument("--policy", default="hadare")
    parser.add_argument("--baseline", action="store_true", help="also time a restart that re-derives the whole log")
    parser.add_argument("--dead-letters", type=int, default=0, help="dead letters on the topic before the history")
    args = parser.parse_args(argv)
    if args.rounds % args.snapshot_every == 0:
        args.rounds += args.snapshot_every // 2   # end between snapshots: later rounds are re-derived
    logging.disable(logging.CRITICAL)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    result = asyncio.run(run(args))
    print(f"restart after {result['rounds']} rounds: {result['restart_s']} s (goal < 5 s); "
          f"identical decisions for {result['rounds_compared']} rounds after: {result['identical']}",
          file=sys.stderr)
    print(json.dumps(result))
    return 0 if result["identical"] and result["restart_s"] < 5.0 else 1


if __name__ == "__main__":
    sys.exit(main())
