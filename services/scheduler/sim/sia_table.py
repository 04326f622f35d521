"""A throughput table from Sia's measured step times, used exactly like Gavel's.

``build_sia_throughput()`` returns a :class:`ProfiledThroughputModel`: a
``services.scheduler.core.throughput.ThroughputModel`` whose job types are
``"<application> (batch size B, W=W)"`` -- the global batch B over W replicas, both fixed:
jobs are rigid, as the workload rows give them -- for every validated batch of the five
applications, on the GPU types ``t4`` (Sia's ``aws``), ``rtx2080ti`` (``rtx``) and ``a100``
(``dgx-ext``).

Unit, as everywhere in Hadar: a copy's own optimizer steps per second. On ``n = W`` GPUs one
step is one iteration of the global batch B. A copy on ``n != W`` GPUs (HadarE forks a gang
into copies, one per node) keeps the gang's per-GPU work, as the live system keeps the
per-worker batch (``shared.domain.progress``): each GPU runs the gang's passes (Sia's atomic
batch and accumulation steps for B on W GPUs of that type, packed), so one of its steps trains
``n / W`` of B and the simulator credits it ``n / W`` job steps. Rule (``sia_profiles`` for the
step times, whose docstring states where each comes from):

* ``rate(job, type, n)``: ``1 / seconds(packed)`` with ``packed`` the ``n`` GPUs on as few
  nodes of that type's profile size as possible (4 per T4 node, 8 per RTX 2080 Ti or A100
  node); at ``n = W`` what Sia's Gavel predicts for a job's gang. ``seconds(shape)``: at
  ``n = W`` Sia's ``iteration(shape, B)``; otherwise the gang's per-GPU passes timed on
  ``shape`` (``step + accum x (step - sync)`` at the gang's atomic batch). 0 where the
  profiles cannot say (outside the measured batches or shapes) or beyond the profiled nodes
  (16 aws, 3 rtx, 2 dgx-ext). No fallback to another worker count or estimator.
* ``placement_rate(job, parts)``: the placement's own shape, one replica count per node in
  the order the parts name the nodes: ``1 / seconds(shape)``, so 4 GPUs as 2 + 2 on two nodes
  pay the measured cross-node synchronisation (``step_time + sync_time`` of that placement
  row) and 4 on one node do not. A copy mixing GPU types runs at the slowest type's rate for
  that shape (synchronous data parallelism). A shape across nodes the profiles cannot
  describe (outside the measured hull, or more nodes than were profiled) runs at the packed
  rate times ``default_cross_node`` (0.8, as ``ThroughputModel``'s own default), so a
  placement the packed rate allows never stalls. ``cross_node=False`` ignores the shape
  (always the packed rate).
* ``cross_node_factor(job, types, n)``, what planners (Hadar's spread options) multiply
  ``rate`` by for a copy that spans nodes: 1 where ``n`` is above a type's node size (its
  ``rate`` already is the packed placement across nodes; 0.8 on top charged the spanning
  twice), else the slower two-node shape's rate over one node's; the smallest over
  ``types``. A placement on more nodes than that may step slower (the planner's drift
  check re-plans it).

Work per job is ``sia_work.total_steps``; Sia's calibration slowdown is charged there, not here,
so these rates are the measured ones.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.scheduler.core.throughput import Part, ThroughputModel
from services.scheduler.sim.sia_profiles import (
    APPLICATIONS,
    CLUSTER_GPU_TYPE,
    GPUS_PER_NODE,
    MAX_INTERPOLATED_NODES,
    AppProfile,
    packed_placement,
)
from services.scheduler.sim.sia_work import validated_batches

JOB_TYPE_RE = re.compile(r"^(?P<app>[a-z0-9]+) \(batch size (?P<batch>[1-9]\d*), W=(?P<replicas>[1-9]\d*)\)$")
# Profiled physical nodes per Sia cluster (simulator_config.cluster_max_physical_nnodes).
PROFILED_NODES = {"aws": MAX_INTERPOLATED_NODES, "rtx": 3, "dgx-ext": 2}


@dataclass(frozen=True, kw_only=True)
class SiaJobType:
    """What a job type of this table names: an application, its global batch, its replicas."""

    application: str
    batch: int
    replicas: int


def job_type_name(application: str, batch: int, replicas: int) -> str:
    return f"{application} (batch size {batch}, W={replicas})"


def parse_job_type(job_type: str) -> SiaJobType | None:
    m = JOB_TYPE_RE.match(job_type)
    if m is None or m["app"] not in APPLICATIONS:
        return None
    return SiaJobType(application=m["app"], batch=int(m["batch"]), replicas=int(m["replicas"]))


@dataclass(frozen=True, kw_only=True)
class ProfiledThroughputModel(ThroughputModel):
    """Gavel-table interface over Sia's profiles (module docstring); immutable apart from a memo.

    ``rates`` holds only overrides (measurements, ``with_rates``); every other rate is derived
    from the profiles on first use and memoised.
    """

    profiles: Mapping[tuple[str, str], AppProfile] = field(default_factory=dict)  # (application, gpu type)
    batch_range: Mapping[str, tuple[int, int]] = field(default_factory=dict)      # application -> (min, max)
    profiled_gpus: Mapping[str, tuple[int, int]] = field(default_factory=dict)    # gpu type -> (per node, nodes)
    _shape_rates: dict[tuple[str, str, tuple[int, ...]], float] = field(
        init=False, repr=False, compare=False, default_factory=dict)

    @property
    def job_types(self) -> tuple[str, ...]:
        most = max(size * nodes for size, nodes in self.profiled_gpus.values())
        return tuple(sorted(job_type_name(app, batch, replicas) for app in self.batch_range
                            for batch in validated_batches(app) for replicas in range(1, most + 1)))

    def scales(self, job_type: str, gpu_type: str) -> tuple[int, ...]:
        if parse_job_type(job_type) is None or gpu_type not in self.profiled_gpus:
            return ()
        size, nodes = self.profiled_gpus[gpu_type]
        return tuple(range(1, size * nodes + 1))

    def rate(self, job_type: str, gpu_type: str, n: int) -> float:
        measured = self.rates.get((job_type, gpu_type, n))
        if measured is not None:
            return measured
        size, nodes = self.profiled_gpus.get(gpu_type, (0, 0))
        if not 0 < n <= size * nodes:
            return 0.0
        return self.shape_rate(job_type, gpu_type, packed_placement(n, size))

    def shape_rate(self, job_type: str, gpu_type: str, shape: tuple[int, ...]) -> float:
        """Steps/s of ``job_type`` on GPUs of ``gpu_type`` laid out as ``shape`` (per-node counts)."""
        key = (job_type, gpu_type, shape)
        cached = self._shape_rates.get(key)
        if cached is not None:
            return cached
        job = parse_job_type(job_type)
        profile = self.profiles.get((job.application, gpu_type)) if job else None
        value = 0.0
        if job is not None and profile is not None:
            seconds = (self._seconds(job, gpu_type, profile, shape)
                       if len(shape) <= self.profiled_gpus[gpu_type][1] else None)
            if seconds is not None:
                value = 1.0 / seconds
            elif len(shape) > 1:   # a shape the data cannot describe: the packed rate, slowed
                value = self.rate(job_type, gpu_type, sum(shape)) * self.default_cross_node
        self._shape_rates[key] = value
        return value

    def _seconds(self, job: SiaJobType, gpu_type: str, profile: AppProfile, shape: tuple[int, ...], *,
                 use_rows: bool = True) -> float | None:
        """One own step of ``sum(shape)`` GPUs (module docstring), or None where the data cannot say."""
        low, high = self.batch_range[job.application]
        if sum(shape) == job.replicas:
            it = profile.iteration(shape, job.batch, min_batch=low, max_batch=high, use_rows=use_rows)
            return it.seconds if it is not None else None
        gang = profile.iteration(packed_placement(job.replicas, self.profiled_gpus[gpu_type][0]), job.batch,
                                 min_batch=low, max_batch=high)
        times = profile.step_and_sync_s(shape, gang.atomic_bsz, use_rows=use_rows) if gang is not None else None
        if gang is None or times is None:
            return None
        step, sync = times
        seconds = step + gang.accum_steps * (step - sync)
        return seconds if seconds > 0 else None

    def spanning_bound(self, job_type: str, gpu_type: str, n: int) -> float:
        """The most steps/s any placement of ``n`` workers across nodes with a ``gpu_type`` GPU
        gets: the best of the measured shapes of n GPUs on 2+ nodes, the interpolation at every
        node count 2..n (it depends only on node and replica counts), and the fallback
        (packed rate x ``default_cross_node``). A mixed copy runs at most at its slowest type's
        shape rate, so this bounds it too."""
        job = parse_job_type(job_type)
        profile = self.profiles.get((job.application, gpu_type)) if job else None
        if job is None or profile is None or n < 2:
            return 0.0
        best = self.rate(job_type, gpu_type, n) * self.default_cross_node
        for shape in profile.measured_shapes(n):
            if len(shape) > 1:
                best = max(best, self.shape_rate(job_type, gpu_type, shape))
        for nodes in range(2, min(n, MAX_INTERPOLATED_NODES) + 1):
            shape = (n - nodes + 1,) + (1,) * (nodes - 1)   # stands for every shape of that many nodes
            seconds = self._seconds(job, gpu_type, profile, shape, use_rows=False)
            if seconds is not None:
                best = max(best, 1.0 / seconds)
        return best

    def cross_node_factor(self, job_type: str, gpu_types: Iterable[str], n: int) -> float:
        if not self.cross_node:
            return 1.0
        factors = []
        for gpu_type in set(gpu_types):
            size = self.profiled_gpus.get(gpu_type, (0, 0))[0]
            packed = self.rate(job_type, gpu_type, n)
            if packed <= 0 or n < 2:
                continue
            if n > size:
                factors.append(1.0)
                continue
            two_nodes = min(self.shape_rate(job_type, gpu_type, (n - 1, 1)),
                            self.shape_rate(job_type, gpu_type, (n - n // 2, n // 2)))
            factors.append(min(1.0, two_nodes / packed))
        return min(factors) if factors else self.default_cross_node

    def placement_rate(self, job_type: str, parts: Iterable[Part]) -> float:
        parts = [p for p in parts if p.count > 0]
        if not parts:
            return 0.0
        n = sum(p.count for p in parts)
        types = {p.gpu_type for p in parts}
        if not self.cross_node or len({p.node_id for p in parts}) == 1:
            return min(self.rate(job_type, t, n) for t in types)
        per_node: dict[str, int] = {}
        for p in parts:
            per_node[p.node_id] = per_node.get(p.node_id, 0) + p.count
        shape = tuple(per_node.values())
        return min(self.shape_rate(job_type, t, shape) for t in types)

    def with_rates(self, extra: Mapping[tuple[str, str, int], float]) -> ThroughputModel:
        """Measurements override packed rates; shapes across nodes still come from the profiles."""
        merged = dict(self.rates)
        merged.update(extra)
        return ProfiledThroughputModel(rates=merged, profiles=self.profiles, batch_range=self.batch_range,
                                       profiled_gpus=self.profiled_gpus, cross_node=self.cross_node)


@functools.lru_cache(maxsize=4)
def build_sia_throughput(*, cross_node: bool = True) -> ProfiledThroughputModel:
    """The table for every (application, validated batch) on t4, rtx2080ti and a100 (module docstring).

    Memoised: the model is immutable (its memo only caches pure values).
    """
    profiles: dict[tuple[str, str], AppProfile] = {}
    batch_range: dict[str, tuple[int, int]] = {}
    for app in APPLICATIONS:
        batches = validated_batches(app)
        batch_range[app] = (batches[0], batches[-1])
        for cluster, gpu_type in CLUSTER_GPU_TYPE.items():
            profiles[(app, gpu_type)] = AppProfile.load(app, cluster)
    profiled = {CLUSTER_GPU_TYPE[c]: (GPUS_PER_NODE[c], PROFILED_NODES[c]) for c in CLUSTER_GPU_TYPE}
    return ProfiledThroughputModel(rates={}, profiles=profiles, batch_range=batch_range, profiled_gpus=profiled,
                                   cross_node=cross_node)
