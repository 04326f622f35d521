"""The live scheduler: a thin asyncio shell around the pure policies.

It folds every event of its input topics into ``SchedulerState``; each round it builds a
snapshot, calls the policy the simulator uses, and publishes RoundStarted plus one
Assignment per (node, job copy).

Guarantees:

* Decisions are a deterministic function of the events read: RoundStarted records how
  many records of each input partition were folded, and ``rerun`` reproduces the plan.
* Nothing is lost on restart: at start the scheduler reads its topics from the beginning,
  re-derives every recorded round (recovering the policy's carried state, e.g. Hadar's
  ledger) and continues with the next round number.
* A round starts no earlier than the previous one's end, and (up to
  ``consolidation_wait_s``) only after the tracker announced the models of the jobs that ran
  in it, so copies of the next round start from the averaged model.
* A node not heard from for 3 heartbeat periods leaves the cluster at the next round; a
  cancelled job is dropped at the next round boundary.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.scheduler.policies import make_policy
from services.scheduler.policy import Plan
from services.scheduler.rerun import LoggedEvent, rerun
from services.scheduler.rounds import RoundTiming, build_snapshot, plan_to_events
from services.scheduler.state import SchedulerState
from shared.bus import Bus
from shared.clock import Clock, SystemClock
from shared.events import Assignment
from shared.logging import get_logger
from shared.topics import ALL_TOPICS, DEADLETTER, JOBS, MODELS, NODES, PLACEMENTS, PROGRESS, THROUGHPUT

INPUT_TOPICS = (JOBS, NODES, THROUGHPUT, PROGRESS, MODELS)


class SchedulerService:
    name = "scheduler"

    def __init__(self, *, bus: Bus, policy: str = "hadare", round_s: float = 360.0, heartbeat_s: float = 5.0,
                 consolidation_wait_s: float = 60.0, seed: int = 0, clock: Clock | None = None,
                 group: str = "hadar-scheduler", policy_options: dict[str, Any] | None = None,
                 run_rounds: bool = True) -> None:
        """``run_rounds=False``: rounds are planned only by calling ``plan_round`` (tests, tools)."""
        self.bus = bus
        self.policy_name = policy
        self.policy = make_policy(policy, **(policy_options or {}))
        self.round_s = round_s
        self.heartbeat_s = heartbeat_s
        self.consolidation_wait_s = consolidation_wait_s
        self.seed = seed
        self.clock = clock or SystemClock()
        self.group = group
        self.run_rounds = run_rounds
        self.state = SchedulerState()
        self.previous: Plan | None = None
        self.next_round = 0
        self._folded: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._log = get_logger(service=self.name, policy=policy)
        self.registry = CollectorRegistry()
        self._m_rounds = Counter("hadar_scheduler_rounds", "Rounds planned", registry=self.registry)
        self._m_decision = Histogram("hadar_scheduler_decision_seconds", "Time in policy.plan()",
                                     registry=self.registry, buckets=(.001, .01, .05, .1, .5, 1, 5, 30))
        self._m_queue = Gauge("hadar_scheduler_queue_length", "Active jobs left waiting", registry=self.registry)
        self._m_busy = Gauge("hadar_scheduler_gpus_busy", "GPUs assigned this round", ["gpu_type"],
                             registry=self.registry)
        self._m_in = Counter("hadar_events_in", "Events folded", ["type"], registry=self.registry)
        self._m_out = Counter("hadar_events_out", "Events published", ["type"], registry=self.registry)
        self._m_dead = Gauge("hadar_dead_letters", "Records in the dead-letter topic", registry=self.registry)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.bus.ensure_topics(ALL_TOPICS)
        await self._recover()
        self._tasks = [asyncio.create_task(self._consume(), name="scheduler-consume")]
        if self.run_rounds:
            self._tasks.append(asyncio.create_task(self._rounds(), name="scheduler-rounds"))

    async def stop(self) -> None:
        self._stopping = True
        self._changed.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def health(self) -> dict[str, Any]:
        failed = [t.get_name() for t in self._tasks if t.done() and not t.cancelled()]
        return {"ok": not failed and bool(self._tasks), "round": self.next_round - 1,
                "active_jobs": len(self.state.active_jobs()), "nodes": len(self.state.nodes), "failed": failed}

    # ------------------------------------------------------------------ recovery

    async def _recover(self) -> None:
        log: list[LoggedEvent] = []
        for topic in (*INPUT_TOPICS, PLACEMENTS):
            async for d in self.bus.read(topic):
                log.append(LoggedEvent(topic=d.topic, partition=d.partition, offset=d.offset, event=d.event))
                if topic != PLACEMENTS:
                    tp = f"{d.topic}:{d.partition}"
                    self._folded[tp] = max(self._folded.get(tp, 0), d.offset + 1)
        checks = list(rerun(log, self.policy, seed=self.seed, heartbeat_s=self.heartbeat_s, state=self.state))
        if checks:
            self.previous = checks[-1].plan
            self.next_round = checks[-1].round + 1
            differing = [c.round for c in checks if not c.matches]
            self._log.info("scheduler.recovered", rounds=len(checks), next_round=self.next_round,
                           differing_rounds=differing[:10])
        async for _ in self.bus.read(DEADLETTER):
            self._m_dead.inc()

    # ------------------------------------------------------------------ consuming

    async def _consume(self) -> None:
        async with self.bus.subscribe(list(INPUT_TOPICS) + [DEADLETTER], self.group) as sub:
            async for delivery in sub:
                if delivery.topic == DEADLETTER:
                    self._m_dead.inc()
                elif self.state.apply(delivery.event):
                    self._m_in.labels(type=delivery.event.TYPE).inc()
                tp = f"{delivery.topic}:{delivery.partition}"
                if delivery.topic != DEADLETTER:
                    self._folded[tp] = max(self._folded.get(tp, 0), delivery.offset + 1)
                await delivery.ack()
                self._changed.set()

    # ------------------------------------------------------------------ rounds

    async def _wait_for(self, predicate, timeout_s: float) -> bool:
        deadline = self.clock.time() + timeout_s
        while not predicate():
            remaining = deadline - self.clock.time()
            if remaining <= 0 or self._stopping:
                return predicate()
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.5))
            except asyncio.TimeoutError:
                pass
        return True

    async def _rounds(self) -> None:
        next_start = self.clock.time()
        while not self._stopping:
            await self.clock.sleep(next_start - self.clock.time())
            previous_round = self.next_round - 1
            if not await self._wait_for(lambda: not self.state.awaiting_consolidation(previous_round),
                                        self.consolidation_wait_s):
                self._log.warning("round.consolidation_timeout", round=previous_round,
                                  jobs=self.state.awaiting_consolidation(previous_round))
            if not self.state.active_jobs():
                await self._wait_for(lambda: bool(self.state.active_jobs()), 1.0)
                next_start = self.clock.time()
                continue
            await self.plan_round()
            next_start = self.clock.time() + self.round_s

    async def plan_round(self) -> None:
        """Plan and publish round ``next_round`` now."""
        timing = RoundTiming(round=self.next_round, started_at=self.clock.time(), round_s=self.round_s,
                             heartbeat_s=self.heartbeat_s)
        inputs = dict(self._folded)
        snapshot = build_snapshot(self.state, timing, self.previous, self.seed)
        t0 = time.perf_counter()
        plan = self.policy.plan(snapshot)
        seconds = time.perf_counter() - t0
        events = plan_to_events(plan, snapshot, self.state, timing, policy=self.policy_name,
                                source=self.name, inputs=inputs, decision_ms=seconds * 1e3)
        for event in events:
            await self.bus.emit(event)
            self.state.apply(event)
            self._m_out.labels(type=event.TYPE).inc()
        self.previous = plan
        self.next_round += 1
        self._m_rounds.inc()
        self._m_decision.observe(seconds)
        self._m_queue.set(len(plan.waiting))
        busy: dict[str, int] = {}
        for e in events:
            if isinstance(e, Assignment):
                busy[e.gpu_type] = busy.get(e.gpu_type, 0) + len(e.gpus)
        self._m_busy.clear()
        for gpu_type, n in busy.items():
            self._m_busy.labels(gpu_type=gpu_type).set(n)
        self._log.info("round.planned", round=timing.round, assignments=len(events) - 1,
                       waiting=len(plan.waiting), decision_ms=round(seconds * 1e3, 2))
