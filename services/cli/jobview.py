"""How the CLI shows jobs: pure functions of a folded log and the time ``now``.

No I/O here: ``jobs``, ``status``, ``watch`` and the demo fetch and fold the log, then
render through these. :func:`job_doc` is the one JSON shape of a job (``status --json``,
each element of ``jobs --json``, the final document of ``watch --json``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from typing import Any

from services.cli.joblog import TrainingLog
from services.cli.queueview import job_queue_doc, queue_jobs, queue_of, reclaim_reason
from services.scheduler.live.records import JobRecord
from services.scheduler.live.state import SchedulerState
from services.scheduler.live.stuck import stuck_reason
from shared.errors import UsageError

__all__ = ["JOB_STATES", "NO_ESTIMATE", "job_doc", "jobs_table", "select_jobs", "parse_since",
           "progress_line", "waiting_reason", "elapsed_s", "format_duration"]

JOB_STATES: tuple[str, ...] = ("waiting", "running", "stuck", "completed", "cancelled")
# Shown instead of the scheduler's reason while the profiler has not estimated the job yet:
# until then the policy sees no rate on any GPU type and calls the job "infeasible", which
# reads as permanent when it is only early.
NO_ESTIMATE = "waiting for a throughput estimate"
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _gpus(state: SchedulerState, job: JobRecord) -> dict[str, int]:
    """GPUs by type in the job's last round; empty once a later round left it out."""
    gpus: dict[str, int] = {}
    if job.last_round is None or job.last_round not in state.rounds:
        return gpus
    if job.active and job.last_round != state.last_round:
        return gpus
    for a in state.rounds[job.last_round].assignments:
        if a.job_id == job.spec.job_id:
            gpus[a.gpu_type] = gpus.get(a.gpu_type, 0) + len(a.gpus)
    return gpus


def waiting_reason(state: SchedulerState, job: JobRecord) -> str | None:
    """Why an active job is not running: :data:`NO_ESTIMATE` for a job never placed with no
    throughput estimate yet, why it is stuck (:func:`~services.scheduler.live.state.stuck_reason`),
    else the latest round's reason (``code: detail``); None if none."""
    if not job.active:
        return None
    stuck = stuck_reason(job)
    if stuck is not None:
        return stuck
    if job.last_round is None and not any(k[0] == job.spec.job_id for k in state.rates):
        return NO_ESTIMATE
    if state.queues is not None:
        reclaim = reclaim_reason(state, state.queues, job)
        if reclaim is not None:
            return reclaim
    if state.last_round < 0 or state.last_round not in state.rounds:
        return None
    for w in state.rounds[state.last_round].started.waiting:
        if w.job_id == job.spec.job_id:
            return f"{w.code}: {w.detail}" if w.detail else w.code
    return None


def finished_at(job: JobRecord, cancelled_at: Mapping[str, float]) -> float | None:
    if job.completed_at is not None:
        return job.completed_at
    return cancelled_at.get(job.spec.job_id) if job.cancelled else None


def elapsed_s(job: JobRecord, now: float, cancelled_at: Mapping[str, float]) -> float | None:
    """Submission to completion or cancellation; to ``now`` while active; None if a
    cancelled job's cancellation time is unknown."""
    end = now if job.active else finished_at(job, cancelled_at)
    return None if end is None else max(0.0, end - job.submitted_at)


def job_doc(state: SchedulerState, job_id: str, *, now: float,
            cancelled_at: Mapping[str, float] | None = None, training: TrainingLog | None = None) -> dict[str, Any]:
    """The JSON document of one job; :class:`UsageError` if the log has no such job.

    Times are unix seconds (floats), durations seconds; ``waiting`` is null unless the
    job is active and waits (or is stuck); ``stuck`` is null unless the job made no
    consolidated progress for several rounds, and then says why; ``steps`` counts what
    copies reported since the last model too, ``consolidated_steps`` only what models hold;
    ``gpus`` maps GPU type to count in its last round. With
    ``training``: ``loss`` (``{"round", "value"}``, the newest round's copies' last reported
    training loss, averaged) and ``metric`` (``{"round", "name", "value"}``, the latest
    model's held-out metric), each null until reported. ``final_evaluation``: for a completed
    job of user code, how its final model's evaluation copy went
    (:mod:`services.scheduler.live.evaluations`): ``{"state": "pending" | "measured" |
    "given up", "tries", "metric": {"name", "value"} | null, "failure": str | null}``; null
    otherwise (the tracker evaluates zoo models).
    """
    job = state.jobs.get(job_id)
    if job is None:
        raise UsageError(f"job: no job {job_id!r}")
    cancels = cancelled_at or {}
    elapsed = elapsed_s(job, now, cancels)
    return {
        "job": job.spec.job_id, "user": job.spec.user, "state": job.state, "model": job.spec.model,
        "dataset": job.spec.dataset, "workers": job.spec.workers, "iterations": job.spec.iterations,
        "priority": job.spec.priority, "steps": job.progress_steps(), "consolidated_steps": job.steps_done,
        "submitted_at": job.submitted_at, "finished_at": finished_at(job, cancels),
        "elapsed_s": None if elapsed is None else round(elapsed, 3),
        "last_round": job.last_round, "gpus": _gpus(state, job), "waiting": waiting_reason(state, job),
        "stuck": stuck_reason(job),
        "rounds_run": job.rounds_run, "attained_gpu_s": round(job.attained_gpu_s, 1),
        "latest_model": job.model_key, "final_model": job.final_key,
        "jct_s": None if job.completed_at is None else round(job.completed_at - job.submitted_at, 3),
        "queue": job_queue_doc(state, job, now), "final_evaluation": final_evaluation_doc(job),
        **((training or TrainingLog()).latest(job_id)),
    }


def final_evaluation_doc(job: JobRecord) -> dict[str, Any] | None:
    """How a completed user-code job's final model was measured (see :func:`job_doc`)."""
    if job.completed_at is None or job.spec.code is None:
        return None
    return {"state": job.final_evaluation, "tries": job.evaluations,
            "metric": None if job.final_metric is None else {"name": job.final_metric_name, "value": job.final_metric},
            "failure": job.evaluation_failure or None}


def select_jobs(state: SchedulerState, *, include_done: bool, states: Collection[str] = (),
                user: str | None = None, since: float | None = None) -> list[JobRecord]:
    """Jobs in submission order (ties by id). ``states`` (any of :data:`JOB_STATES`)
    overrides ``include_done``; ``user`` matches exactly; ``since``: submitted at or after."""
    picked = []
    for job in sorted(state.jobs.values(), key=lambda j: (j.submitted_at, j.spec.job_id)):
        if states:
            if job.state not in states:
                continue
        elif not include_done and not job.active:
            continue
        if user is not None and job.spec.user != user:
            continue
        if since is not None and job.submitted_at < since:
            continue
        picked.append(job)
    return picked


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _utc_minute(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%MZ")


def jobs_table(state: SchedulerState, *, include_done: bool, now: float | None = None,
               cancelled_at: Mapping[str, float] | None = None, jobs: list[JobRecord] | None = None) -> str:
    """The ``hadar jobs`` table: ``jobs`` (default: :func:`select_jobs` with ``include_done``).
    PROGRESS is consolidated progress (what the job's models hold); a stuck job's state is
    ``stuck`` and its reason is in the last column.

    ``now`` defaults to the latest submission or completion in the log, so elapsed times
    of a replayed or simulated log stay meaningful.
    """
    picked = select_jobs(state, include_done=include_done) if jobs is None else jobs
    if now is None:
        now = max((t for j in state.jobs.values() for t in (j.submitted_at, j.completed_at) if t is not None),
                  default=0.0)
    cancels = cancelled_at or {}
    config = state.queues
    teams = ("QUEUE", "POS") if config is not None else ()
    rows: list[tuple[str, ...]] = [("JOB", "USER", *teams, "STATE", "PROGRESS", "GPUS", "ROUND", "SUBMITTED",
                                    "ELAPSED", "WAITING")]
    for job in picked:
        gpus = _gpus(state, job)
        pct = 100.0 * min(job.steps_done, job.spec.iterations) / job.spec.iterations
        place: tuple[str, ...] = ()
        if config is not None:
            name = queue_of(config, job)
            ids = [j.spec.job_id for j in queue_jobs(state, config, name)]
            place = (name, f"{ids.index(job.spec.job_id) + 1}/{len(ids)}" if job.spec.job_id in ids else "-")
        rows.append((job.spec.job_id, job.spec.user, *place, job.state, f"{pct:5.1f}%",
                     ",".join(f"{t}x{n}" for t, n in sorted(gpus.items())) or "-",
                     "-" if job.last_round is None else str(job.last_round), _utc_minute(job.submitted_at),
                     format_duration(elapsed_s(job, now, cancels)), waiting_reason(state, job) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def parse_since(text: str, now: float) -> float:
    """``--since``: a duration back from ``now`` (``90s``, ``30m``, ``2h``, ``1d``), unix
    seconds, or an ISO-8601 time (UTC unless it names a zone)."""
    m = _DURATION.match(text.strip())
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    when = parse_instant(text)
    if when is None:
        raise UsageError(f"--since: {text!r} is neither a duration (30m, 2h, 1d), unix seconds "
                         "nor an ISO-8601 time")
    return when


def parse_instant(text: str) -> float | None:
    """Unix seconds from ``text``: a number, or an ISO-8601 time (UTC unless it names a
    zone); None if it is neither."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def progress_line(job: JobRecord, rate: float, width: int = 30, waiting: str | None = None) -> str:
    """One line: bar, percent, consolidated steps, rate, ETA and state (with the waiting
    or stuck reason, if any)."""
    done = min(job.steps_done, job.spec.iterations)
    frac = done / job.spec.iterations
    bar = "#" * int(frac * width)
    eta_text = f"{(job.spec.iterations - done) / rate:5.0f}s" if rate > 0 else "--"
    state = f"{job.state}: {waiting}" if waiting else job.state
    return (f"{job.spec.job_id} [{bar:<{width}}] {100 * frac:5.1f}% {done}/{job.spec.iterations} steps "
            f"{rate:7.1f} steps/s ETA {eta_text} ({state})")
