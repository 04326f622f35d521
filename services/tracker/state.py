"""The tracker's bookkeeping: which copies ran in which round, what they did, what is due.

Pure: events in (``apply``), decisions out (``due_rounds``, ``due_completions``); no I/O,
no clock (``now`` is passed in). The service feeds it every event of hadar.jobs,
hadar.placements, hadar.progress and hadar.models -- including the tracker's own
ModelConsolidated and JobCompleted -- so a restarted tracker that replays those topics
arrives at the same state.

Guarantees:

* Idempotent: applying any event twice changes nothing the second time. A copy's
  CopyFinished counts once per (job, round, copy) -- the first one wins; Progress keeps
  the largest ``steps_round`` per (job, round, copy); Assignments are a set per
  (job, round, copy, node); the first ModelConsolidated of a (job, round) decides it.
* Steps: a job's consolidated steps are the sum, over its consolidated rounds, of the
  steps of the copies averaged into that round's model (work whose result is in the
  model). ``live_steps`` adds the steps copies report in rounds not yet consolidated.
* A round is due once every copy assigned to the job in it has finished -- and, when the
  round's RoundStarted was seen, once all of the round's Assignment events have been seen
  (RoundStarted.assignments counts them), so a lagging placements topic cannot make a
  round look complete -- or once ``timeout_s`` has passed since the round's deadline
  (the latest Assignment deadline; else the RoundStarted end; else the first time anything
  of that round was seen). Rounds of a job come due in round order.
* A job is due for completion when its consolidated steps reach its iterations and it
  has a consolidated model; it completes once (JobCompleted decides it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shared.dispatch import HandlerTable
from shared.events import (
    Assignment, CopyFinished, Event, JobCancelled, JobCompleted, JobSpec, JobSubmitted,
    ModelConsolidated, Progress, RoundStarted,
)
from shared.topics import JOBS, MODELS, PLACEMENTS, PROGRESS

__all__ = ["FinishedCopy", "RoundWork", "CompletionWork", "TrackerState", "FOLDED_TOPICS"]

# What ``apply`` folds: the tracker service's INPUT_TOPICS (tests check they match).
FOLDED_TOPICS: tuple[str, ...] = (MODELS, JOBS, PLACEMENTS, PROGRESS)


@dataclass(frozen=True, kw_only=True)
class FinishedCopy:
    copy: int
    node_id: str
    status: str
    steps: int
    checkpoint: str | None
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class RoundWork:
    """A round to consolidate now.

    ``usable``: finished copies with a checkpoint (status ok or preempted); ``failed``:
    copies that reported failure; ``missing``: assigned copies that never reported.
    ``prior_steps``: the job's consolidated steps before this round.
    """

    job_id: str
    round: int
    usable: tuple[FinishedCopy, ...]
    failed: tuple[FinishedCopy, ...]
    missing: tuple[int, ...]
    prior_steps: int
    timed_out: bool


@dataclass(frozen=True, kw_only=True)
class CompletionWork:
    job_id: str
    model_key: str
    total_steps: int
    submitted_at: float


@dataclass(kw_only=True)
class _Round:
    assigned: set[tuple[int, str]] = field(default_factory=set)   # (copy, node)
    deadline: float | None = None
    first_seen: float | None = None
    finished: dict[int, FinishedCopy] = field(default_factory=dict)
    progress: dict[int, int] = field(default_factory=dict)
    outcome: str | None = None          # None (open), "consolidated", "abandoned"
    steps: int = 0                      # steps in its model, once consolidated
    model_key: str | None = None

    def seen_at(self, ts: float) -> None:
        self.first_seen = ts if self.first_seen is None else min(self.first_seen, ts)


@dataclass(kw_only=True)
class _Job:
    spec: JobSpec | None = None
    submitted_at: float | None = None
    first_seen: float | None = None
    rounds: dict[int, _Round] = field(default_factory=dict)
    cancelled: bool = False
    completed: JobCompleted | None = None

    def round(self, number: int) -> _Round:
        return self.rounds.setdefault(number, _Round())

    @property
    def consolidated_steps(self) -> int:
        return sum(r.steps for r in self.rounds.values() if r.outcome == "consolidated")

    def latest_model(self) -> str | None:
        done = [n for n, r in self.rounds.items() if r.outcome == "consolidated"]
        return self.rounds[max(done)].model_key if done else None


class TrackerState:
    """Per-job, per-round bookkeeping derived from events; see the module guarantees."""

    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._expected: dict[int, int] = {}                    # round -> Assignment events
        self._placed: dict[int, set[tuple[str, int, str]]] = {}  # round -> (job, copy, node)
        self._round_ends: dict[int, float] = {}

    # ------------------------------------------------------------------ events

    def apply(self, event: Event) -> bool:
        """Fold one event in; True if it changed the state (dispatch by ``HANDLERS``)."""
        handler = self.HANDLERS.handler_for(event)
        return handler(self, event) if handler is not None else False

    def _job(self, job_id: str, ts: float) -> _Job:
        job = self._jobs.setdefault(job_id, _Job())
        job.first_seen = ts if job.first_seen is None else min(job.first_seen, ts)
        return job

    def _on_JobSubmitted(self, e: JobSubmitted) -> bool:
        job = self._job(e.job_id, e.ts)
        if job.submitted_at is not None:
            return False
        job.spec, job.submitted_at = e.job, e.submitted_at
        return True

    def _on_JobCancelled(self, e: JobCancelled) -> bool:
        job = self._job(e.job_id, e.ts)
        changed = not job.cancelled and job.completed is None
        job.cancelled = job.cancelled or job.completed is None
        return changed

    def _on_RoundStarted(self, e: RoundStarted) -> bool:
        changed = self._expected.get(e.round) != e.assignments
        self._expected[e.round] = e.assignments
        self._round_ends[e.round] = e.ends_at
        return changed

    def _on_Assignment(self, e: Assignment) -> bool:
        placed = self._placed.setdefault(e.round, set())
        key = (e.job_id, e.copy, e.node_id)
        if key in placed:
            return False
        placed.add(key)
        job = self._job(e.job_id, e.ts)
        if job.spec is None:
            job.spec = e.job
        rnd = job.round(e.round)
        rnd.assigned.add((e.copy, e.node_id))
        rnd.deadline = e.deadline if rnd.deadline is None else max(rnd.deadline, e.deadline)
        rnd.seen_at(e.ts)
        return True

    def _on_Progress(self, e: Progress) -> bool:
        rnd = self._job(e.job_id, e.ts).round(e.round)
        rnd.seen_at(e.ts)
        if rnd.outcome is not None or e.steps_round <= rnd.progress.get(e.copy, -1):
            return False
        rnd.progress[e.copy] = e.steps_round
        return True

    def _on_CopyFinished(self, e: CopyFinished) -> bool:
        rnd = self._job(e.job_id, e.ts).round(e.round)
        rnd.seen_at(e.ts)
        if rnd.outcome is not None or e.copy in rnd.finished:
            return False  # late (the round is decided) or a repeat: never counted twice
        rnd.finished[e.copy] = FinishedCopy(copy=e.copy, node_id=e.node_id, status=e.status,
                                            steps=e.steps_round, checkpoint=e.checkpoint,
                                            reason=e.reason)
        return True

    def _on_ModelConsolidated(self, e: ModelConsolidated) -> bool:
        rnd = self._job(e.job_id, e.ts).round(e.round)
        if rnd.outcome == "consolidated":
            return False
        rnd.outcome, rnd.model_key = "consolidated", e.key
        rnd.steps = sum(c.steps for c in e.copies)
        return True

    def _on_JobCompleted(self, e: JobCompleted) -> bool:
        job = self._job(e.job_id, e.ts)
        if job.completed is not None:
            return False
        job.completed = e
        return True

    HANDLERS: ClassVar[HandlerTable[Callable[[TrackerState, Any], bool]]] = HandlerTable({
        JobSubmitted: _on_JobSubmitted, JobCancelled: _on_JobCancelled,
        RoundStarted: _on_RoundStarted, Assignment: _on_Assignment,
        Progress: _on_Progress, CopyFinished: _on_CopyFinished,
        ModelConsolidated: _on_ModelConsolidated, JobCompleted: _on_JobCompleted,
    }, topics=FOLDED_TOPICS)

    # ------------------------------------------------------------------ decisions

    def abandon(self, job_id: str, round_: int) -> None:
        """Close a round that produced no model (nothing usable); it never comes due again."""
        rnd = self._jobs[job_id].rounds[round_]
        if rnd.outcome is None:
            rnd.outcome = "abandoned"

    def due_rounds(self, now: float, timeout_s: float) -> list[RoundWork]:
        """Rounds to consolidate now: at most one per job, its earliest open round."""
        work = []
        for job_id in sorted(self._jobs):
            job = self._jobs[job_id]
            if job.cancelled or job.completed is not None:
                continue
            open_rounds = sorted(n for n, r in job.rounds.items() if r.outcome is None)
            if open_rounds:
                item = self._round_work(job_id, job, open_rounds[0], now, timeout_s)
                if item is not None:
                    work.append(item)
        return work

    def _round_work(self, job_id: str, job: _Job, number: int, now: float,
                    timeout_s: float) -> RoundWork | None:
        rnd = job.rounds[number]
        assigned = {c for c, _ in rnd.assigned}
        placements_known = (number not in self._expected
                            or len(self._placed.get(number, ())) >= self._expected[number])
        all_in = bool(assigned) and placements_known and assigned <= rnd.finished.keys()
        base = rnd.deadline if rnd.deadline is not None else self._round_ends.get(number, rnd.first_seen)
        timed_out = base is not None and now >= base + timeout_s
        if not (all_in or timed_out):
            return None
        finished = [rnd.finished[c] for c in sorted(rnd.finished)]
        return RoundWork(
            job_id=job_id, round=number,
            usable=tuple(f for f in finished if f.status != "failed" and f.checkpoint),
            failed=tuple(f for f in finished if f.status == "failed" or not f.checkpoint),
            missing=tuple(sorted(assigned - rnd.finished.keys())),
            prior_steps=job.consolidated_steps, timed_out=not all_in)

    def due_completions(self) -> list[CompletionWork]:
        """Jobs whose consolidated steps reached their iterations and have not completed."""
        work = []
        for job_id in sorted(self._jobs):
            job = self._jobs[job_id]
            key = job.latest_model()
            if (job.spec is None or job.completed is not None or job.cancelled or key is None
                    or job.consolidated_steps < job.spec.iterations):
                continue
            submitted = job.submitted_at if job.submitted_at is not None else job.first_seen
            work.append(CompletionWork(job_id=job_id, model_key=key, total_steps=job.consolidated_steps,
                                       submitted_at=submitted if submitted is not None else 0.0))
        return work

    # ------------------------------------------------------------------ queries

    def consolidated_steps(self, job_id: str) -> int:
        job = self._jobs.get(job_id)
        return job.consolidated_steps if job is not None else 0

    def live_steps(self, job_id: str) -> int:
        """Consolidated steps plus what copies report in rounds still open."""
        job = self._jobs.get(job_id)
        if job is None:
            return 0
        live = 0
        for rnd in job.rounds.values():
            if rnd.outcome is not None:
                continue
            for copy in rnd.progress.keys() | rnd.finished.keys():
                finished = rnd.finished.get(copy)
                if finished is not None and finished.status == "failed":
                    continue  # a failed copy's work is lost
                live += max(rnd.progress.get(copy, 0), finished.steps if finished else 0)
        return job.consolidated_steps + live

    def is_completed(self, job_id: str) -> bool:
        job = self._jobs.get(job_id)
        return job is not None and job.completed is not None

    def iterations(self, job_id: str) -> int | None:
        job = self._jobs.get(job_id)
        return job.spec.iterations if job is not None and job.spec is not None else None

    def open_rounds(self) -> int:
        return sum(1 for j in self._jobs.values() if not j.cancelled and j.completed is None
                   for r in j.rounds.values() if r.outcome is None)

    def jobs(self) -> int:
        return len(self._jobs)
