"""The scheduler's cluster-level metrics: what an operator graphs and alerts on.

Computed when scraped, from the folded :class:`~services.scheduler.live.state.SchedulerState`
(:func:`cluster_view`, a pure function of the state and the time), so they are right from
the first scrape after a restart, not only after the next round:

* ``hadar_scheduler_gpu_capacity{gpu_type}`` -- GPUs of the live nodes (heard from within
  3 heartbeat periods), and ``hadar_scheduler_gpus_allocated{gpu_type}`` -- GPUs assigned
  in the current round (0 once it ended and before the next starts), for every type of
  either, so ``allocated / capacity`` is the utilization by type.
* ``hadar_scheduler_nodes{state="live"|"lost"}`` and
  ``hadar_scheduler_node_heartbeat_age_seconds{node}`` for every node ever registered.
* ``hadar_scheduler_jobs{state="waiting"|"running"|"stuck"}`` -- active jobs not yet placed
  in any round / placed at least once / placed but without consolidated progress for several
  rounds (``services/scheduler/live/stuck.py``; finished jobs are counted by the tracker's
  ``hadar_tracker_jobs_completed_total``).
* ``hadar_scheduler_job_consolidated_steps{job}`` and ``hadar_scheduler_job_target_steps{job}``
  for active jobs: the last consolidated model's steps and the job's iterations.
* ``hadar_scheduler_dead_letters{topic}`` -- distinct bad records in ``hadar.deadletter``,
  by origin topic (:class:`DeadLetterTally`).
* Team queues, from the latest round's standings (absent without queues):
  ``hadar_scheduler_queue_gpus{queue,gpu_type,kind="quota"|"entitled"|"used"}``,
  ``hadar_scheduler_queue_borrowed_gpus{queue}`` / ``..._lent_gpus{queue}`` (beyond its quota /
  of its quota left to others), ``hadar_scheduler_queue_jobs{queue,state="running"|"pending"}``
  and ``hadar_scheduler_queue_usage_gpu_seconds{queue}`` (decayed normalized usage, the
  fair-share order: services/scheduler/core/queues.py).
* ``hadar_scheduler_last_round_start_timestamp_seconds`` (absent before any round),
  ``hadar_scheduler_round_length_seconds`` and ``hadar_scheduler_heartbeat_period_seconds``
  (the configured periods, so alert rules need no copy of them).

Recorded as rounds start (:meth:`SchedulerTelemetry.round_started`):
``hadar_scheduler_round_duration_seconds`` (histogram: one round's start to the next's;
not observed across an idle gap) and ``hadar_scheduler_round_lag_seconds`` (gauge: how much
later than ``previous start + round_s`` the latest round started, e.g. waiting for models).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.scheduler.live.state import SchedulerState
from shared.wire.events import DeadLetter, QueueStanding

__all__ = ["ClusterView", "DeadLetterTally", "SchedulerCounters", "SchedulerTelemetry", "cluster_view"]

MISSED_HEARTBEATS = 3   # as SchedulerState.live_nodes: a node silent this many periods is lost


class DeadLetterTally:
    """Distinct bad records among the dead letters read.

    Every consumer group that meets an undecodable record publishes its own DeadLetter, and
    a restart reads the topic again: counting records of ``hadar.deadletter`` counted one
    bad record once per group and again per restart. A DeadLetter names its origin
    (topic, partition, offset); this counts each origin once. Memory: one small tuple per
    distinct bad record (the topic is kept forever, so is this)."""

    def __init__(self) -> None:
        self._origins: set[tuple[str, int, int]] = set()
        self._by_topic: dict[str, int] = {}

    def add(self, letter: DeadLetter) -> bool:
        """True if ``letter`` names a bad record not seen before."""
        return self.add_origin((letter.topic, letter.partition, letter.offset))

    def add_origin(self, origin: tuple[str, int, int]) -> bool:
        """True if ``origin`` (topic, partition, offset) is a bad record not seen before."""
        if origin in self._origins:
            return False
        self._origins.add(origin)
        self._by_topic[origin[0]] = self._by_topic.get(origin[0], 0) + 1
        return True

    def extend(self, origins: Iterable[tuple[str, int, int]]) -> None:
        """Count every origin of ``origins`` not seen before (what a snapshot restores)."""
        for origin in origins:
            self.add_origin(origin)

    def by_topic(self) -> dict[str, int]:
        return dict(self._by_topic)

    def origins(self) -> list[tuple[str, int, int]]:
        """Every origin counted (a copy: what a snapshot keeps, so a restart need not re-read them)."""
        return list(self._origins)


@dataclass(frozen=True, kw_only=True)
class ClusterView:
    capacity: Mapping[str, int]          # gpu_type -> GPUs of live nodes
    allocated: Mapping[str, int]         # gpu_type -> GPUs assigned in the current round
    nodes: Mapping[str, int]             # "live" / "lost" -> count
    heartbeat_age_s: Mapping[str, float]  # node -> seconds since last heard from
    jobs: Mapping[str, int]              # "waiting" / "running" / "stuck" -> active jobs
    consolidated_steps: Mapping[str, int]  # active job -> steps of its last model
    target_steps: Mapping[str, int]      # active job -> iterations asked for
    last_round_start: float | None
    queues: tuple[QueueStanding, ...] = ()
    quotas: Mapping[str, Mapping[str, int]] = field(default_factory=dict)   # queue -> GPU type -> quota


def cluster_view(state: SchedulerState, *, now: float, heartbeat_s: float) -> ClusterView:
    """What the gauges show at ``now``; reads ``state``, changes nothing."""
    live = {n.registered.node_id for n in state.live_nodes(now, heartbeat_s, MISSED_HEARTBEATS)}
    capacity: dict[str, int] = {}
    for node_id in live:
        for gpu in state.nodes[node_id].registered.gpus:
            capacity[gpu.type] = capacity.get(gpu.type, 0) + 1
    allocated = dict.fromkeys(capacity, 0)
    current = state.rounds.get(state.last_round)
    if current is not None and current.started.started_at <= now < current.started.ends_at:
        for a in current.assignments:
            allocated[a.gpu_type] = allocated.get(a.gpu_type, 0) + len(a.gpus)
    for gpu_type in allocated:
        capacity.setdefault(gpu_type, 0)
    active = state.active_jobs()
    jobs = {"waiting": 0, "running": 0, "stuck": 0}
    for job in active:
        jobs[job.state] += 1
    return ClusterView(
        capacity=capacity, allocated=allocated,
        nodes={"live": len(live), "lost": len(state.nodes) - len(live)},
        heartbeat_age_s={n: max(0.0, now - r.last_seen) for n, r in state.nodes.items()},
        jobs=jobs,
        consolidated_steps={j.spec.job_id: j.steps_done for j in active},
        target_steps={j.spec.job_id: j.spec.iterations for j in active},
        last_round_start=current.started.started_at if current is not None else None,
        queues=current.started.queues if current is not None else (),
        quotas={q.name: dict(q.quota) for q in state.queues.queues} if state.queues is not None else {},
    )


class _ViewCollector(Collector):
    def __init__(self, view: Callable[[], ClusterView], dead: DeadLetterTally, round_s: float,
                 heartbeat_s: float) -> None:
        self._view, self._dead, self._round_s, self._heartbeat_s = view, dead, round_s, heartbeat_s

    def collect(self) -> Iterator[Metric]:
        v = self._view()
        yield _family("hadar_scheduler_gpu_capacity", "GPUs of the live nodes, by type", "gpu_type", v.capacity)
        yield _family("hadar_scheduler_gpus_allocated", "GPUs assigned in the current round, by type", "gpu_type",
                      v.allocated)
        yield _family("hadar_scheduler_nodes", "Registered nodes: live (heard from within 3 heartbeat periods) "
                      "or lost", "state", v.nodes)
        yield _family("hadar_scheduler_node_heartbeat_age_seconds", "Seconds since each registered node was "
                      "last heard from", "node", v.heartbeat_age_s)
        yield _family("hadar_scheduler_jobs", "Active jobs: waiting (never placed), running (placed), "
                      "stuck (no consolidated progress)", "state", v.jobs)
        yield _family("hadar_scheduler_job_consolidated_steps", "Steps of the last consolidated model, per "
                      "active job", "job", v.consolidated_steps)
        yield _family("hadar_scheduler_job_target_steps", "Iterations the job asked for, per active job", "job",
                      v.target_steps)
        yield _family("hadar_scheduler_dead_letters", "Distinct bad records in hadar.deadletter, by origin topic",
                      "topic", self._dead.by_topic())
        yield from _queue_families(v)
        last = GaugeMetricFamily("hadar_scheduler_last_round_start_timestamp_seconds",
                                 "Unix time the latest round started (absent before the first)")
        if v.last_round_start is not None:
            last.add_metric([], v.last_round_start)
        yield last
        yield GaugeMetricFamily("hadar_scheduler_round_length_seconds", "Configured round length",
                                value=self._round_s)
        yield GaugeMetricFamily("hadar_scheduler_heartbeat_period_seconds", "Configured agent heartbeat period",
                                value=self._heartbeat_s)


def _queue_families(v: ClusterView) -> Iterator[Metric]:
    gpus = GaugeMetricFamily("hadar_scheduler_queue_gpus", "GPUs of each team queue by type: its quota, what "
                             "the latest round entitled it to, what it used", labels=["queue", "gpu_type", "kind"])
    borrowed = GaugeMetricFamily("hadar_scheduler_queue_borrowed_gpus", "GPUs a queue holds beyond its quota",
                                 labels=["queue"])
    lent = GaugeMetricFamily("hadar_scheduler_queue_lent_gpus", "GPUs of a queue's quota it left to others",
                             labels=["queue"])
    jobs = GaugeMetricFamily("hadar_scheduler_queue_jobs", "A queue's active jobs: running (placed in the latest "
                             "round) or pending", labels=["queue", "state"])
    usage = GaugeMetricFamily("hadar_scheduler_queue_usage_gpu_seconds", "A queue's decayed, normalized GPU-seconds "
                              "(lower comes first for idle GPUs, per unit of weight)", labels=["queue"])
    for queue, quota in sorted(v.quotas.items()):
        for gpu_type, n in sorted(quota.items()):
            gpus.add_metric([queue, gpu_type, "quota"], n)
    for s in v.queues:
        for kind, counts in (("entitled", s.entitled), ("used", s.used)):
            for gpu_type, n in sorted(counts.items()):
                gpus.add_metric([s.name, gpu_type, kind], n)
        borrowed.add_metric([s.name], s.borrowed)
        lent.add_metric([s.name], s.lent)
        jobs.add_metric([s.name, "running"], s.running)
        jobs.add_metric([s.name, "pending"], s.pending)
        usage.add_metric([s.name], s.usage)
    yield from (gpus, borrowed, lent, jobs, usage)


def _family(name: str, documentation: str, label: str, values: Mapping[str, float]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=[label])
    for key in sorted(values):
        family.add_metric([key], values[key])
    return family


class SchedulerTelemetry:
    """The metrics of :mod:`this module <services.scheduler.live.metrics>` on ``registry``."""

    def __init__(self, registry: CollectorRegistry, *, state: Callable[[], SchedulerState],
                 now: Callable[[], float], round_s: float, heartbeat_s: float) -> None:
        self.dead_letters = DeadLetterTally()
        registry.register(_ViewCollector(lambda: cluster_view(state(), now=now(), heartbeat_s=heartbeat_s),
                                         self.dead_letters, round_s, heartbeat_s))
        self._duration = Histogram("hadar_scheduler_round_duration_seconds",
                                   "One round's start to the next round's start (not across idle gaps)",
                                   buckets=_round_buckets(round_s), registry=registry)
        self._lag = Gauge("hadar_scheduler_round_lag_seconds",
                          "How much later than the previous start plus round_s the latest round started",
                          registry=registry)
        self._round_s = round_s
        self._previous: float | None = None

    def round_started(self, started_at: float) -> None:
        if self._previous is not None:
            self._duration.observe(max(0.0, started_at - self._previous))
            self._lag.set(max(0.0, started_at - self._previous - self._round_s))
        else:
            self._lag.set(0.0)
        self._previous = started_at

    def went_idle(self) -> None:
        """No active jobs: the next round's start is not the end of the last one."""
        self._previous = None


def _round_buckets(round_s: float) -> tuple[float, ...]:
    """Around the configured length: a round that starts late shows in the upper buckets."""
    return tuple(round(round_s * f, 6) for f in (0.5, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0))


class SchedulerCounters:
    """The scheduler service's own counters and gauges, updated as it folds, plans and
    publishes (the cluster view above is computed at scrape time instead)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.rounds = Counter("hadar_scheduler_rounds", "Rounds planned", registry=r)
        self.decision = Histogram("hadar_scheduler_decision_seconds", "Time in policy.plan()",
                                  registry=r, buckets=(.001, .01, .05, .1, .5, 1, 5, 30))
        self.queue = Gauge("hadar_scheduler_queue_length", "Active jobs left waiting", registry=r)
        self.stuck = Gauge("hadar_scheduler_jobs_stuck",
                           "Active jobs without consolidated progress for several rounds", registry=r)
        self.events_in = Counter("hadar_scheduler_events_in", "Events folded", ["type"], registry=r)
        self.events_out = Counter("hadar_scheduler_events_out", "Events published", ["type"], registry=r)
        self.failures = Counter("hadar_scheduler_round_failures", "Round attempts that failed, by stage",
                                ["stage"], registry=r)
        self.publish_retries = Counter("hadar_scheduler_publish_retries", "Publishes retried after a bus error",
                                       registry=r)
        self.rejected = Counter("hadar_scheduler_events_rejected", "Events refused and dead-lettered",
                                ["type"], registry=r)
        self.snapshots = Counter("hadar_scheduler_snapshots", "State snapshots written, by outcome",
                                 ["outcome"], registry=r)
