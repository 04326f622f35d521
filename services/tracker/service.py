"""The tracker service: follows copies' progress, consolidates each round, completes jobs.

A thin shell around :class:`~services.tracker.state.TrackerState` (what is due, what is
refused) and :mod:`services.tracker.consolidate` (the averaging). On start it replays, from
the beginning, every RoundStarted, then hadar.jobs, hadar.placements, hadar.models and
hadar.progress, to rebuild its state -- placements before the events checked against
them, and every RoundStarted first because its partition is not its Assignments' -- then
follows them in consumer group ``config.group``; a worker consolidates due rounds one at
a time, off the event loop.

Guarantees:

* A round's model is written to ``models/{job}/{round}.safetensors`` (temp file, then an
  atomic ``put_file``) before its ModelConsolidated is published, and a round is never
  announced twice: a ModelConsolidated already on hadar.models decides the round, and a
  model object written by an earlier run that was not announced is announced from its
  own metadata rather than recomputed, so a restart never publishes a different model.
* A round model holds the averaged weights only and describes itself (model, dataset,
  width/depth, zoo view, library, samples: ``shared.model_meta``); the averaged optimizer
  state is stored first, beside it (``shared.layout.optim_key``), and the announcement
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
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.tracker.acceptance import REFUSAL_REASONS, Refusal
from services.tracker.attempts import Attempts
from services.tracker.config import MAX_RETRY_S, TrackerConfig
from services.tracker.consolidate import NoUsableReplica, Rejected, Replica, plan_consolidation
from services.tracker.lifecycle import ObjectJanitor, ObjectLifecycle
from services.tracker.model_output import RoundOutputs, held_out_metric, write_round_outputs
from services.tracker.safetensors_format import InvalidSafetensors, read_header
from services.tracker.state import CompletionWork, RoundWork, TrackerState
from services.tracker.store_reader import StoreRangeReader
from shared.bus import Bus, Delivery
from shared.clock import Clock, SystemClock
from shared.errors import HadarError
from shared.events import Event, JobCompleted, ModelConsolidated, Rejection, RoundAbandoned, RoundStarted
from shared.layout import final_key, model_key, optim_key
from shared.logging import get_logger
from shared.model_meta import InvalidModelMetadata, ModelMetadata
from shared.rejection import dead_letter_delivery
from shared.store import InvalidKey, ObjectNotFound, ObjectStore
from shared.topics import DEADLETTER, JOBS, MODELS, PLACEMENTS, PROGRESS

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
        self.clock = clock or SystemClock()
        self.registry = registry or CollectorRegistry()
        self.state = TrackerState()
        self._log = get_logger(service=self.name)
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
        self._m_seconds = Histogram("hadar_tracker_consolidation_seconds", "Time to consolidate one round",
                                    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
                                    registry=r)
        self._m_models = Counter("hadar_tracker_models_written_total", "Round models written", registry=r)
        self._m_rejected = Counter("hadar_tracker_replicas_rejected_total",
                                   "Replicas left out of a consolidation (bad, mismatched, absent)", registry=r)
        self._m_failed = Counter("hadar_tracker_copies_failed_total", "Copies that reported failure", registry=r)
        self._m_missing = Counter("hadar_tracker_copies_missing_total", "Assigned copies that never finished",
                                  registry=r)
        self._m_abandoned = Counter("hadar_tracker_rounds_without_model_total", "Rounds with nothing to average",
                                    registry=r)
        self._m_completed = Counter("hadar_tracker_jobs_completed_total", "Jobs completed", registry=r)
        self._m_errors = Counter("hadar_tracker_errors_total", "Consolidation or completion attempts that failed",
                                 ["stage"], registry=r)
        for stage in ("consolidate", "complete"):
            self._m_errors.labels(stage=stage)   # exported as 0, so increase() sees the first failure
        self._m_bytes = Counter("hadar_tracker_replica_read_bytes_total", "Replica bytes read for averaging",
                                registry=r)
        self._m_in = Counter("hadar_tracker_events_in_total", "Events consumed", ["type"], registry=r)
        self._m_out = Counter("hadar_tracker_events_out_total", "Events published", ["type"], registry=r)
        self._m_open = Gauge("hadar_tracker_open_rounds", "Rounds not consolidated yet", registry=r)
        self._m_refused = Counter("hadar_tracker_events_rejected_total",
                                  "Events refused (changed nothing; dead-lettered when read live)", ["reason"],
                                  registry=r)
        for reason in REFUSAL_REASONS:
            self._m_refused.labels(reason=reason)
        self._m_given_up = Counter("hadar_tracker_rounds_given_up_total",
                                   "Rounds abandoned after max_attempts failed consolidations", registry=r)
        self._m_completions_given_up = Counter("hadar_tracker_completions_given_up_total",
                                               "Completions abandoned after max_attempts failures", registry=r)
        self._m_entries = Gauge("hadar_tracker_state_entries", "What the tracker's state holds, per kind", ["kind"],
                                registry=r)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.bus.ensure_topics((*INPUT_TOPICS, DEADLETTER))
        async for delivery in self.bus.read(PLACEMENTS):
            if isinstance(delivery.event, RoundStarted):
                self._fold(delivery.event)
        for topic in INPUT_TOPICS:
            async for delivery in self.bus.read(topic):
                self._fold(delivery.event)   # no origin: refused during replay, counted, not dead-lettered
        refused = await self._handle_refusals()
        self._replayed = True
        self._log.info("tracker.replayed", jobs=self.state.jobs(), open_rounds=self.state.open_rounds(),
                       refused=refused, sizes=self.state.sizes())
        self._consumer = asyncio.create_task(self._consume(), name="tracker-consume")
        self._worker = asyncio.create_task(self._work(), name="tracker-work")
        self._janitor_task = asyncio.create_task(self._janitor.run(self.config.tick_s), name="tracker-objects")

    async def stop(self) -> None:
        """Stop consuming, let the round in progress finish and be published, then return."""
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
                "jobs": self.state.jobs(), "open_rounds": self.state.open_rounds(),
                # stage and exception type only: an exception's text may carry a URL or a key
                "last_error": ": ".join(self._last_error.split(": ", 2)[:2]) if self._last_error else None}

    # ------------------------------------------------------------------ consuming

    async def _consume(self) -> None:
        # hadar.deadletter is not read here: the scheduler counts bad records, once each.
        async with self.bus.subscribe(INPUT_TOPICS, self.config.group) as sub:
            async for delivery in sub:
                self._m_in.labels(type=delivery.event.TYPE).inc()
                if self._fold(delivery.event, origin=delivery):
                    self._wake.set()
                await self._handle_refusals()
                # State is rebuilt from the topics on start, so acking once folded is safe.
                await delivery.ack()

    def _fold(self, event: Event, origin: object = None) -> bool:
        """Fold into the state; what it accepted also into the object lifecycle."""
        if changed := self.state.apply(event, origin):
            self.lifecycle.observe(event, time.monotonic())
        return changed

    async def _handle_refusals(self) -> dict[str, int]:
        """Count, log and (for events read live) dead-letter what the state refused."""
        counts: dict[str, int] = {}
        for refusal in self.state.drain_refusals():
            counts[refusal.reason] = counts.get(refusal.reason, 0) + 1
            self._m_refused.labels(reason=refusal.reason).inc()
            origin = refusal.origin
            if isinstance(origin, Delivery):
                self._log_refusal(refusal, origin, "event.rejected")
                await dead_letter_delivery(self.bus, origin, f"{refusal.reason}: {refusal.detail}",
                                           ts=self.clock.time(), source=self.config.source)
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
            except asyncio.TimeoutError:
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
        for work in rounds:
            if self._stopping:
                break  # drain: the round in progress (if any) finished; start no new one
            key = ("round", work.job_id, work.round)
            if self._attempts.waiting(key, time.monotonic()):
                continue
            try:
                await self._round(work)
                self._attempts.succeeded(key)
            except Exception as exc:
                if self._failed("consolidate", exc, key, job=work.job_id, round=work.round):
                    await self._give_up(work)
                    self._m_given_up.inc()
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
                    self._m_completions_given_up.inc()
        self._m_open.set(self.state.open_rounds())
        for kind, size in self.state.sizes().items():
            self._m_entries.labels(kind=kind).set(size)

    def _abandonment(self, work: RoundWork, reason: str, *, rejected: tuple[Rejection, ...] = ()) -> RoundAbandoned:
        return RoundAbandoned(ts=self.clock.time(), source=self.config.source, job_id=work.job_id, round=work.round,
                              reason=reason[:1024], rejected=rejected, missing=work.missing)

    async def _give_up(self, work: RoundWork) -> None:
        """After the last failed attempt: announce the round as abandoned if the bus takes it;
        either way the round is closed here, so later rounds of the job come due."""
        try:
            await self._publish(self._abandonment(work, f"gave up after {self._attempts.max_attempts} attempts: "
                                                        f"{self._last_error or 'unknown error'}"))
        except Exception as exc:   # the bus may be the reason it failed: close the round anyway
            self._log.error("round.abandon_publish_failed", job=work.job_id, round=work.round,
                            error=f"{type(exc).__name__}: {exc}"[:300])
            self.state.abandon(work.job_id, work.round)
            await self._handle_refusals()

    def _failed(self, stage: str, exc: Exception, key: tuple[str, str, int], **bound: Any) -> bool:
        """Count and log a failed attempt; True if it was the last one allowed (give it up)."""
        delay = self._attempts.failed(key, time.monotonic())
        self._m_errors.labels(stage=stage).inc()
        self._last_error = f"{stage}: {type(exc).__name__}: {exc}"[:300]
        if delay is None:
            self._log.error(f"tracker.{stage}_given_up", error=self._last_error,
                            attempts=self._attempts.max_attempts, **bound)
            return True
        self._log.error(f"tracker.{stage}_failed", error=self._last_error, retry_in_s=delay, **bound)
        return False

    async def _publish(self, event: Event) -> None:
        await self.bus.emit(event)
        self._m_out.labels(type=event.TYPE).inc()
        self._fold(event)
        await self._handle_refusals()   # reports still held for a round this decided

    # ------------------------------------------------------------------ rounds

    async def _round(self, work: RoundWork) -> None:
        log = self._log.bind(job=work.job_id, round=work.round)
        key = model_key(work.job_id, work.round)
        event = None
        if await self.store.exists(key):
            event = await self._announcement_of_existing(work, key, log)
        if event is None:
            event = await self._consolidate(work, key, log)
        if isinstance(event, RoundAbandoned):
            await self._publish(event)   # folding it closes the round; held reports are refused
            self._m_abandoned.inc()
        else:
            refusal = self.state.check_announcement(event)
            if refusal is not None:   # never for a model this tracker computed: its plan obeys the same rules
                raise AnnouncementRefused(f"{refusal.reason}: {refusal.detail}")
            await self._publish(event)
            log.info("round.consolidated", key=key, total_steps=event.total_steps,
                     copies=[c.copy for c in event.copies], rejected=[r.copy for r in event.rejected],
                     missing=list(event.missing), seconds=round(event.seconds, 3))
        self._m_failed.inc(len(work.failed))     # once per round decided, not per attempt
        self._m_missing.inc(len(work.missing))

    async def _consolidate(self, work: RoundWork, key: str, log: Any) -> ModelConsolidated | RoundAbandoned:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        rejected = [Rejected(copy=f.copy, reason=f"copy failed: {f.reason or 'no reason given'}"[:240])
                    for f in work.failed]
        replicas = []
        for copy in work.usable:
            assert copy.checkpoint is not None
            try:
                size = await self.store.size(copy.checkpoint)
            except (ObjectNotFound, InvalidKey) as exc:
                rejected.append(Rejected(copy=copy.copy, reason=f"checkpoint {copy.checkpoint!r}: {exc}"[:240]))
                continue
            replicas.append(Replica(copy=copy.copy, steps=copy.steps, max_steps=copy.budget,
                                    workers=copy.workers, reader=StoreRangeReader(self.store, copy.checkpoint, size, loop)))
        tmp_dir = Path(tempfile.mkdtemp(prefix="hadar-tracker-", dir=self.config.temp_dir))
        try:
            try:
                outputs, metric = await asyncio.to_thread(self._write, work, replicas, rejected, tmp_dir)
            except NoUsableReplica as exc:
                self._m_rejected.inc(len(exc.rejected) - len(work.failed))
                log.warning("round.no_usable_replica", reason=str(exc)[:500], missing=list(work.missing))
                return self._abandonment(work, "no usable replica",
                                         rejected=tuple(Rejection(copy=r.copy, reason=r.reason) for r in exc.rejected))
            if outputs.optim_path is not None:   # first: a copy that finds the model finds its optimizer state
                await self.store.put_file(optim_key(work.job_id, work.round), outputs.optim_path)
            await self.store.put_file(key, outputs.model_path)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        seconds = time.perf_counter() - started
        self._m_seconds.observe(seconds)
        self._m_models.inc()
        self._m_bytes.inc(outputs.stats.bytes_read)
        self._m_rejected.inc(len(outputs.plan.rejected) - len(work.failed))
        return _announcement(outputs.meta, key, self.clock.time(), self.config.source, seconds=seconds,
                             metric=metric)

    def _write(self, work: RoundWork, replicas: list[Replica], rejected: list[Rejected],
               tmp_dir: Path) -> tuple[RoundOutputs, tuple[str, float] | None]:
        # The plan bounds each copy's steps and the job's total. Writing may reject replicas
        # holding NaN or inf: the files' metadata and the announcement are those of the plan
        # actually written (model_output.py).
        plan = plan_consolidation(replicas, mode=self.config.mode, rejected=rejected,
                                  prior_worker_steps=work.prior_worker_steps, job_workers=work.job_workers,
                                  limit_worker_steps=work.limit_worker_steps)
        outputs = write_round_outputs(plan, tmp_dir, job_id=work.job_id, round_=work.round, missing=work.missing,
                                      spec=work.spec, chunk_bytes=self.config.chunk_bytes)
        metric, why_not = held_out_metric(outputs.model_path, work.spec)
        if metric is None:
            self._log.info("round.no_metric", job=work.job_id, round=work.round, reason=why_not)
        return outputs, metric

    async def _announcement_of_existing(self, work: RoundWork, key: str, log: Any) -> ModelConsolidated | None:
        """The ModelConsolidated of a model an earlier run wrote but did not announce."""
        size = await self.store.size(key)
        reader = StoreRangeReader(self.store, key, size, asyncio.get_running_loop())
        try:
            header = await asyncio.to_thread(read_header, reader)
            meta = ModelMetadata.from_metadata(header.metadata)
        except (InvalidSafetensors, InvalidModelMetadata) as exc:
            log.warning("round.existing_model_unusable", key=key, error=str(exc)[:300])
            return None  # not ours or unreadable, and never announced: recompute over it
        if (meta.job, meta.round) != (work.job_id, work.round):
            log.warning("round.existing_model_unusable", key=key,
                        error=f"metadata names job {meta.job!r} round {meta.round}")
            return None
        event = _announcement(meta, key, self.clock.time(), self.config.source)
        refusal = self.state.check_announcement(event)
        if refusal is not None:
            log.warning("round.existing_model_unusable", key=key, error=f"{refusal.reason}: {refusal.detail}"[:300])
            return None
        log.info("round.existing_model_announced", key=key)
        return event

    # ------------------------------------------------------------------ completion

    async def _complete(self, work: CompletionWork) -> None:
        key = final_key(work.job_id)
        tmp_dir = Path(tempfile.mkdtemp(prefix="hadar-tracker-", dir=self.config.temp_dir))
        try:
            path = tmp_dir / "final.safetensors"
            await self.store.get_file(work.model_key, path)
            await self.store.put_file(key, path)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        now = self.clock.time()
        event = JobCompleted(ts=now, source=self.config.source, job_id=work.job_id, final_key=key,
                             total_steps=work.total_steps, jct_s=max(0.0, now - work.submitted_at),
                             completed_at=now)
        refusal = self.state.check_announcement(event)
        if refusal is not None:
            raise AnnouncementRefused(f"{refusal.reason}: {refusal.detail}")
        await self._publish(event)
        self._m_completed.inc()
        self._log.info("job.completed", job=work.job_id, final_key=key, total_steps=work.total_steps,
                       jct_s=round(event.jct_s, 3))


class AnnouncementRefused(HadarError):
    """An announcement of the tracker's own that its state would refuse: a bug, counted as a
    failed attempt like any other."""


def _announcement(meta: ModelMetadata, key: str, ts: float, source: str, *, seconds: float = 0.0,
                  metric: tuple[str, float] | None = None) -> ModelConsolidated:
    """The ModelConsolidated of the model at ``key``: what it says about itself, and its
    held-out metric when it was just evaluated."""
    name, value = metric if metric is not None else ("", None)
    return ModelConsolidated(ts=ts, source=source, job_id=meta.job, round=meta.round, key=key,
                             total_steps=meta.total_steps, copies=meta.copies, rejected=meta.rejected,
                             missing=meta.missing, seconds=seconds, metric_name=name, metric_value=value)
