"""The tracker service: follows copies' progress, consolidates each round, completes jobs.

A thin shell around :class:`~services.tracker.state.TrackerState` (what is due, what is
refused) and :mod:`services.tracker.averaging.consolidate` (the averaging). On start it loads its
newest valid state snapshot (:mod:`services.tracker.snapshot`; a damaged one falls back to
the one before, none: the log start) and replays, from the offsets it covers, every
RoundStarted, then hadar.jobs, hadar.placements, hadar.models and hadar.progress, to
rebuild its state -- placements before the events checked against them, and every
RoundStarted first because its partition is not its Assignments' -- then follows them in
consumer group ``config.group``; a worker consolidates due rounds off the event loop, the
rounds of ``config.consolidation_jobs`` jobs at once (one job's rounds always in order), and
after every ``snapshot_every`` rounds it decided writes a snapshot (the newest
``snapshots_kept`` are kept; a failed write is logged, counted in
``hadar_tracker_snapshots{outcome}`` and tried again ``snapshot_every`` rounds later).

Guarantees:

* A round's model is written to ``models/{job}/{round}.safetensors`` (temp file, then an
  atomic ``put_file``) before its ModelConsolidated is published, and a round is never
  announced twice: a ModelConsolidated already on hadar.models decides the round, and a
  model object written by an earlier run that was not announced is announced from its
  own metadata rather than recomputed, so a restart never publishes a different model.
* A round model holds the averaged weights only and describes itself (model, dataset,
  width/depth, zoo view, library, samples: ``shared.domain.model_meta``); the averaged optimizer
  state is stored first, beside it (``shared.domain.layout.optim_key``), and the announcement
  carries the model's held-out metric (``model_output.py``).
* When a job's consolidated steps reach its iterations, ``models/{job}/final.safetensors``
  is written (a copy of the latest round's model) and JobCompleted follows, once, with
  ``jct_s = completed_at - submitted_at``.
* An event the state refuses (:mod:`services.tracker.acceptance`) changes nothing; it is
  counted in ``hadar_tracker_events_rejected_total{reason}`` and logged with its job, round and
  node, and -- when it came from the live consumer, not from the replay -- published to
  hadar.deadletter with its origin and reason, so a restart counts it again but does not
  dead-letter it again. The tracker's own announcements are checked before publishing; a
  model object whose metadata would be refused is recomputed over.
* A round with no usable replica publishes no model but a RoundAbandoned (with the
  rejections), so the scheduler stops waiting for it and the job continues from its
  previous model; it is logged and counted.
* Nothing is retried forever: a failed consolidation or completion is tried again after
  a back-off doubling from ``tick_s`` up to :data:`MAX_RETRY_S`, at most
  ``config.max_attempts`` times in all. Then the round is abandoned (logged,
  ``hadar_tracker_rounds_given_up_total``, RoundAbandoned published when the bus takes it): the
  job's next round comes due and starts from the job's previous model. Folding
  RoundAbandoned on replay keeps an abandoned round closed across restarts.
  A completion given up (``hadar_tracker_completions_given_up_total``) is tried again only by
  a restarted tracker.
* Objects nothing can need are deleted after the announcement that decides so, in a task
  of its own, so a failing store delays deletions, never a round (:mod:`.lifecycle`).
* With ``standby`` (several replicas) :class:`~services.tracker.standby.StandbyTracker` runs
  this only while it holds the role, publishing through the role's fenced publisher; what
  fencing does not cover (the store) is stated there.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from services.tracker.acceptance import Refusal
from services.tracker.attempts import Attempts
from services.tracker.config import MAX_RETRY_S, TrackerConfig
from services.tracker.consolidator import AnnouncementRefused, Consolidator
from services.tracker.lifecycle import ObjectJanitor, ObjectLifecycle
from services.tracker.metrics import TrackerMetrics
from services.tracker.snapshot import SERVICE, Position, capture, restore
from services.tracker.state import DueCompletion, DueRound, TrackerState
from shared.bus import Bus, Delivery
from shared.bus.base import Resume
from shared.bus.rejection import dead_letter_delivery
from shared.clock import Clock, SystemClock
from shared.domain.layout import model_key
from shared.persistence.snapshot import SnapshotStore, StateSnapshot
from shared.store import ObjectStore
from shared.wire.events import (
    Event,
    JobCancelled,
    JobCompleted,
    ModelConsolidated,
    RoundAbandoned,
    RoundStarted,
)
from shared.wire.topics import DEADLETTER, JOBS, MODELS, PLACEMENTS, PROGRESS

__all__ = ["TrackerConfig", "TrackerService", "INPUT_TOPICS", "MAX_RETRY_S"]

# The replay order: placements before what is checked against them (models, progress), and
# models before progress, so reports of rounds already decided are merely late.
INPUT_TOPICS: tuple[str, ...] = (JOBS, PLACEMENTS, MODELS, PROGRESS)


class TrackerService:
    name = "tracker"

    def __init__(self, *, bus: Bus, store: ObjectStore, config: TrackerConfig | None = None,
                 clock: Clock | None = None, registry: CollectorRegistry | None = None) -> None:
        self.bus = bus
        self.store = store
        self.config = config or TrackerConfig()
        if self.config.standby and type(self) is TrackerService:
            raise ValueError("standby: run services.tracker.standby.StandbyTracker")
        self.clock = clock or SystemClock()
        self.registry = registry or CollectorRegistry()
        self.state = TrackerState()
        self._log = structlog.get_logger(__name__).bind(service=self.name)
        self._wake = asyncio.Event()
        self._stopping = False
        self._replayed = False
        self._consumer: asyncio.Task[None] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._janitor_task: asyncio.Task[None] | None = None
        self._last_error: str | None = None
        self._attempts = Attempts(max_attempts=self.config.max_attempts,
                                  base_s=min(self.config.tick_s, MAX_RETRY_S), max_s=MAX_RETRY_S)
        r = self.registry
        self.lifecycle = ObjectLifecycle.of(self.config)
        self._janitor = ObjectJanitor(store, self.lifecycle, registry=r, log=self._log)
        self._m = TrackerMetrics(r)
        self._produce = Consolidator(store=store, config=self.config, clock=self.clock, metrics=self._m,
                                      log=self._log)
        self.snapshots = (SnapshotStore(store, owner=self.config.group, service=SERVICE,
                                        keep=self.config.snapshots_kept,
                                        log=self._log) if self.config.snapshot_every else None)
        self._folded: dict[str, int] = {}        # "topic:partition" -> next offset not folded
        self._fold_lock = asyncio.Lock()         # the consumer folds, or a snapshot is taken
        self._decided = 0                        # rounds decided here since the last snapshot
        self._closed_unannounced: set[str] = set()   # jobs whose latest close is not on the bus
        self.recovery: dict[str, Any] = {}       # how the last start recovered (snapshot, records, seconds)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.bus.ensure_topics((*INPUT_TOPICS, DEADLETTER))
        t0 = time.perf_counter()
        snapshot = await self._load_snapshot()
        records = 0
        # From the offsets the snapshot covers (a partition it does not name: from the start).
        async for delivery in self.bus.read(PLACEMENTS, start=_start(snapshot, PLACEMENTS)):
            if isinstance(delivery.event, RoundStarted):
                self._fold(delivery.event)
        for topic in INPUT_TOPICS:
            async for delivery in self.bus.read(topic, start=_start(snapshot, topic)):
                # a Position, not a Delivery: refused during replay, counted, not dead-lettered
                self._fold(delivery.event, Position(topic=delivery.topic, partition=delivery.partition,
                                                    offset=delivery.offset))
                self._note(delivery)
                records += 1
        self.recovery.update(records=records, seconds=round(time.perf_counter() - t0, 4))
        refused = await self._handle_refusals()
        self._replayed = True
        self._log.info("tracker.replayed", jobs=self.state.jobs(), open_rounds=self.state.open_rounds(),
                       refused=refused, sizes=self.state.sizes())
        self._consumer = asyncio.create_task(self._consume(), name="tracker-consume")
        self._worker = asyncio.create_task(self._work(), name="tracker-work")
        self._janitor_task = asyncio.create_task(self._janitor.run(self.config.tick_s), name="tracker-objects")

    async def stop(self) -> None:
        """Stop consuming, let the round in progress finish and be published, then return.

        Cancelled (``run_service``'s drain timeout), the round in progress is abandoned
        cleanly: its averaging thread stops, nothing is stored or announced, and the next
        tracker consolidates it (:mod:`services.tracker.consolidator`)."""
        self._stopping = True
        self._wake.set()
        for task in (self._consumer, self._janitor_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._worker is not None:
            await asyncio.gather(self._worker, return_exceptions=True)

    def health(self) -> dict[str, Any]:
        tasks_ok = all(t is not None and not t.done() for t in (self._consumer, self._worker, self._janitor_task))
        return {"ok": self._replayed and (tasks_ok or self._stopping), "replayed": self._replayed,
                "role": "standalone", "jobs": self.state.jobs(), "open_rounds": self.state.open_rounds(),
                # stage and exception type only: an exception's text may carry a URL or a key
                "last_error": ": ".join(self._last_error.split(": ", 2)[:2]) if self._last_error else None}

    # ------------------------------------------------------------------ consuming

    async def _consume(self) -> None:
        # hadar.deadletter is not read here: the scheduler counts bad records, once each.
        async with self.bus.subscribe(INPUT_TOPICS, self.config.group, resume=self._resume()) as sub:
            async for delivery in sub:
                self._m.events_in.labels(type=delivery.event.TYPE).inc()
                async with self._fold_lock:   # not while a snapshot is captured and encoded
                    if self._fold(delivery.event, origin=delivery):
                        self._wake.set()
                    self._note(delivery)
                    await self._handle_refusals()
                # State is rebuilt from the topics (after a snapshot) on start: acking once folded is safe.
                await delivery.ack()

    def _fold(self, event: Event, origin: object = None) -> bool:
        """Fold into the state; what it accepted also into the object lifecycle."""
        if changed := self.state.apply(event, origin):
            self.lifecycle.observe(event, time.monotonic())
            if isinstance(event, (ModelConsolidated, RoundAbandoned, JobCompleted, JobCancelled)):
                self._closed_unannounced.discard(event.job_id)   # a decision on the bus supersedes it
        return changed

    def _note(self, delivery: Delivery) -> None:
        tp = f"{delivery.topic}:{delivery.partition}"
        self._folded[tp] = max(self._folded.get(tp, 0), delivery.offset + 1)

    async def _handle_refusals(self) -> dict[str, int]:
        """Count, log and (for events read live) dead-letter what the state refused."""
        counts: dict[str, int] = {}
        for refusal in self.state.drain_refusals():
            counts[refusal.reason] = counts.get(refusal.reason, 0) + 1
            self._m.refused.labels(reason=refusal.reason).inc()
            origin = refusal.origin
            if isinstance(origin, Delivery):
                self._log_refusal(refusal, origin, "event.rejected")
                await self._dead_letter(origin, f"{refusal.reason}: {refusal.detail}")
            else:   # replayed: counted again, dead-lettered by the run that read it live
                self._log_refusal(refusal, None, "event.rejected_on_replay", level="debug")
        return counts

    def _log_refusal(self, refusal: Refusal, origin: Delivery | None, message: str, *,
                     level: str = "warning") -> None:
        event = refusal.event
        getattr(self._log, level)(
            message, reason=refusal.reason, detail=refusal.detail[:300], event_type=event.TYPE,
            job=getattr(event, "job_id", None), round=getattr(event, "round", None),
            node=getattr(event, "node_id", None), source=event.source[:64],
            topic=origin.topic if origin else None, offset=origin.offset if origin else None)

    async def _work(self) -> None:
        while not self._stopping:
            self._wake.clear()
            await self.process_due()
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.tick_s)
            except TimeoutError:
                pass

    async def process_due(self) -> None:
        """Consolidate every due round, then complete every due job (one pass).

        A failed attempt stays due and is tried again after its back-off; after
        ``max_attempts`` failures it is given up (see the module guarantees).
        """
        rounds = self.state.due_rounds(self.clock.time(), self.config.finish_timeout_s)
        completions = self.state.due_completions()
        self._attempts.retain([("round", w.job_id, w.round) for w in rounds]
                              + [("complete", c.job_id, 0) for c in completions])
        by_job: dict[str, list[DueRound]] = {}
        for work in rounds:
            by_job.setdefault(work.job_id, []).append(work)
        slots = asyncio.Semaphore(self.config.consolidation_jobs)
        await asyncio.gather(*(self._job_rounds(works, slots) for works in by_job.values()))
        for completion in self.state.due_completions():
            key = ("complete", completion.job_id, 0)
            if self._stopping or self._attempts.waiting(key, time.monotonic()):
                continue
            try:
                await self._complete(completion)
                self._attempts.succeeded(key)
            except Exception as exc:
                if self._failed("complete", exc, key, job=completion.job_id):
                    self.state.give_up_completion(completion.job_id)
                    self._m.completions_given_up.inc()
        every = self.config.snapshot_every
        if self.snapshots is not None and self._decided >= every and not self._stopping:
            await self._write_snapshot()
        self._m.open.set(self.state.open_rounds())
        for kind, size in self.state.sizes().items():
            self._m.entries.labels(kind=kind).set(size)

    async def _job_rounds(self, works: list[DueRound], slots: asyncio.Semaphore) -> None:
        """One job's due rounds, in order; other jobs' run beside them, ``consolidation_jobs`` at once."""
        for work in works:
            key = ("round", work.job_id, work.round)
            if self._attempts.waiting(key, time.monotonic()):
                continue
            async with slots:
                if self._stopping:
                    return  # drain: rounds in progress finish; none starts
                try:
                    await self._round(work)
                    self._attempts.succeeded(key)
                except Exception as exc:
                    if self._failed("consolidate", exc, key, job=work.job_id, round=work.round):
                        await self._give_up(work)
                        self._m.given_up.inc()

    async def _give_up(self, work: DueRound) -> None:
        """After the last failed attempt: announce the round as abandoned if the bus takes it;
        either way the round is closed here, so later rounds of the job come due."""
        try:
            reason = f"gave up after {self._attempts.max_attempts} attempts: {self._last_error or 'unknown error'}"
            await self._publish(self._produce.abandonment(work, reason))
        except Exception as exc:   # the bus may be the reason it failed: close the round anyway
            self._log.error("round.abandon_publish_failed", job=work.job_id, round=work.round,
                            error=f"{type(exc).__name__}: {exc}"[:300])
            self.state.abandon(work.job_id, work.round)
            self._closed_unannounced.add(work.job_id)   # no snapshot may keep it closed (snapshot.py)
            await self._handle_refusals()

    def _failed(self, stage: str, exc: Exception, key: tuple[str, str, int], **bound: Any) -> bool:
        """Count and log a failed attempt; True if it was the last one allowed (give it up)."""
        delay = self._attempts.failed(key, time.monotonic())
        self._m.errors.labels(stage=stage).inc()
        self._last_error = f"{stage}: {type(exc).__name__}: {exc}"[:300]
        if delay is None:
            self._log.error(f"tracker.{stage}_given_up", error=self._last_error,
                            attempts=self._attempts.max_attempts, **bound)
            return True
        self._log.error(f"tracker.{stage}_failed", error=self._last_error, retry_in_s=delay, **bound)
        return False

    def _resume(self) -> Resume | None:   # where the consumer starts a partition (None: where the group committed)
        return None

    async def _dead_letter(self, origin: Delivery, reason: str) -> None:
        await dead_letter_delivery(self.bus, origin, reason, ts=self.clock.time(), source=self.config.source)

    async def _send(self, event: Event) -> None:
        await self.bus.publish(event)

    async def _publish(self, event: Event) -> None:
        await self._send(event)
        self._m.events_out.labels(type=event.TYPE).inc()
        self._fold(event)
        await self._handle_refusals()   # reports still held for a round this decided

    # ------------------------------------------------------------------ snapshots

    async def _load_snapshot(self) -> StateSnapshot | None:
        """The newest valid snapshot, adopted into the state and the lifecycle; None without one."""
        if self.snapshots is None:
            return None
        found = await self.snapshots.recover(
            lambda snap: restore(snap, self.state, self.lifecycle, wall_now=self.clock.time(),
                                 mono_now=time.monotonic()))
        self.recovery.update(found.recovery())
        if found.snapshot is None:
            return None
        self._folded = dict(found.snapshot.offsets)
        self._log.info("tracker.snapshot_loaded", key=found.key, jobs=self.state.jobs())
        return found.snapshot

    async def _write_snapshot(self) -> None:
        """Snapshot the state now (captured and encoded, off the event loop, while the consumer
        folds nothing); never raises. Deferred while a job's latest close is not on the bus."""
        assert self.snapshots is not None
        if self._closed_unannounced:
            self._log.info("tracker.snapshot_deferred", jobs=sorted(self._closed_unannounced)[:10])
            return
        try:
            saved = await self.snapshots.save(
                lambda: capture(self.state, self.lifecycle, self._folded, wall_now=self.clock.time(),
                                mono_now=time.monotonic()), hold=self._fold_lock)
        except Exception as exc:
            self._m.snapshots.labels(outcome="failed").inc()
            self._decided = 0   # tried again after snapshot_every more rounds, not every tick
            self._log.warning("tracker.snapshot_failed", error=f"{type(exc).__name__}: {exc}"[:300])
            return
        if saved is None:
            self._log.warning("tracker.snapshot_deferred", reason="a held report has no position")
            return
        self._decided = 0
        self._m.snapshots.labels(outcome="written").inc()
        self._log.info("tracker.snapshot_written", key=saved.key, bytes=saved.bytes,
                       offsets=len(saved.snapshot.offsets))

    # ------------------------------------------------------------------ rounds

    async def _round(self, work: DueRound) -> None:
        log = self._log.bind(job=work.job_id, round=work.round)
        key = model_key(work.job_id, work.round)
        event: ModelConsolidated | RoundAbandoned | None = None
        if await self.store.exists(key):
            event = await self._produce.existing(work, key, log, self.state.check_announcement)
        if event is None:
            event = await self._produce.consolidate(work, key, log)
        if isinstance(event, RoundAbandoned):
            await self._publish(event)   # folding it closes the round; held reports are refused
            self._m.abandoned.inc()
        else:
            refusal = self.state.check_announcement(event)
            if refusal is not None:   # never for a model this tracker computed: its weighing obeys the same rules
                raise AnnouncementRefused(f"{refusal.reason}: {refusal.detail}")
            await self._publish(event)
            log.info("round.consolidated", key=key, total_steps=event.total_steps,
                     copies=[c.copy for c in event.copies], rejected=[r.copy for r in event.rejected],
                     missing=list(event.missing), seconds=round(event.seconds, 3))
        self._decided += 1
        self._m.failed.inc(len(work.failed))     # once per round decided, not per attempt
        self._m.missing.inc(len(work.missing))

    # ------------------------------------------------------------------ completion

    async def _complete(self, work: DueCompletion) -> None:
        key = await self._produce.store_final(work)
        now = self.clock.time()
        event = JobCompleted(ts=now, source=self.config.source, job_id=work.job_id, final_key=key,
                             total_steps=work.total_steps, jct_s=max(0.0, now - work.submitted_at),
                             completed_at=now)
        refusal = self.state.check_announcement(event)
        if refusal is not None:
            raise AnnouncementRefused(f"{refusal.reason}: {refusal.detail}")
        await self._publish(event)
        self._m.completed.inc()
        self._log.info("job.completed", job=work.job_id, final_key=key, total_steps=work.total_steps,
                       jct_s=round(event.jct_s, 3))


def _start(snapshot: StateSnapshot | None, topic: str) -> dict[int, int] | None:
    return snapshot.partition_offsets(topic) if snapshot is not None else None
