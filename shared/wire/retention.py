"""How long each Hadar topic keeps its records, how Kafka cleans it, and why.

The configs themselves are in the topic table (:data:`shared.wire.topics.TOPICS`).

Applied when a topic is created -- by :meth:`shared.bus.kafka.KafkaBus.ensure_topics` and
by deploy/stack.yml's ``topics`` job, which also alters existing topics to it. Without it
Kafka's default (``delete`` after 7 days) made a service restarted after a week forget
older jobs.

=================  ==============  =====================  ===================================
topic              cleanup.policy  retention.ms           why
=================  ==============  =====================  ===================================
hadar.jobs         delete          -1 (forever)           tracker and profiler rebuild
hadar.placements   delete          -1 (forever)           state by replaying these from
hadar.models       delete          -1 (forever)           the start when they have no valid
hadar.throughput   delete          -1 (forever)           snapshot, and replay --rerun reads
hadar.nodes        delete          -1 (forever)           them whole: a deleted record is a
                                                          forgotten job, round, model, rate
                                                          or node
hadar.deadletter   delete          -1 (forever)           rare; the evidence of what was refused
hadar.progress     delete          86400000 (1 day),      advisory: matters only while its
                                   segment.ms 3600000     round is open (rounds last minutes)
hadar.leadership   delete          3600000 (1 hour),      a standby reads only the newest
                                   segment.ms 3600000     renewals; the terms are in the log
=================  ==============  =====================  ===================================

Why not compaction, which keeps only the latest record per key
(:func:`shared.wire.events.key_for`):

* hadar.throughput: every estimate of a job -- each worker count, estimated and measured --
  has the key job id, so compaction keeps one and drops the others (a measured rate
  followed by an estimate would leave only the estimate).
* hadar.nodes: an agent sends NodeRegistered once, at start, then NodeHeartbeat every few
  seconds, all keyed by node id: compaction keeps the latest heartbeat and drops the
  registration, and a time limit drops it too once the agent has run that long; a
  scheduler restarted after that would not know the node. Heartbeats therefore pile up
  (about 17,000 a day per node at 5 s) until registrations and heartbeats get different
  keys, or snapshots exist; then this topic can be compacted.

hadar.progress also carries CopyFinished: a round still open when the tracker has been down
longer than a day loses its copies' reports and is redone (the models it consolidated are
on hadar.models, kept forever). Kafka deletes whole closed segments only, so the segment
rolls hourly to make one day mean about one day.

The scheduler, the tracker and the profiler restart from state snapshots (shared/persistence/snapshot.py)
and read only records after them (the tracker: after its oldest report still held, at most
ROUND_HISTORY rounds back), so with a valid snapshot any retention longer than the snapshot
interval would do (tests/integration/test_topic_retention.py deletes the segments of older rounds on a
real broker and checks that the scheduler's decisions do not change;
tests/integration/test_tracker_retention.py does the same for the tracker's announcements,
models and credited steps).

Records are timestamped with the publishing bus's clock (CreateTime): a fake clock far in
the past makes hadar.progress records due for deletion at once (see shared/bus/base.py).
Topics not named here (tests' own) get the broker's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from shared.wire.topics import TOPICS

__all__ = ["TOPIC_CONFIGS", "topic_configs", "config_string"]

# Set in the topic table (shared/wire/topics.py, each Topic's ``retention``); explained here.
TOPIC_CONFIGS: Mapping[str, Mapping[str, str]] = MappingProxyType({t.name: t.retention for t in TOPICS})


def topic_configs(topic: str) -> dict[str, str]:
    """The topic-level configs ``topic`` is created with; empty (broker defaults) for a
    topic that is not Hadar's."""
    return dict(TOPIC_CONFIGS.get(topic, {}))


def config_string(topic: str) -> str:
    """``topic_configs`` as ``kafka-configs.sh --add-config`` takes them: ``k=v,k=v``, sorted."""
    return ",".join(f"{name}={value}" for name, value in sorted(topic_configs(topic).items()))
