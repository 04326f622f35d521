"""The profiler's bookkeeping: measured steps/s per (job, GPU type, workers), smoothed.

Pure: Progress events in, "publish this rate" decisions out; no I/O, no clock.

* A sample is a copy's steps/s: from two successive Progress events of the same copy on
  the same node in the same round, ``(steps_round' - steps_round) / (ts' - ts)``; for the
  first Progress of a copy-round, ``samples_per_s / (batch_size x workers)`` when the
  job's batch size is known and the rate is positive: one step of a copy on ``workers``
  GPUs trains a per-worker batch on each (the agent reports samples/s of the whole copy),
  so both samples are a copy's own steps/s, the unit of ThroughputEstimate. An event that is not newer than the last
  one seen for its copy (a repeat, or out of order) gives no sample.
* A sample is kept only if it is finite and at most ``MAX_RATE``, from reports at least
  ``MIN_INTERVAL_S`` apart: timestamps a denormal apart or a forged ``samples_per_s``
  must not turn into an infinite or absurd rate that the scheduler would plan with.
* Each key ``(job, gpu_type, workers)`` keeps an EWMA: ``v <- alpha * x + (1 - alpha) * v``,
  starting at the first sample.
* A rate is to be published when the key has none published yet, or the EWMA differs from
  the last published value by more than ``threshold`` (5%) of it.
* Nodes (NodeRegistered, the latest per node): a GPU type is *emulated* when every node
  that offers it is emulated (:meth:`ProfilerState.emulated_types`, with the reference its
  slowdowns are relative to); one real GPU of the type makes it real.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.persistence.codec import snapshot_type
from shared.wire.events import JobSpec, NodeRegistered, Progress, ThroughputEstimate

__all__ = ["MeasuredUpdate", "ProfilerState", "RateKey", "DEFAULT_ALPHA", "DEFAULT_THRESHOLD",
           "MAX_RATE", "MIN_INTERVAL_S"]

DEFAULT_ALPHA = 0.3
DEFAULT_THRESHOLD = 0.05
MAX_RATE = 1e6          # steps/s: three orders above the fastest job the zoo can build on an H100
MIN_INTERVAL_S = 1e-3   # reports closer than this give no sample

RateKey = tuple[str, str, int]  # (job_id, gpu_type, workers)


@dataclass(frozen=True, kw_only=True)
class MeasuredUpdate:
    """A measured rate to publish: whole-copy steps/s of ``workers`` GPUs of ``gpu_type``."""

    job_id: str
    gpu_type: str
    workers: int
    rate: float
    emulated: bool
    emulation_reference: str = ""   # of the Progress that moved the rate ("" = catalog default)


@snapshot_type("profiler.LastReport", formerly="services.profiler.state._Last")
@dataclass(frozen=True, kw_only=True)
class _Last:
    ts: float
    steps: int


@snapshot_type("profiler.ProfilerState", formerly="services.profiler.state.ProfilerState")
class ProfilerState:
    """EWMA of measured rates and what was last published; see the module docstring."""

    def __init__(self, *, alpha: float = DEFAULT_ALPHA, threshold: float = DEFAULT_THRESHOLD) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        self.alpha = alpha
        self.threshold = threshold
        self._specs: dict[str, JobSpec] = {}
        self._estimated: set[str] = set()
        self._last: dict[tuple[str, int, int, str], _Last] = {}   # (job, round, copy, node)
        self._ewma: dict[RateKey, float] = {}
        self._published: dict[RateKey, float] = {}
        self._nodes: dict[str, tuple[tuple[str, ...], bool, str]] = {}   # node -> (GPU types, emulated, reference)

    def fill_added_attributes(self) -> None:
        """Give a state restored from an older snapshot what later versions added (the nodes)."""
        self.__dict__.setdefault("_nodes", {})

    # ------------------------------------------------------------------ nodes

    def add_node(self, event: NodeRegistered) -> None:
        """Remember a node's GPU types and whether they are emulated (its latest registration)."""
        self._nodes[event.node_id] = (tuple(sorted({g.type for g in event.gpus})), event.emulated,
                                      event.emulation_reference)

    def emulated_types(self) -> dict[str, str]:
        """``{gpu_type: emulation reference}`` of the types that only emulated nodes offer."""
        real = {t for types, emulated, _ in self._nodes.values() if not emulated for t in types}
        return {t: reference for types, emulated, reference in self._nodes.values() if emulated
                for t in types if t not in real}

    # ------------------------------------------------------------------ jobs

    def add_job(self, spec: JobSpec) -> bool:
        """Remember a submitted job; True if it still needs its catalog estimate."""
        self._specs.setdefault(spec.job_id, spec)
        return spec.job_id not in self._estimated

    def spec(self, job_id: str) -> JobSpec | None:
        """The spec of a job submitted and not finished (None otherwise)."""
        return self._specs.get(job_id)

    def mark_estimated(self, job_id: str) -> None:
        self._estimated.add(job_id)

    def forget_job(self, job_id: str) -> None:
        """Drop a finished or cancelled job's copy positions (its rates stay known)."""
        self._specs.pop(job_id, None)
        for key in [k for k in self._last if k[0] == job_id]:
            del self._last[key]

    def seed(self, estimate: ThroughputEstimate) -> None:
        """Fold an estimate already on hadar.throughput (replay after a restart)."""
        if estimate.basis == "estimate":
            self._estimated.add(estimate.job_id)
            return
        for gpu_type, rate in estimate.rates.items():
            key = (estimate.job_id, gpu_type, estimate.workers)
            self._ewma[key] = self._published[key] = rate

    # ------------------------------------------------------------------ measurements

    def observe(self, progress: Progress) -> MeasuredUpdate | None:
        """Fold one Progress; a MeasuredUpdate when the smoothed rate should be published."""
        sample = self._sample(progress)
        if sample is None:
            return None
        key = (progress.job_id, progress.gpu_type, progress.workers)
        previous = self._ewma.get(key)
        value = sample if previous is None else self.alpha * sample + (1 - self.alpha) * previous
        self._ewma[key] = value
        published = self._published.get(key)
        if published is not None and abs(value - published) <= self.threshold * published:
            return None
        self._published[key] = value
        return MeasuredUpdate(job_id=progress.job_id, gpu_type=progress.gpu_type,
                              workers=progress.workers, rate=value, emulated=progress.emulated,
                              emulation_reference=progress.emulation_reference)

    def _sample(self, p: Progress) -> float | None:
        copy_key = (p.job_id, p.round, p.copy, p.node_id)
        last = self._last.get(copy_key)
        if last is not None and p.ts <= last.ts:
            return None  # a repeat or an older report
        self._last[copy_key] = _Last(ts=p.ts, steps=p.steps_round)
        for stale in [k for k in self._last if k[0] == p.job_id and k[1] < p.round]:
            del self._last[stale]
        sample = None
        if last is not None and p.steps_round >= last.steps:
            if p.ts - last.ts >= MIN_INTERVAL_S:
                sample = (p.steps_round - last.steps) / (p.ts - last.ts)
        else:
            spec = self._specs.get(p.job_id)
            if last is None and spec is not None and p.samples_per_s > 0:
                sample = p.samples_per_s / (spec.batch_size * p.workers)
        if sample is None or not (math.isfinite(sample) and sample <= MAX_RATE):
            return None
        return sample

    def rate(self, job_id: str, gpu_type: str, workers: int) -> float | None:
        """The current smoothed rate of a key, if measured."""
        return self._ewma.get((job_id, gpu_type, workers))
