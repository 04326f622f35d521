"""The tracker's Prometheus metrics, registered in one place (names are part of the
monitoring contract: docs/monitoring.md and the dashboards read them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.tracker.acceptance import REFUSAL_REASONS
from shared.domain.replica_screen import RULES

__all__ = ["TrackerMetrics"]


class TrackerMetrics:
    """Every metric of the tracker service (the object lifecycle's are the janitor's);
    labelled series that must be exported as 0 from the start are created here."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.seconds = Histogram("hadar_tracker_consolidation_seconds", "Time to consolidate one round",
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
                                 registry=r)
        self.models = Counter("hadar_tracker_models_written_total", "Round models written", registry=r)
        self.rejected = Counter("hadar_tracker_replicas_rejected_total",
                                "Replicas left out of a consolidation (bad, mismatched, absent)", registry=r)
        self.screened = Counter("hadar_tracker_replicas_screened_total",
                                "Replicas the screen left out of an average (shared/domain/replica_screen.py), by rule",
                                ["rule"], registry=r)
        for rule in RULES:
            self.screened.labels(rule=rule)
        self.rollbacks = Counter("hadar_tracker_rollbacks_total",
                                 "Rounds announced as a rollback to the job's last model that trained", registry=r)
        self.failed = Counter("hadar_tracker_copies_failed_total", "Copies that reported failure", registry=r)
        self.missing = Counter("hadar_tracker_copies_missing_total", "Assigned copies that never finished",
                               registry=r)
        self.abandoned = Counter("hadar_tracker_rounds_without_model_total", "Rounds with nothing to average",
                                 registry=r)
        self.completed = Counter("hadar_tracker_jobs_completed_total", "Jobs completed", registry=r)
        self.errors = Counter("hadar_tracker_errors_total", "Consolidation or completion attempts that failed",
                              ["stage"], registry=r)
        for stage in ("consolidate", "complete"):
            self.errors.labels(stage=stage)   # exported as 0, so increase() sees the first failure
        self.bytes = Counter("hadar_tracker_replica_read_bytes_total", "Replica bytes read for averaging",
                             registry=r)
        self.events_in = Counter("hadar_tracker_events_in_total", "Events consumed", ["type"], registry=r)
        self.events_out = Counter("hadar_tracker_events_out_total", "Events published", ["type"], registry=r)
        self.open = Gauge("hadar_tracker_open_rounds", "Rounds not consolidated yet", registry=r)
        self.refused = Counter("hadar_tracker_events_rejected_total",
                               "Events refused (changed nothing; dead-lettered when read live)", ["reason"],
                               registry=r)
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason=reason)
        self.given_up = Counter("hadar_tracker_rounds_given_up_total",
                                "Rounds abandoned after max_attempts failed consolidations", registry=r)
        self.completions_given_up = Counter("hadar_tracker_completions_given_up_total",
                                            "Completions abandoned after max_attempts failures", registry=r)
        self.entries = Gauge("hadar_tracker_state_entries", "What the tracker's state holds, per kind", ["kind"],
                             registry=r)
        self.snapshots = Counter("hadar_tracker_snapshots", "State snapshots written, by outcome", ["outcome"],
                                 registry=r)
        for outcome in ("written", "failed"):
            self.snapshots.labels(outcome=outcome)
