"""Faults on the replicated backbone (issue 28 item 5): a Kafka cluster of three brokers
(replication 3, ``min.insync.replicas=2``, producers ``acks=all``) and MinIO over four
drives (one erasure set, 2 data + 2 parity shards), as ``hadar infra up --brokers 3 --drives
4`` starts them -- here in the scenario's own run directory, on free ports, beside (never
instead of) the shared development servers.

* ``replicated_leader_kill``: the broker leading the ``hadar.placements`` partition of a
  running job SIGKILLed while the job's copies train, and left dead; ``writes_resumed_s``: kill to the first
  acknowledgement on a partition it led.
* ``replicated_two_brokers_kill``: that, then -- once writes resumed -- the partition's new
  leader SIGKILLed too: one broker of three left, no controller quorum, so nothing may be
  acknowledged (``acked_while_minority`` counts acknowledgements from 2 s after the second
  kill until a broker returns: must be 0; ``held_till_return``: records made in that window
  and acknowledged after it, writes that waited); after ``down_s`` the first broker is
  restarted with its data (``hadar infra restart``) and writes resume (``writes_resumed_s``:
  restart begun to the first acknowledgement); the second stays dead.
* ``replicated_drive_lost``: a MinIO drive taken away at a running job's round deadline, as
  the copies upload their replicas and the tracker consolidates them, and left lost (renamed
  away, a plain file in its place, as ``tests/integration/test_minio_erasure.py`` does: an
  empty path MinIO would recreate and heal at once).
* ``replicated_standby_kill`` / ``replicated_standby_freeze``: the standby scheduler's
  scenarios (``benchmarks/fault_scenarios.py``) on this backbone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Sequence

from aiokafka.admin import AIOKafkaAdminClient

from benchmarks.fault_acks import Ack, read_acks
from benchmarks.fault_harness import Cluster, Miss
from benchmarks.fault_scenarios import (
    Scenario,
    at_deadline,
    first_progress,
    standby_freeze,
    standby_kill,
    training,
)
from devinfra import InfraError, KafkaServer, restart
from devinfra.common import is_running
from devinfra.kafka import load_kafka_cluster
from devinfra.minio import load_minio
from shared.wire.events import Assignment
from shared.wire.topics import ALL_TOPICS, PLACEMENTS

__all__ = ["REPLICATED_SCENARIOS", "leader_kill", "two_brokers_kill", "drive_lost", "first_ack_after",
           "acks_between", "held_between"]

ACK_SETTLE_S = 1.0   # an ack journaled this soon after a kill may be for a record acknowledged before it


async def _leaders(bootstrap: str) -> dict[tuple[str, int], int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        described = await admin.describe_topics(list(ALL_TOPICS))
        return {(t["topic"], p["partition"]): int(p["leader"]) for t in described for p in t["partitions"]}
    finally:
        await admin.close()


def leaders(c: Cluster) -> dict[tuple[str, int], int]:
    """The leader (node id, -1: none) of every partition of every topic."""
    return asyncio.run(asyncio.wait_for(_leaders(c.bootstrap), 60))


def brokers(c: Cluster) -> dict[int, KafkaServer]:
    return {b.node_id: b for b in load_kafka_cluster(c.paths)}


def placements_leader(c: Cluster) -> tuple[KafkaServer, int, frozenset[tuple[str, int]]]:
    """The broker leading the ``hadar.placements`` partition of a running job's latest
    assignment; that partition; and every partition (of every topic) the broker leads."""
    done = c.completed(c.log())
    latest = [r for r in c.log_records() if isinstance(r.event, Assignment) and r.event.job_id in c.job_ids
              and r.event.job_id not in done]
    if not latest:
        raise Miss("no running job has an assignment on hadar.placements")
    partition = max(latest, key=lambda r: r.event.round if isinstance(r.event, Assignment) else -1).partition
    led = leaders(c)
    node = led.get((PLACEMENTS, partition), -1)
    if node not in brokers(c):
        raise Miss(f"hadar.placements partition {partition} has no leader")
    return brokers(c)[node], partition, frozenset(tp for tp, n in led.items() if n == node)


def kill_broker(broker: KafkaServer) -> None:
    """SIGKILL a broker's process group and wait until it is gone."""
    os.killpg(broker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while is_running(broker.pid, broker.marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    if is_running(broker.pid, broker.marker):
        raise InfraError(f"{broker.name} survived SIGKILL")


def restart_broker(c: Cluster, broker: KafkaServer, *, attempts: int = 3) -> None:
    """``hadar infra restart kafka-N`` with its data; failed tries recorded and retried."""
    for attempt in range(1, attempts + 1):
        try:
            restart(c.paths, broker.name)
            return
        except InfraError as exc:
            c.restart_failures.append(f"{broker.name} attempt {attempt}: {exc}")
            if attempt == attempts:
                raise
            time.sleep(2)


def first_ack_after(acks: Sequence[Ack], since: float, partitions: frozenset[tuple[str, int]] | None, *,
                    settle_s: float = ACK_SETTLE_S) -> float | None:
    """Seconds from ``since`` to the first service acknowledgement (on ``partitions``) seen more
    than ``settle_s`` after it."""
    times = [a.at for a in acks if a.at > since + settle_s and not a.writer.startswith("harness")
             and (partitions is None or (a.topic, a.partition) in partitions)]
    return round(min(times) - since, 1) if times else None


def acks_between(acks: Sequence[Ack], start: float, end: float) -> int:
    """Acknowledgements seen between ``start`` and ``end``."""
    return sum(1 for a in acks if start < a.at < end)


def held_between(acks: Sequence[Ack], start: float, end: float) -> int:
    """Service records made between ``start`` and ``end`` and acknowledged only after ``end``:
    writes that waited out the window instead of failing or being lost."""
    return sum(1 for a in acks if start < a.created < end and a.at >= end and not a.writer.startswith("harness"))


def _wait_resumed(c: Cluster, since: float, partitions: frozenset[tuple[str, int]], timeout_s: float) -> float | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        resumed = first_ack_after(read_acks(c.acks_dir), since, partitions)
        if resumed is not None:
            return resumed
        time.sleep(0.5)
    return None


def leader_kill(c: Cluster, timeout_s: float) -> float:
    """(a) SIGKILL the broker leading a running job's placements partition while the job's
    copies train; leave it dead."""
    training(c, timeout_s)
    victim, partition, led = placements_leader(c)
    killed = c.struck()
    kill_broker(victim)
    c.notes["killed"] = f"{victim.name} (led {PLACEMENTS}/{partition} and {len(led) - 1} more)"
    c.watches.append(("writes_resumed_s", killed, led))
    return killed


def two_brokers_kill(down_s: float) -> Scenario:
    """(b) (a), then the placements partition's new leader too, for ``down_s``; then the first back."""
    def scenario(c: Cluster, timeout_s: float) -> float:
        first_progress(c, timeout_s)
        first, partition, led = placements_leader(c)
        killed = c.struck()
        kill_broker(first)
        c.notes["first_resumed_s"] = _wait_resumed(c, killed, led, 90.0)
        alive = {n: b for n, b in brokers(c).items() if n != first.node_id}
        node = leaders(c).get((PLACEMENTS, partition), -1)
        second = alive.get(node) or next(iter(alive.values()))
        second_killed = time.time()
        kill_broker(second)
        time.sleep(down_s)
        back = time.time()
        c.quiet.append(("acked_while_minority", second_killed + ACK_SETTLE_S, back))
        restart_broker(c, first)
        c.notes["killed"] = f"{first.name}, then {second.name} for {down_s:.0f} s; {first.name} restarted"
        c.notes["restart_s"] = round(time.time() - back, 1)
        c.watches.append(("writes_resumed_s", back, None))
        return time.time()
    return scenario


def drive_lost(c: Cluster, timeout_s: float) -> float:
    """(c) Take a MinIO drive away at a running job's round deadline; leave it lost."""
    server = load_minio(c.paths)
    if server is None or server.drives < 4:
        raise Miss("MinIO does not run over several drives")
    job, round_ = at_deadline(c, timeout_s)
    c.notes["target"] = f"{job} round {round_}"
    drive = server.drive_dirs[1]
    c.struck()
    os.rename(drive, drive.with_name(drive.name + ".lost"))
    drive.write_text("this drive is lost\n")   # a plain file: MinIO cannot recreate the drive here
    c.notes["drive"] = f"{drive.name} of {server.drives}"
    return time.time()


REPLICATED_SCENARIOS: dict[str, Scenario] = {
    "replicated_leader_kill": leader_kill,
    "replicated_two_brokers_kill": two_brokers_kill(20.0),
    "replicated_drive_lost": drive_lost,
    "replicated_standby_kill": standby_kill,
    "replicated_standby_freeze": standby_freeze,
}
