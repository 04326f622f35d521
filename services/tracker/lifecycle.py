"""Object lifecycle: the tracker deletes the checkpoints and round models nothing can need.

:class:`ObjectLifecycle` decides (pure: events in, keys to delete out, time passed in);
:class:`ObjectJanitor` lists and deletes in the store, in its own task, so a slow or
failing store never holds up a consolidation. The service feeds the lifecycle every event
its :class:`~services.tracker.state.TrackerState` accepted -- replayed, consumed live, or
its own announcement once the bus has taken it -- so a restarted tracker derives the same
decisions from the log and re-issues any deletion that was missed (deleting is idempotent).

What is deleted, and when (``config`` names :class:`~services.tracker.config.TrackerConfig`):

* **Checkpoints of decided rounds** (``delete_checkpoints``): every
  ``checkpoints/{job}/{r}/...`` with ``r <= floor``, the job's latest decided round, once a
  ModelConsolidated or RoundAbandoned of round ``floor`` has been published (acked by the
  bus) or read from hadar.models. Safe: the model they fed was stored before it was
  announced (``put_file``, then publish), a decided round is never consolidated again (a
  restarted tracker replays the announcement and closes the round; only an unannounced
  round is recomputed from its checkpoints), and an agent resumes only a copy of a round
  still running. A round the tracker closed without publishing its RoundAbandoned (the
  bus was down) is not a decision here: its checkpoints wait for the next announcement.
  Stragglers (a checkpoint uploaded after its round was decided) are caught by the job's
  next sweep, since every sweep lists the job's whole checkpoint prefix.
* **Old round models** (``keep_round_models`` = K >= 1): a running job keeps the round
  models of its K latest announced rounds, and any model an open round's Assignment
  starts from (``start_from``: the scheduler may have planned round r + 1 before model r
  was announced, so its copies start from model r - 1); older ``models/{job}/{r}`` (and
  the optimizer state beside each, ``{r}.optim.safetensors``) are deleted once a newer
  model is announced. (A checkpoint an open round starts from --
  the agent admits one -- is kept likewise.) The latest announced model -- what the next
  round starts from, and what completion copies to the final key -- is always kept. K = 1
  relies on reading the open round's Assignments before the next announcement; the
  default, 2, covers a round planned one model behind without it.
* **A completed job** (JobCompleted published or read): every checkpoint, and
  (``delete_completed_models``) every round model. Safe: ``final.safetensors`` is a byte
  copy of the latest round model, stored before JobCompleted was published; no round of a
  completed job is consolidated or scheduled again. The final model is never deleted. The
  job is swept once more ``straggler_sweep_s`` later for late uploads, then forgotten; a
  checkpoint uploaded after that stays (the gap: a restarted tracker sweeps it).
* A cancelled job keeps its latest models (no final model exists) and is forgotten after
  its next sweep; its objects then stay.

Belt and braces against an announcement that is false (the state accepts a well-formed
one from anyone on hadar.models): nothing of a job is deleted unless the model the rules
rely on is in the same sweep's listing -- its latest announced round model, or, once it
completed, its final model (:meth:`ObjectLifecycle.required`).

Failures: a failed list or delete is counted (``hadar_tracker_object_deletions_failed_total``)
and logged, and the job is swept again after a back-off doubling from ``base_s`` to
``max_s``; after ``max_attempts`` failures in a row it waits for its next decision (a
completed job: ``straggler_sweep_s``, then it is forgotten; a restart retries). Work is
bounded: at most :data:`MAX_JOBS_PER_SWEEP` jobs per tick, two listings each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from services.tracker.config import MAX_RETRY_S, TrackerConfig
from shared.domain.layout import (
    checkpoint_prefix,
    final_key,
    model_key,
    model_prefix,
    parse_checkpoint_key,
    parse_model_key,
    parse_optim_key,
)
from shared.persistence.codec import snapshot_type
from shared.store import ObjectStore
from shared.wire.events import (
    Assignment,
    Event,
    JobCancelled,
    JobCompleted,
    ModelConsolidated,
    RoundAbandoned,
)

__all__ = ["ObjectLifecycle", "ObjectJanitor", "MAX_JOBS_PER_SWEEP", "MAX_FINISHED"]

MAX_JOBS_PER_SWEEP = 8
MAX_FINISHED = 16384      # completed or cancelled jobs still waiting for their last sweep


@snapshot_type("tracker.LifecycleJob", formerly="services.tracker.lifecycle._Job")
@dataclass(kw_only=True)
class _Job:
    floor: int = -1                                          # latest decided round
    models: list[int] = field(default_factory=list)          # latest announced model rounds (<= K)
    starts: dict[int, set[str]] = field(default_factory=dict)  # open round -> models it starts from
    completed: bool = False
    cancelled: bool = False
    resweep: bool = False                                    # completed: one straggler sweep left
    due_s: float | None = None                               # when to sweep next (monotonic)
    failures: int = 0
    decisions: int = 0                                       # observed so far (a sweep's ``begun``)


class ObjectLifecycle:
    """Which of a job's objects may go, and when to look; see the module docstring."""

    def __init__(self, *, keep_round_models: int = 2, delete_checkpoints: bool = True,
                 delete_completed_models: bool = True, straggler_sweep_s: float = 600.0,
                 base_s: float = 1.0, max_s: float = 60.0, max_attempts: int = 6) -> None:
        self.keep = keep_round_models
        self.delete_checkpoints = delete_checkpoints
        self.delete_completed_models = delete_completed_models
        self.straggler_sweep_s = straggler_sweep_s
        self.base_s, self.max_s, self.max_attempts = base_s, max_s, max_attempts
        self._jobs: dict[str, _Job] = {}
        self._finished: dict[str, None] = {}     # completed or cancelled, oldest first

    @classmethod
    def of(cls, config: TrackerConfig) -> ObjectLifecycle:
        """The lifecycle ``config`` asks for; failed sweeps back off like failed rounds."""
        return cls(keep_round_models=config.keep_round_models, delete_checkpoints=config.delete_checkpoints,
                   delete_completed_models=config.delete_completed_models,
                   straggler_sweep_s=config.straggler_sweep_s, base_s=min(config.tick_s, MAX_RETRY_S),
                   max_s=MAX_RETRY_S, max_attempts=config.max_attempts)

    def observe(self, event: Event, now_s: float) -> None:
        """Fold an event the tracker's state accepted (and that changed it)."""
        if isinstance(event, Assignment):
            job = self._jobs.setdefault(event.job_id, _Job())
            if event.start_from is not None and event.round > job.floor and not (job.completed or job.cancelled):
                job.starts.setdefault(event.round, set()).add(event.start_from)
            return
        if not isinstance(event, (ModelConsolidated, RoundAbandoned, JobCompleted, JobCancelled)):
            return
        job = self._jobs.setdefault(event.job_id, _Job())
        if isinstance(event, (ModelConsolidated, RoundAbandoned)):
            job.floor = max(job.floor, event.round)
            job.starts = {r: keys for r, keys in job.starts.items() if r > job.floor}
            if isinstance(event, ModelConsolidated) and event.round not in job.models:
                job.models = sorted([*job.models, event.round])[-self.keep:]
        elif isinstance(event, JobCompleted):
            job.completed, job.resweep, job.starts = True, self.straggler_sweep_s > 0, {}
        else:
            job.cancelled, job.starts = True, {}
        job.due_s, job.failures = now_s, 0
        job.decisions += 1
        if job.completed or job.cancelled:
            self._finished[event.job_id] = None
            while len(self._finished) > MAX_FINISHED:
                self._drop(next(iter(self._finished)))

    def due(self, now_s: float) -> list[str]:
        """Jobs to sweep now, longest waiting first, at most MAX_JOBS_PER_SWEEP."""
        due = sorted((job.due_s, job_id) for job_id, job in self._jobs.items()
                     if job.due_s is not None and job.due_s <= now_s)
        return [job_id for _, job_id in due[:MAX_JOBS_PER_SWEEP]]

    def required(self, job_id: str) -> str | None:
        """The key that must be stored before anything of ``job_id`` is deleted: its final
        model once completed, else its latest announced round model (None: no model yet)."""
        job = self._jobs.get(job_id)
        if job is not None and job.completed:
            return final_key(job_id)
        return model_key(job_id, job.models[-1]) if job is not None and job.models else None

    def doomed(self, job_id: str, keys: Iterable[str]) -> list[tuple[str, str]]:
        """``(key, kind)`` of each of ``keys`` (the job's listing) that may be deleted now;
        kind: checkpoint or model. Nothing if the :meth:`required` key is not among them."""
        job = self._jobs.get(job_id)
        keys = list(keys)
        required = self.required(job_id)
        if job is None or (required is not None and required not in keys):
            return []
        protected = set().union(*job.starts.values()) if job.starts else set()
        cutoff = job.models[0] if len(job.models) >= self.keep else -1   # the K-th latest announced round
        out = []
        for key in keys:
            ck = parse_checkpoint_key(key)
            if ck is not None and ck.job_id == job_id:
                if self.delete_checkpoints and key not in protected and (job.completed or ck.round <= job.floor):
                    out.append((key, "checkpoint"))
                continue
            mk = parse_model_key(key)   # None for the final model: never deleted
            owner = key
            if mk is None:   # a round model's optimizer state goes with its model
                mk = parse_optim_key(key)
                owner = model_key(mk.job_id, mk.round) if mk is not None else key
            if mk is not None and mk.job_id == job_id and owner not in protected and (
                    (job.completed and self.delete_completed_models) or mk.round < cutoff):
                out.append((key, "model"))
        return out

    def begin(self, job_id: str) -> int:
        """A sweep of ``job_id`` starts (before it lists): the token its :meth:`swept` takes."""
        job = self._jobs.get(job_id)
        return job.decisions if job is not None else 0

    def swept(self, job_id: str, now_s: float, *, ok: bool, begun: int) -> bool:
        """Record the outcome of the sweep that :meth:`begin` returned ``begun`` for; False if
        the job's failures reached ``max_attempts`` (given up). A decision observed while the
        sweep ran leaves the job due now: the sweep's listing predates it."""
        job = self._jobs.get(job_id)
        if job is None:
            return True
        if job.decisions != begun:
            return True
        finished = job.completed or job.cancelled
        if not ok:
            job.failures += 1
            if job.failures < self.max_attempts:
                job.due_s = now_s + min(self.max_s, self.base_s * 2 ** (job.failures - 1))
                return True
            job.failures = 0
            if finished and job.resweep:
                job.resweep, job.due_s = False, now_s + self.straggler_sweep_s
            elif finished:
                self._drop(job_id)
            else:
                job.due_s = None
            return False
        job.failures = 0
        if job.completed and job.resweep:
            job.resweep, job.due_s = False, now_s + self.straggler_sweep_s
        elif finished:
            self._drop(job_id)
        else:
            job.due_s = None
        return True

    def _drop(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
        self._finished.pop(job_id, None)

    def __len__(self) -> int:
        return len(self._jobs)


class ObjectJanitor:
    """Sweeps due jobs every ``interval_s``: lists their prefixes, deletes what the lifecycle dooms."""

    def __init__(self, store: ObjectStore, lifecycle: ObjectLifecycle, *, registry: CollectorRegistry,
                 log: Any) -> None:
        self.store = store
        self.lifecycle = lifecycle
        self._log = log
        self._m_deleted = Counter("hadar_tracker_objects_deleted_total", "Objects the tracker deleted", ["kind"],
                                  registry=registry)
        for kind in ("checkpoint", "model"):
            self._m_deleted.labels(kind=kind)
        self._m_failed = Counter("hadar_tracker_object_deletions_failed_total",
                                 "Store listings or deletions of the object lifecycle that failed", registry=registry)

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.sweep()
            except Exception as exc:   # a bug, never a store error (those are caught per call)
                self._log.error("objects.sweep_failed", error=f"{type(exc).__name__}: {exc}"[:300])
            await asyncio.sleep(interval_s)

    async def sweep(self) -> None:
        """One pass over the due jobs (at most MAX_JOBS_PER_SWEEP)."""
        for job_id in self.lifecycle.due(time.monotonic()):
            begun = self.lifecycle.begin(job_id)
            ok = await self._sweep_job(job_id)
            if not self.lifecycle.swept(job_id, time.monotonic(), ok=ok, begun=begun):
                self._log.error("objects.sweep_given_up", job=job_id, attempts=self.lifecycle.max_attempts)

    async def _sweep_job(self, job_id: str) -> bool:
        keys: list[str] = []
        for prefix in (model_prefix(job_id), checkpoint_prefix(job_id)):
            try:
                keys += await self.store.list(prefix)
            except Exception as exc:
                return self._failed(job_id, prefix, exc)
        required = self.lifecycle.required(job_id)
        if required is not None and required not in keys:
            self._log.warning("objects.kept", job=job_id, reason=f"{required} is not stored")
            return True   # not a store failure: the next decision (or a restart) looks again
        ok = True
        for key, kind in self.lifecycle.doomed(job_id, keys):
            try:
                await self.store.delete(key)
            except Exception as exc:
                ok = self._failed(job_id, key, exc)
            else:
                self._m_deleted.labels(kind=kind).inc()
                self._log.debug("objects.deleted", job=job_id, key=key, kind=kind)
        return ok

    def _failed(self, job_id: str, key: str, exc: Exception) -> bool:
        self._m_failed.inc()
        self._log.warning("objects.delete_failed", job=job_id, key=key, error=f"{type(exc).__name__}: {exc}"[:300])
        return False
