"""A scripted cluster around a live scheduler: what agents, profiler and tracker would
publish between its rounds, without running any of them. For restart tests and
``benchmarks/recovery.py``, which need long, realistic histories quickly.

:class:`ScriptedCluster` publishes before each round: the nodes' registrations (round 0)
and heartbeats, a new job every ``job_every`` rounds (with the profiler's estimates for
every worker count up to its W), and for every job that ran in the previous round the
tracker's ModelConsolidated (each copy credited ``steps_per_copy`` job steps), then
JobCompleted once the job's iterations are reached. Everything is a function of the round
number and of the scheduler's own Assignments, and times come from the clock passed in, so
two schedulers that decide the same receive the same inputs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from shared.bus import Bus
from shared.clock import Clock
from shared.domain.layout import final_key, model_key
from shared.wire.events import (
    Assignment,
    CopyWeight,
    GpuInfo,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    NodeHeartbeat,
    NodeRegistered,
    ThroughputEstimate,
)

__all__ = ["ScriptedCluster", "DEFAULT_NODES"]

DEFAULT_NODES: tuple[tuple[str, str, int], ...] = (("n1", "v100", 2), ("n2", "t4", 2), ("n3", "k80", 4))
_SPEED = {"v100": 10.0, "t4": 4.0, "k80": 2.0}


@dataclass(kw_only=True)
class ScriptedCluster:
    bus: Bus
    clock: Clock
    nodes: tuple[tuple[str, str, int], ...] = DEFAULT_NODES
    job_every: int = 3
    steps_per_copy: int = 40
    queues: tuple[str, ...] = ()           # jobs go to these team queues in turn ("": the default queue)
    published: int = 0                     # input records published so far
    _done: dict[str, int] = field(default_factory=dict)
    _specs: dict[str, JobSpec] = field(default_factory=dict)
    _finished: set[str] = field(default_factory=set)

    async def _emit(self, event) -> None:
        await self.bus.publish(event)
        self.published += 1

    async def before_round(self, r: int, ran: list[Assignment]) -> None:
        """Publish what the cluster reports before round ``r``; ``ran``: round r-1's Assignments."""
        now = self.clock.time()
        if r == 0:
            for node_id, gpu_type, count in self.nodes:
                gpus = tuple(GpuInfo(index=i, type=gpu_type) for i in range(count))
                await self._emit(NodeRegistered(ts=now, source="agent", node_id=node_id, gpus=gpus))
        for node_id, _, _ in self.nodes:
            await self._emit(NodeHeartbeat(ts=now, source="agent", node_id=node_id, seq=r))
        if r % self.job_every == 0:
            await self._submit(r, now)
        copies: dict[str, set[int]] = defaultdict(set)
        for a in ran:
            copies[a.job_id].add(a.copy)
        for job_id in sorted(copies):
            if job_id in self._finished or job_id not in self._specs:
                continue
            spec = self._specs[job_id]
            done = min(spec.iterations, self._done.get(job_id, 0) + self.steps_per_copy * len(copies[job_id]))
            self._done[job_id] = done
            n = len(copies[job_id])
            weights = tuple(CopyWeight(copy=c, steps=self.steps_per_copy, weight=1.0 / n)
                            for c in sorted(copies[job_id]))
            await self._emit(ModelConsolidated(ts=now, source="tracker", job_id=job_id, round=r - 1,
                                               key=model_key(job_id, r - 1), total_steps=done, copies=weights))
            if done >= spec.iterations:
                self._finished.add(job_id)
                await self._emit(JobCompleted(ts=now, source="tracker", job_id=job_id, final_key=final_key(job_id),
                                              total_steps=done, jct_s=0.0, completed_at=now))

    async def _submit(self, r: int, now: float) -> None:
        job_id = f"job-{r}"
        workers = 1 + (r // self.job_every) % 2
        queue = self.queues[(r // self.job_every) % len(self.queues)] if self.queues else ""
        spec = JobSpec(job_id=job_id, user="bench", model="resnet", dataset="digits", batch_size=32,
                       workers=workers, iterations=120 + 40 * (r % 7), queue=queue)
        self._specs[job_id] = spec
        await self._emit(JobSubmitted(ts=now, source="cli", job=spec, submitted_at=now))
        factor = 1.0 + (r % 5) / 10
        for w in range(1, workers + 1):
            rates = {t: round(s * factor, 3) for t, s in _SPEED.items()}
            await self._emit(ThroughputEstimate(ts=now, source="profiler", job_id=job_id, basis="estimate",
                                                workers=w, rates=rates))
