"""The live scheduler's records of one job, one node and one round, as its state folds them.

Plain mutable dataclasses owned by :class:`~services.scheduler.live.state.SchedulerState`
(only its ``apply`` changes them; views read them). Each is a snapshot type under a fixed
name, so moving a class between modules never changes a stored snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.live.stuck import stuck_reason
from shared.persistence.codec import snapshot_type
from shared.wire.events import Assignment, JobSpec, NodeRegistered, RoundStarted

MAX_EVALUATIONS = 3    # tries at a user-code job's final-model metric before it is left without one


@snapshot_type("scheduler.JobRecord", formerly="services.scheduler.state.JobRecord")
@dataclass(kw_only=True)
class JobRecord:
    spec: JobSpec
    submitted_at: float
    cancelled: bool = False
    completed_at: float | None = None
    final_key: str | None = None
    steps_done: int = 0                 # authoritative: the last consolidated model's total
    model_key: str | None = None        # the last consolidated model (start point of the next round)
    consolidated_round: int = -1
    decided_round: int = -1             # latest round with a model or given up (RoundAbandoned)
    # (round, copy) -> worker-steps (own steps x the copy's workers) reported this round
    live_steps: dict[tuple[int, int], int] = field(default_factory=dict)
    attained_gpu_s: float = 0.0
    time_by_type: dict[str, float] = field(default_factory=dict)
    rounds_run: int = 0
    first_round: int | None = None
    last_round: int | None = None
    progress_round: int = -1            # latest round whose model added steps
    runs_since_progress: int = 0        # rounds run after ``progress_round``
    last_outcome: str = ""              # why the latest decided round added nothing ("" if it did)
    # Its copies' measured start-ups (CopyFinished.start_s) as (sum of seconds, copies), of cold
    # workers and of warm ones. A job's reports share one partition (keyed by job id), so a
    # replay folds them in the order the service did.
    cold_starts: tuple[float, int] = (0.0, 0)
    warm_starts: tuple[float, int] = (0.0, 0)
    # User code's final model, evaluated by an evaluation copy on an agent (services/scheduler/live/evaluations.py)
    last_evaluation_deadline: float = 0.0
    last_evaluation_reported: bool = False   # the latest try's report came (with or without a metric)
    final_metric_name: str = ""
    final_metric: float | None = None
    evaluation_failure: str = ""        # why the latest evaluation copy gave no metric
    evaluation_placed: set[tuple[int, str]] = field(default_factory=set)   # (round, node) of each try
    # the latest report of an evaluation copy from each node, until its Assignment is folded (a
    # viewer folds placements last): node -> (round, status, metric name, metric, reason). One per
    # node, so a node can hold back no other node's report.
    evaluation_reports: dict[str, tuple[int, str, str, float | None, str]] = field(default_factory=dict)

    @property
    def evaluations(self) -> int:
        """Evaluation copies placed (one per try, each in its own round)."""
        return len(self.evaluation_placed)

    @property
    def last_evaluation_round(self) -> int:
        return max((r for r, _ in self.evaluation_placed), default=-1)

    @property
    def final_evaluation(self) -> str:
        """How the final model's evaluation stands: "measured", "given up" (MAX_EVALUATIONS
        tries, the last reported without a metric) or "pending"."""
        if self.final_metric is not None:
            return "measured"
        if self.evaluations >= MAX_EVALUATIONS and self.last_evaluation_reported:
            return "given up"
        return "pending"

    @property
    def active(self) -> bool:
        return not self.cancelled and self.completed_at is None

    @property
    def move_cost_s(self) -> float:
        """What a move costs a copy of this job (``JobState.restart_s``): its cold copies' mean
        start-up over its warm copies', once both were measured; else 0 (unknown)."""
        (cold, n_cold), (warm, n_warm) = self.cold_starts, self.warm_starts
        return max(0.0, cold / n_cold - warm / n_warm) if n_cold and n_warm else 0.0

    def note_start(self, seconds: float, *, warm: bool) -> None:
        """Fold one copy's measured start-up (``CopyFinished.start_s``)."""
        total, n = self.warm_starts if warm else self.cold_starts
        setattr(self, "warm_starts" if warm else "cold_starts", (total + seconds, n + 1))

    @property
    def state(self) -> str:
        if self.completed_at is not None:
            return "completed"
        if self.cancelled:
            return "cancelled"
        if self.last_round is None:
            return "waiting"
        return "stuck" if stuck_reason(self) is not None else "running"

    def progress_steps(self) -> int:
        """Consolidated steps plus what copies reported since, in job steps: a copy on k of
        the job's W workers earns k/W of a step per step (shared.domain.progress; display only)."""
        pending = sum(s for (r, _), s in self.live_steps.items() if r > self.consolidated_round)
        return min(self.spec.iterations, self.steps_done + pending // self.spec.workers)


@snapshot_type("scheduler.NodeRecord", formerly="services.scheduler.state.NodeRecord")
@dataclass(kw_only=True)
class NodeRecord:
    registered: NodeRegistered
    last_seen: float
    incarnation: int = 0     # times the node came back with other devices


@snapshot_type("scheduler.RoundRecord", formerly="services.scheduler.state.RoundRecord")
@dataclass(kw_only=True)
class RoundRecord:
    started: RoundStarted
    assignments: list[Assignment] = field(default_factory=list)
    placed: set[tuple[str, int, str]] = field(default_factory=set)   # (job, copy, node) of ``assignments``


def settle_evaluation(job: JobRecord, round_: int, node_id: str) -> None:
    """Take the report of the evaluation copy of ``round_`` on ``node_id`` once both it and its
    Assignment are folded, in either order (a report from a node no try was placed on stays
    unmatched and changes nothing)."""
    held = job.evaluation_reports.get(node_id)
    if held is None or held[0] != round_ or (round_, node_id) not in job.evaluation_placed:
        return
    _, status, name, value, reason = job.evaluation_reports.pop(node_id)
    job.last_evaluation_reported |= round_ == job.last_evaluation_round
    if status == "ok" and name and value is not None:
        job.final_metric_name, job.final_metric = name, value
    else:
        job.evaluation_failure = reason or "the script reported no metric of its start"
