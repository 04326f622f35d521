"""The Kafka topics, and which event types travel on each: the one place topic names live.

Every service imports its topic names from here; nothing else spells ``"hadar.…"``.
Each event type travels on exactly one topic, keyed so that per-job (or per-node) order
holds (:func:`shared.wire.events.key_for`).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "JOBS", "NODES", "THROUGHPUT", "PROGRESS", "PLACEMENTS", "MODELS", "DEADLETTER",
    "ALL_TOPICS", "TOPIC_OF_TYPE", "event_types_on",
]

JOBS = "hadar.jobs"                # JobSubmitted, JobCancelled (CLI -> everyone)
NODES = "hadar.nodes"              # NodeRegistered, NodeHeartbeat (agents -> scheduler)
THROUGHPUT = "hadar.throughput"    # ThroughputEstimate (profiler -> scheduler)
PROGRESS = "hadar.progress"        # Progress, CopyFinished (agents -> tracker, profiler, scheduler)
PLACEMENTS = "hadar.placements"    # RoundStarted, Assignment (scheduler -> agents, tracker)
MODELS = "hadar.models"            # ModelConsolidated, RoundAbandoned, JobCompleted (tracker -> scheduler, CLI)
DEADLETTER = "hadar.deadletter"    # DeadLetter: anything undecodable or rejected, with the reason

# Event type name -> its topic.
TOPIC_OF_TYPE: dict[str, str] = {
    "JobSubmitted": JOBS, "JobCancelled": JOBS,
    "NodeRegistered": NODES, "NodeHeartbeat": NODES,
    "ThroughputEstimate": THROUGHPUT,
    "Progress": PROGRESS, "CopyFinished": PROGRESS,
    "RoundStarted": PLACEMENTS, "Assignment": PLACEMENTS,
    "ModelConsolidated": MODELS, "RoundAbandoned": MODELS, "JobCompleted": MODELS,
    "DeadLetter": DEADLETTER,
}

ALL_TOPICS: tuple[str, ...] = tuple(sorted(set(TOPIC_OF_TYPE.values())))


def event_types_on(topics: Iterable[str]) -> frozenset[str]:
    """Names of the event types that can arrive on ``topics``."""
    wanted = set(topics)
    unknown = wanted - set(ALL_TOPICS)
    if unknown:
        raise ValueError(f"not a Hadar topic: {sorted(unknown)}")
    return frozenset(t for t, topic in TOPIC_OF_TYPE.items() if topic in wanted)
