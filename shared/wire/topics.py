"""The Kafka topics: the one table that says what travels on each, who writes it, who reads
it and how long it is kept.

Every service imports its topic names from here; nothing else spells ``"hadar.…"``. The
table is read by the bus (topic configs at creation), by the principals' ACLs
(:mod:`shared.security.principals`: a principal may write and read exactly the topics that
name it here), and by the generated event reference (docs/events.md). Each event type
travels on exactly one topic, keyed so that per-job (or per-node) order holds
(:func:`shared.wire.events.key_for`).

``writers`` and ``readers`` are principals: ``cli`` (every user's ``hadar`` command) and the
services. A reader either follows the topic or rebuilds its state from it at start (the
scheduler its own placements, the profiler its own estimates); the CLI reads every topic
for its views and replay, never in a consumer group. Every principal also writes
``hadar.deadletter`` (a consumer refuses a record there); only the scheduler follows it, to
count bad records once. Retention (``retention``, Kafka topic configs) and why each topic
keeps what it keeps: :mod:`shared.wire.retention`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "JOBS", "NODES", "THROUGHPUT", "PROGRESS", "PLACEMENTS", "MODELS", "DEADLETTER", "QUEUES", "LEADERSHIP",
    "PRINCIPALS",
    "Topic", "TOPICS", "TOPIC_BY_NAME", "ALL_TOPICS", "TOPIC_OF_TYPE", "event_types_on", "written_by", "read_by",
]

JOBS = "hadar.jobs"
NODES = "hadar.nodes"
THROUGHPUT = "hadar.throughput"
PROGRESS = "hadar.progress"
PLACEMENTS = "hadar.placements"
MODELS = "hadar.models"
DEADLETTER = "hadar.deadletter"
QUEUES = "hadar.queues"
LEADERSHIP = "hadar.leadership"

# ``admin`` is Kafka's super user in a secured deployment (it needs no ACL); the table still
# says it is the one writer of the queues.
PRINCIPALS = ("cli", "scheduler", "agent", "tracker", "profiler", "admin")

_FOREVER: Mapping[str, str] = MappingProxyType({"cleanup.policy": "delete", "retention.ms": "-1"})
_DAY_MS = 24 * 3600 * 1000
_HOUR_MS = 3600 * 1000


@dataclass(frozen=True, kw_only=True)
class Topic:
    """One topic: its ``events`` (type names; each record keyed by ``key_for``), the
    principals that write and read it, and its Kafka topic configs."""

    name: str
    events: tuple[str, ...]
    writers: tuple[str, ...]
    readers: tuple[str, ...]
    retention: Mapping[str, str]


TOPICS: tuple[Topic, ...] = (
    Topic(name=JOBS, events=("JobSubmitted", "JobCancelled"), writers=("cli",),
          readers=("scheduler", "agent", "tracker", "profiler", "cli"), retention=_FOREVER),
    Topic(name=NODES, events=("NodeRegistered", "NodeHeartbeat"), writers=("agent",),
          readers=("scheduler", "profiler", "cli"), retention=_FOREVER),
    Topic(name=THROUGHPUT, events=("ThroughputEstimate",), writers=("profiler",),
          readers=("scheduler", "profiler", "cli"), retention=_FOREVER),
    Topic(name=PROGRESS, events=("Progress", "CopyFinished"), writers=("agent",),
          readers=("scheduler", "tracker", "profiler", "cli"),
          retention=MappingProxyType({"cleanup.policy": "delete", "retention.ms": str(_DAY_MS),
                                      "segment.ms": str(_HOUR_MS)})),
    Topic(name=PLACEMENTS, events=("RoundStarted", "Assignment"),
          writers=("scheduler",), readers=("scheduler", "agent", "tracker", "cli"), retention=_FOREVER),
    Topic(name=MODELS, events=("ModelConsolidated", "RoundAbandoned", "JobCompleted"),
          writers=("tracker",), readers=("scheduler", "tracker", "profiler", "cli"), retention=_FOREVER),
    Topic(name=QUEUES, events=("QueuesApplied",), writers=("admin",), readers=("scheduler", "cli"),
          retention=_FOREVER),
    # A standby (scheduler or tracker: one role each) reads only the renewals of the last hour to
    # decide whether the active one is alive.
    Topic(name=LEADERSHIP, events=("LeaderRenewed",), writers=("scheduler", "tracker"),
          readers=("scheduler", "tracker", "cli"),
          retention=MappingProxyType({"cleanup.policy": "delete", "retention.ms": str(_HOUR_MS),
                                      "segment.ms": str(_HOUR_MS)})),
    Topic(name=DEADLETTER, events=("DeadLetter",), writers=tuple(p for p in PRINCIPALS if p != "admin"),
          readers=("scheduler", "cli"), retention=_FOREVER),
)

TOPIC_BY_NAME: Mapping[str, Topic] = MappingProxyType({t.name: t for t in TOPICS})
ALL_TOPICS: tuple[str, ...] = tuple(sorted(TOPIC_BY_NAME))
# Event type name -> its topic.
TOPIC_OF_TYPE: Mapping[str, str] = MappingProxyType({e: t.name for t in TOPICS for e in t.events})

if len(TOPIC_OF_TYPE) != sum(len(t.events) for t in TOPICS):
    raise ImportError("an event type is listed on two topics")
if any(p not in PRINCIPALS for t in TOPICS for p in (*t.writers, *t.readers)):
    raise ImportError("a topic names a principal that does not exist")


def event_types_on(topics: Iterable[str]) -> frozenset[str]:
    """Names of the event types that can arrive on ``topics``."""
    wanted = set(topics)
    unknown = wanted - set(ALL_TOPICS)
    if unknown:
        raise ValueError(f"not a Hadar topic: {sorted(unknown)}")
    return frozenset(t for t, topic in TOPIC_OF_TYPE.items() if topic in wanted)


def written_by(principal: str) -> tuple[str, ...]:
    """The topics ``principal`` may publish to, in table order."""
    return tuple(t.name for t in TOPICS if principal in t.writers)


def read_by(principal: str) -> tuple[str, ...]:
    """The topics ``principal`` may read, in table order."""
    return tuple(t.name for t in TOPICS if principal in t.readers)
