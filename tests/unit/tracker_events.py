"""Event builders for the tracker's state tests: one job ``j1`` by default, rounds 360 s apart."""

from __future__ import annotations

from services.tracker.state import TrackerState
from shared.domain.layout import checkpoint_key, final_key, model_key
from shared.wire.events import (
    Assignment,
    CopyFinished,
    CopyWeight,
    Event,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    Progress,
    RoundStarted,
)

T0 = 1_000.0
BUDGET = 1_000


def spec(job_id: str = "j1", iterations: int = 500) -> JobSpec:
    return JobSpec(job_id=job_id, user="u", model="resnet-8", dataset="digits", batch_size=32, workers=1,
                   iterations=iterations)


SPEC = spec()


def submitted(job: JobSpec = SPEC, at: float = T0) -> JobSubmitted:
    return JobSubmitted(ts=at, source="cli", job=job, submitted_at=at)


def started(round_: int, assignments: int) -> RoundStarted:
    at = T0 + round_ * 360
    return RoundStarted(ts=at, source="scheduler", round=round_, policy="hadare", started_at=at,
                        ends_at=at + 360, assignments=assignments)


def assignment(copy: int, round_: int = 0, node: str = "n1", job: JobSpec = SPEC, deadline: float = T0 + 360,
               budget: int = BUDGET, ranks: tuple[int, ...] = (0,), world_size: int = 1) -> Assignment:
    return Assignment(ts=T0 + round_ * 360, source="scheduler", round=round_, job=job, copy=copy,
                      node_id=node, gpus=tuple(range(len(ranks))), gpu_type="V100", world_size=world_size,
                      ranks=ranks, step_budget=budget, deadline=deadline + round_ * 360,
                      rendezvous=None if world_size == len(ranks) else "n1:29500")


def finished(copy: int, steps: int, round_: int = 0, status: str = "ok", job: str = "j1", node: str = "n1",
             checkpoint: str | None = "") -> CopyFinished:
    """``checkpoint=""``: the prescribed key, under the reporting ``node`` (None when failed)."""
    if checkpoint == "":
        checkpoint = None if status == "failed" else checkpoint_key(job, round_, copy, node=node)
    return CopyFinished(ts=T0 + 350 + round_ * 360, source="agent", job_id=job, round=round_, copy=copy,
                        node_id=node, status=status, steps_round=steps, checkpoint=checkpoint,
                        reason="oom" if status == "failed" else "")


def progress(copy: int, steps: int, round_: int = 0, job: str = "j1", node: str = "n1") -> Progress:
    return Progress(ts=T0 + steps, source="agent", job_id=job, round=round_, copy=copy, node_id=node,
                    gpu_type="V100", workers=1, steps_round=steps, steps_total=steps, samples_per_s=10.0,
                    loss=1.0)


def consolidated(round_: int, copies: dict[int, int], total: int, job: str = "j1", key: str | None = None,
                 weights: dict[int, float] | None = None) -> ModelConsolidated:
    whole = max(1, sum(copies.values()))
    return ModelConsolidated(
        ts=T0 + 400 + round_ * 360, source="tracker", job_id=job, round=round_,
        key=model_key(job, round_) if key is None else key, total_steps=total,
        copies=tuple(CopyWeight(copy=c, steps=s, weight=(weights or {}).get(c, s / whole))
                     for c, s in copies.items()))


def completed(total: int, job: str = "j1", key: str | None = None, at: float = T0 + 800) -> JobCompleted:
    return JobCompleted(ts=at, source="tracker", job_id=job, final_key=final_key(job) if key is None else key,
                        total_steps=total, jct_s=at - T0, completed_at=at)


def fold(events: list[Event], state: TrackerState | None = None) -> TrackerState:
    state = state or TrackerState()
    for event in events:
        state.apply(event)
    return state
