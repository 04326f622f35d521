"""What the tracker saves in a state snapshot, and the offsets it covers.

A tracker snapshot (``shared.persistence.snapshot`` format, service ``"tracker"``) holds only what is
decided or accepted -- nothing that points at a live Kafka delivery or at this process's
monotonic clock:

* its :class:`~services.tracker.state.TrackerState` less the held reports and refusals:
  every unfinished job (spec, open rounds with their accepted placements, reports and
  progress, ``floor``, consolidated worker-steps, latest model), the window of finished
  jobs with their steps, the placement index and the window of event ids;
* the object lifecycle's bookkeeping (:mod:`services.tracker.lifecycle`), with each job's
  next sweep as a wall-clock time (``due_at``) instead of a monotonic one;
* offsets (``"topic:partition" -> next offset``): for every input partition, the next
  record not folded -- except that a partition holding a report still *held* (a
  CopyFinished read before its Assignment) is covered only up to that report's offset.

Restarting from it (the service's ``start``) replays the input topics from those offsets in
the usual order, so a held report is read again and judged again, never lost. Nothing is
applied twice: the held reports' ids are left out of the saved id window (so they are
folded when re-read), and every other record re-read after them is a repeat -- its id is in
the window, or, past the window, the state's rules make it change nothing (the first
accepted CopyFinished of a copy counts, Progress keeps the largest, Assignments are a set,
a decided round's reports are stale, the first announcement decides a round).

What a snapshot does not carry, and why a restart from it is still equivalent to one from
the whole log: attempt counters and given-up completions (a whole-log restart resets them
too: ``completion_given_up`` is cleared on restore), and refusals already drained (counted
and dead-lettered when read). The service writes no snapshot while a round it closed
without publishing its RoundAbandoned (the bus was away) is the job's latest decision: the
log would not close that round, so neither may a snapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace

from services.tracker.jobs import FinishedJob, JobRecord
from services.tracker.lifecycle import ObjectLifecycle, _Job
from services.tracker.placements import PlacementIndex
from services.tracker.state import TrackerState
from shared.persistence.codec import snapshot_type
from shared.persistence.snapshot import SnapshotCorrupt, StateSnapshot

__all__ = ["SERVICE", "Position", "TrackerSnapshot", "covered_offsets", "capture", "restore"]

SERVICE = "tracker"


@dataclass(frozen=True, kw_only=True)
class Position:
    """Where a replayed record was read: the ``origin`` the service folds it with (not a
    Delivery, so a refusal of it is counted, never dead-lettered again)."""

    topic: str
    partition: int
    offset: int


@snapshot_type("tracker.TrackerSnapshot", formerly="services.tracker.snapshot.TrackerSnapshot")
@dataclass(frozen=True, kw_only=True)
class TrackerSnapshot:
    """The body of a tracker snapshot (see the module docstring)."""

    jobs: dict[str, JobRecord]
    finished: list[tuple[str, FinishedJob]]          # oldest first
    index: PlacementIndex
    ids: list[str]                                   # remembered event ids, oldest first
    sweeps: dict[str, _Job]                          # lifecycle per job; due_s holds a wall-clock time
    swept_finished: list[str]                        # lifecycle's finished jobs, oldest first



def covered_offsets(folded: dict[str, int], held: Iterable[object]) -> dict[str, int] | None:
    """``folded`` (next offset per ``"topic:partition"``) lowered to the offset of each held
    report's record; None if a held report's origin has no position (not snapshottable now)."""
    offsets = dict(folded)
    for origin in held:
        topic, partition, offset = (getattr(origin, name, None) for name in ("topic", "partition", "offset"))
        if not (isinstance(topic, str) and isinstance(partition, int) and isinstance(offset, int)):
            return None
        tp = f"{topic}:{partition}"
        offsets[tp] = min(offsets.get(tp, offset), offset)
    return offsets


def capture(state: TrackerState, lifecycle: ObjectLifecycle, folded: dict[str, int], *,
            wall_now: float, mono_now: float) -> StateSnapshot | None:
    """A snapshot of the tracker now (not copied: dump it before the state changes; the store
    numbers it), or None if a held report cannot be re-read (see :func:`covered_offsets`)."""
    held = list(state._pending)   # the one reader of the state's internals besides the state
    offsets = covered_offsets(folded, (h.origin for h in held))
    if offsets is None:
        return None
    held_ids = {h.event.id for h in held}
    sweeps = {job_id: job if job.due_s is None else replace(job, due_s=job.due_s - mono_now + wall_now)
              for job_id, job in lifecycle._jobs.items()}
    body = TrackerSnapshot(jobs=state._jobs, finished=list(state._finished.items()), index=state._index,
                           ids=[i for i in state._ids if i not in held_ids], sweeps=sweeps,
                           swept_finished=list(lifecycle._finished))
    return StateSnapshot(service=SERVICE, created_at=wall_now, offsets=offsets, body=body)


def restore(snapshot: StateSnapshot, state: TrackerState, lifecycle: ObjectLifecycle, *, wall_now: float,
            mono_now: float) -> None:
    """Adopt a loaded snapshot into a fresh ``state`` and ``lifecycle`` (their limits and
    settings stay this tracker's); :class:`SnapshotCorrupt` if it is not a tracker snapshot,
    in which case neither was changed."""
    body = snapshot.body
    if not (isinstance(body, TrackerSnapshot) and isinstance(body.jobs, dict) and isinstance(body.index, PlacementIndex)
            and all(isinstance(k, str) and isinstance(v, JobRecord) for k, v in body.jobs.items())
            and all(isinstance(k, str) and isinstance(v, FinishedJob) for k, v in _pairs(body.finished))
            and isinstance(body.ids, list) and all(isinstance(i, str) for i in body.ids)
            and isinstance(body.sweeps, dict) and all(isinstance(v, _Job) for v in body.sweeps.values())
            and isinstance(body.swept_finished, list)):
        raise SnapshotCorrupt("not a tracker snapshot body")
    for job in body.jobs.values():
        job.completion_given_up = False   # a restart tries a given-up completion again
    state._jobs = body.jobs
    state._finished = OrderedDict(body.finished)
    state._index = body.index
    state._ids = OrderedDict.fromkeys(body.ids)
    lifecycle._jobs = {job_id: job if job.due_s is None else replace(job, due_s=job.due_s - wall_now + mono_now)
                       for job_id, job in body.sweeps.items()}
    lifecycle._finished = dict.fromkeys(body.swept_finished)


def _pairs(items: object) -> list[tuple[object, object]]:
    if not isinstance(items, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in items):
        return [(None, None)]   # fails the check above
    return items
