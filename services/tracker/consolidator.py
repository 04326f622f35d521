"""What the tracker produces for a decided round or a completed job, in the store, and the
announcement that goes with it (:class:`Consolidator`, used by the service).

Guarantees (the service's docstring states them for the whole tracker):

* :meth:`Consolidator.consolidate` stores the averaged optimizer state first, then the
  round model (temp file, then an atomic ``put_file``), and only then returns the
  ModelConsolidated that announces it; with no usable replica it stores nothing and
  returns a RoundAbandoned with the rejections.
* A consolidation cancelled while it averages (a drain cut short: ``run_service``'s
  ``drain_timeout_s``) stops its worker thread at the replicas' next chunk
  (:class:`~services.tracker.store_reader.ConsolidationStopped`), waits for it up to
  :data:`STOP_WAIT_S` and removes its staging directory: no read of the store, no write
  and no upload follows, and nothing is announced; the round stays unannounced and the
  next tracker consolidates it. Cancelled during an upload, the upload may still complete
  (an object appears whole or not at all); the next tracker then announces it as stored.
* Before averaging, the replicas are screened against the round's starting model
  (:mod:`shared.domain.replica_screen`; measured by
  :mod:`services.tracker.averaging.screening`): each one rejected is logged
  (``round.replica_screened``, with job, round and copy), counted in
  ``hadar_tracker_replicas_screened_total{rule}`` and recorded with its reason in the
  model's ``rejected`` (or the RoundAbandoned's), which ``hadar logs`` shows. A starting
  model that is absent or unusable leaves the round unscreened (``round.screening_skipped``).
* A round left without a usable replica whose work carries a ``rollback`` is announced as
  the job's rollback model instead of abandoned (:mod:`services.tracker.rollback`); if the
  source model is gone or unusable, it is abandoned as before.
* :meth:`Consolidator.existing` announces a model an earlier run stored but did not
  announce, from the model's own metadata, so a restart never publishes a different model;
  a model that is not this round's, unreadable, or whose announcement ``check`` refuses
  gives None (recompute over it).
* :meth:`Consolidator.store_final` stores ``final.safetensors`` as a byte copy of the
  job's latest round model before JobCompleted is built.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.tracker.acceptance import Refusal
from services.tracker.averaging.consolidate import (
    NoUsableReplica,
    Rejected,
    Replica,
    Weighing,
    weigh_replicas,
)
from services.tracker.averaging.safetensors_format import (
    InvalidSafetensors,
    RangeReader,
    read_header,
)
from services.tracker.averaging.screening import StartUnusable, screen_replicas
from services.tracker.config import TrackerConfig
from services.tracker.due import DueCompletion, DueRound
from services.tracker.metrics import TrackerMetrics
from services.tracker.model_files import (
    ModelFiles,
    held_out_metric,
    write_model_files,
)
from services.tracker.rollback import write_rollback
from services.tracker.store_reader import ConsolidationStopped, StoreRangeReader
from shared.clock import Clock
from shared.domain.layout import final_key, model_owner, optim_key, optim_key_of
from shared.domain.model_meta import InvalidModelMetadata, ModelMetadata
from shared.errors import HadarError
from shared.store import InvalidKey, ObjectNotFound, ObjectStore
from shared.wire.events import ModelConsolidated, Rejection, RoundAbandoned

__all__ = ["Consolidator", "AnnouncementRefused", "announcement", "STOP_WAIT_S"]

STOP_WAIT_S = 5.0   # how long a cancelled consolidation waits for its worker thread to stop


class AnnouncementRefused(HadarError):
    """An announcement of the tracker's own that its state would refuse: a bug, counted as a
    failed attempt like any other."""


class Consolidator:
    """Writes round models and final models; see the module guarantees."""

    def __init__(self, *, store: ObjectStore, config: TrackerConfig, clock: Clock, metrics: TrackerMetrics,
                 log: Any) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self._m = metrics
        self._log = log

    def abandonment(self, work: DueRound, reason: str, *,
                    rejected: tuple[Rejection, ...] = ()) -> RoundAbandoned:
        return RoundAbandoned(ts=self.clock.time(), source=self.config.source, job_id=work.job_id, round=work.round,
                              reason=reason[:1024], rejected=rejected, missing=work.missing)

    async def consolidate(self, work: DueRound, key: str, log: Any) -> ModelConsolidated | RoundAbandoned:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        rejected = [Rejected(copy=f.copy, reason=f"copy failed: {f.reason or 'no reason given'}"[:240])
                    for f in work.failed]
        stop = threading.Event()
        replicas = []
        for copy in work.usable:
            assert copy.checkpoint is not None
            try:
                size = await self.store.size(copy.checkpoint)
            except (ObjectNotFound, InvalidKey) as exc:
                rejected.append(Rejected(copy=copy.copy, reason=f"checkpoint {copy.checkpoint!r}: {exc}"[:240]))
                continue
            replicas.append(Replica(copy=copy.copy, steps=copy.steps, max_steps=copy.budget,
                                    workers=copy.workers,
                                    reader=StoreRangeReader(self.store, copy.checkpoint, size, loop, stop=stop)))
        start = await self._reader(work.start_from, loop, stop, log) if replicas else None
        tmp_dir = Path(tempfile.mkdtemp(prefix="hadar-tracker-", dir=self.config.temp_dir))
        try:
            try:
                outputs, metric = await self._in_thread(stop, log, self._write, work, replicas, rejected,
                                                        tmp_dir, stop, start, log)
            except NoUsableReplica as exc:
                self._m.rejected.inc(len(exc.rejected) - len(work.failed))
                log.warning("round.no_usable_replica", reason=str(exc)[:500], missing=list(work.missing))
                rolled = await self._rollback(work, key, exc.rejected, tmp_dir, stop, log)
                if rolled is not None:
                    return rolled
                return self.abandonment(work, "no usable replica",
                                        rejected=tuple(Rejection(copy=r.copy, reason=r.reason) for r in exc.rejected))
            await self._store_outputs(work, key, outputs)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        seconds = time.perf_counter() - started
        self._m.seconds.observe(seconds)
        self._m.models.inc()
        self._m.bytes.inc(outputs.stats.bytes_read)
        self._m.rejected.inc(len(outputs.weighing.rejected) - len(work.failed))
        return announcement(outputs.meta, key, self.clock.time(), self.config.source, seconds=seconds,
                            metric=metric)

    async def _store_outputs(self, work: DueRound, key: str, outputs: ModelFiles) -> None:
        owner = _owner(work)
        if outputs.optim_path is not None:   # first: a copy that finds the model finds its optimizer state
            await self.store.put_file(optim_key(work.job_id, work.round), outputs.optim_path, owner=owner)
        await self.store.put_file(key, outputs.model_path, owner=owner)

    async def _reader(self, key: str | None, loop: asyncio.AbstractEventLoop, stop: threading.Event,
                      log: Any) -> StoreRangeReader | None:
        """A reader of the object at ``key``; None (logged) when there is none to read."""
        if key is None:
            return None
        try:
            return StoreRangeReader(self.store, key, await self.store.size(key), loop, stop=stop)
        except (ObjectNotFound, InvalidKey) as exc:
            log.warning("round.screening_skipped", start_from=key, reason=str(exc)[:300])
            return None

    async def _rollback(self, work: DueRound, key: str, rejected: tuple[Rejected, ...], tmp_dir: Path,
                        stop: threading.Event, log: Any) -> ModelConsolidated | None:
        """The round's rollback model, stored, and its announcement; None when the round is
        not to roll back or cannot (logged): it is then abandoned."""
        target = work.rollback
        if target is None or not rejected:
            return None
        started = time.perf_counter()
        try:
            source = StoreRangeReader(self.store, target.key, await self.store.size(target.key),
                                      asyncio.get_running_loop(), stop=stop)
            write = functools.partial(write_rollback, chunk_bytes=self.config.chunk_bytes,
                                      threads=self.config.consolidation_threads)
            outputs = await self._in_thread(stop, log, write, work, target, source, rejected, tmp_dir)
            optim = optim_key_of(target.key)
            if outputs.optim_path is None and optim is not None and await self.store.exists(optim):
                await self.store.get_file(optim, tmp_dir / "source.optim.safetensors")
                await self.store.put_file(optim_key(work.job_id, work.round), tmp_dir / "source.optim.safetensors",
                                          owner=_owner(work))
            await self._store_outputs(work, key, outputs)
        except (ObjectNotFound, InvalidKey, NoUsableReplica) as exc:
            log.error("round.rollback_impossible", rollback_to=target.key, error=f"{type(exc).__name__}: {exc}"[:300])
            return None
        metric, _ = await asyncio.to_thread(held_out_metric, outputs.model_path, work.spec)
        self._m.rollbacks.inc()
        log.warning("round.rolled_back", rollback_to=target.key, total_steps=outputs.meta.total_steps,
                    worker_steps=target.worker_steps, metric=metric)
        return announcement(outputs.meta, key, self.clock.time(), self.config.source,
                            seconds=time.perf_counter() - started, metric=metric)

    @staticmethod
    async def _in_thread(stop: threading.Event, log: Any, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker thread. Cancelled, it sets ``stop`` (which ``fn`` obeys
        at its next chunk) and waits up to :data:`STOP_WAIT_S` for the thread to return
        before the cancellation goes on, so nothing it does outlives the round's attempt."""
        task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())   # retrieved: never logged as lost
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            stop.set()
            await asyncio.wait({task}, timeout=STOP_WAIT_S)
            stopped = task.done() and (task.cancelled() or isinstance(task.exception(), ConsolidationStopped))
            log.warning("round.consolidation_stopped", stopped=stopped, thread_running=not task.done())
            raise

    def _write(self, work: DueRound, replicas: list[Replica], rejected: list[Rejected],
               tmp_dir: Path, stop: threading.Event, start: RangeReader | None,
               log: Any) -> tuple[ModelFiles, tuple[str, float] | None]:
        # The weighing bounds each copy's steps and the job's total; the screen leaves out the
        # replicas out of line with the starting model. Writing may reject replicas holding NaN
        # or inf: the files' metadata and the announcement are those of the weighing actually
        # written (model_output.py).
        weighing = weigh_replicas(replicas, mode=self.config.mode, rejected=rejected,
                                  prior_worker_steps=work.prior_worker_steps, job_workers=work.job_workers,
                                  limit_worker_steps=work.limit_worker_steps)
        if start is not None:
            weighing = self._screen(weighing, start, log)
        outputs = write_model_files(weighing, tmp_dir, job_id=work.job_id, round_=work.round, missing=work.missing,
                                      spec=work.spec, chunk_bytes=self.config.chunk_bytes,
                                      threads=self.config.consolidation_threads)
        if stop.is_set():   # the evaluation cannot be stopped midway: do not start it
            raise ConsolidationStopped(f"{work.job_id} round {work.round}: consolidation stopped",
                                       retriable=True)
        metric, why_not = held_out_metric(outputs.model_path, work.spec)
        if metric is None:
            self._log.info("round.no_metric", job=work.job_id, round=work.round, reason=why_not)
        return outputs, metric

    def _screen(self, weighing: Weighing, start: RangeReader, log: Any) -> Weighing:
        """``weighing`` less the replicas the screen rejects, each logged and counted. Raises
        ``NoUsableReplica`` when none is left."""
        try:
            screening = screen_replicas(weighing, start, chunk_bytes=self.config.chunk_bytes)
        except StartUnusable as exc:
            log.warning("round.screening_skipped", start_from=start.name, reason=str(exc)[:300])
            return weighing
        self._m.bytes.inc(screening.bytes_read)
        norms = {u.copy: u for u in screening.updates}
        for verdict in screening.verdicts:
            self._m.screened.labels(rule=verdict.rule).inc()
            log.bind(copy=verdict.copy).warning("round.replica_screened", rule=verdict.rule, reason=verdict.reason,
                                                steps=norms[verdict.copy].steps,
                                                start_norm=round(screening.start_norm, 6))
        return weighing.without(screening.rejections()) if screening.verdicts else weighing

    async def existing(self, work: DueRound, key: str, log: Any,
                       check: Callable[[ModelConsolidated], Refusal | None]) -> ModelConsolidated | None:
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
        event = announcement(meta, key, self.clock.time(), self.config.source)
        refusal = check(event)
        if refusal is not None:
            log.warning("round.existing_model_unusable", key=key, error=f"{refusal.reason}: {refusal.detail}"[:300])
            return None
        log.info("round.existing_model_announced", key=key)
        return event

    async def store_final(self, work: DueCompletion) -> str:
        """Copy the job's latest round model to its final key; returns that key."""
        key = final_key(work.job_id)
        tmp_dir = Path(tempfile.mkdtemp(prefix="hadar-tracker-", dir=self.config.temp_dir))
        try:
            path = tmp_dir / "final.safetensors"
            await self.store.get_file(work.model_key, path)
            await self.store.put_file(key, path, owner=work.owner)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        return key


def _owner(work: DueRound) -> str | None:
    """Who may read the round's model: its job's user (shared.domain.layout.model_owner)."""
    return None if work.spec is None else model_owner(work.spec.user)


def announcement(meta: ModelMetadata, key: str, ts: float, source: str, *, seconds: float = 0.0,
                 metric: tuple[str, float] | None = None) -> ModelConsolidated:
    """The ModelConsolidated of the model at ``key``: what it says about itself, and its
    held-out metric when it was just evaluated."""
    name, value = metric if metric is not None else ("", None)
    return ModelConsolidated(ts=ts, source=source, job_id=meta.job, round=meta.round, key=key,
                             total_steps=meta.total_steps, copies=meta.copies, rejected=meta.rejected,
                             missing=meta.missing, seconds=seconds, metric_name=name, metric_value=value)
