"""The tracker's bookkeeping: which copies ran in which round, what they did, what is due.

Pure: events in (``apply``), decisions out (``due_rounds``, ``due_completions``), refusals
out (``drain_refusals``); no I/O, no clock (``now`` is passed in). The service feeds it
every event of hadar.jobs, hadar.placements, hadar.models and hadar.progress -- including
the tracker's own ModelConsolidated and JobCompleted -- so a restarted tracker that
replays those topics arrives at the same state.

Guarantees:

* Checked: the placements (RoundStarted, Assignment) define what was assigned; every
  other event is checked against them by the rules of :mod:`services.tracker.acceptance`.
  A refused event changes nothing and is reported once, with its reason and the
  ``origin`` it was applied with, by ``drain_refusals``. A late event (a round already
  decided, a job already finished) or a repeat changes nothing and is not refused.
* Evaluation copies (``Assignment.evaluation``: a completed user-code job's final model
  measured on an agent, :mod:`services.scheduler.live.evaluations`) train nothing: they
  count toward their round's Assignments, but open no round of their job, and their
  CopyFinished is neither taken nor refused.
* Held, not lost: a CopyFinished whose copy has no Assignment yet (the topics are read in
  parallel) is held, and judged again when an Assignment of its (job, round) arrives,
  when all of the round's placements are known (RoundStarted.assignments of them), or
  when its round is decided -- then it is refused as unassigned.
* Idempotent: applying any event twice changes nothing the second time (event ids
  within a window, and content: the first accepted CopyFinished of a copy counts,
  Progress keeps the largest ``steps_round``, Assignments are a set per (job, round, copy,
  node), the first accepted ModelConsolidated decides its round).
* Steps, in samples (``shared.domain.progress``): a job's consolidated worker-steps are, exactly,
  the sum over its consolidated rounds of steps x workers of the copies in that round's
  model (a copy's workers: its Assignments' world size, at most the job's W), since its
  latest rollback (``services/tracker/rollback.py``: a model whose ``total_steps`` is below
  the job's takes them back to it); its consolidated steps are those // W. Every copy's
  steps are at most its budget.
* Due: a round is due once every copy assigned to the job in it has finished -- and,
  when the round's RoundStarted was seen, once all of the round's Assignments have been
  seen -- or once ``timeout_s`` has passed since its deadline (the latest Assignment
  deadline). Rounds of a job come due in round order; deciding round r (a model, or
  ``abandon``) decides every earlier open round of the job too, since the tracker
  decides in order. A job is due for completion when its consolidated steps reach its
  iterations (worker-steps reach W x iterations) and it has a model; it completes once.
* Bounded: decided rounds are forgotten at once (a job keeps its last decided round,
  its steps and its latest model); finished (completed or cancelled) jobs are forgotten
  but for their id, in a window of ``max_finished_jobs``; placements per round are kept
  for the last :data:`ROUND_HISTORY` rounds and rounds still open; at most
  ``max_pending`` held reports and ``max_ids`` event ids; an event refused is not kept.
  ``sizes`` reports each.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from services.tracker.acceptance import (
    Problem,
    Refusal,
    announcement_problem,
    completion_problem,
    future_problem,
    key_problem,
    report_problem,
)
from services.tracker.due import DueCompletion, DueRound, FinishedCopy
from services.tracker.jobs import FinishedJob, JobRecord, RoundRecord
from services.tracker.pending import HeldReport, PendingReports
from services.tracker.placements import ROUND_HISTORY, PlacementIndex
from shared.domain.ownership import cancel_refusal
from shared.wire.dispatch import HandlerTable
from shared.wire.events import (
    Assignment,
    CopyFinished,
    Event,
    JobCancelled,
    JobCompleted,
    JobSubmitted,
    ModelConsolidated,
    Progress,
    RoundAbandoned,
    RoundStarted,
)
from shared.wire.topics import JOBS, MODELS, PLACEMENTS, PROGRESS

__all__ = ["FinishedCopy", "DueRound", "DueCompletion", "Refusal", "TrackerState", "FOLDED_TOPICS",
           "ROUND_HISTORY"]

# What ``apply`` folds: the tracker service's INPUT_TOPICS (tests check they match).
FOLDED_TOPICS: tuple[str, ...] = (JOBS, PLACEMENTS, MODELS, PROGRESS)
MAX_REFUSALS = 4096         # refusals kept for a caller that does not drain them

_Verdict = Problem | Literal["accept", "hold", "stale"]


class TrackerState:
    """Per-job, per-round bookkeeping derived from events; see the module guarantees."""

    def __init__(self, *, max_pending: int = 1024, max_ids: int = 8192, max_finished_jobs: int = 16384) -> None:
        self._jobs: dict[str, JobRecord] = {}
        self._finished: OrderedDict[str, FinishedJob] = OrderedDict()
        self._max_finished = max_finished_jobs
        self._index = PlacementIndex()
        self._pending = PendingReports(max_pending)
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._max_ids = max_ids
        self._refusals: deque[Refusal] = deque(maxlen=MAX_REFUSALS)

    # ------------------------------------------------------------------ events

    def apply(self, event: Event, origin: object = None) -> bool:
        """Fold one event in; True if it changed the state. ``origin`` is returned with any
        refusal of this event, now or later (a held report). Never raises for an event."""
        if event.id in self._ids:
            return False
        self._ids[event.id] = None
        if len(self._ids) > self._max_ids:
            self._ids.popitem(last=False)
        handler = self.HANDLERS.handler_for(event)
        return handler(self, event, origin) if handler is not None else False

    def drain_refusals(self) -> list[Refusal]:
        """The refusals since the last call, oldest first (at most the last MAX_REFUSALS)."""
        refusals = list(self._refusals)
        self._refusals.clear()
        return refusals

    def check_announcement(self, event: ModelConsolidated | JobCompleted) -> Refusal | None:
        """What ``apply`` would refuse ``event`` for; None if it would not. Changes nothing."""
        if isinstance(event, ModelConsolidated):
            verdict = self._model_verdict(event)
        else:
            verdict = self._completion_verdict(event)
        if isinstance(verdict, Problem):
            return Refusal(event=event, reason=verdict.reason, detail=verdict.detail)
        return None

    def _refuse(self, event: Event, problem: Problem, origin: object) -> None:
        self._refusals.append(Refusal(event=event, reason=problem.reason, detail=problem.detail, origin=origin))

    def _job(self, job_id: str, ts: float) -> JobRecord:
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = JobRecord(first_seen=ts)
        job.first_seen = min(job.first_seen, ts)
        return job

    def _on_JobSubmitted(self, e: JobSubmitted, origin: object) -> bool:
        if e.job_id in self._finished:
            return False
        job = self._job(e.job_id, e.ts)
        if job.submitted_at is not None:
            return False
        job.spec, job.submitted_at = e.job, e.submitted_at
        return True

    def _on_JobCancelled(self, e: JobCancelled, origin: object) -> bool:
        if e.job_id in self._finished:
            return False
        job = self._jobs.get(e.job_id)
        refusal = cancel_refusal(e, job.spec.user if job is not None and job.spec is not None else None)
        if refusal is not None:
            self._refuse(e, Problem(reason="not_owner", detail=refusal), origin)
            return False
        self._forget_job(e.job_id, FinishedJob(completed=False, steps=job.consolidated_steps if job else 0))
        return True

    def _on_RoundStarted(self, e: RoundStarted, origin: object) -> bool:
        was_complete = self._index.complete(e.round)
        changed = self._index.started(e.round, e.assignments)
        if not was_complete and self._index.complete(e.round):
            self._rejudge(self._pending.take_where(lambda held: held.round == e.round))
        self._prune()
        return changed

    def _on_Assignment(self, e: Assignment, origin: object) -> bool:
        if self._index.seen(e.round, e.job_id, e.copy, e.node_id):
            return False
        problem = future_problem(e.round, self._index.latest)
        if problem is not None:
            self._refuse(e, problem, origin)
            return False
        was_complete = self._index.complete(e.round)
        self._index.place(e.round, e.job_id, e.copy, e.node_id)
        changed = False
        if e.job_id not in self._finished and not e.evaluation:   # an evaluation copy trains nothing
            job = self._job(e.job_id, e.ts)
            job.spec = job.spec or e.job
            if e.round > job.floor:
                self._place(job, e)
                changed = True
                self._rejudge(self._pending.take(e.job_id, e.round))
        if not was_complete and self._index.complete(e.round):
            self._rejudge(self._pending.take_where(lambda held: held.round == e.round))
        return changed

    def _place(self, job: JobRecord, e: Assignment) -> None:
        if e.round not in job.rounds:
            job.rounds[e.round] = RoundRecord(deadline=e.deadline)
            self._index.opened(e.round)
        job.rounds[e.round].place(e)

    def _on_Progress(self, e: Progress, origin: object) -> bool:
        job = self._jobs.get(e.job_id)
        if e.job_id in self._finished or (job is not None and e.round <= job.floor):
            return False
        rnd = job.rounds.get(e.round) if job is not None else None
        placement = rnd.copies.get(e.copy) if rnd is not None else None
        problem = future_problem(e.round, self._index.latest)
        if problem is None:
            problem = (report_problem(e, placement) if placement is not None else
                       Problem(reason="unassigned", detail=f"copy {e.copy} of {e.job_id!r} is not placed "
                                                           f"in round {e.round}"))
        if problem is not None:
            self._refuse(e, problem, origin)
            return False
        assert rnd is not None
        if e.steps_round <= rnd.progress.get(e.copy, -1):
            return False
        rnd.progress[e.copy] = e.steps_round
        return True

    def _on_CopyFinished(self, e: CopyFinished, origin: object) -> bool:
        if e.evaluation:
            return False   # a completed job's final model measured (the scheduler's concern): nothing to average
        return self._settle(HeldReport(event=e, origin=origin), self._judge(e))

    def _judge(self, e: CopyFinished) -> _Verdict:
        job = self._jobs.get(e.job_id)
        if e.job_id in self._finished or (job is not None and e.round <= job.floor):
            return "stale"
        problem = key_problem(e) or future_problem(e.round, self._index.latest)
        if problem is not None:
            return problem
        rnd = job.rounds.get(e.round) if job is not None else None
        placement = rnd.copies.get(e.copy) if rnd is not None else None
        complete = self._index.complete(e.round)
        if rnd is None or placement is None:
            if complete:
                return Problem(reason="unassigned", detail=f"copy {e.copy} of {e.job_id!r} was not placed "
                                                           f"in round {e.round}")
            return "hold"
        if not complete and e.node_id not in placement.nodes and (e.status == "failed" or not placement.reporters):
            return "hold"   # the Assignment of this node may still be unread
        problem = report_problem(e, placement)
        if problem is not None:
            return problem
        return "stale" if e.copy in rnd.finished else "accept"

    def _settle(self, report: HeldReport, verdict: _Verdict) -> bool:
        e = report.event
        if verdict == "accept":
            rnd = self._jobs[e.job_id].rounds[e.round]
            rnd.finished[e.copy] = FinishedCopy(copy=e.copy, node_id=e.node_id, status=e.status, steps=e.steps_round,
                                                budget=rnd.copies[e.copy].budget, checkpoint=e.checkpoint,
                                                reason=e.reason, workers=rnd.copies[e.copy].workers)
            return True
        if verdict == "hold":
            self._hold(report)
        elif isinstance(verdict, Problem):
            self._refuse(e, verdict, report.origin)
        return False

    def _hold(self, report: HeldReport) -> None:
        if self._pending.full:
            # Make room for a report of a job the tracker knows by refusing one of a job it
            # does not: a flood of forged reports cannot push out a real one.
            victim = None
            if report.event.job_id in self._jobs:
                victim = self._pending.evict_first(lambda held: held.job_id not in self._jobs)
            refused = victim or report
            self._refuse(refused.event, Problem(reason="overflow", detail=f"{self._pending.limit} reports already "
                                                                          "wait for their assignments"),
                         refused.origin)
            if victim is None:
                return
        self._pending.hold(report)

    def _rejudge(self, reports: list[HeldReport]) -> None:
        for report in reports:
            self._settle(report, self._judge(report.event))

    def _on_ModelConsolidated(self, e: ModelConsolidated, origin: object) -> bool:
        verdict = self._model_verdict(e)
        if isinstance(verdict, Problem):
            self._refuse(e, verdict, origin)
        if verdict != "accept":
            return False
        rnd = self._jobs[e.job_id].rounds[e.round]   # accepted: every weighed copy is placed in it
        self._jobs[e.job_id].adopt(e.key, worker_steps=rnd.worker_steps((c.copy, c.steps) for c in e.copies),
                                   start_from=rnd.start_from, total_steps=e.total_steps)
        self._decide(e.job_id, e.round)
        return True

    def _model_verdict(self, e: ModelConsolidated) -> _Verdict:
        job = self._jobs.get(e.job_id)
        if e.job_id in self._finished or (job is not None and e.round <= job.floor):
            return "stale"
        problem = future_problem(e.round, self._index.latest)
        if problem is None:
            rnd = job.rounds.get(e.round) if job is not None else None
            problem = announcement_problem(e, rnd.copies if rnd is not None else None)
        return problem or "accept"

    def _on_RoundAbandoned(self, e: RoundAbandoned, origin: object) -> bool:
        """The tracker's own decision (read back on replay): the round is closed without a model."""
        job = self._jobs.get(e.job_id)
        if e.job_id in self._finished or job is None or e.round <= job.floor:
            return False
        problem = future_problem(e.round, self._index.latest)
        if problem is not None:
            self._refuse(e, problem, origin)
            return False
        job.barren += bool(e.rejected and e.round in job.rounds)   # it ran and left no replica
        self.abandon(e.job_id, e.round)
        return True

    def _on_JobCompleted(self, e: JobCompleted, origin: object) -> bool:
        verdict = self._completion_verdict(e)
        if isinstance(verdict, Problem):
            self._refuse(e, verdict, origin)
        if verdict != "accept":
            return False
        self._forget_job(e.job_id, FinishedJob(completed=True, steps=self._jobs[e.job_id].consolidated_steps))
        return True

    def _completion_verdict(self, e: JobCompleted) -> _Verdict:
        if e.job_id in self._finished:
            return "stale"
        job = self._jobs.get(e.job_id)
        problem = completion_problem(
            e, known=job is not None, iterations=job.spec.iterations if job and job.spec else None,
            has_model=job is not None and job.model_key is not None,
            consolidated_steps=job.consolidated_steps if job else 0)
        return problem or "accept"

    HANDLERS: ClassVar[HandlerTable[Callable[[TrackerState, Any, object], bool]]] = HandlerTable({
        JobSubmitted: _on_JobSubmitted, JobCancelled: _on_JobCancelled,
        RoundStarted: _on_RoundStarted, Assignment: _on_Assignment,
        Progress: _on_Progress, CopyFinished: _on_CopyFinished,
        ModelConsolidated: _on_ModelConsolidated, RoundAbandoned: _on_RoundAbandoned,
        JobCompleted: _on_JobCompleted,
    }, topics=FOLDED_TOPICS)

    # ------------------------------------------------------------------ forgetting

    def _decide(self, job_id: str, round_: int) -> None:
        """Close the job's rounds up to ``round_`` (its model, if any, is adopted already)."""
        job = self._jobs[job_id]
        for number in [n for n in job.rounds if n <= round_]:
            self._close(job, number)
        job.floor = max(job.floor, round_)
        for held in self._pending.take_where(lambda e: e.job_id == job_id and e.round <= round_):
            self._refuse(held.event, Problem(reason="unassigned", detail=f"round {held.event.round} was decided "
                                                                         f"before copy {held.event.copy} was placed"),
                         held.origin)
        self._prune()

    def _close(self, job: JobRecord, number: int) -> None:
        del job.rounds[number]
        self._index.closed(number)

    def _forget_job(self, job_id: str, finished: FinishedJob) -> None:
        job = self._jobs.pop(job_id, None)
        if job is not None:
            for number in list(job.rounds):
                self._close(job, number)
        self._pending.take_where(lambda e: e.job_id == job_id)   # moot now: dropped, not refused
        self._finished[job_id] = finished
        while len(self._finished) > self._max_finished:
            self._finished.popitem(last=False)

    def _prune(self) -> None:
        self._index.prune()
        # Rounds that old count as fully placed: the reports held for them are judged for good.
        cutoff = self._index.cutoff
        self._rejudge(self._pending.take_where(lambda e: e.round < cutoff))

    # ------------------------------------------------------------------ decisions

    def abandon(self, job_id: str, round_: int) -> None:
        """Close an open round that produced no model; it never comes due again. A round
        that is not open (decided, unknown, its job finished) is left alone."""
        job = self._jobs.get(job_id)
        if job is not None and round_ in job.rounds:
            self._decide(job_id, round_)

    def give_up_completion(self, job_id: str) -> None:
        """Stop offering ``job_id`` in ``due_completions`` (until a restart rebuilds the state)."""
        job = self._jobs.get(job_id)
        if job is not None:
            job.completion_given_up = True

    def due_rounds(self, now: float, timeout_s: float) -> list[DueRound]:
        """Rounds to consolidate now: at most one per job, its earliest open round."""
        work = []
        for job_id in sorted(self._jobs):
            job = self._jobs[job_id]
            if job.rounds:
                number = min(job.rounds)
                item = job.rounds[number].work(job_id, number, placed=self._index.known(number), now=now,
                                               timeout_s=timeout_s,
                                               prior_worker_steps=job.consolidated_worker_steps,
                                               job_workers=job.workers, spec=job.spec,
                                               rollback=job.rollback_target())
                if item is not None:
                    work.append(item)
        return work

    def due_completions(self) -> list[DueCompletion]:
        """Jobs whose consolidated steps reached their iterations and have not completed."""
        due = (self._jobs[job_id].completion(job_id) for job_id in sorted(self._jobs))
        return [work for work in due if work is not None]

    # ------------------------------------------------------------------ queries

    def consolidated_steps(self, job_id: str) -> int:
        job = self._jobs.get(job_id)
        if job is not None:
            return job.consolidated_steps
        finished = self._finished.get(job_id)
        return finished.steps if finished is not None else 0

    def consolidated_worker_steps(self, job_id: str) -> int:
        """The exact worker-steps of an unfinished job's consolidated rounds (0 if unknown)."""
        job = self._jobs.get(job_id)
        return job.consolidated_worker_steps if job is not None else 0

    def live_steps(self, job_id: str) -> int:
        """Job steps consolidated plus what copies report in rounds still open."""
        job = self._jobs.get(job_id)
        return job.live_steps() if job is not None else self.consolidated_steps(job_id)

    def is_completed(self, job_id: str) -> bool:
        finished = self._finished.get(job_id)
        return finished is not None and finished.completed

    def iterations(self, job_id: str) -> int | None:
        job = self._jobs.get(job_id)
        return job.spec.iterations if job is not None and job.spec is not None else None

    def open_rounds(self) -> int:
        return sum(len(j.rounds) for j in self._jobs.values())

    def jobs(self) -> int:
        return len(self._jobs)

    def sizes(self) -> dict[str, int]:
        """How much the state holds, per kind; each is bounded (see the module guarantees)."""
        return {"jobs": len(self._jobs), "finished_jobs": len(self._finished), "open_rounds": self.open_rounds(),
                "round_index": len(self._index), "pending": len(self._pending),
                "remembered_ids": len(self._ids), "refusals": len(self._refusals)}
