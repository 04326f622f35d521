"""Prometheus metrics of one agent. Every series carries ``node`` and ``emulated`` labels."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["AgentMetrics"]

_BASE = ("node", "emulated")


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry, *, node_id: str, emulated: bool) -> None:
        self._labels = {"node": node_id, "emulated": "true" if emulated else "false"}
        self._copies_running = Gauge("hadar_agent_copies_running", "Job copies with live workers on this node",
                                     _BASE, registry=registry)
        self._steps_per_s = Gauge("hadar_agent_steps_per_second",
                                  "Training steps per second of the copies running here (latest reports)",
                                  _BASE, registry=registry)
        self._steps = Counter("hadar_agent_steps", "Training steps done by copies reported from this node",
                              _BASE, registry=registry)
        self._events = Counter("hadar_agent_events_published", "Events published by this agent, by type",
                               (*_BASE, "type"), registry=registry)
        self._failures = Counter("hadar_agent_worker_failures", "Job copies whose workers failed here",
                                 _BASE, registry=registry)
        self._finished = Counter("hadar_agent_copies_finished", "Job copies finished here, by status",
                                 (*_BASE, "status"), registry=registry)
        self._rejected = Counter("hadar_agent_events_rejected",
                                 "Events this agent refused and dead-lettered, by reason (a small fixed set)",
                                 (*_BASE, "reason"), registry=registry)
        self._not_ours = Counter("hadar_agent_checkpoints_not_ours",
                                 "Objects found at a copy's own checkpoint key that this node did not write "
                                 "(ignored: the copy started its round over)", _BASE, registry=registry)
        self._not_ours.labels(**self._labels)   # exported as 0 from the start: an alert needs the series
        self._skipped = Counter("hadar_agent_events_skipped", "Stale or duplicate assignments skipped, by reason",
                                (*_BASE, "reason"), registry=registry)
        self._retries = Counter("hadar_agent_result_retries",
                                "Retries of publishing a copy's result after a retriable bus failure",
                                _BASE, registry=registry)
        self._undelivered = Counter("hadar_agent_results_undelivered",
                                    "Copy results given up on: not_retriable, abandoned, shutdown (left un-acked)",
                                    (*_BASE, "reason"), registry=registry)
        self._latest_round = Gauge("hadar_agent_latest_round", "The newest round this agent believes",
                                   _BASE, registry=registry)
        self._slots = Counter("hadar_agent_worker_slots", "Worker slot decisions for a copy's rank: reuse "
                              "(warm worker), spawn, respawn", (*_BASE, "action"), registry=registry)
        self._crashes = Counter("hadar_agent_slot_crashes", "Workers that ended without a clean report "
                                "(their slot is respawned)", _BASE, registry=registry)
        self._start = Histogram("hadar_agent_copy_start_seconds", "From the round's start (the Assignment's ts) "
                                "to a copy's first training step, by warm (reused worker) or cold",
                                (*_BASE, "warm"), registry=registry,
                                buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120))
        self._rates: dict[tuple[str, int, int], float] = {}
        for series in (self._copies_running, self._steps_per_s, self._steps, self._failures, self._retries,
                       self._crashes):
            series.labels(**self._labels)   # exported as 0 from the start, not only once it moves

    def copies_running(self, n: int) -> None:
        self._copies_running.labels(**self._labels).set(n)

    def copy_rate(self, key: tuple[str, int, int], steps_per_s: float | None) -> None:
        """Latest steps/s of one copy (None: it stopped)."""
        if steps_per_s is None:
            self._rates.pop(key, None)
        else:
            self._rates[key] = steps_per_s
        self._steps_per_s.labels(**self._labels).set(sum(self._rates.values()))

    def steps(self, n: int) -> None:
        if n > 0:
            self._steps.labels(**self._labels).inc(n)

    def event(self, event_type: str) -> None:
        self._events.labels(**self._labels, type=event_type).inc()

    def failure(self) -> None:
        self._failures.labels(**self._labels).inc()

    def finished(self, status: str) -> None:
        self._finished.labels(**self._labels, status=status).inc()

    def not_ours(self) -> None:
        self._not_ours.labels(**self._labels).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(**self._labels, reason=reason).inc()

    def skipped(self, reason: str) -> None:
        self._skipped.labels(**self._labels, reason=reason).inc()

    def result_retry(self) -> None:
        self._retries.labels(**self._labels).inc()

    def undelivered(self, reason: str) -> None:
        self._undelivered.labels(**self._labels, reason=reason).inc()

    def latest_round(self, round_: int) -> None:
        self._latest_round.labels(**self._labels).set(round_)

    def slot(self, action: str) -> None:
        self._slots.labels(**self._labels, action=action).inc()

    def slot_crash(self) -> None:
        self._crashes.labels(**self._labels).inc()

    def copy_start(self, seconds: float, *, warm: bool) -> None:
        self._start.labels(**self._labels, warm="true" if warm else "false").observe(max(0.0, seconds))
