"""The tracker as one of several replicas: ``hadar serve tracker --standby``.

The tracker has a single-writer role: it alone averages replicas, writes ``models/`` and
publishes ModelConsolidated, RoundAbandoned and JobCompleted on hadar.models.
:class:`StandbyTracker` holds that role with :class:`~shared.runtime.leadership.Leadership`
(role ``tracker``, fencing id :attr:`~services.tracker.config.TrackerConfig.fencing_id`, lease
``lease_ttl_s``), as the standby scheduler does.

Guarantees:

* A standby consumes nothing, folds nothing, writes nothing and publishes nothing but waits
  until it holds the role. It then fences the previous holder, recovers as
  :class:`~services.tracker.service.TrackerService` does (the newest snapshot, then the log:
  every batch the previous holder committed is in it), and runs as a lone tracker would,
  its consumer starting each partition where this replica's recovery stopped, never where
  the group committed (a previous holder may have committed past it).
* Every publication while leading -- announcements, dead letters, renewals -- goes through
  the role's fenced publisher. A round announced by the previous holder is decided for the
  successor (the log says so), a round it had not announced is consolidated by the
  successor, so each round is announced once. A replica that finds itself fenced (a renewal,
  an announcement or a store write refused) stops at once: it logs ``tracker.stepped_down``,
  ``/healthz`` says ``role: stepped_down`` and ``hadar serve tracker`` exits 3. So does one
  whose fenced publisher refuses a batch for good (it was dropped after a failed abort: no
  batch of its term can be published again) or that cannot recover: it gives the role up
  rather than hold it doing nothing.

What fencing does NOT cover: the object store. Kafka refuses a fenced replica's batches; the
store takes anyone's writes. A replica frozen past its lease (SIGSTOP, a long pause) resumes
believing it leads, and the first thing it does may be a store write: the averaged model of
a round its successor has meanwhile announced, a snapshot, or a deletion of the lifecycle
sweep. Left alone, that could overwrite the successor's announced model with one weighed
from other copies (a round the two decided at different moments of its timeout), or
re-create a model or checkpoint the successor's sweep deleted. So every store write goes
through :class:`GuardedStore`: it is made only if this replica confirmed the role -- a
renewal through the fenced publisher -- less than ``lease_ttl_s / 10`` before, on its own
clock (a pause long enough to lose the lease makes it confirm again). Refused, nothing is
written and the replica steps down. A write that outlasts that window is confirmed again
after it; if the role was lost meanwhile the replica steps down and logs
``tracker.store_write_raced`` with the key.

What is left, and why it is harmless: a write already past its check when the replica froze
(or one made just after a confirmation that beat a successor's claim by an instant) lands
late. A model's key is fixed by (job, round) and the averaging is deterministic over the same
log, so it rewrites the bytes the successor wrote and announced; only a round decided at its
timeout from different sets of copies could differ, and then the object no longer matches
its announcement. A checkpoint or old model it re-creates is deleted by the successor's next
sweep of the job (a completed job's: its straggler sweep, ``straggler_sweep_s`` later); a
late snapshot is a consistent, older state (a restart from it replays more of the log). No
more than the writes in flight when it froze (one per task: the worker's, the sweep's) can
land: the next check finds the role gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from services.tracker.config import TrackerConfig
from services.tracker.service import TrackerService
from shared.bus import Bus, BusError, Delivery
from shared.bus.base import Resume, dead_letter
from shared.bus.fencing import BatchFailed, Fenced, FencedPublisher
from shared.clock import Clock, SystemClock
from shared.runtime.leadership import Leadership, LeadershipLost
from shared.store import ObjectStore
from shared.store.base import DEFAULT_CHUNK
from shared.wire.events import Event, LeaderRenewed, encode
from shared.wire.topics import LEADERSHIP

__all__ = ["StandbyTracker", "GuardedStore", "CONFIRM_FRACTION"]

CONFIRM_FRACTION = 10   # a store write needs a confirmation of the role within lease_ttl_s / this

Check = Callable[[str], Awaitable[None]]


class GuardedStore:
    """``store`` whose writes (``put``, ``put_file``, ``delete``) are each preceded by
    ``before(key)`` and followed by ``after(key)``; either raises to refuse. Reads pass through."""

    def __init__(self, store: ObjectStore, *, before: Check, after: Check) -> None:
        self._store, self._before, self._after = store, before, after

    def __repr__(self) -> str:
        return f"GuardedStore({self._store!r})"

    async def start(self) -> None:
        await self._store.start()

    async def stop(self) -> None:
        await self._store.stop()

    async def put(self, key: str, data: bytes, *, owner: str | None = None) -> None:
        await self._before(key)
        await self._store.put(key, data, owner=owner)
        await self._after(key)

    async def put_file(self, key: str, path: Path, *, owner: str | None = None) -> None:
        await self._before(key)
        await self._store.put_file(key, path, owner=owner)
        await self._after(key)

    async def delete(self, key: str) -> None:
        await self._before(key)
        await self._store.delete(key)
        await self._after(key)

    async def get(self, key: str) -> bytes:
        return await self._store.get(key)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        return await self._store.get_range(key, offset, length)

    async def size(self, key: str) -> int:
        return await self._store.size(key)

    async def get_file(self, key: str, path: Path) -> None:
        await self._store.get_file(key, path)

    def stream(self, key: str, chunk_size: int = DEFAULT_CHUNK) -> AsyncIterator[bytes]:
        return self._store.stream(key, chunk_size)

    async def list(self, prefix: str = "") -> list[str]:
        return await self._store.list(prefix)

    async def exists(self, key: str) -> bool:
        return await self._store.exists(key)


class StandbyTracker(TrackerService):
    """A tracker replica that acts only while it holds the role; see the module guarantees.
    ``on_stepped_down``: called once if it led and was taken over."""

    def __init__(self, *, bus: Bus, store: ObjectStore, config: TrackerConfig | None = None,
                 clock: Clock | None = None, registry: CollectorRegistry | None = None, holder: str | None = None,
                 on_stepped_down: Callable[[], None] | None = None) -> None:
        config = config or TrackerConfig(standby=True)
        clock = clock or SystemClock()
        self.leadership = Leadership(bus, role=self.name, fencing_id=config.fencing_id, holder=holder,
                                     ttl_s=config.lease_ttl_s, clock=clock, source=config.source)
        self.stepped_down: str | None = None
        self._on_stepped_down = on_stepped_down
        self._lead_task: asyncio.Task[None] | None = None
        self._leading = False             # recovered and running as the tracker
        self._confirmed_at: float | None = None   # when the last confirmation of the role began
        super().__init__(bus=bus, store=GuardedStore(store, before=self._before_write, after=self._after_write),
                         config=config, clock=clock, registry=registry)

    # ------------------------------------------------------------------ the role

    async def start(self) -> None:
        await self.bus.ensure_topics((LEADERSHIP,))
        self._lead_task = asyncio.create_task(self._lead(), name="tracker-leadership")

    async def _lead(self) -> None:
        try:
            term = await self.leadership.acquire()
        except Exception as exc:   # not retried by acquire (it retries a failed claim): /healthz fails
            self._log.error("tracker.leadership_failed", error=f"{type(exc).__name__}: {exc}"[:300])
            return
        self._log.info("tracker.took_over", term=term, holder=self.leadership.holder,
                       previous_holder=self.leadership.view.holder)
        self.recovery["term"] = term
        try:
            await TrackerService.start(self)   # recovery, then the consumer, the worker and the sweeps
        except Exception as exc:   # the store or the bus away: give the role up rather than sit on it
            self._step_down(f"recovery failed: {type(exc).__name__}: {exc}")
            return
        self._leading = True
        try:
            await self.leadership.hold()
        except LeadershipLost as exc:
            self._step_down(str(exc))

    @property
    def active(self) -> bool:
        """True while this replica holds the role (from its claim until it steps down or stops)."""
        return self.leadership.term is not None and self.stepped_down is None and not self._stopping

    def _step_down(self, reason: str) -> None:
        """Fenced by a newer replica (or unable to recover): stop at once -- no fold, no round, no
        write -- and say so."""
        if self.stepped_down is not None:
            return
        self.stepped_down = reason
        self._stopping = True
        self._wake.set()
        for task in (self._consumer, self._worker, self._janitor_task, self._lead_task):
            if task is not None and not task.done():
                task.cancel()   # the current one too: it stops at its next wait
        self._log.error("tracker.stepped_down", reason=reason[:300], term=self.leadership.term)
        if self._on_stepped_down is not None:
            self._on_stepped_down()

    async def stop(self) -> None:
        """As :meth:`TrackerService.stop` (the round in progress is finished and announced while
        the role is still renewed), then give the role up; a standby just stops waiting."""
        lead = self._lead_task
        if lead is not None and not self._leading:   # waiting for the role, or recovering
            lead.cancel()
            await asyncio.gather(lead, return_exceptions=True)
        await super().stop()
        if lead is not None:
            lead.cancel()
            await asyncio.gather(lead, return_exceptions=True)
        await self.leadership.stop()

    def health(self) -> dict[str, Any]:
        health = super().health()
        if self.stepped_down is not None:
            return {**health, "ok": False, "role": "stepped_down"}
        if self.leadership.term is not None:
            return {**health, "role": "active"}
        waiting = self._lead_task is not None and not self._lead_task.done()
        return {**health, "ok": waiting, "role": "standby"}

    # ------------------------------------------------------------------ what the service does through the role

    def _resume(self) -> Resume | None:
        return lambda topic, partition: self._folded.get(f"{topic}:{partition}", 0)

    async def _publish_as_holder(self, event: Event, what: str) -> None:
        """Publish ``event`` through the role's fenced publisher. Fenced, or refused for good (the
        publisher is unusable: no batch of this term can be published again), this replica steps
        down and :class:`LeadershipLost` is raised; a retriable failure raises the BusError."""
        if self.stepped_down is not None or self.leadership.term is None:
            raise LeadershipLost(f"tracker: not the active replica, {what}")
        publisher: FencedPublisher = self.leadership.publisher
        try:
            await publisher.publish_all([event])
        except Fenced as exc:
            self._step_down(f"{what}: a newer replica took the role over")
            raise LeadershipLost(f"tracker: {what}: {exc}") from exc
        except BatchFailed as exc:
            if exc.retriable:
                raise
            self._step_down(f"{what}: the fenced publisher refused it for good: {exc}")
            raise LeadershipLost(f"tracker: {what}: {exc}") from exc

    async def _send(self, event: Event) -> None:
        await self._publish_as_holder(event, f"{event.TYPE} not published")

    async def _dead_letter(self, origin: Delivery, reason: str) -> None:
        letter = dead_letter(topic=origin.topic, partition=origin.partition, offset=origin.offset, reason=reason,
                             raw=encode(origin.event), ts=self.clock.time(), source=self.config.source)
        try:
            await self._send(letter)
        except LeadershipLost:
            pass   # stepped down: the successor reads the record and refuses it itself
        except BusError as exc:
            self._log.error("dead_letter.publish_failed", topic=origin.topic, offset=origin.offset,
                            reason=reason[:200], error=str(exc)[:200])

    def _failed(self, stage: str, exc: Exception, key: tuple[str, str, int], **bound: Any) -> bool:
        if self.stepped_down is not None:
            return False   # not a failure of the round: this replica no longer decides it
        return super()._failed(stage, exc, key, **bound)

    # ------------------------------------------------------------------ store writes

    async def _confirm(self, why: str) -> None:
        """Renew through the fenced publisher now; step down and raise :class:`LeadershipLost`
        if a newer replica fenced this one (a retriable :class:`BusError`: nothing confirmed)."""
        term = self.leadership.term
        if term is None or self.stepped_down is not None:
            raise LeadershipLost(f"tracker: not the active replica, {why}")
        began = self.clock.time()
        await self._publish_as_holder(LeaderRenewed(ts=began, source=self.config.source, role=self.name,
                                                    holder=self.leadership.holder, term=term,
                                                    ttl_s=self.leadership.ttl_s), why)
        self._confirmed_at = began

    def _confirmed_recently(self) -> bool:
        at = self._confirmed_at
        return at is not None and 0 <= self.clock.time() - at < self.leadership.ttl_s / CONFIRM_FRACTION

    async def _before_write(self, key: str) -> None:
        if self.stepped_down is not None or self.leadership.term is None:
            raise LeadershipLost(f"tracker: not the active replica, store write {key} refused")
        if not self._confirmed_recently():
            await self._confirm(f"store write {key} refused")

    async def _after_write(self, key: str) -> None:
        if self._confirmed_recently():
            return
        try:
            await self._confirm(f"store write {key} may have raced a newer replica")
        except LeadershipLost:
            self._log.error("tracker.store_write_raced", key=key)
            raise
