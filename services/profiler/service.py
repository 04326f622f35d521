"""The profiler service: catalog estimates for new jobs, smoothed measurements after.

* On JobSubmitted: the job's steps/s on every catalog GPU type (``estimator``, by default
  :func:`services.profiler.estimate.catalog_rates`, run off the event loop) published as
  ThroughputEstimate with ``basis="estimate"`` and ``workers`` = the job's W, with the
  job's checkpoint size (``model_bytes``, ``optimizer_slots``:
  ``sizer``, by default :func:`~services.profiler.estimate.checkpoint_size`; 0 bytes if
  unknown), which the
  live HadarE charges for consolidating forked copies. A job whose
  model has no figures gets no estimate (logged, counted); the scheduler then relies on
  its own table or on measurements. Measurements state no size (``model_bytes`` 0).
* On Progress: :class:`~services.profiler.state.ProfilerState` decides; a moved rate is
  published with ``basis="measured"`` (the scheduler prefers measured values). Progress
  from emulated agents is counted under ``emulated="true"`` in the metrics, and a rate
  measured on an emulated GPU also re-estimates every other type by the emulation's
  slowdowns relative to the reference the Progress names, as the agent throttled by
  (:func:`~services.profiler.estimate.emulated_rates`): on an emulated cluster the
  catalog's real-GPU estimate would send work to the wrong nodes. For the same reason the
  profiler reads hadar.nodes: on GPU types that only emulated nodes offer, a job's first
  estimate already has the emulation's ratios between types
  (:func:`~services.profiler.estimate.on_emulated_types`). A job of user code gets a
  provisional estimate (:mod:`services.profiler.estimate`), so it is placed before it was ever
  measured. A rate measured on a real GPU re-estimates every other real type of the job from
  it, at the estimator's ratios (:func:`~services.profiler.estimate.anchored_rates`), for every
  job: against published step times that halves the estimate's error.
* Restart: hadar.jobs, hadar.throughput and hadar.nodes are replayed first, so a job already
  estimated is not estimated again, smoothing resumes from the last published rate and the
  emulated types are known.
  With an object store the profiler snapshots its state every ``snapshot_interval_s``
  (``services/profiler/snapshot.py``) and a restart replays the three topics only after
  the offsets of the newest valid snapshot (a damaged one falls back to the one before).
  A delivery is acked only after what it caused is published (at-least-once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import structlog
from prometheus_client import CollectorRegistry, Counter

from services.profiler.estimate import (
    Sizer,
    anchored_rates,
    catalog_rates,
    checkpoint_size,
    emulated_rates,
    on_emulated_types,
    size_or_unknown,
)
from services.profiler.snapshot import SERVICE, capture, restore
from services.profiler.state import DEFAULT_ALPHA, DEFAULT_THRESHOLD, MeasuredUpdate, ProfilerState
from shared.bus import Bus, BusError, Delivery
from shared.bus.rejection import Rejected, dead_letter_delivery
from shared.clock import Clock, SystemClock
from shared.domain.gpus import GPU_TYPES
from shared.domain.ownership import cancel_refusal
from shared.persistence.snapshot import SnapshotStore
from shared.runtime.config import FieldError
from shared.store import ObjectStore
from shared.wire.dispatch import HandlerTable
from shared.wire.events import (
    CopyFinished,
    Event,
    JobCancelled,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    NodeHeartbeat,
    NodeRegistered,
    Progress,
    RoundAbandoned,
    ThroughputEstimate,
)
from shared.wire.topics import DEADLETTER, JOBS, MODELS, NODES, PROGRESS, THROUGHPUT

__all__ = ["ProfilerConfig", "ProfilerService", "Estimator", "Sizer"]

Estimator = Callable[[JobSpec], dict[str, float]]
INPUT_TOPICS: tuple[str, ...] = (JOBS, PROGRESS, MODELS, NODES)
RECOVERY_TOPICS: tuple[str, ...] = (THROUGHPUT, JOBS, NODES)   # read at start-up: its own estimates, jobs, nodes
MAX_WORKERS = 64  # ThroughputEstimate.workers range


@dataclass(frozen=True, kw_only=True)
class ProfilerConfig:
    """The profiler's settings; ``hadar serve profiler`` loads them with
    :func:`shared.runtime.config.load_config` (flags, ``HADAR_PROFILER_*``, ``--config`` file).

    ``alpha``: EWMA weight of a new measurement, in (0, 1]. ``threshold``: a measured rate
    is published when it moves by more than this fraction, >= 0. ``snapshot_interval_s``:
    with an object store, snapshot the state at most this often (0: never);
    ``snapshots_kept``: how many to keep. An invalid value raises
    :class:`~shared.runtime.config.FieldError` naming the field.
    """

    group: str = "hadar-profiler"
    alpha: float = DEFAULT_ALPHA
    threshold: float = DEFAULT_THRESHOLD
    source: str = "profiler"
    snapshot_interval_s: float = 600.0
    snapshots_kept: int = 3

    def __post_init__(self) -> None:
        if not 0 <= self.snapshot_interval_s <= 1e9:
            raise FieldError("snapshot_interval_s", f"must be in [0, 1e9] seconds, got {self.snapshot_interval_s}")
        if not 1 <= self.snapshots_kept <= 1000:
            raise FieldError("snapshots_kept", f"must be in 1..1000, got {self.snapshots_kept}")
        if not 0 < self.alpha <= 1:
            raise FieldError("alpha", f"must be in (0, 1], got {self.alpha}")
        if not self.threshold >= 0:
            raise FieldError("threshold", f"must be >= 0, got {self.threshold}")


class ProfilerService:
    name = "profiler"

    def __init__(self, *, bus: Bus, config: ProfilerConfig | None = None, clock: Clock | None = None,
                 registry: CollectorRegistry | None = None, estimator: Estimator = catalog_rates,
                 store: ObjectStore | None = None, sizer: Sizer = checkpoint_size) -> None:
        self.bus = bus
        self.config = config or ProfilerConfig()
        self.clock = clock or SystemClock()
        self.registry = registry or CollectorRegistry()
        self.estimator = estimator
        self.sizer = sizer
        self.state = ProfilerState(alpha=self.config.alpha, threshold=self.config.threshold)
        self._log = structlog.get_logger(__name__).bind(service=self.name)
        self._consumer: asyncio.Task[None] | None = None
        self._replayed = False
        self._stopping = False
        self._busy = False
        self.snapshots = (SnapshotStore(store, owner=self.config.group, service=SERVICE,
                                        keep=self.config.snapshots_kept, log=self._log) if store is not None else None)
        self._covered: dict[str, int] = {}   # "topic:partition" -> next offset the state covers
        self._fold_lock = asyncio.Lock()     # held while a delivery is handled or the state is snapshot
        self._last_snapshot = 0.0
        self.recovery: dict[str, Any] = {}
        r = self.registry
        self._m_published = Counter("hadar_profiler_estimates_published_total", "ThroughputEstimates published",
                                    ["basis", "emulated"], registry=r)
        self._m_no_figures = Counter("hadar_profiler_estimate_failures_total", "Jobs the catalog could not estimate",
                                     registry=r)
        self._m_progress = Counter("hadar_profiler_progress_total", "Progress events folded", ["emulated"], registry=r)
        self._m_in = Counter("hadar_profiler_events_in_total", "Events consumed", ["type"], registry=r)
        self._m_out = Counter("hadar_profiler_events_out_total", "Events published", ["type"], registry=r)
        self._m_rejected = Counter("hadar_profiler_events_rejected_total", "Events dead-lettered by the profiler",
                                   registry=r)

    async def start(self) -> None:
        await self.bus.ensure_topics((*INPUT_TOPICS, THROUGHPUT, DEADLETTER))
        snapshot = await self._load_snapshot()
        records = 0
        for topic in RECOVERY_TOPICS:
            start = snapshot.partition_offsets(topic) if snapshot is not None else None
            async for delivery in self.bus.read(topic, start=start):
                records += 1
                self._cover(delivery.topic, delivery.partition, delivery.offset)
                if isinstance(delivery.event, ThroughputEstimate):
                    self.state.seed(delivery.event)
                elif isinstance(delivery.event, JobSubmitted):
                    self.state.add_job(delivery.event.job)
                elif isinstance(delivery.event, NodeRegistered):
                    self.state.add_node(delivery.event)
        self.recovery["records"] = records
        self._last_snapshot = self.clock.time()
        self._replayed = True
        self._consumer = asyncio.create_task(self._consume(), name="profiler-consume")

    async def stop(self) -> None:
        """Stop after the event in hand is handled and acked."""
        self._stopping = True
        if self._consumer is not None:
            if not self._busy:  # idle, waiting for a record: nothing to finish
                self._consumer.cancel()
            await asyncio.gather(self._consumer, return_exceptions=True)

    def health(self) -> dict[str, Any]:
        running = self._consumer is not None and not self._consumer.done()
        return {"ok": self._replayed and (running or self._stopping), "replayed": self._replayed}

    async def _consume(self) -> None:
        # hadar.deadletter is not read here: the scheduler counts bad records, once each.
        async with self.bus.subscribe(INPUT_TOPICS, self.config.group) as sub:
            async for delivery in sub:
                self._busy = True
                try:
                    async with self._fold_lock:
                        await self._handle_safely(delivery)
                        if delivery.topic in (JOBS, NODES):
                            self._cover(delivery.topic, delivery.partition, delivery.offset)
                    await delivery.ack()
                    await self._maybe_snapshot()
                finally:
                    self._busy = False
                if self._stopping:
                    break

    async def _handle_safely(self, delivery: Delivery) -> None:
        """Handle one event; a failure dead-letters it (with the reason) instead of ending the loop.

        A bus error while publishing what the event caused is not the event's fault: it is
        raised, the delivery stays un-acked and comes again."""
        try:
            await self._handle(delivery.event)
        except BusError:
            raise
        except Exception as exc:
            reason = f"profiler: {type(exc).__name__}: {exc}"
            self._m_rejected.inc()
            self._log.error("event.rejected", topic=delivery.topic, offset=delivery.offset,
                            event_type=delivery.event.TYPE, job=getattr(delivery.event, "job_id", None),
                            reason=reason[:300])
            await dead_letter_delivery(self.bus, delivery, reason, ts=self.clock.time(), source=self.config.source)

    async def _handle(self, event: Event) -> None:
        self._m_in.labels(type=event.TYPE).inc()
        handler = self.HANDLERS.handler_for(event)
        if handler is not None:
            await handler(self, event)

    async def _on_submitted(self, event: JobSubmitted) -> None:
        if self.state.add_job(event.job):
            await self._estimate(event.job)

    async def _on_node(self, event: NodeRegistered) -> None:
        self.state.add_node(event)

    async def _on_finished(self, event: JobCompleted | JobCancelled) -> None:
        if isinstance(event, JobCancelled):
            spec = self.state.spec(event.job_id)
            refusal = cancel_refusal(event, spec.user if spec is not None else None)
            if refusal is not None:
                raise Rejected(refusal)
        self.state.forget_job(event.job_id)

    async def _estimate(self, spec: JobSpec) -> None:
        log = self._log.bind(job=spec.job_id)
        try:
            rates = await asyncio.to_thread(self.estimator, spec)
            rates = on_emulated_types(rates, self.state.emulated_types())
            model_bytes, slots = await asyncio.to_thread(size_or_unknown, self.sizer, spec)
        except ValueError as exc:
            self._m_no_figures.inc()
            self.state.mark_estimated(spec.job_id)
            log.warning("estimate.unavailable", reason=str(exc)[:300])
            return
        await self._publish(ThroughputEstimate(ts=self.clock.time(), source=self.config.source,
                                               job_id=spec.job_id, basis="estimate", workers=spec.workers,
                                               rates=rates, model_bytes=model_bytes, optimizer_slots=slots),
                            emulated=False)
        self.state.mark_estimated(spec.job_id)
        log.info("estimate.published", workers=spec.workers, gpu_types=len(rates))

    async def _measure(self, progress: Progress) -> None:
        self._m_progress.labels(emulated=str(progress.emulated).lower()).inc()
        if progress.workers > MAX_WORKERS:
            return
        update = self.state.observe(progress)
        if update is None:
            return
        await self._publish(ThroughputEstimate(ts=self.clock.time(), source=self.config.source,
                                               job_id=update.job_id, basis="measured", workers=update.workers,
                                               rates={update.gpu_type: update.rate}), emulated=update.emulated)
        self._log.info("measured.published", job=update.job_id, round=progress.round,
                       gpu_type=update.gpu_type, workers=update.workers, rate=round(update.rate, 4),
                       emulated=update.emulated)
        if not update.emulated:
            await self._anchor(update)
            return
        if update.emulated and update.gpu_type in GPU_TYPES:
            try:
                rates = emulated_rates(update.gpu_type, update.rate, update.emulation_reference)
            except ValueError as exc:   # a reference this catalog does not know: no scale to re-estimate by
                self._log.warning("emulated.unknown_reference", job=update.job_id, reason=str(exc)[:300])
                return
            await self._publish(ThroughputEstimate(
                ts=self.clock.time(), source=self.config.source, job_id=update.job_id, basis="estimate",
                workers=update.workers, rates=rates), emulated=True)

    async def _anchor(self, update: MeasuredUpdate) -> None:
        """Re-estimate every other real type of a job from its rate measured on a real GPU, at
        the estimator's ratio for the measured copy's workers (``estimate.anchored_rates``);
        emulated types keep the emulation's estimate. Nothing for a job the estimator cannot
        rate, or one this profiler never saw submitted."""
        spec = self.state.spec(update.job_id)
        if spec is None:
            return
        try:
            estimate = await asyncio.to_thread(self.estimator, replace(spec, workers=update.workers))
        except ValueError:
            return
        emulated = self.state.emulated_types()
        rates = {t: r for t, r in anchored_rates(estimate, update.gpu_type, update.rate).items() if t not in emulated}
        if rates:
            await self._publish(ThroughputEstimate(
                ts=self.clock.time(), source=self.config.source, job_id=update.job_id, basis="estimate",
                workers=update.workers, rates=rates), emulated=False)

    async def _publish(self, event: ThroughputEstimate, *, emulated: bool) -> None:
        partition, offset = await self.bus.publish(event)
        self._cover(THROUGHPUT, partition, offset)
        self._m_out.labels(type=event.TYPE).inc()
        self._m_published.labels(basis=event.basis, emulated=str(emulated).lower()).inc()

    # ------------------------------------------------------------------ snapshots

    def _cover(self, topic: str, partition: int, offset: int) -> None:
        tp = f"{topic}:{partition}"
        self._covered[tp] = max(self._covered.get(tp, 0), offset + 1)

    async def _load_snapshot(self):
        """The newest valid snapshot, its state adopted; None without one."""
        if self.snapshots is None:
            return None
        found = await self.snapshots.recover(
            lambda snap: restore(snap, alpha=self.config.alpha, threshold=self.config.threshold))
        self.recovery.update(found.recovery())
        if found.snapshot is None:
            return None
        assert found.value is not None   # set with the snapshot
        self.state = found.value
        self._covered = dict(found.snapshot.offsets)
        self._log.info("profiler.snapshot_loaded", key=found.key)
        return found.snapshot

    async def _maybe_snapshot(self) -> None:
        interval = self.config.snapshot_interval_s
        if self.snapshots is not None and interval and self.clock.time() - self._last_snapshot >= interval:
            await self.write_snapshot()

    async def write_snapshot(self) -> None:
        """Snapshot the state now, between two deliveries (none is handled while it is captured
        and encoded, off the event loop); a failure is logged, never raised."""
        assert self.snapshots is not None
        self._last_snapshot = self.clock.time()
        try:
            saved = await self.snapshots.save(
                lambda: capture(self.state, self._covered, created_at=self.clock.time()), hold=self._fold_lock)
        except Exception as exc:
            self._log.warning("profiler.snapshot_failed", error=f"{type(exc).__name__}: {exc}"[:300])
            return
        assert saved is not None   # capture() always returns a snapshot
        self._log.info("profiler.snapshot_written", key=saved.key, bytes=saved.bytes)

    HANDLERS: ClassVar[HandlerTable[Callable[[ProfilerService, Any], Awaitable[None]]]] = HandlerTable({
        JobSubmitted: _on_submitted, Progress: _measure, NodeRegistered: _on_node,
        JobCompleted: _on_finished, JobCancelled: _on_finished,
    }, topics=INPUT_TOPICS, ignore=(CopyFinished, ModelConsolidated, RoundAbandoned, NodeHeartbeat))

