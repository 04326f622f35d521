"""The live scheduler: a thin asyncio shell around the pure policies.

It folds every event of its input topics into ``SchedulerState``; each round it builds a
request, calls the policy the simulator uses, and publishes RoundStarted plus one
Assignment per (node, job copy).

Guarantees:

* Decisions are a deterministic function of the events read and of the settings in
  ``SchedulerConfig``: RoundStarted records how many records of each input partition were
  folded, the nodes planned on, and the policy, options, seed and timing decided with, so
  ``rerun`` reproduces the plan from the log alone.
* Nothing is lost on restart: at start the scheduler loads its newest valid state snapshot
  (with an object store; ``services/scheduler/live/snapshot.py``) and reads its topics from the
  offsets the snapshot covers -- from the beginning without one --, re-derives every
  recorded round after it with the settings each recorded (recovering the policy's carried
  state, e.g. Hadar's ledger) and continues with the next round number. Started with
  another policy or options than the last round recorded, it logs the change and plans the
  next round afresh. Every ``snapshot_every`` rounds it writes a snapshot; a failed write
  is logged and counted, never fatal (the next one covers it).
* A round starts no earlier than the previous one's end (unless that placed nothing: next
  point), and only after the tracker announced the models of the jobs that ran in it, so
  copies of the next round start from the averaged model -- or, if it never does, once the
  previous round's deadline plus ``late_copy_s`` plus ``consolidation_wait_s`` has passed
  (``shared.domain.deadline``, the rule the tracker decides a late round by), so it never
  plans past a round the tracker may still decide.
* A round that placed nothing while jobs wait ends early, as soon as a job gets its first
  estimate or a node joins (:func:`services.scheduler.live.pacing.wake_after_empty_round`):
  a scheduler started before its profiler or its agents would otherwise idle the whole
  cluster for a round. Nothing runs in such a round, so no copy is cut short.
* A round is never shorter than ``round_overhead_factor`` x the measured start-up +
  consolidation overhead of recent rounds (:mod:`services.scheduler.live.round_length`), so a
  slow start cannot leave rounds without progress; a stretched round is logged
  (``round.stretched``) and records its length in its RoundStarted.
* A node not heard from for 3 heartbeat periods leaves the cluster at the next round; a
  cancelled job is dropped at the next round boundary.
* With ``standby`` (several replicas), a replica does nothing but watch until it holds the
  role (:mod:`shared.runtime.leadership`); it then fences the previous holder, recovers as
  above from the newest snapshot and the committed log, and publishes each round -- its
  RoundStarted and every Assignment -- as one fenced batch: a round is visible whole or not
  at all, a replica that was taken over can publish no round after its successor started,
  and its successor numbers rounds after every round ever committed. A replica that finds
  itself fenced steps down (``scheduler.stepped_down``; ``hadar serve scheduler`` exits 3).
* Inputs are read, after recovery, from the offsets this replica folded, never from offsets
  the consumer group committed (a previous holder may have committed past what we folded).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from services.scheduler.config import DecisionSettings, SchedulerConfig
from services.scheduler.core.policy import InvalidPlan, Plan, PlanRequest, Policy, check_plan
from services.scheduler.core.queues import plan_with_queues
from services.scheduler.live.inputs import Inputs
from services.scheduler.live.metrics import SchedulerCounters, SchedulerTelemetry
from services.scheduler.live.pacing import Pacer, wake_after_empty_round
from services.scheduler.live.publish import RoundFailed, publish_each, publish_fenced
from services.scheduler.live.recovery import resume
from services.scheduler.live.round_length import (
    RoundCosts,
    copy_startup_s,
    stretched_round_s,
)
from services.scheduler.live.rounds import RoundTiming, build_request, plan_to_events
from services.scheduler.live.snapshot import (
    SERVICE,
    SchedulerSnapshot,
    capture,
    dead_letter_origins,
    dead_letter_start,
    input_offsets,
    restore,
)
from services.scheduler.live.state import SchedulerState
from services.scheduler.live.stuck import stuck_reason
from shared.bus import Bus
from shared.clock import Clock, SystemClock
from shared.domain.deadline import next_round_gives_up_at
from shared.persistence.snapshot import Recovered, SnapshotStore
from shared.runtime.leadership import Leadership, LeadershipLost
from shared.store import ObjectStore
from shared.wire.events import Event, Progress
from shared.wire.topics import ALL_TOPICS, LEADERSHIP

LEADERSHIP_TOPICS = (LEADERSHIP,)   # followed by a standby (shared.runtime.leadership)
RETRY_BASE_S = 0.05
ESTIMATE_WAIT_S = 5.0   # the most a round started early waits for its new jobs' first estimates


def _timed_plan(policy: Policy, request: PlanRequest) -> tuple[Plan, float]:
    t0 = time.perf_counter()
    return plan_with_queues(policy, request), time.perf_counter() - t0


class SchedulerService:
    name = "scheduler"

    def __init__(self, *, bus: Bus, config: SchedulerConfig | None = None, clock: Clock | None = None,
                 run_rounds: bool = True, store: ObjectStore | None = None,
                 on_stepped_down: Callable[[], None] | None = None, holder: str | None = None) -> None:
        """``run_rounds=False``: rounds are planned only by calling ``plan_round`` (tests, tools).
        ``store``: where state snapshots go (None: no snapshots; restarts read the whole log).
        ``on_stepped_down``: called once if a standby replica that led was taken over."""
        self.bus = bus
        self.config = config or SchedulerConfig()
        self.settings: DecisionSettings = self.config.decision_settings
        self.policy = self.settings.choice.build()
        self.clock = clock or SystemClock()
        self.run_rounds = run_rounds
        self.previous: Plan | None = None
        self.next_round = 0
        self.costs = RoundCosts()
        self._round_s = self.settings.round_s   # the length of the last round planned
        self.recovery: dict[str, Any] = {}
        self.pacer = Pacer(self.clock, stopping=lambda: self._stopping)
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._last_error: str | None = None   # logged in full; /healthz shows only its kind
        self._log = structlog.get_logger(__name__).bind(service=self.name, policy=self.config.policy)
        self.leadership = (Leadership(bus, role=self.name, fencing_id=self.config.fencing_id, holder=holder,
                                      ttl_s=self.config.lease_ttl_s, clock=self.clock, source=self.config.source)
                           if self.config.standby else None)
        self.stepped_down: str | None = None
        self._on_stepped_down = on_stepped_down
        self.snapshots = (SnapshotStore(store, owner=self.config.group, service=SERVICE,
                                        keep=self.config.snapshots_kept, log=self._log) if store is not None else None)
        self.registry = CollectorRegistry()
        self.counters = SchedulerCounters(self.registry)
        self.telemetry = SchedulerTelemetry(self.registry, state=lambda: self.state, now=self.clock.time,
                                            round_s=self.settings.round_s, heartbeat_s=self.settings.heartbeat_s)
        self.inputs = Inputs(bus=bus, group=self.config.group, source=self.config.source, clock=self.clock,
                             counters=self.counters, telemetry=self.telemetry, log=self._log,
                             on_folded=self.pacer.changed, on_progress=self._measure_startup)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.bus.ensure_topics(ALL_TOPICS)
        if self.leadership is not None:
            self._tasks = [asyncio.create_task(self._lead(), name="scheduler-leadership")]
            return
        await self._begin()

    async def _begin(self) -> None:
        await self._recover()
        self._tasks.append(asyncio.create_task(self.inputs.consume(), name="scheduler-consume"))
        if self.run_rounds:
            self._tasks.append(asyncio.create_task(self._rounds(), name="scheduler-rounds"))

    async def _lead(self) -> None:
        """A standby: wait for the role, then act as the scheduler while holding it."""
        assert self.leadership is not None
        term = await self.leadership.acquire()
        self._log.info("scheduler.took_over", term=term, holder=self.leadership.holder,
                       previous_holder=self.leadership.view.holder)
        await self._begin()
        self.recovery["term"] = term
        try:
            await self.leadership.hold()
        except LeadershipLost as exc:
            self._step_down(str(exc))

    def _step_down(self, reason: str) -> None:
        """Fenced by a newer replica: stop acting at once (no fold, no round) and say so."""
        if self.stepped_down is not None:
            return
        self.stepped_down = reason
        self._stopping = True
        self.pacer.changed()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._log.error("scheduler.stepped_down", reason=reason, round=self.next_round - 1)
        if self._on_stepped_down is not None:
            self._on_stepped_down()

    @property
    def active(self) -> bool:
        """True while this replica acts as the scheduler (always, without ``standby``)."""
        if self.leadership is None:
            return not self._stopping
        return self.leadership.term is not None and self.stepped_down is None

    async def stop(self) -> None:
        self._stopping = True
        self.pacer.changed()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.leadership is not None:
            await self.leadership.stop()

    @property
    def state(self) -> SchedulerState:
        """Everything folded from the inputs and the scheduler's own rounds."""
        return self.inputs.state

    @property
    def records_folded(self) -> int:
        """Input records folded so far (restored from a snapshot included): a test's settle point."""
        return self.inputs.records

    def health(self) -> dict[str, Any]:
        failed = [t.get_name() for t in self._tasks if t.done() and not t.cancelled()]
        role = "standalone" if self.leadership is None else (
            "stepped_down" if self.stepped_down else "active" if self.active else "standby")
        return {"ok": not failed and bool(self._tasks) and self.stepped_down is None, "role": role,
                "round": self.next_round - 1,
                "active_jobs": len(self.state.active_jobs()), "nodes": len(self.state.nodes), "failed": failed,
                "last_round_error": self._last_error.split(":", 1)[0] if self._last_error else None}

    # ------------------------------------------------------------------ recovery

    async def _recover(self) -> None:
        t0 = time.perf_counter()
        found = await self._load_snapshot()
        log = await self.inputs.read_log(found)
        resumed = resume(log, state=self.state, body=found.value, configured=self.settings.choice)
        if resumed.out_of_sequence:
            self._log.warning("scheduler.rounds_out_of_sequence", rounds=list(resumed.out_of_sequence[:10]),
                              count=len(resumed.out_of_sequence))
        self.recovery.update(records=len(log), rounds_rederived=resumed.rederived,
                             differing_rounds=list(resumed.differing_rounds[:10]))
        if resumed.next_round is not None:
            self.next_round = resumed.next_round
        if resumed.rederived:
            self._log.info("scheduler.recovered", rounds=resumed.rederived, next_round=self.next_round,
                           differing_rounds=self.recovery["differing_rounds"], records=len(log))
        self.previous = resumed.previous
        if resumed.policy_changed_from is not None:
            self._log.warning("scheduler.policy_changed", recorded=resumed.policy_changed_from,
                              configured=self.settings.choice.describe(), next_round=self.next_round)
        self.recovery["seconds"] = round(time.perf_counter() - t0, 4)
        self.recovery["dead_letters"] = await self.inputs.count_letters()

    async def _load_snapshot(self) -> Recovered[SchedulerSnapshot]:
        """The newest valid snapshot and its body, adopted into this service (none: empty)."""
        if self.snapshots is None:
            return Recovered()
        found = await self.snapshots.recover(restore)
        self.recovery.update(found.recovery())
        if found.snapshot is not None and found.value is not None:
            folded, placed = input_offsets(found.snapshot)
            self.inputs.adopt(found.value.state, folded=folded, placed=placed,
                              lettered=dead_letter_start(found.snapshot, found.value) or {})
            self.telemetry.dead_letters.extend(dead_letter_origins(found.value))
            self._log.info("scheduler.snapshot_loaded", key=found.key, next_round=found.value.next_round)
        return found

    async def _write_snapshot(self) -> None:
        """Snapshot the state now (folding paused while it is captured and encoded); never raises."""
        assert self.snapshots is not None

        def take():
            return capture(state=self.state, previous=self.previous, previous_key=self.settings.choice.key,
                           next_round=self.next_round, folded=dict(self.inputs.folded),
                           placed=dict(self.inputs.placed), created_at=self.clock.time(),
                           dead_letters=self.telemetry.dead_letters.origins(), lettered=self.inputs.lettered)
        try:
            saved = await self.snapshots.save(take, hold=self.inputs.lock)
        except Exception as exc:
            self.counters.snapshots.labels(outcome="failed").inc()
            self._log.warning("scheduler.snapshot_failed", round=self.next_round - 1,
                              error=f"{type(exc).__name__}: {exc}"[:300])
            return
        assert saved is not None   # capture() always returns a snapshot
        self.counters.snapshots.labels(outcome="written").inc()
        self._log.info("scheduler.snapshot_written", key=saved.key, round=self.next_round - 1, bytes=saved.bytes)

    # ------------------------------------------------------------------ rounds

    def _measure_startup(self, e: Progress) -> None:
        record, job = self.state.rounds.get(e.round), self.state.jobs.get(e.job_id)
        if record is None or job is None:
            return
        self.costs.startup(e.round, e.job_id, e.copy, copy_startup_s(
            ts=e.ts, started_at=record.started.started_at, steps_round=e.steps_round,
            samples_per_s=e.samples_per_s, batch_size=job.spec.batch_size, workers=e.workers))

    def wait_left(self, round_: int, *, now: float) -> float:
        """Seconds the next round may still wait for ``round_``'s models at ``now``: until
        :func:`shared.domain.deadline.next_round_gives_up_at` of its deadline (0 for a round not
        in memory)."""
        record = self.state.rounds.get(round_)
        if record is None:
            return 0.0
        until = next_round_gives_up_at(record.started.ends_at, late_copy_s=self.config.late_copy_s,
                                       consolidation_wait_s=self.config.consolidation_wait_s)
        return max(0.0, until - now)

    async def _await_estimates(self, limit_s: float) -> None:
        """Until every active job has an estimate, for at most ESTIMATE_WAIT_S (and ``limit_s``)."""
        await self.pacer.wait_for(lambda: not self.state.unrated_jobs(), min(ESTIMATE_WAIT_S, limit_s))

    async def _rounds(self) -> None:
        next_start = self.clock.time()
        wake: Callable[[], bool] | None = None
        failures = 0
        while not self._stopping:
            if await self.pacer.sleep_until(next_start, wake):
                # Ended early by a first estimate or a new node: the profiler rates jobs one by
                # one, so give the others the moment the idle start gives them.
                await self._await_estimates(next_start - self.clock.time())
            wake = None
            previous_round = self.next_round - 1
            def consolidated(r: int = previous_round) -> bool:
                return not self.state.awaiting_consolidation(r)
            if not await self.pacer.wait_for(consolidated, self.wait_left(previous_round, now=self.clock.time())):
                self._log.warning("round.consolidation_timeout", round=previous_round,
                                  jobs=self.state.awaiting_consolidation(previous_round))
            ended = self.state.rounds.get(previous_round)
            if ended is not None and ended.assignments:
                self.costs.consolidation(previous_round, self.clock.time() - ended.started.ends_at)
            if not self.state.active_jobs() and not self.state.awaiting_evaluation(self.clock.time()):
                self.telemetry.went_idle()
                if await self.pacer.wait_for(lambda: bool(self.state.active_jobs()), 1.0):
                    # From idle the round starts with the new job: planned before its estimate
                    # (the profiler answers within milliseconds), the job would wait a whole
                    # round on an idle cluster.
                    await self._await_estimates(self._round_s)
                next_start = self.clock.time()
                continue
            try:
                await self.plan_round()
            except Exception as exc:   # the loop never dies: log, count, back off, try again
                failures += 1
                stage = exc.stage if isinstance(exc, RoundFailed) else "internal"
                delay = min(self.settings.round_s, RETRY_BASE_S * 2 ** min(failures - 1, 10))
                self.counters.failures.labels(stage=stage).inc()
                self._last_error = f"{type(exc).__name__}: {exc}"[:300]
                self._log.error("round.failed", round=self.next_round, stage=stage, error=self._last_error,
                                retry_in_s=delay, consecutive=failures, exc_info=stage == "internal")
                next_start = self.clock.time() + delay
                continue
            failures = 0
            self._last_error = None
            next_start = self.clock.time() + self._round_s
            wake = wake_after_empty_round(self.state, self.next_round - 1, now=self.clock.time,
                                          heartbeat_s=self.settings.heartbeat_s)

    async def plan_round(self) -> None:
        """Plan and publish round ``next_round`` now; raise :class:`RoundFailed` if it cannot.

        The policy runs in a worker thread, so the event loop keeps serving ``/healthz`` and
        the bus; folding waits meanwhile, so the state cannot change under the plan. Each
        event is published with retries until acked or the round's end: ids make a repeat
        harmless. Once RoundStarted is out the round number is spent, even if a later
        Assignment could not be published (the rest of that round is lost, not re-planned
        under the same number).
        """
        settings = self.settings
        stretch = stretched_round_s(settings.round_s, self.costs.overheads(), self.config.round_overhead_factor)
        if stretch.stretched:
            self._log.warning("round.stretched", round=self.next_round, round_s=round(stretch.round_s, 3),
                              configured_s=stretch.configured_s, overhead_s=round(stretch.overhead_s or 0.0, 3),
                              factor=self.config.round_overhead_factor,
                              note="start-up + consolidation would leave too little of the round for training")
        async with self.inputs.lock:
            timing = RoundTiming(round=self.next_round, started_at=self.clock.time(), round_s=stretch.round_s,
                                 heartbeat_s=settings.heartbeat_s)
            inputs = dict(self.inputs.folded)
            request = build_request(self.state, timing, self.previous, settings.seed)
            try:
                plan, seconds = await asyncio.to_thread(_timed_plan, self.policy, request)
            except Exception as exc:
                raise RoundFailed(f"policy {settings.choice.describe()}: {type(exc).__name__}: {exc}",
                                  stage="plan", round=timing.round) from exc
            try:
                check_plan(request, plan)   # fail closed: a plan that breaks an invariant is never published
            except InvalidPlan as exc:
                raise RoundFailed(f"policy {settings.choice.describe()} broke an invariant, plan not published: {exc}",
                                  stage="invalid_plan", round=timing.round) from exc
            events = await asyncio.to_thread(
                plan_to_events, plan, request, self.state, timing, choice=settings.choice, seed=settings.seed,
                source=self.config.source, inputs=inputs, decision_ms=seconds * 1e3)
        try:
            if self.leadership is not None:
                await publish_fenced(self.leadership.publisher, events, round_=timing.round,
                                     timeout_s=timing.ends_at - self.clock.time(), applied=self.inputs.applied)
            else:
                # Waits are real time (a real broker's acks take real time), the deadline is the
                # service clock's: a fake clock's sleep would jump it past the round's end at once.
                await publish_each(self.bus, events, round_=timing.round, applied=self.inputs.applied,
                                   give_up=lambda: self._stopping or self.clock.time() >= timing.ends_at,
                                   placed=self.inputs.note_placed, on_retry=self._publish_retried(timing.round))
        except RoundFailed as exc:
            if exc.spent:
                self._spend(plan, timing)
            if exc.stage == "fenced":
                self._step_down(str(exc))
            raise
        self._spend(plan, timing)
        await self._after_round(plan, timing, seconds, events)

    def _spend(self, plan: Plan, timing: RoundTiming) -> None:
        self.previous, self.next_round, self._round_s = plan, timing.round + 1, timing.round_s

    def _publish_retried(self, round_: int) -> Callable[[Event, BaseException, int, float], None]:
        def retried(event: Event, error: BaseException, attempt: int, wait_s: float) -> None:
            self.counters.publish_retries.inc()
            self._log.warning("round.publish_retry", round=round_, event_type=event.TYPE, error=str(error)[:200],
                              retry_in_s=wait_s)
        return retried

    async def _after_round(self, plan: Plan, timing: RoundTiming, seconds: float, events: list[Event]) -> None:
        self.counters.rounds.inc()
        self.counters.decision.observe(seconds)
        self.counters.queue.set(len(plan.waiting))
        self.telemetry.round_started(timing.started_at)
        stuck = {j.spec.job_id: r for j in self.state.active_jobs() if (r := stuck_reason(j)) is not None}
        self.counters.stuck.set(len(stuck))
        for job_id, reason in sorted(stuck.items())[:10]:
            self._log.warning("job.stuck", job=job_id, round=timing.round, reason=reason)
        self._log.info("round.planned", round=timing.round, assignments=len(events) - 1,
                       waiting=len(plan.waiting), decision_ms=round(seconds * 1e3, 2))
        every = self.config.snapshot_every
        if self.snapshots is not None and every and self.next_round % every == 0:
            await self._write_snapshot()
