"""The live scheduler's state: a pure fold over the events it has read.

``SchedulerState.apply(event)`` is the only way state changes; applying the same event
twice (same ``id``) is a no-op, so at-least-once delivery is safe, and a scheduler that
restarts rebuilds exactly this state by reading its topics from the start. Nothing here
reads a clock: times come from the events themselves.

A well-formed event is still checked against what the state knows, and refused with
:class:`~shared.bus.rejection.Rejected` (changing nothing) when it cannot be true -- a forged
announcement, an implausible rate: the rules are in :mod:`services.scheduler.live.acceptance`.
A NodeRegistered with other devices than the node's current ones starts a new
incarnation (counted); the old devices are gone.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from services.scheduler.live.acceptance import CHECKS
from services.scheduler.live.records import (
    MAX_EVALUATIONS,
    JobRecord,
    NodeRecord,
    RoundRecord,
    settle_evaluation,
)
from shared.bus.rejection import Rejected
from shared.persistence.codec import snapshot_type
from shared.wire.dispatch import HandlerTable
from shared.wire.events import (
    Assignment,
    CopyFinished,
    Event,
    JobCancelled,
    JobCompleted,
    JobSubmitted,
    ModelConsolidated,
    NodeHeartbeat,
    NodeRegistered,
    Progress,
    QueueConfig,
    QueuesApplied,
    RoundAbandoned,
    RoundStarted,
    ThroughputEstimate,
)
from shared.wire.topics import (
    DEADLETTER,
    JOBS,
    MODELS,
    NODES,
    PLACEMENTS,
    PROGRESS,
    QUEUES,
    THROUGHPUT,
)

# What ``apply`` folds: the scheduler service's INPUT_TOPICS plus its own placements, which
# it reads back on restart (tests check this matches the service).
FOLDED_TOPICS: tuple[str, ...] = (JOBS, NODES, THROUGHPUT, PROGRESS, MODELS, QUEUES, PLACEMENTS)


FINISHED_KEPT = 1024    # completed or cancelled jobs whose records stay in memory (views, the demo)
SEEN_WINDOW = 65_536   # event ids remembered for dedupe (~8 MB): far more than one commit interval
ROUNDS_KEPT = 64       # rounds kept in memory; older ones live on in the log only
EVALUATION_REPORT_S = 60.0   # after its deadline, an evaluation copy that has not reported is tried again


@snapshot_type("scheduler.SchedulerState", formerly="services.scheduler.state.SchedulerState")
class SchedulerState:
    """Memory stays bounded however long the log: dedupe remembers the last
    ``seen_window`` event ids, only the last ``rounds_kept`` rounds are kept (older ones
    are folded into running utilization totals), a finished job drops its rates and
    unconsolidated progress at once and its record once ``finished_kept`` jobs finished
    after it (only its id is remembered, so the id is never reused). Folds that a redelivery could double
    (Assignments) are also idempotent by content, so a duplicate older than the id window
    changes nothing either."""

    def __init__(self, *, seen_window: int = SEEN_WINDOW, rounds_kept: int = ROUNDS_KEPT,
                 finished_kept: int = FINISHED_KEPT, rounds_in_order: bool = True) -> None:
        """``rounds_in_order=False``: for a viewer that reads topics concurrently, so a model
        may arrive before the RoundStarted of its round; the round check is then skipped."""
        self.jobs: dict[str, JobRecord] = {}
        self.nodes: dict[str, NodeRecord] = {}
        # (job_id, gpu_type, workers) -> (basis, steps/s); a measured value is never replaced by an estimate
        self.rates: dict[tuple[str, str, int], tuple[str, float]] = {}
        # job_id -> (model_bytes, optimizer_slots): the last size a ThroughputEstimate stated
        # (HadarE's consolidation cost); like rates, it may come before the job and goes with it
        self.sizes: dict[str, tuple[int, int]] = {}
        self.queues: QueueConfig | None = None   # the latest QueuesApplied (None: no queues, no quotas)
        self.rounds: dict[int, RoundRecord] = {}
        self.last_round: int = -1
        self.events_applied = 0
        self._rounds_in_order = rounds_in_order
        self._finished_kept = finished_kept
        self._finished_order: deque[str] = deque()
        self._forgotten: set[str] = set()   # finished jobs whose records were dropped (~50 B each)
        self._seen_window = seen_window
        self._rounds_kept = rounds_kept
        self._seen: set[str] = set()
        self._seen_order: deque[str] = deque()
        self._pruned_gpu_s = (0.0, 0.0)   # (offered, assigned) GPU-seconds of rounds no longer kept

    @property
    def remembered_ids(self) -> int:
        return len(self._seen)

    @property
    def rounds_in_order(self) -> bool:
        """False for a viewer reading topics concurrently (``__init__``)."""
        return self._rounds_in_order

    def forgotten(self, job_id: str) -> bool:
        """True for a finished job whose record was dropped (its id is never reused)."""
        return job_id in self._forgotten

    # ------------------------------------------------------------------ fold

    def apply(self, event: Event) -> bool:
        """Fold one event in; False when it was already applied (duplicate id).

        Dispatch is by ``HANDLERS``; an event of a type that cannot arrive on
        ``FOLDED_TOPICS`` (e.g. a DeadLetter in a whole-log replay) is counted but changes nothing.
        """
        if event.id in self._seen:
            return False
        handler = self.HANDLERS.handler_for(event)
        check = self.CHECKS.get(type(event))
        if check is not None:
            reason = check(self, event)
            if reason is not None:
                raise Rejected(reason)
        self._seen.add(event.id)
        self._seen_order.append(event.id)
        if len(self._seen_order) > self._seen_window:
            self._seen.discard(self._seen_order.popleft())
        self.events_applied += 1
        if handler is not None:
            handler(self, event)
        return True

    def _on_JobSubmitted(self, e: JobSubmitted) -> None:
        if e.job_id not in self.jobs and e.job_id not in self._forgotten:   # an id keeps its first submission
            self.jobs[e.job_id] = JobRecord(spec=e.job, submitted_at=e.submitted_at)

    def _on_JobCancelled(self, e: JobCancelled) -> None:
        job = self.jobs.get(e.job_id)
        if job is not None and job.completed_at is None:
            job.cancelled = True
            self._finished(job)

    def _finished(self, job: JobRecord) -> None:
        job.live_steps = {}
        for key in [k for k in self.rates if k[0] == job.spec.job_id]:
            del self.rates[key]
        self.sizes.pop(job.spec.job_id, None)
        self._finished_order.append(job.spec.job_id)
        while len(self._finished_order) > self._finished_kept:
            old = self._finished_order.popleft()
            self.jobs.pop(old, None)
            self._forgotten.add(old)

    def _on_NodeRegistered(self, e: NodeRegistered) -> None:
        old = self.nodes.get(e.node_id)
        incarnation = 0
        if old is not None:
            same = sorted((g.index, g.type) for g in old.registered.gpus) == sorted((g.index, g.type) for g in e.gpus)
            incarnation = old.incarnation + (0 if same else 1)
        self.nodes[e.node_id] = NodeRecord(registered=e, last_seen=e.ts, incarnation=incarnation)

    def _on_NodeHeartbeat(self, e: NodeHeartbeat) -> None:
        node = self.nodes.get(e.node_id)
        if node is not None:
            node.last_seen = max(node.last_seen, e.ts)

    def _on_ThroughputEstimate(self, e: ThroughputEstimate) -> None:
        merge_rates(self.rates, e)
        if e.model_bytes > 0:
            self.sizes[e.job_id] = (e.model_bytes, e.optimizer_slots)

    def _on_RoundStarted(self, e: RoundStarted) -> None:
        if e.round <= self.last_round - self._rounds_kept:
            return   # older than every round kept: already counted, or too late to matter
        self.rounds.setdefault(e.round, RoundRecord(started=e))
        self.last_round = max(self.last_round, e.round)
        for old in [r for r in self.rounds if r <= self.last_round - self._rounds_kept]:
            offered, assigned = self._round_gpu_s(self.rounds.pop(old))
            self._pruned_gpu_s = (self._pruned_gpu_s[0] + offered, self._pruned_gpu_s[1] + assigned)

    def _on_Assignment(self, e: Assignment) -> None:
        record = self.rounds.get(e.round)
        if record is None:
            return   # its round is not kept (pruned, or never seen): nothing current depends on it
        key = (e.job_id, e.copy, e.node_id)
        if key in record.placed:
            return   # a redelivery under another id, or one older than the id window
        record.placed.add(key)
        record.assignments.append(e)
        seconds = max(0.0, record.started.ends_at - record.started.started_at)
        job = self.jobs.get(e.job_id)
        if job is None:
            return
        if e.evaluation:   # after the job: not training time, not a round it ran
            if e.round > job.last_evaluation_round:
                job.last_evaluation_deadline, job.last_evaluation_reported = e.deadline, False
            job.evaluation_placed.add((e.round, e.node_id))
            settle_evaluation(job, e.round, e.node_id)
            return
        job.attained_gpu_s += seconds * len(e.gpus)
        job.time_by_type[e.gpu_type] = job.time_by_type.get(e.gpu_type, 0.0) + seconds
        if job.last_round != e.round:
            job.rounds_run += 1
            job.last_round = e.round
            if e.round > job.progress_round:
                job.runs_since_progress += 1
        if job.first_round is None:
            job.first_round = e.round

    def _on_Progress(self, e: Progress) -> None:
        job = self.jobs.get(e.job_id)
        if job is not None:
            workers = min(e.workers, job.spec.workers)
            key = (e.round, e.copy)
            job.live_steps[key] = max(job.live_steps.get(key, 0), e.steps_round * workers)

    def _on_CopyFinished(self, e: CopyFinished) -> None:
        job = self.jobs.get(e.job_id)
        if e.evaluation:
            if job is not None:
                job.evaluation_reports[e.node_id] = (e.round, e.status, e.metric_name, e.start_metric,
                                                     e.reason[:200])
                settle_evaluation(job, e.round, e.node_id)
            return
        if job is not None and e.start_s is not None:
            job.note_start(e.start_s, warm=e.start_warm)
        if job is not None and e.status != "failed":
            key = (e.round, e.copy)
            workers = self._copy_workers(e.job_id, e.round, e.copy, default=job.spec.workers)
            job.live_steps[key] = max(job.live_steps.get(key, 0), e.steps_round * workers)

    def _copy_workers(self, job_id: str, round_: int, copy: int, *, default: int) -> int:
        """The copy's world size, from its Assignment when the round is kept."""
        record = self.rounds.get(round_)
        for a in record.assignments if record is not None else ():
            if a.job_id == job_id and a.copy == copy:
                return min(a.world_size, default)
        return default

    def _on_ModelConsolidated(self, e: ModelConsolidated) -> None:
        job = self.jobs.get(e.job_id)
        if job is not None and e.round >= job.consolidated_round:
            if e.total_steps > job.steps_done:
                job.progress_round = e.round
                job.runs_since_progress = int(job.last_round is not None and job.last_round > e.round)
                job.last_outcome = ""
            else:
                job.last_outcome = f"round {e.round}'s model added no steps"
            job.consolidated_round = e.round
            job.decided_round = max(job.decided_round, e.round)
            job.steps_done = e.total_steps
            job.model_key = e.key
            job.live_steps = {k: v for k, v in job.live_steps.items() if k[0] > e.round}

    def _on_RoundAbandoned(self, e: RoundAbandoned) -> None:
        """A round that left no replica does not count against the job: its GPU time is refunded."""
        job = self.jobs.get(e.job_id)
        if job is not None:
            record = self.rounds.get(e.round)
            if record is not None and job.decided_round < e.round:
                for a in record.assignments:
                    if a.job_id == e.job_id:
                        seconds = max(0.0, record.started.ends_at - record.started.started_at)
                        job.attained_gpu_s = max(0.0, job.attained_gpu_s - seconds * len(a.gpus))
                        job.time_by_type[a.gpu_type] = max(0.0, job.time_by_type.get(a.gpu_type, 0.0) - seconds)
            job.decided_round = max(job.decided_round, e.round)
            job.live_steps = {k: v for k, v in job.live_steps.items() if k[0] != e.round}
            job.last_outcome = f"round {e.round} abandoned: {e.reason[:200]}"

    def _on_JobCompleted(self, e: JobCompleted) -> None:
        job = self.jobs.get(e.job_id)
        if job is not None and job.completed_at is None:
            job.completed_at = e.completed_at
            job.final_key = e.final_key
            job.steps_done = max(job.steps_done, e.total_steps)
            self._finished(job)

    def _on_QueuesApplied(self, e: QueuesApplied) -> None:
        self.queues = e.config

    CHECKS: ClassVar[dict[type, Callable[[SchedulerState, Any], str | None]]] = CHECKS   # acceptance.py

    HANDLERS: ClassVar[HandlerTable[Callable[[SchedulerState, Any], None]]] = HandlerTable({
        JobSubmitted: _on_JobSubmitted, JobCancelled: _on_JobCancelled,
        NodeRegistered: _on_NodeRegistered, NodeHeartbeat: _on_NodeHeartbeat,
        ThroughputEstimate: _on_ThroughputEstimate,
        RoundStarted: _on_RoundStarted, Assignment: _on_Assignment,
        Progress: _on_Progress, CopyFinished: _on_CopyFinished,
        ModelConsolidated: _on_ModelConsolidated, RoundAbandoned: _on_RoundAbandoned,
        JobCompleted: _on_JobCompleted, QueuesApplied: _on_QueuesApplied,
    }, topics=FOLDED_TOPICS)

    # ------------------------------------------------------------------ queries

    def active_jobs(self) -> list[JobRecord]:
        """Active jobs in submission order (ties by id): the order snapshots list them."""
        return sorted((j for j in self.jobs.values() if j.active), key=lambda j: (j.submitted_at, j.spec.job_id))

    def awaiting_evaluation(self, now: float) -> list[JobRecord]:
        """Completed user-code jobs whose final model has no metric yet and may be evaluated
        at ``now``: fewer than MAX_EVALUATIONS tries, the latest of them reported or
        EVALUATION_REPORT_S past its deadline (its report lost). Oldest completion first."""
        due = [j for j in self.jobs.values()
               if j.completed_at is not None and j.spec.code is not None and j.final_metric is None
               and j.evaluations < MAX_EVALUATIONS
               and (j.evaluations == 0 or j.last_evaluation_reported
                    or now >= j.last_evaluation_deadline + EVALUATION_REPORT_S)]
        return sorted(due, key=lambda j: (j.completed_at or 0.0, j.spec.job_id))

    def unrated_jobs(self) -> list[str]:
        """Active jobs no ThroughputEstimate has rated yet, in submission order."""
        rated = self._rated()
        return [j.spec.job_id for j in self.active_jobs() if j.spec.job_id not in rated]

    def _rated(self) -> set[str]:
        return {job_id for job_id, _, _ in self.rates}

    def placeable(self, at: float, heartbeat_s: float) -> tuple[frozenset[str], frozenset[str]]:
        """The active jobs a plan could place at ``at`` (rated) and the nodes it could place on
        (live): a round that placed nothing has something new to plan once either grows."""
        rated = self._rated()
        return (frozenset(j.spec.job_id for j in self.active_jobs() if j.spec.job_id in rated),
                frozenset(n.registered.node_id for n in self.live_nodes(at, heartbeat_s)))

    def live_nodes(self, at: float, heartbeat_s: float, missed: int = 3) -> list[NodeRecord]:
        """Nodes heard from within ``missed`` heartbeat periods of ``at``, sorted by id."""
        horizon = missed * heartbeat_s
        return sorted((n for n in self.nodes.values() if at - n.last_seen <= horizon),
                      key=lambda n: n.registered.node_id)

    def allocation_utilization(self) -> float | None:
        """GPU-seconds assigned / GPU-seconds offered, over every round folded.

        Offered: every GPU of the round's live nodes for the round's length (until the next
        round's start, for a round that placed nothing and ended early); assigned: every GPU of
        every Assignment for the same length. None before the first round.
        """
        offered, assigned = self._pruned_gpu_s
        for record in self.rounds.values():
            o, a = self._round_gpu_s(record)
            offered, assigned = offered + o, assigned + a
        return assigned / offered if offered > 0 else None

    def _round_gpu_s(self, record: RoundRecord) -> tuple[float, float]:
        ends_at = record.started.ends_at
        if (after := self.rounds.get(record.started.round + 1)) is not None:
            ends_at = min(ends_at, after.started.started_at)   # a round that placed nothing may end early
        seconds = max(0.0, ends_at - record.started.started_at)
        offered = seconds * sum(len(self.nodes[n].registered.gpus) for n in record.started.nodes if n in self.nodes)
        return offered, seconds * sum(len(a.gpus) for a in record.assignments)

    def awaiting_consolidation(self, round_: int) -> list[str]:
        """Active jobs that ran in ``round_`` whose model for it was neither announced nor given up."""
        record = self.rounds.get(round_)
        if record is None:
            return []
        ran = {a.job_id for a in record.assignments}
        return sorted(j for j in ran if j in self.jobs and self.jobs[j].active
                      and self.jobs[j].decided_round < round_)


def merge_rates(rates: dict[tuple[str, str, int], tuple[str, float]], e: ThroughputEstimate) -> None:
    """Fold one estimate into ``(job, gpu_type, workers) -> (basis, steps/s)``: the latest
    value wins, except that a measurement is never replaced by an estimate."""
    for gpu_type, rate in e.rates.items():
        key = (e.job_id, gpu_type, e.workers)
        current = rates.get(key)
        if current is not None and current[0] == "measured" and e.basis == "estimate":
            continue
        rates[key] = (e.basis, rate)


def fold_log(items: Iterable[tuple[str, Event]]) -> SchedulerState:
    """A state from ``(topic, event)`` pairs read topic by topic (as the CLI and tests read).

    A topic-by-topic read does not say how topics interleaved, so the order is rebuilt:
    RoundStarted first (a model can only be announced for a round that started), then the
    other topics, then the Assignments by round. Nothing is pruned (a one-shot view of the
    whole log), and events the state refuses are left out, as the scheduler left them out.
    """
    state = SchedulerState(seen_window=sys.maxsize, rounds_kept=sys.maxsize, finished_kept=sys.maxsize)
    placements: list[Event] = []
    others: list[Event] = []
    for topic, event in items:
        if topic == PLACEMENTS:
            placements.append(event)
        elif topic != DEADLETTER:
            others.append(event)
    rounds = sorted((e for e in placements if isinstance(e, RoundStarted)), key=lambda e: e.round)
    assignments = sorted((e for e in placements if isinstance(e, Assignment)), key=lambda e: e.round)
    ordered: list[Event] = [*rounds, *others, *assignments]
    for event in ordered:
        try:
            state.apply(event)
        except Rejected:
            pass
    return state
