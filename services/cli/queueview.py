"""How the CLI shows team queues: pure functions of a folded log and the time ``now``.

The standings are what the scheduler published with its latest round (``RoundStarted.queues``),
not a recomputation. A job's place in its queue follows the mechanism's queue order
(``services/scheduler/core/queues.queue_order``: priority class, then arrival, then id).

Estimated start (:func:`estimated_start`), from the current plan: a job the latest round
placed starts now; else the queue has ``free`` GPUs now (entitled minus used) and the jobs
it runs free theirs as they finish, each at ``now + remaining steps / its current rate``
(the rate the scheduler holds for it on the GPUs it runs on); the estimate is when the
freed GPUs first cover this job's W plus the W of the waiting jobs ahead of it. None when
a rate is missing or the queue could never cover it from its running jobs alone (it then
depends on other queues' use and on arrivals).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from services.scheduler.live.records import JobRecord
from services.scheduler.live.state import SchedulerState
from shared.wire.queues import QueueConfig, QueueStanding

__all__ = ["standings", "queue_of", "queue_jobs", "job_queue_doc", "estimated_start", "queues_doc",
           "queues_table", "reclaim_reason"]


def standings(state: SchedulerState) -> dict[str, QueueStanding]:
    """Each queue's standing in the latest round (empty before a round under queues)."""
    record = state.rounds.get(state.last_round)
    return {s.name: s for s in record.started.queues} if record is not None else {}


def queue_of(config: QueueConfig, job: JobRecord) -> str:
    return config.queue_of(job.spec.queue)


def queue_jobs(state: SchedulerState, config: QueueConfig, name: str) -> list[JobRecord]:
    """The queue's active jobs in queue order."""
    jobs = [j for j in state.active_jobs() if queue_of(config, j) == name]
    return sorted(jobs, key=lambda j: (-j.spec.priority_class, j.submitted_at, j.spec.job_id))


def _running(state: SchedulerState) -> dict[str, tuple[str, int]]:
    """Jobs the latest round placed: job id -> (GPU type of copy 0, GPUs in all)."""
    record = state.rounds.get(state.last_round)
    out: dict[str, tuple[str, int]] = {}
    for a in record.assignments if record is not None else ():
        gpu_type, n = out.get(a.job_id, (a.gpu_type, 0))
        out[a.job_id] = (gpu_type, n + len(a.gpus))
    return out


def _eta(state: SchedulerState, job: JobRecord, gpu_type: str, now: float) -> float | None:
    found = state.rates.get((job.spec.job_id, gpu_type, job.spec.workers))
    if found is None or found[1] <= 0:
        return None
    return now + max(0, job.spec.iterations - job.steps_done) / found[1]


def estimated_start(state: SchedulerState, config: QueueConfig, job: JobRecord, now: float) -> float | None:
    """When ``job`` may start (module docstring); ``now`` if the latest round runs it."""
    running = _running(state)
    if job.spec.job_id in running:
        return now
    name = queue_of(config, job)
    standing = standings(state).get(name)
    if standing is None:
        return None
    members = queue_jobs(state, config, name)
    ahead = members[:next(i for i, j in enumerate(members) if j.spec.job_id == job.spec.job_id)]
    need = job.spec.workers + sum(j.spec.workers for j in ahead if j.spec.job_id not in running)
    free = sum(standing.entitled.values()) - sum(standing.used.values())
    if free >= need:
        record = state.rounds.get(state.last_round)
        return record.started.ends_at if record is not None else now
    finishing = []
    for j in members:
        if j.spec.job_id in running:
            gpu_type, gpus = running[j.spec.job_id]
            eta = _eta(state, j, gpu_type, now)
            if eta is None:
                return None
            finishing.append((eta, gpus))
    for eta, gpus in sorted(finishing):
        free += gpus
        if free >= need:
            return eta
    return None


def reclaim_reason(state: SchedulerState, config: QueueConfig, job: JobRecord) -> str | None:
    """For a job submitted after the latest round: whether its queue gets GPUs back from
    borrowers at the next round (``waiting for reclaim: ...``), else None."""
    record = state.rounds.get(state.last_round)
    if record is None or job.submitted_at <= record.started.started_at or job.last_round is not None:
        return None
    name = queue_of(config, job)
    spec, mine = config.queue(name), standings(state).get(name)
    if spec is None or mine is None or sum(mine.entitled.values()) >= spec.nominal:
        return None
    borrowed = [s.name for s in standings(state).values() if s.borrowed > 0]
    if not borrowed:
        return None
    return (f"waiting for reclaim: {', '.join(sorted(borrowed))} borrow GPUs; {name}'s quota comes back "
            "at the next round")


def job_queue_doc(state: SchedulerState, job: JobRecord, now: float) -> dict[str, Any] | None:
    """The ``queue`` part of a job's JSON document (None without queues)."""
    config = state.queues
    if config is None:
        return None
    name = queue_of(config, job)
    members = queue_jobs(state, config, name)
    ids = [j.spec.job_id for j in members]
    running = _running(state)
    position = ids.index(job.spec.job_id) + 1 if job.spec.job_id in ids else None
    ahead = [{"job": j.spec.job_id, "state": "running" if j.spec.job_id in running else "waiting",
              "gpus": running.get(j.spec.job_id, ("", j.spec.workers))[1], "priority_class": j.spec.priority_class}
             for j in members[:(position or 1) - 1]]
    start = estimated_start(state, config, job, now) if job.active else None
    return {"name": name, "known": config.queue(name) is not None, "priority_class": job.spec.priority_class,
            "position": position, "of": len(members), "ahead": ahead,
            "estimated_start": None if start is None else round(start, 1)}


def queues_doc(state: SchedulerState) -> dict[str, Any]:
    """``hadar queues --json``: the queues in force and each one's latest standing."""
    config = state.queues
    if config is None:
        return {"queues": [], "default_queue": None}
    now_standing = standings(state)
    pending: dict[str, int] = defaultdict(int)
    for job in state.active_jobs():
        pending[queue_of(config, job)] += 1
    out = []
    for q in config.queues:
        s = now_standing.get(q.name) or QueueStanding(name=q.name)
        out.append({"name": q.name, "weight": q.weight, "quota": dict(q.quota), "borrowing_limit": q.borrowing_limit,
                    "user_max_gpus": q.user_max_gpus, "user_max_queued": q.user_max_queued,
                    "entitled": dict(s.entitled), "used": dict(s.used), "borrowed": s.borrowed, "lent": s.lent,
                    "usage_gpu_s": round(s.usage, 1), "fair_share": round(s.usage / q.weight, 1),
                    "running": s.running, "pending": s.pending, "active_jobs": pending.get(q.name, 0)})
    return {"queues": out, "default_queue": config.default_queue,
            "fair_share_half_life_s": config.fair_share_half_life_s, "round": state.last_round}


def _gpu_hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} GPU-h"


def _counts(counts: dict[str, int]) -> str:
    return ",".join(f"{t}:{n}" for t, n in sorted(counts.items()) if n) or "-"


def queues_table(state: SchedulerState) -> str:
    """``hadar queues``: one line per queue (fair share: decayed usage over weight, lower first)."""
    doc = queues_doc(state)
    if not doc["queues"]:
        return "no queues applied (every job competes with every other; see hadar queues apply)"
    rows = [("QUEUE", "WEIGHT", "QUOTA", "ENTITLED", "USED", "BORROWED", "LENT", "RUNNING", "PENDING", "FAIR SHARE")]
    for q in doc["queues"]:
        rows.append((q["name"] + (" (default)" if q["name"] == doc["default_queue"] else ""), f"{q['weight']:g}",
                     _counts(q["quota"]), _counts(q["entitled"]), _counts(q["used"]), str(q["borrowed"]),
                     str(q["lent"]), str(q["running"]), str(q["pending"]), _gpu_hours(q["fair_share"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
