"""The node agent service: registers its devices, heartbeats, and runs the copies assigned to it.

Consumes ``hadar.placements`` (and ``hadar.jobs`` for cancellations) in consumer group
``agent-<node_id>``, so every agent sees every assignment. Rules:

* An :class:`Assignment` for this node starts a :class:`~services.agent.runner.CopyRun`
  unless it is a duplicate (same job, round, copy seen since start), or stale: its round
  is older than the newest round this agent knows of, or its deadline has passed.
* Learning of a newer round r (a :class:`RoundStarted`, or an Assignment for this node)
  preempts every older-round copy on this node that round r does not continue (its job
  copy is not yet assigned here in round r); continued copies run to their own deadline.
  A :class:`JobCancelled` preempts the job's copies.
* An Assignment is acked once its copy's :class:`CopyFinished` is published (or it is
  skipped), so an agent that restarts mid-round gets it again and its workers resume from
  the copy's own checkpoint of that round; everything else is acked when handled.
* ``stop()`` drains: stops taking work, preempts every copy, waits for their checkpoints
  and results (workers are killed ``stop_timeout_s`` after SIGTERM), then commits.

Only this process holds a bus connection; workers talk to the store themselves.
"""

from __future__ import annotations

import asyncio
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog
from prometheus_client import CollectorRegistry

from services.agent.discovery import NodeDevices
from services.agent.emulation import parse_emulation
from services.agent.metrics import AgentMetrics
from services.agent.process import WorkerPool
from services.agent.runner import CopyKey, CopyRun, RunContext
from services.agent.spec import StoreTarget
from shared.bus import Bus, Delivery, Subscription
from shared.clock import Clock, SystemClock
from shared.dispatch import HandlerTable
from shared.events import (
    NODE_ID_RE, Assignment, Event, JobCancelled, JobSubmitted, NodeHeartbeat, NodeRegistered, RoundStarted,
)
from shared.gpus import GPU_TYPES
from shared.settings import FieldError
from shared.topics import JOBS, PLACEMENTS

__all__ = ["AgentConfig", "AgentDaemon"]

TOPICS = (PLACEMENTS, JOBS)
SEEN_LIMIT = 4096


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """The agent's settings; ``hadar serve agent`` loads them with
    :func:`shared.settings.load_config` from flags, the environment (``HADAR_NODE_ID``,
    ``HADAR_NODE_ADDRESS``, else ``HADAR_AGENT_<FIELD>``) and a ``--config`` file.

    ``emulate``, ``emulate_reference`` and ``cpu_devices`` choose the devices the CLI
    hands the daemon (see :meth:`emulation`); the daemon itself uses the rest. An invalid
    value raises :class:`~shared.settings.FieldError` naming the field.
    """

    node_id: str = field(metadata={"env": "HADAR_NODE_ID"})
    address: str = field(default="", metadata={"env": "HADAR_NODE_ADDRESS"})  # DDP rendezvous host ("" = node id)
    heartbeat_s: float = 5.0
    progress_s: float = 2.0
    stop_timeout_s: float = 30.0    # SIGTERM -> SIGKILL for a preempted worker
    deadline_grace_s: float = 30.0  # a worker still running this long after its deadline is preempted
    threads: int = 1                # torch threads per worker
    spare_workers: int = 1          # warm worker processes kept ready
    python: str = sys.executable
    emulate: str | None = None      # TYPE:N[,TYPE:N...]: emulated GPUs on the CPU (None or "": discover)
    emulate_reference: str | None = None   # the type emulated at full CPU speed (None: fastest in the catalog)
    cpu_devices: int = 1            # devices a machine without CUDA offers

    def __post_init__(self) -> None:
        if not NODE_ID_RE.match(self.node_id):
            raise FieldError("node_id", f"{self.node_id!r} must be 1-63 letters, digits, '.', '_', '-'")
        for name in ("heartbeat_s", "progress_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")
        if not self.deadline_grace_s >= 0:
            raise FieldError("deadline_grace_s", f"must be >= 0, got {self.deadline_grace_s}")
        for name, least in (("threads", 1), ("spare_workers", 0), ("cpu_devices", 1)):
            if getattr(self, name) < least:
                raise FieldError(name, f"must be >= {least}, got {getattr(self, name)}")
        if self.emulate:
            try:
                parse_emulation(self.emulate)
            except ValueError as exc:
                raise FieldError("emulate", str(exc)) from None
        if self.emulate_reference is not None and self.emulate_reference not in GPU_TYPES:
            raise FieldError("emulate_reference", f"unknown GPU type {self.emulate_reference!r}; "
                                                  f"valid: {', '.join(GPU_TYPES)}")

    @property
    def group(self) -> str:
        return f"agent-{self.node_id}"

    @property
    def emulation(self) -> tuple[tuple[str, int], ...]:
        """The parsed ``emulate`` (empty: discover the devices)."""
        return parse_emulation(self.emulate) if self.emulate else ()


class AgentDaemon:
    """The agent as a :class:`shared.service.Service`."""

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
        self.ctx = RunContext(node_id=config.node_id, devices=devices, store=store, pool=self.pool,
                              clock=self.clock, publish=self._publish, metrics=self.metrics,
                              progress_s=config.progress_s, threads=config.threads,
                              stop_timeout_s=config.stop_timeout_s, deadline_grace_s=config.deadline_grace_s)
        self.log = structlog.get_logger().bind(node=config.node_id)
        self.runs: dict[CopyKey, CopyRun] = {}
        self._run_tasks: dict[CopyKey, asyncio.Task[None]] = {}
        self._seen: OrderedDict[CopyKey, None] = OrderedDict()
        self._assigned: dict[int, set[tuple[str, int]]] = {}
        self.latest_round = -1
        self._sub: Subscription | None = None
        self._consumer: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._draining = False
        self._seq = 0

    @property
    def source(self) -> str:
        return f"agent/{self.config.node_id}"

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.bus.ensure_topics()
        self.pool.start()
        await self._publish(NodeRegistered(ts=self.clock.time(), source=self.source, node_id=self.config.node_id,
                                           gpus=self.devices.gpus, address=self.config.address,
                                           emulated=self.devices.emulated))
        self.log.info("agent.registered", devices=[g.type for g in self.devices.gpus], kind=self.devices.kind)
        self._sub = self.bus.subscribe(TOPICS, self.config.group)
        await self._sub.start()
        self._consumer = asyncio.create_task(self._consume(self._sub))
        self._heartbeat = asyncio.create_task(self._beat())

    async def stop(self) -> None:
        self._draining = True
        for run in list(self.runs.values()):
            run.preempt("agent stopping")
        tasks = list(self._run_tasks.values())
        if tasks:
            await asyncio.wait(tasks)
        for task in (self._consumer, self._heartbeat):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._sub is not None:
            await self._sub.stop()
        await self.pool.close()
        self.log.info("agent.stopped")

    def health(self) -> dict[str, Any]:
        alive = all(t is not None and not t.done() for t in (self._consumer, self._heartbeat))
        return {"ok": alive and not self._draining, "node": self.config.node_id, "kind": self.devices.kind,
                "emulated": self.devices.emulated, "latest_round": self.latest_round,
                "running": ["/".join(map(str, k)) for k in sorted(self.runs)]}

    # ------------------------------------------------------------ loops

    async def _publish(self, event: Event) -> None:
        await self.bus.emit(event)
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
        async for delivery in sub:
            if self._draining:
                continue   # left un-acked: whoever consumes next gets it again
            try:
                acked_later = await self._handle(delivery)
            except Exception:
                self.log.exception("agent.handler_error", topic=delivery.topic, offset=delivery.offset)
                acked_later = False
            if not acked_later:
                await delivery.ack()

    # ------------------------------------------------------------ handlers

    async def _handle(self, delivery: Delivery) -> bool:
        """Act on one event; True if its ack is deferred to the end of a copy run."""
        handler = self.HANDLERS.handler_for(delivery.event)
        return handler(self, delivery.event, delivery) if handler is not None else False

    def _on_round_started(self, event: RoundStarted, delivery: Delivery) -> bool:
        self._newer_round(event.round)
        return False

    def _on_job_cancelled(self, event: JobCancelled, delivery: Delivery) -> bool:
        for key, run in list(self.runs.items()):
            if key[0] == event.job_id:
                run.preempt(f"job cancelled: {event.reason}" if event.reason else "job cancelled")
        return False

    def _on_assignment(self, event: Assignment, delivery: Delivery) -> bool:
        return event.node_id == self.config.node_id and self._assignment(event, delivery)

    HANDLERS: ClassVar[HandlerTable[Callable[[AgentDaemon, Any, Delivery], bool]]] = HandlerTable({
        RoundStarted: _on_round_started, JobCancelled: _on_job_cancelled, Assignment: _on_assignment,
    }, topics=TOPICS, ignore=(JobSubmitted,))

    def _newer_round(self, round_: int) -> None:
        if round_ <= self.latest_round:
            return
        self.latest_round = round_
        continued = self._assigned.get(round_, set())
        for (job, r, copy), run in list(self.runs.items()):
            if r < round_ and (job, copy) not in continued:
                run.preempt(f"round {round_} started without this copy")
        for old in [r for r in self._assigned if r < round_ - 1]:
            del self._assigned[old]

    def _assignment(self, a: Assignment, delivery: Delivery) -> bool:
        key: CopyKey = (a.job_id, a.round, a.copy)
        log = self.log.bind(job=a.job_id, round=a.round, copy=a.copy)
        if key in self._seen:
            log.info("assignment.duplicate")
            return False
        if a.round < self.latest_round or a.deadline <= self.clock.time():
            log.info("assignment.stale", latest_round=self.latest_round, deadline=a.deadline)
            return False
        self._seen[key] = None
        if len(self._seen) > SEEN_LIMIT:
            self._seen.popitem(last=False)
        self._assigned.setdefault(a.round, set()).add((a.job_id, a.copy))
        self._newer_round(a.round)
        run = CopyRun(self.ctx, a)
        self.runs[key] = run
        self.metrics.copies_running(len(self.runs))
        self._run_tasks[key] = asyncio.create_task(self._run(run, delivery))
        return True

    async def _run(self, run: CopyRun, delivery: Delivery) -> None:
        try:
            await run.run()
        finally:
            self.runs.pop(run.key, None)
            self._run_tasks.pop(run.key, None)
            self.metrics.copies_running(len(self.runs))
            await delivery.ack()
