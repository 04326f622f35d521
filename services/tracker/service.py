"""The tracker service: follows copies' progress, consolidates each round, completes jobs.

A thin shell around :class:`~services.tracker.state.TrackerState` (what is due) and
:mod:`services.tracker.consolidate` (the averaging). On start it replays hadar.models,
hadar.jobs, hadar.placements and hadar.progress from the beginning to rebuild its state,
then follows them in consumer group ``config.group``; a worker consolidates due rounds
one at a time, off the event loop.

Guarantees:

* A round's model is written to ``models/{job}/{round}.safetensors`` (temp file, then an
  atomic ``put_file``) before its ModelConsolidated is published, and a round is never
  announced twice: a ModelConsolidated already on hadar.models decides the round, and a
  model object written by an earlier run that was not announced is announced from its
  own metadata rather than recomputed, so a restart never publishes a different model.
* When a job's consolidated steps reach its iterations, ``models/{job}/final.safetensors``
  is written (a copy of the latest round's model) and JobCompleted follows, once, with
  ``jct_s = completed_at - submitted_at``.
* A round with no usable replica publishes no model; it is logged and counted.
* Failures of the store or the bus leave the round due; it is retried with back-off.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.tracker.consolidate import (
    ConsolidationPlan, Mode, NoUsableReplica, Rejected, Replica, WriteStats, plan_consolidation,
    write_consolidated,
)
from services.tracker.safetensors_format import InvalidSafetensors, read_header
from services.tracker.state import CompletionWork, RoundWork, TrackerState
from services.tracker.store_reader import StoreRangeReader
from shared.bus import Bus
from shared.clock import Clock, SystemClock
from shared.events import Event, JobCompleted, ModelConsolidated
from shared.layout import final_key, model_key
from shared.logging import get_logger
from shared.model_meta import InvalidModelMetadata, ModelMetadata
from shared.settings import FieldError
from shared.store import InvalidKey, ObjectNotFound, ObjectStore
from shared.topics import DEADLETTER, JOBS, MODELS, PLACEMENTS, PROGRESS

__all__ = ["TrackerConfig", "TrackerService", "INPUT_TOPICS"]

# hadar.models first: rounds already decided then ignore late progress of those rounds.
INPUT_TOPICS: tuple[str, ...] = (MODELS, JOBS, PLACEMENTS, PROGRESS)
MAX_RETRY_S = 60.0


@dataclass(frozen=True, kw_only=True)
class TrackerConfig:
    """The tracker's settings; ``hadar serve tracker`` loads them with
    :func:`shared.settings.load_config` (flags, ``HADAR_TRACKER_*``, ``--config`` file).

    ``mode``: weigh copies by the steps each did, or uniformly. ``finish_timeout_s``: how
    long after a round's deadline missing copies are waited for. ``tick_s``: how often due
    rounds are checked. ``chunk_bytes``: accumulator chunk, also the size of each ranged
    read from the store. ``temp_dir``: where consolidated models are staged (None: the
    system's). An invalid value raises :class:`~shared.settings.FieldError` naming the field.
    """

    group: str = "tracker"
    mode: Mode = "steps"
    finish_timeout_s: float = 120.0
    tick_s: float = 1.0
    chunk_bytes: int = 8 << 20
    temp_dir: str | None = None
    source: str = "tracker"

    def __post_init__(self) -> None:
        if self.mode not in ("steps", "uniform"):
            raise FieldError("mode", f"must be 'steps' or 'uniform', got {self.mode!r}")
        if not self.finish_timeout_s >= 0:
            raise FieldError("finish_timeout_s", f"must be >= 0, got {self.finish_timeout_s}")
        if not self.tick_s > 0:
            raise FieldError("tick_s", f"must be > 0, got {self.tick_s}")
        if self.chunk_bytes < 8:
            raise FieldError("chunk_bytes", f"must be >= 8, got {self.chunk_bytes}")


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
        self._last_error: str | None = None
        self._retry: dict[tuple[str, str, int], tuple[float, float]] = {}  # key -> (monotonic due, delay)
        r = self.registry
        self._m_seconds = Histogram("tracker_consolidation_seconds", "Time to consolidate one round",
                                    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
                                    registry=r)
        self._m_models = Counter("tracker_models_written_total", "Round models written", registry=r)
        self._m_rejected = Counter("tracker_replicas_rejected_total",
                                   "Replicas left out of a consolidation (bad, mismatched, absent)", registry=r)
        self._m_failed = Counter("tracker_copies_failed_total", "Copies that reported failure", registry=r)
        self._m_missing = Counter("tracker_copies_missing_total", "Assigned copies that never finished", registry=r)
        self._m_abandoned = Counter("tracker_rounds_without_model_total", "Rounds with nothing to average", registry=r)
        self._m_completed = Counter("tracker_jobs_completed_total", "Jobs completed", registry=r)
        self._m_errors = Counter("tracker_errors_total", "Consolidation or completion attempts that failed",
                                 ["stage"], registry=r)
        self._m_bytes = Counter("tracker_bytes_read_total", "Replica bytes read for averaging", registry=r)
        self._m_in = Counter("tracker_events_in_total", "Events consumed", ["type"], registry=r)
        self._m_out = Counter("tracker_events_out_total", "Events published", ["type"], registry=r)
        self._m_dead = Counter("tracker_dead_letters_seen_total", "Dead letters seen", registry=r)
        self._m_open = Gauge("tracker_open_rounds", "Rounds not consolidated yet", registry=r)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.bus.ensure_topics((*INPUT_TOPICS, DEADLETTER))
        for topic in INPUT_TOPICS:
            async for delivery in self.bus.read(topic):
                self.state.apply(delivery.event)
        self._replayed = True
        self._log.info("tracker.replayed", jobs=self.state.jobs(), open_rounds=self.state.open_rounds())
        self._consumer = asyncio.create_task(self._consume(), name="tracker-consume")
        self._worker = asyncio.create_task(self._work(), name="tracker-work")

    async def stop(self) -> None:
        """Stop consuming, let the round in progress finish and be published, then return."""
        self._stopping = True
        self._wake.set()
        if self._consumer is not None:
            self._consumer.cancel()
            await asyncio.gather(self._consumer, return_exceptions=True)
        if self._worker is not None:
            await asyncio.gather(self._worker, return_exceptions=True)

    def health(self) -> dict[str, Any]:
        tasks_ok = all(t is not None and not t.done() for t in (self._consumer, self._worker))
        return {"ok": self._replayed and (tasks_ok or self._stopping), "replayed": self._replayed,
                "jobs": self.state.jobs(), "open_rounds": self.state.open_rounds(),
                "last_error": self._last_error}

    # ------------------------------------------------------------------ consuming

    async def _consume(self) -> None:
        async with self.bus.subscribe((*INPUT_TOPICS, DEADLETTER), self.config.group) as sub:
            async for delivery in sub:
                if delivery.topic == DEADLETTER:
                    self._m_dead.inc()
                else:
                    self._m_in.labels(type=delivery.event.TYPE).inc()
                    if self.state.apply(delivery.event):
                        self._wake.set()
                # State is rebuilt from the topics on start, so acking once folded is safe.
                await delivery.ack()

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

        A failed attempt stays due; it is retried after a back-off that doubles per failure
        (``tick_s`` up to ``MAX_RETRY_S``), so a missing object does not flood the logs.
        """
        for work in self.state.due_rounds(self.clock.time(), self.config.finish_timeout_s):
            if self._stopping:
                break  # drain: the round in progress (if any) finished; start no new one
            key = ("round", work.job_id, work.round)
            if self._backing_off(key):
                continue
            try:
                await self._round(work)
                self._retry.pop(key, None)
            except Exception as exc:
                self._fail("consolidate", exc, key, job=work.job_id, round=work.round)
        for completion in self.state.due_completions():
            key = ("complete", completion.job_id, 0)
            if self._stopping or self._backing_off(key):
                continue
            try:
                await self._complete(completion)
                self._retry.pop(key, None)
            except Exception as exc:
                self._fail("complete", exc, key, job=completion.job_id)
        self._m_open.set(self.state.open_rounds())

    def _backing_off(self, key: tuple[str, str, int]) -> bool:
        retry = self._retry.get(key)
        return retry is not None and time.monotonic() < retry[0]

    def _fail(self, stage: str, exc: Exception, key: tuple[str, str, int], **bound: Any) -> None:
        delay = min(MAX_RETRY_S, 2 * self._retry[key][1]) if key in self._retry else self.config.tick_s
        self._retry[key] = (time.monotonic() + delay, delay)
        self._m_errors.labels(stage=stage).inc()
        self._last_error = f"{stage}: {type(exc).__name__}: {exc}"[:300]
        self._log.error(f"tracker.{stage}_failed", error=self._last_error, retry_in_s=delay, **bound)

    async def _publish(self, event: Event) -> None:
        await self.bus.emit(event)
        self._m_out.labels(type=event.TYPE).inc()
        self.state.apply(event)

    # ------------------------------------------------------------------ rounds

    async def _round(self, work: RoundWork) -> None:
        log = self._log.bind(job=work.job_id, round=work.round)
        self._m_failed.inc(len(work.failed))
        self._m_missing.inc(len(work.missing))
        key = model_key(work.job_id, work.round)
        event = None
        if await self.store.exists(key):
            event = await self._announcement_of_existing(work, key, log)
        if event is None:
            event = await self._consolidate(work, key, log)
        if event is None:
            self.state.abandon(work.job_id, work.round)
            self._m_abandoned.inc()
            return
        await self._publish(event)
        log.info("round.consolidated", key=key, total_steps=event.total_steps,
                 copies=[c.copy for c in event.copies], rejected=[r.copy for r in event.rejected],
                 missing=list(event.missing), seconds=round(event.seconds, 3))

    async def _consolidate(self, work: RoundWork, key: str, log: Any) -> ModelConsolidated | None:
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
            replicas.append(Replica(copy=copy.copy, steps=copy.steps,
                                    reader=StoreRangeReader(self.store, copy.checkpoint, size, loop)))
        tmp_dir = Path(tempfile.mkdtemp(prefix="hadar-tracker-", dir=self.config.temp_dir))
        try:
            try:
                plan, meta, stats, path = await asyncio.to_thread(self._write, work, replicas, rejected, tmp_dir)
            except NoUsableReplica as exc:
                self._m_rejected.inc(len(exc.rejected) - len(work.failed))
                log.warning("round.no_usable_replica", reason=str(exc)[:500], missing=list(work.missing))
                return None
            await self.store.put_file(key, path)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        seconds = time.perf_counter() - started
        self._m_seconds.observe(seconds)
        self._m_models.inc()
        self._m_bytes.inc(stats.bytes_read)
        self._m_rejected.inc(len(plan.rejected) - len(work.failed))
        return _announcement(meta, key, self.clock.time(), self.config.source, seconds=seconds)

    def _write(self, work: RoundWork, replicas: list[Replica], rejected: list[Rejected],
               tmp_dir: Path) -> tuple[ConsolidationPlan, ModelMetadata, WriteStats, Path]:
        # The plan bounds each copy's steps and the job's total. Writing may reject replicas
        # holding NaN or inf: the file's metadata and the announcement are those of the plan
        # actually written (stats.plan).
        plan = plan_consolidation(replicas, mode=self.config.mode, rejected=rejected,
                                  prior_steps=work.prior_steps)
        static = {"job": work.job_id, "round": str(work.round), "missing": json.dumps(list(work.missing))}
        path = tmp_dir / "model.safetensors"
        with open(path, "wb") as out:
            stats = write_consolidated(plan, out, metadata=static, chunk_bytes=self.config.chunk_bytes)
        meta = stats.plan.model_metadata(job=work.job_id, round_=work.round, missing=work.missing)
        return stats.plan, meta, stats, path

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
        log.info("round.existing_model_announced", key=key)
        return _announcement(meta, key, self.clock.time(), self.config.source)

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
        await self._publish(event)
        self._m_completed.inc()
        self._log.info("job.completed", job=work.job_id, final_key=key, total_steps=work.total_steps,
                       jct_s=round(event.jct_s, 3))


def _announcement(meta: ModelMetadata, key: str, ts: float, source: str, *, seconds: float = 0.0
                  ) -> ModelConsolidated:
    """The ModelConsolidated of the model at ``key``: what it says about itself, nothing more."""
    return ModelConsolidated(ts=ts, source=source, job_id=meta.job, round=meta.round, key=key,
                             total_steps=meta.total_steps, copies=meta.copies, rejected=meta.rejected,
                             missing=meta.missing, seconds=seconds)
