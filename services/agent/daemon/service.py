"""The node agent service: registers its devices, heartbeats, and runs the copies assigned to it.

Consumes ``hadar.placements`` (and ``hadar.jobs`` for cancellations) in consumer group
``agent-<node_id>``, so every agent sees every assignment. What it believes and runs is
decided by :class:`~services.agent.daemon.admission.Admission` (pure; its docstring has the exact
rules); this shell carries the verdicts out:

* **Rounds.** A round more than ``max_round_leap`` (8) ahead of the newest round the agent
  believes is not believed on one event's word: the RoundStarted or Assignment is refused
  (dead-lettered, ``round_far_ahead``) until another event agrees with it. At start the
  agent seeds that belief from the RoundStarted events of the last ``max_deadline_ahead_s``
  on the log (a round whose assignments could still be running started within it), so a
  restarted agent knows the current round before it meets its own unfinished assignment.
  Learning of a newer round preempts every older-round copy it does not continue; a
  :class:`JobCancelled` preempts the job's copies.
* **Copies.** At most one copy per GPU: an Assignment naming a GPU held by another copy of
  its round is refused (``gpu_busy``); one of a newer round preempts the older copies on its
  GPUs and starts its workers only once theirs have exited. So the node never runs more
  copies than it has GPUs, nor two on one GPU.
* **What reaches a worker** is checked first (:mod:`services.agent.daemon.validation`): deadline at
  most a day ahead, GPUs of this node named once, ranks distinct, rendezvous ``host:port``,
  ``start_from`` an earlier model of the same job. An implausible Assignment is refused.
* **Refused** events are dead-lettered with the reason (:func:`shared.bus.rejection.dead_letter_delivery`),
  logged with job, round and node, counted in ``hadar_agent_events_rejected_total{reason}``
  and acked. A handler that raises is treated the same way (reason ``handler_error``). Stale
  and duplicate assignments are acked and counted as skipped (replays produce them).
* **Results.** A copy's Progress reports and its CopyFinished are published in order, each
  with retries until the bus takes it, or it is abandoned (:mod:`services.agent.daemon.result_expiry`:
  deadline + grace + ``result_ttl_s`` passed and a newer round exists). Publishing never
  holds up the copy: a broker outage does not stall its runner, so a copy that finishes while
  the broker is away has its result made then and delivered when the broker is back. At most
  ``MAX_PENDING_PROGRESS`` reports wait at once; one past that is dropped, logged and counted
  (``hadar_agent_results_undelivered_total{reason="backlog"}``). The Assignment is acked only
  once the CopyFinished is delivered, so an agent that restarts mid-round gets it again and
  its workers resume from the copy's own checkpoint.
* **The consumer loop never ends on a handler error**, nor on a retriable fetch error (it
  backs off and reads on); only a non-retriable bus error ends it, which ``/healthz`` shows.
* **Warm workers.** Each GPU slot's worker outlives the round (:mod:`services.agent.slots`):
  a copy whose job stays on the same GPUs with the same rank set next round is not
  preempted -- its workers checkpoint at the deadline, report, and take the next round's
  spec, reloading the consolidated model in place (a DDP copy's ranks keep their process
  group). A new process starts only on first use, for another job, model, GPU or rank set,
  for a spanning copy whose Assignment names no peers, or after a crash (reported,
  counted, respawned).
* ``stop()`` drains: stops taking work, preempts every copy, waits for their workers (killed
  ``stop_timeout_s`` after the stop if they have not reported), retires the warm workers,
  gives undelivered results ``stop_timeout_s`` more, then leaves their Assignments
  un-acked for the next run.

Only this process holds a bus connection; workers talk to the store themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

import structlog
from prometheus_client import CollectorRegistry

from services.agent.config import AgentConfig
from services.agent.daemon.admission import Admission, AdmissionLimits, CopyKey, Verdict
from services.agent.daemon.discovery import NodeDevices
from services.agent.daemon.metrics import AgentMetrics
from services.agent.daemon.process import WorkerPool, WorkerSlots
from services.agent.daemon.result_expiry import (
    Outcome,
    RetryPolicy,
    publish_until,
    result_abandoned,
)
from services.agent.daemon.runner import CopyRun, RunContext
from services.agent.protocol import StoreTarget
from shared.bus import Bus, BusError, Delivery, Subscription
from shared.bus.rejection import dead_letter_delivery
from shared.bus.retry import bus_send
from shared.clock import Clock, SystemClock
from shared.wire.dispatch import HandlerTable
from shared.wire.events import (
    Assignment,
    CopyFinished,
    Event,
    JobCancelled,
    JobSubmitted,
    NodeHeartbeat,
    NodeRegistered,
    Progress,
    RoundStarted,
)
from shared.wire.topics import JOBS, PLACEMENTS

__all__ = ["AgentConfig", "AgentDaemon"]

TOPICS = (PLACEMENTS, JOBS)
FETCH_RETRY_MAX_S = 5.0
MAX_PENDING_PROGRESS = 1000   # Progress reports held for the bus at once, all copies together


class AgentDaemon:
    """The agent as a :class:`shared.runtime.service.Service`."""

    name = "agent"

    def __init__(self, config: AgentConfig, *, bus: Bus, store: StoreTarget, devices: NodeDevices,
                 clock: Clock | None = None, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.bus = bus
        self.devices = devices
        self.clock = clock or SystemClock()
        self.registry = registry or CollectorRegistry()
        self.metrics = AgentMetrics(self.registry, node_id=config.node_id, emulated=devices.emulated)
        self.pool = WorkerPool(python=config.python, spares=config.spare_workers)
        self.slots = WorkerSlots(self.pool)
        self.ctx = RunContext(node_id=config.node_id, devices=devices, store=store, pool=self.pool, slots=self.slots,
                              clock=self.clock, publish=self._progress, metrics=self.metrics,
                              progress_s=config.progress_s, threads=config.threads,
                              stop_timeout_s=config.stop_timeout_s, deadline_grace_s=config.deadline_grace_s,
                              upload_grace_s=config.upload_grace_s, cache_dir=config.cache_dir,
                              cache_bytes=config.cache_bytes, trainer_sandbox=config.trainer_sandbox,
                              ledger_dir=config.ledger_dir)
        self.admission = Admission(node_id=config.node_id, gpus=[g.index for g in devices.gpus],
                                   limits=AdmissionLimits(max_round_leap=config.max_round_leap,
                                                          max_deadline_ahead_s=config.max_deadline_ahead_s))
        self.retry = RetryPolicy(first_s=config.result_retry_s, max_s=config.result_retry_max_s)
        self.log = structlog.get_logger().bind(node=config.node_id)
        self.runs: dict[CopyKey, CopyRun] = {}
        self._run_tasks: dict[CopyKey, asyncio.Task[None]] = {}
        self._deliveries: set[asyncio.Task[None]] = set()
        self._send = bus_send(bus)
        self._outbox: dict[CopyKey, asyncio.Task[None]] = {}   # each copy's latest delivery, in order
        self._pending_progress = 0
        self._sub: Subscription | None = None
        self._consumer: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._draining = False
        self._seq = 0

    @property
    def source(self) -> str:
        return f"agent/{self.config.node_id}"

    @property
    def latest_round(self) -> int:
        return self.admission.latest_round

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.bus.ensure_topics()
        self.pool.start()
        await self._publish(NodeRegistered(ts=self.clock.time(), source=self.source, node_id=self.config.node_id,
                                           gpus=self.devices.gpus, address=self.config.address,
                                           emulated=self.devices.emulated,
                                           emulation_reference=self.devices.reference))
        self.log.info("agent.registered", devices=[g.type for g in self.devices.gpus], kind=self.devices.kind)
        await self._seed_rounds()
        self._sub = self.bus.subscribe(TOPICS, self.config.group)
        await self._sub.start()
        self._consumer = asyncio.create_task(self._consume(self._sub))
        self._heartbeat = asyncio.create_task(self._beat())

    async def _seed_rounds(self) -> None:
        """Believe the rounds the log recorded lately (see the module docstring); best effort."""
        since = self.clock.time() - self.config.max_deadline_ahead_s
        try:
            async with contextlib.aclosing(self.bus.read(PLACEMENTS, start=since)) as records:
                async for record in records:
                    if isinstance(record.event, RoundStarted):
                        self.admission.round_started(record.event)
        except BusError as exc:
            self.log.warning("agent.rounds_not_seeded", error=str(exc)[:300])
        self.metrics.latest_round(self.latest_round)
        self.log.info("agent.rounds_seeded", latest_round=self.latest_round)

    async def stop(self) -> None:
        self._draining = True
        for run in list(self.runs.values()):
            run.preempt("agent stopping")
        tasks = list(self._run_tasks.values())
        if tasks:
            await asyncio.wait(tasks)
        if self._deliveries:   # registered by every run task before it ended, and by Progress reports
            _, late = await asyncio.wait(set(self._deliveries), timeout=self.config.stop_timeout_s)
            for task in late:
                task.cancel()
                self.metrics.undelivered("shutdown")
            if late:
                self.log.warning("agent.results_left", count=len(late),
                                 note="their assignments stay un-acked: the next run gets them again")
                await asyncio.gather(*late, return_exceptions=True)
        for background in (self._consumer, self._heartbeat):
            if background is not None:
                background.cancel()
                await asyncio.gather(background, return_exceptions=True)
        if self._sub is not None:
            await self._sub.stop()
        await self.slots.close()
        await self.pool.close()
        self.log.info("agent.stopped")

    def health(self) -> dict[str, Any]:
        alive = all(t is not None and not t.done() for t in (self._consumer, self._heartbeat))
        return {"ok": alive and not self._draining, "node": self.config.node_id, "kind": self.devices.kind,
                "emulated": self.devices.emulated, "latest_round": self.latest_round,
                "running": ["/".join(map(str, k)) for k in sorted(self.runs)]}

    # ------------------------------------------------------------ loops

    async def _publish(self, event: Event) -> None:
        await self.bus.publish(event)
        self.metrics.event(event.TYPE)

    async def _beat(self) -> None:
        while True:
            await self.clock.sleep(self.config.heartbeat_s)
            self._seq += 1
            running = tuple(sorted({job for job, _, _ in self.runs}))
            try:
                await self._publish(NodeHeartbeat(ts=self.clock.time(), source=self.source,
                                                  node_id=self.config.node_id, seq=self._seq, running=running,
                                                  emulated=self.devices.emulated))
            except Exception as exc:  # a bus outage must not end the heartbeat loop
                self.log.warning("heartbeat.publish_failed", error=f"{type(exc).__name__}: {exc}"[:300])

    async def _consume(self, sub: Subscription) -> None:
        failures = 0
        while True:
            try:
                delivery = await anext(sub)
            except StopAsyncIteration:
                return
            except BusError as exc:
                if not exc.retriable:
                    self.log.error("agent.consumer_failed", error=str(exc)[:300])
                    raise
                failures += 1
                wait_s = min(FETCH_RETRY_MAX_S, 0.1 * 2.0 ** min(failures, 16))
                self.log.warning("agent.fetch_failed", error=str(exc)[:300], retry_in_s=wait_s)
                await asyncio.sleep(wait_s)
                continue
            failures = 0
            if self._draining:
                continue   # left un-acked: whoever consumes next gets it again
            try:
                deferred = await self._handle(delivery)
            except Exception as exc:
                self.log.exception("agent.handler_error", topic=delivery.topic, offset=delivery.offset)
                await self._reject(delivery, "handler_error", f"{type(exc).__name__}: {exc}")
                deferred = False
            if not deferred:
                await delivery.ack()

    # ------------------------------------------------------------ handlers

    async def _handle(self, delivery: Delivery) -> bool:
        """Act on one event; True if its ack is deferred until its copy's result is delivered."""
        handler = self.HANDLERS.handler_for(delivery.event)
        if handler is None:
            return False
        verdict: Verdict = handler(self, delivery.event)
        for preemption in verdict.preempt:
            run = self.runs.get(preemption.key)
            if run is not None:
                run.preempt(preemption.reason)
        self.metrics.latest_round(self.latest_round)
        if verdict.action == "refuse":
            await self._reject(delivery, verdict.code, verdict.detail)
        elif verdict.action == "skip":
            self.metrics.skipped(verdict.code)
            self.log.info("event.skipped", reason=verdict.code, detail=verdict.detail, **_about(delivery.event))
        elif verdict.action == "admit":
            assert isinstance(delivery.event, Assignment)
            self._start(delivery.event, delivery, verdict.wait_for)
            return True
        return False

    def _on_round_started(self, event: RoundStarted) -> Verdict:
        return self.admission.round_started(event)

    def _on_job_cancelled(self, event: JobCancelled) -> Verdict:
        return self.admission.cancelled(event)

    def _on_assignment(self, event: Assignment) -> Verdict:
        return self.admission.assignment(event, now=self.clock.time())

    HANDLERS: ClassVar[HandlerTable[Callable[[AgentDaemon, Any], Verdict]]] = HandlerTable({
        RoundStarted: _on_round_started, JobCancelled: _on_job_cancelled, Assignment: _on_assignment,
    }, topics=TOPICS, ignore=(JobSubmitted,))

    async def _reject(self, delivery: Delivery, code: str, detail: str) -> None:
        """Dead-letter, count and log one refused event; never raises."""
        self.metrics.rejected(code)
        self.log.warning("event.rejected", reason=code, detail=detail[:300], topic=delivery.topic,
                         offset=delivery.offset, **_about(delivery.event))
        try:
            await dead_letter_delivery(self.bus, delivery, f"agent {self.config.node_id}: {code}: {detail}",
                                       ts=self.clock.time(), source=self.source)
        except Exception:   # the event is refused either way; the loop must go on
            self.log.exception("event.dead_letter_failed", topic=delivery.topic, offset=delivery.offset)

    # ------------------------------------------------------------ copies

    def _start(self, a: Assignment, delivery: Delivery, wait_for: tuple[CopyKey, ...]) -> None:
        run = CopyRun(self.ctx, a)
        self.runs[run.key] = run
        predecessors = [self._run_tasks[k] for k in wait_for if k in self._run_tasks]
        self._run_tasks[run.key] = asyncio.create_task(self._run(run, delivery, predecessors))
        self.metrics.copies_running(len(self.runs))

    async def _run(self, run: CopyRun, delivery: Delivery, predecessors: list[asyncio.Task[None]]) -> None:
        try:
            if predecessors:
                await asyncio.wait(predecessors)   # the copies that had these GPUs exit first
            if self._draining:
                return   # never started: left un-acked for the agent's next run
            result = await run.run()
        finally:
            self.runs.pop(run.key, None)
            self._run_tasks.pop(run.key, None)
            self.admission.exited(run.key)
            self.metrics.copies_running(len(self.runs))
        self._report(run.a, result, delivery)

    async def _progress(self, event: Event) -> None:
        """Queue a copy's Progress behind its earlier events; returns at once (module docstring)."""
        if not isinstance(event, Progress):
            await self._publish(event)
            return
        if self._pending_progress >= MAX_PENDING_PROGRESS:
            self.metrics.undelivered("backlog")
            self.log.warning("progress.dropped", reason="backlog", pending=self._pending_progress,
                             job=event.job_id, round=event.round, copy=event.copy)
            return
        key: CopyKey = (event.job_id, event.round, event.copy)
        run = self.runs.get(key)
        deadline = run.a.deadline if run is not None else self.clock.time()
        self._pending_progress += 1

        async def deliver() -> None:
            try:
                await self._deliver(event, deadline=deadline, round_=event.round,
                                    log=self.log.bind(job=event.job_id, round=event.round, copy=event.copy))
            finally:
                self._pending_progress -= 1
        self._chain(key, deliver)

    def _chain(self, key: CopyKey, deliver: Callable[[], Any]) -> asyncio.Task[None]:
        """Run ``deliver`` once the copy's previous delivery has ended, so its events keep their order."""
        previous = self._outbox.get(key)

        async def in_order() -> None:
            if previous is not None:
                await asyncio.wait({previous})
            await deliver()

        task = asyncio.create_task(in_order())
        self._outbox[key] = task
        self._deliveries.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._deliveries.discard(t)
            if self._outbox.get(key) is t:
                del self._outbox[key]
        task.add_done_callback(done)
        return task

    async def _deliver(self, event: Event, *, deadline: float, round_: int, log: Any) -> Outcome:
        """Publish one of a copy's events under :mod:`services.agent.daemon.result_expiry`'s rule; never raises
        but for cancellation."""
        def abandon() -> bool:
            return result_abandoned(now=self.clock.time(), deadline=deadline, grace_s=self.config.deadline_grace_s,
                                    ttl_s=self.config.result_ttl_s, latest_round=self.latest_round, round_=round_)

        def retrying(error: BaseException, attempt: int, wait_s: float) -> None:
            self.metrics.result_retry()
            log.warning("result.publish_failed", event_type=event.TYPE, attempt=attempt,
                        retry_in_s=round(wait_s, 3), error=f"{type(error).__name__}: {error}"[:300])

        def giving_up(error: BaseException, outcome: Outcome) -> None:
            self.metrics.undelivered(outcome.value)
            log.error("result.undelivered", event_type=event.TYPE, outcome=outcome.value,
                      note="the round is decided without it and its work re-planned",
                      error=f"{type(error).__name__}: {error}"[:300])

        outcome = await publish_until(self._send, event, policy=self.retry, give_up=abandon, on_retry=retrying,
                                      on_give_up=giving_up)
        if outcome is Outcome.PUBLISHED:
            self.metrics.event(event.TYPE)
        return outcome

    def _report(self, a: Assignment, result: CopyFinished | None, delivery: Delivery) -> None:
        """Deliver the copy's result after its Progress reports (module rule), then ack its Assignment."""
        key: CopyKey = (a.job_id, a.round, a.copy)

        async def deliver() -> None:
            if result is not None:
                await self._deliver(result, deadline=a.deadline, round_=a.round,
                                    log=self.log.bind(job=a.job_id, round=a.round, copy=a.copy, status=result.status))
            await delivery.ack()
        self._chain(key, deliver)


def _about(event: Event) -> dict[str, Any]:
    """The job, round and copy an event is about, for log lines."""
    return {name: getattr(event, attr) for name, attr in (("job", "job_id"), ("round", "round"), ("copy", "copy"))
            if hasattr(event, attr)}
