"""A job's training as the log tells it: per round and copy, loss, samples/s, steps, how
each copy ended, and each round's model with its held-out metric -- pure, no I/O.

:class:`TrainingLog` folds events (in any order, any number of times: an event id is
applied once) from hadar.placements (Assignment: node, GPU type, workers), hadar.progress
(Progress: loss, samples/s, steps; CopyFinished: status, reason) and hadar.models
(ModelConsolidated: total steps, held-out metric, rejected and missing copies;
RoundAbandoned: why the round has no model). ``hadar logs`` renders it as lines
(:func:`log_line`), one per event, in event time, and ``--json`` as :meth:`doc`;
``hadar status`` shows :meth:`latest`.

Failures shown: a copy that finished ``failed`` or ``preempted`` (with its reason), a
replica the tracker left out of the average (``rejected``, with its reason), a copy that
never reported (``missing``), a round abandoned without a model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, TypeAlias

from shared.domain.layout import final_key
from shared.wire.events import (
    Assignment,
    CopyFinished,
    Event,
    ModelConsolidated,
    Progress,
    RoundAbandoned,
)

__all__ = ["TrainingLog", "CopyRun", "RoundModel", "FoldedEvent", "log_line"]

FOLDED = (Assignment, Progress, CopyFinished, ModelConsolidated, RoundAbandoned)
FoldedEvent: TypeAlias = Assignment | Progress | CopyFinished | ModelConsolidated | RoundAbandoned   # one of FOLDED


def _job_of(event: Event) -> str | None:
    if isinstance(event, Assignment):
        return event.job.job_id
    return getattr(event, "job_id", None)


def _number(value: float | None, digits: int) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


def _loss(value: float | None) -> str:
    """A reported training loss; None (Progress.loss: none reported) as "-"."""
    return "-" if value is None else f"{value:.4f}"


@dataclass
class CopyRun:
    """One copy of one round, as far as the log tells."""

    round: int
    copy: int
    nodes: list[str] = field(default_factory=list)
    gpu_type: str = ""
    workers: int = 0
    budget: int = 0
    steps: int = 0
    loss: float | None = None
    samples_per_s: float | None = None
    status: str = "assigned"          # assigned, running, ok, preempted, failed
    reason: str = ""
    rejected: str = ""                # why the tracker left its replica out of the model
    missing: bool = False             # assigned but never reported (the tracker's verdict)
    start_from: str | None = None     # the model key the copy started from
    metric_name: str = ""             # user code: what its script measured, of the start model and
    start_metric: float | None = None  # of this copy's final weights (on the agent)
    final_metric: float | None = None
    log_tail: str = ""                # user code: the end of its output, when it failed
    evaluation: bool = False          # user code: it measured the job's final model, trained nothing

    def doc(self) -> dict[str, Any]:
        return {"copy": self.copy, "nodes": list(self.nodes), "gpu_type": self.gpu_type, "workers": self.workers,
                "evaluation": self.evaluation,
                "step_budget": self.budget, "steps": self.steps, "loss": _number(self.loss, 6),
                "samples_per_s": _number(self.samples_per_s, 3), "status": self.status,
                "reason": self.reason or None, "rejected": self.rejected or None, "missing": self.missing,
                "metric": None if not self.metric_name else {
                    "name": self.metric_name, "start": _number(self.start_metric, 6),
                    "final": _number(self.final_metric, 6)},
                "log_tail": self.log_tail or None}


@dataclass(frozen=True, kw_only=True)
class RoundModel:
    """A round's outcome: its model (``key``, ``total_steps``, metric) or why it has none."""

    key: str | None
    total_steps: int | None
    metric_name: str = ""
    metric_value: float | None = None
    abandoned: str = ""
    evaluated_by: str = ""            # "tracker", or for user code "agent" (a later round's copy)

    def doc(self) -> dict[str, Any]:
        return {"key": self.key, "total_steps": self.total_steps,
                "metric": None if self.metric_value is None else {"name": self.metric_name,
                                                                   "value": _number(self.metric_value, 6),
                                                                   "by": self.evaluated_by or "tracker"},
                "abandoned": self.abandoned or None}


@dataclass
class _Job:
    copies: dict[tuple[int, int], CopyRun] = field(default_factory=dict)
    models: dict[int, RoundModel] = field(default_factory=dict)
    events: list[FoldedEvent] = field(default_factory=list)   # the job's folded events, for log lines
    final_metric: tuple[str, float] | None = None   # user code: an evaluation copy's measure of the final model


class TrainingLog:
    """Every job's training, folded from the log; see the module docstring."""

    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._seen: set[str] = set()

    def fold(self, events: Iterable[Event]) -> list[FoldedEvent]:
        """Apply ``events`` (repeats are skipped); the newly applied ones, in event time."""
        new = sorted((e for e in events if isinstance(e, FOLDED) and e.id not in self._seen),
                     key=lambda e: (e.ts, _RANK[type(e)]))
        applied: list[FoldedEvent] = []
        for event in new:
            if event.id in self._seen:
                continue
            self._seen.add(event.id)
            job_id = _job_of(event)
            if job_id is None:
                continue
            job = self._jobs.setdefault(job_id, _Job())
            _apply(job, event)
            job.events.append(event)
            applied.append(event)
        return applied

    def events(self, job_id: str, round_: int | None = None) -> list[FoldedEvent]:
        """The job's folded events (of round ``round_`` only, if given), in event time."""
        job = self._jobs.get(job_id)
        if job is None:
            return []
        return sorted((e for e in job.events if round_ is None or e.round == round_), key=lambda e: e.ts)

    def doc(self, job_id: str, round_: int | None = None) -> dict[str, Any]:
        """``{"job", "rounds": [{"round", "copies": [...], "model": {...} | null}], "latest"}``."""
        job = self._jobs.get(job_id) or _Job()
        numbers = sorted({r for r, _ in job.copies} | set(job.models))
        rounds = []
        for number in numbers:
            if round_ is not None and number != round_:
                continue
            copies = [job.copies[k].doc() for k in sorted(job.copies) if k[0] == number]
            model = job.models.get(number)
            rounds.append({"round": number, "copies": copies, "model": None if model is None else model.doc()})
        final = None if job.final_metric is None else {
            "key": final_key(job_id), "metric": {"name": job.final_metric[0], "value": _number(job.final_metric[1], 6),
                                                 "by": "agent"}}
        return {"job": job_id, "rounds": rounds, "latest": self.latest(job_id), "final_model": final}

    def latest(self, job_id: str) -> dict[str, Any]:
        """The latest reported training loss (of the newest round that reported one, averaged
        over its copies' last reports) and the latest model's held-out metric."""
        job = self._jobs.get(job_id) or _Job()
        loss = None
        reported = [c for c in job.copies.values() if c.loss is not None]
        if reported:
            newest = max(c.round for c in reported)
            losses = [c.loss for c in reported if c.round == newest and c.loss is not None]   # all of them
            loss = {"round": newest, "value": _number(sum(losses) / len(losses), 6)}
        metric = None
        scored = [r for r in sorted(job.models) if job.models[r].metric_value is not None]
        if scored:
            m = job.models[scored[-1]]
            metric = {"round": scored[-1], "name": m.metric_name, "value": _number(m.metric_value, 6)}
        return {"loss": loss, "metric": metric}


_RANK = {Assignment: 0, Progress: 1, CopyFinished: 2, ModelConsolidated: 3, RoundAbandoned: 3}


def _run(job: _Job, round_: int, copy: int) -> CopyRun:
    return job.copies.setdefault((round_, copy), CopyRun(round=round_, copy=copy))


def _apply(job: _Job, e: Event) -> None:
    if isinstance(e, Assignment):
        run = _run(job, e.round, e.copy)
        if e.node_id not in run.nodes:
            run.nodes.append(e.node_id)
        run.gpu_type, run.workers, run.budget, run.start_from = e.gpu_type, e.world_size, e.step_budget, e.start_from
        run.evaluation = e.evaluation
    elif isinstance(e, Progress):
        run = _run(job, e.round, e.copy)
        run.steps = max(run.steps, e.steps_round)
        run.loss = e.loss if e.loss is not None else run.loss   # None: none reported
        run.samples_per_s = e.samples_per_s
        run.gpu_type, run.workers = run.gpu_type or e.gpu_type, run.workers or e.workers
        if run.status == "assigned":
            run.status = "running"
    elif isinstance(e, CopyFinished):
        run = _run(job, e.round, e.copy)
        run.status, run.reason = e.status, e.reason
        run.steps = max(run.steps, e.steps_round)
        run.metric_name, run.start_metric, run.final_metric = e.metric_name, e.start_metric, e.final_metric
        run.log_tail = e.log_tail
        if e.metric_name and e.start_metric is not None and run.start_from is not None:
            if e.evaluation:
                _final_evaluated(job, e.metric_name, e.start_metric)
            else:
                _evaluated(job, run.start_from, e.metric_name, e.start_metric)
    elif isinstance(e, ModelConsolidated):
        old = job.models.get(e.round)
        model = RoundModel(key=e.key, total_steps=e.total_steps, metric_name=e.metric_name,
                           metric_value=e.metric_value, evaluated_by="tracker" if e.metric_value is not None else "")
        if model.metric_value is None and old is not None and old.metric_value is not None:
            model = replace(model, metric_name=old.metric_name, metric_value=old.metric_value,
                            evaluated_by=old.evaluated_by)
        job.models[e.round] = model
        _verdicts(job, e.round, e.rejected, e.missing)
    elif isinstance(e, RoundAbandoned):
        job.models[e.round] = RoundModel(key=None, total_steps=None, abandoned=e.reason)
        _verdicts(job, e.round, e.rejected, e.missing)


def _evaluated(job: _Job, start_from: str, name: str, value: float) -> None:
    """A user script's measure of the model a copy started from: that round model's metric
    (the tracker never evaluates user code), unless the tracker's is known."""
    for number, model in job.models.items():
        if model.key == start_from:
            if model.metric_value is None:
                job.models[number] = replace(model, metric_name=name, metric_value=value, evaluated_by="agent")
            return


def _final_evaluated(job: _Job, name: str, value: float) -> None:
    """An evaluation copy's measure of the job's final model, which is a byte copy of its
    latest round model: that model's metric too."""
    job.final_metric = (name, value)
    keyed = [number for number, model in job.models.items() if model.key is not None]
    if keyed:
        _evaluated(job, job.models[max(keyed)].key or "", name, value)


def _verdicts(job: _Job, round_: int, rejected: Iterable[Any], missing: Iterable[int]) -> None:
    for r in rejected:
        _run(job, round_, r.copy).rejected = r.reason
    for copy in missing:
        _run(job, round_, copy).missing = True


def _time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def log_line(e: FoldedEvent) -> str:
    """One human line for one of a job's events: time, round, copy, then what happened."""
    head = f"{_time(e.ts)}  round {e.round:<4}"
    if isinstance(e, Assignment):
        if e.evaluation:
            return f"{head} copy {e.copy:<3} evaluates  the final model on {e.node_id} {e.gpu_type}"
        return (f"{head} copy {e.copy:<3} assigned   {e.node_id} {e.gpu_type} x{len(e.gpus)} "
                f"(copy of {e.world_size} workers), budget {e.step_budget} steps")
    if isinstance(e, Progress):
        return (f"{head} copy {e.copy:<3} progress   step {e.steps_round} (job step {e.steps_total})  "
                f"loss {_loss(e.loss)}  {e.samples_per_s:.1f} samples/s  [{e.node_id} {e.gpu_type}]")
    if isinstance(e, CopyFinished):
        text = f"{head} copy {e.copy:<3} finished   {e.status}, {e.steps_round} steps"
        if e.metric_name:
            values = [f"{of} {v:.4f}" for of, v in (("start", e.start_metric), ("final", e.final_metric))
                      if v is not None]
            text += f", {e.metric_name}: {', '.join(values)}" if values else ""
        text += f": {e.reason}" if e.reason else ""
        if e.log_tail:
            text += "".join(f"\n    | {line}" for line in e.log_tail.rstrip().splitlines()[-20:])
        return text
    if isinstance(e, ModelConsolidated):
        metric = f", {e.metric_name} {e.metric_value:.4f}" if e.metric_value is not None else ""
        text = f"{head} model      {e.total_steps} job steps{metric}, copies {[c.copy for c in e.copies]}"
        for r in e.rejected:
            text += f"; rejected copy {r.copy}: {r.reason}"
        if e.missing:
            text += f"; missing copies {list(e.missing)}"
        return text
    if isinstance(e, RoundAbandoned):
        text = f"{head} abandoned  no model: {e.reason}"
        for r in e.rejected:
            text += f"; rejected copy {r.copy}: {r.reason}"
        return text
    return f"{head} {e.TYPE}"   # pragma: no cover - only FOLDED types are kept
