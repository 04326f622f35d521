"""Per-policy results of a simulated run (a ``SimResult``; docs/architecture.md "Simulator
and metrics").

* TTD: first arrival to last completion; None if some job did not complete (the run
  never drained the trace, so it has no drain time). ``unfinished`` then lists each such
  job, whether it was ever placed, and why: the last wait reason the policy gave
  ("code: detail"), or, for a job that ran, the run's stop reason.
* CRU: busy GPU-seconds / (GPUs in the cluster x span); GRU: the same per GPU type. The
  span is TTD, or, if some job did not complete, first arrival to the end of the last
  simulated round. Busy time is as simulator.py defines it (held from round start to
  completion or round end).
* JCT (completion - arrival): mean, median, p95 (linear interpolation), completed jobs only.
* Queueing delay: start of the first round a job was placed in - arrival; mean over jobs
  that were ever placed.
* Finish-time fairness: JCT / isolated JCT, where isolated JCT = total_steps / max over the
  cluster's GPU types with at least W GPUs of ``throughput.rate(job_type, type, W)`` -- the
  job alone on its best type, no round quantisation, node boundaries ignored. Jobs with no
  such type (or only zero rates) are left out of the mean.
* Decision time: p50 and max of the per-round plan() time, ms.
Undefined values (no completed job, TTD 0) are None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.sim.simulator import JobRecord, SimResult


@dataclass(frozen=True, kw_only=True)
class UnfinishedJob:
    job_id: str
    placed: bool      # ever placed in a round
    reason: str


@dataclass(frozen=True, kw_only=True)
class PolicyResults:
    ttd_s: float | None
    cru: float | None
    gru: Mapping[str, float | None]
    jct_mean_s: float | None
    jct_median_s: float | None
    jct_p95_s: float | None
    queue_delay_mean_s: float | None
    ftf_mean: float | None
    decision_ms_p50: float | None
    decision_ms_max: float | None
    jobs_total: int
    jobs_completed: int
    stop_reason: str                        # SimResult.stop_reason
    unfinished: tuple[UnfinishedJob, ...]   # jobs that did not complete, in trace order

    def as_dict(self) -> dict:
        out = asdict(self)
        out["gru"] = dict(self.gru)
        out["unfinished"] = [{"job": u.job_id, "placed": u.placed, "reason": u.reason} for u in self.unfinished]
        return out


def isolated_jct_s(job: JobRecord, cluster: Cluster, throughput: ThroughputModel) -> float | None:
    rates = [throughput.rate(job.job_type, gpu_type, job.workers)
             for gpu_type, count in cluster.gpus_by_type.items() if count >= job.workers]
    best = max(rates, default=0.0)
    return job.total_steps / best if best > 0 else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def span_s(result: SimResult) -> float:
    """First arrival to the last completion, or to the end of the run if a job is left."""
    if not result.jobs:
        return 0.0
    first = min(j.arrival_s for j in result.jobs)
    completions = [j.completion_s for j in result.jobs]
    if all(c is not None for c in completions):
        last = max(c for c in completions if c is not None)
    else:
        last = result.end_s
    return max(0.0, last - first)


def ttd_s(result: SimResult) -> float | None:
    return span_s(result) if all(j.completion_s is not None for j in result.jobs) else None


def unfinished_jobs(result: SimResult) -> tuple[UnfinishedJob, ...]:
    out = []
    for job in result.jobs:
        if job.completion_s is not None:
            continue
        if job.first_start_s is None:
            reason = job.last_wait or f"not yet active when the run stopped ({result.stop_reason})"
        else:
            reason = f"ran, unfinished when the run stopped ({result.stop_reason})"
        out.append(UnfinishedJob(job_id=job.job_id, placed=job.first_start_s is not None, reason=reason))
    return tuple(out)


def compute_results(result: SimResult, throughput: ThroughputModel) -> PolicyResults:
    cluster = result.cluster
    span = span_s(result)
    busy_by_type: dict[str, float] = dict.fromkeys(cluster.types, 0.0)
    for rnd in result.rounds:
        for gpu_type, gpu_s in rnd.busy_gpu_s.items():
            busy_by_type[gpu_type] += gpu_s
    total_busy = sum(busy_by_type.values())
    cru = total_busy / (cluster.total_gpus * span) if span > 0 else None
    gru = {t: (busy_by_type[t] / (count * span) if span > 0 else None) for t, count in cluster.gpus_by_type.items()}

    done = [j for j in result.jobs if j.completion_s is not None]
    jcts = [j.completion_s - j.arrival_s for j in done if j.completion_s is not None]
    delays = [j.first_start_s - j.arrival_s for j in result.jobs if j.first_start_s is not None]
    ftfs = []
    for job in done:
        isolated = isolated_jct_s(job, cluster, throughput)
        if isolated is not None and job.completion_s is not None:
            ftfs.append((job.completion_s - job.arrival_s) / isolated)
    decisions = [r.decision_ms for r in result.rounds]
    return PolicyResults(
        ttd_s=ttd_s(result), cru=cru, gru=gru,
        jct_mean_s=_mean(jcts), jct_median_s=_percentile(jcts, 50), jct_p95_s=_percentile(jcts, 95),
        queue_delay_mean_s=_mean(delays), ftf_mean=_mean(ftfs),
        decision_ms_p50=_percentile(decisions, 50), decision_ms_max=max(decisions, default=None),
        jobs_total=len(result.jobs), jobs_completed=len(done), stop_reason=result.stop_reason,
        unfinished=unfinished_jobs(result),
    )


def utilization_series(result: SimResult) -> tuple[np.ndarray, np.ndarray]:
    """(round start times relative to the first round, busy fraction of the cluster) for every
    round from the first simulated one to the last, skipped rounds as 0."""
    if not result.rounds:
        return np.zeros(0), np.zeros(0)
    first, last = result.rounds[0].round, result.rounds[-1].round
    util = np.zeros(last - first + 1)
    capacity = result.cluster.total_gpus * result.round_s
    for rnd in result.rounds:
        util[rnd.round - first] = sum(rnd.busy_gpu_s.values()) / capacity
    return np.arange(last - first + 1) * result.round_s, util


def completed_jcts_s(result: SimResult) -> list[float]:
    return sorted(j.completion_s - j.arrival_s for j in result.jobs if j.completion_s is not None)
