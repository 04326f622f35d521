"""Acknowledged records, recorded at ack time, for the fault benchmark (issue 28 item 5).

A service of the fault harness runs as ``python -m benchmarks.fault_acks serve ...``: this
module installs a journal into the bus, then runs ``hadar`` (``services.cli.main``) as
usual. Every record the process's producers get an acknowledgement for -- a plain publish
once its awaitable resolved (``acks=all``: the in-sync replicas have it), a fenced batch
once its transaction committed -- is appended to the journal named by
:data:`JOURNAL_ENV` as one JSON line (event id, topic, partition, offset, unix time seen, the event's own ts),
written with one ``write`` to an ``O_APPEND`` file: a process SIGKILLed after an ack has
the line in the page cache already. Nothing in the services changes: the journal wraps
:meth:`Bus.publish_pipelined` and :meth:`KafkaFencedPublisher.publish_all`, the two ways
an event reaches Kafka. The harness journals its own publishes (submissions, forged
events) the same way (:func:`open_journal`).

After a scenario, :func:`acked_lost` counts journal ids that are not in the topics read
back (must be 0), and :func:`fencing_violations` counts records a superseded scheduler
replica published after its successor had (must be 0).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOURNAL_ENV = "HADAR_FAULTS_ACK_JOURNAL"
FENCED_TOPICS = ("hadar.placements", "hadar.leadership")   # what only the active scheduler writes

__all__ = ["JOURNAL_ENV", "Ack", "Journal", "open_journal", "close_journal", "read_acks", "acked_lost",
           "fencing_violations", "term_regressions"]


@dataclass(frozen=True, kw_only=True)
class Ack:
    """One acknowledged record: ``writer`` is the journal's name (service and start)."""

    writer: str
    id: str
    topic: str
    partition: int
    offset: int
    at: float
    created: float = 0.0   # the event's ts: when its producer made it


class Journal:
    """An append-only file of acknowledged records."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(self, entries: Iterable[tuple[str, str, int, int, float]]) -> None:
        """``(event id, topic, partition, offset, event ts)`` of records acknowledged just now."""
        import time

        now = time.time()
        lines = "".join(json.dumps({"id": i, "topic": t, "partition": p, "offset": o, "at": now, "ts": ts}) + "\n"
                        for i, t, p, o, ts in entries)
        if lines:
            os.write(self._fd, lines.encode())

    def close(self) -> None:
        os.close(self._fd)


_journal: Journal | None = None
_installed = False
_originals: tuple[Any, Any] = (None, None)


def open_journal(path: Path) -> Journal:
    """Journal this process's acknowledged records to ``path`` from now on (the bus is
    wrapped once; :func:`close_journal` stops the recording)."""
    global _journal
    _install()
    if _journal is not None:
        _journal.close()
    _journal = Journal(path)
    return _journal


def close_journal() -> None:
    """Stop journaling and unwrap the bus (as before :func:`open_journal`)."""
    global _journal, _installed
    if _journal is not None:
        _journal.close()
    _journal = None
    if _installed:
        from shared.bus.base import Bus
        from shared.bus.kafka_fencing import KafkaFencedPublisher

        Bus.publish_pipelined, KafkaFencedPublisher.publish_all = _originals   # type: ignore[method-assign]
        _installed = False


def _install() -> None:
    global _installed, _originals
    if _installed:
        return
    from shared.bus.base import Bus
    from shared.bus.kafka_fencing import KafkaFencedPublisher
    from shared.wire.events import Event, topic_for

    pipelined = Bus.publish_pipelined
    publish_all = KafkaFencedPublisher.publish_all
    _originals = (pipelined, publish_all)

    async def publish_pipelined(self: Bus, event: Event, *, topic: str | None = None,
                                key: str | None = None) -> Awaitable[tuple[int, int]]:
        durable = await pipelined(self, event, topic=topic, key=key)
        name = topic if topic is not None else topic_for(event)

        async def acknowledged() -> tuple[int, int]:
            partition, offset = await durable
            if _journal is not None:
                _journal.record([(event.id, name, partition, offset, event.ts)])
            return partition, offset
        return acknowledged()

    async def fenced_publish_all(self: KafkaFencedPublisher, events: Sequence[Event]) -> list[tuple[int, int]]:
        placed = await publish_all(self, events)
        if _journal is not None:
            _journal.record((e.id, topic_for(e), p, o, e.ts) for e, (p, o) in zip(events, placed))
        return placed

    Bus.publish_pipelined = publish_pipelined   # type: ignore[method-assign]
    KafkaFencedPublisher.publish_all = fenced_publish_all   # type: ignore[method-assign]
    _installed = True


def read_acks(directory: Path) -> list[Ack]:
    """Every journal line under ``directory`` (``<writer>.jsonl``); a torn last line is skipped."""
    acks: list[Ack] = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                item: dict[str, Any] = json.loads(line)
                acks.append(Ack(writer=path.stem, id=item["id"], topic=item["topic"],
                                partition=int(item["partition"]), offset=int(item["offset"]), at=float(item["at"]),
                                created=float(item.get("ts", 0.0))))
            except (ValueError, KeyError, TypeError):
                continue
    return acks


def acked_lost(acks: Iterable[Ack], read_back_ids: Iterable[str]) -> int:
    """Acknowledged event ids not found among the ids read back from the topics."""
    return len({a.id for a in acks} - set(read_back_ids))


def fencing_violations(acks: Sequence[Ack], old: str, new: str, topics: Sequence[str] = FENCED_TOPICS) -> int:
    """Records the superseded writer ``old`` got acknowledged on ``topics`` after its successor
    ``new`` had published on the same partition (by offset: the order every consumer sees)."""
    first: dict[tuple[str, int], int] = {}
    for a in acks:
        if a.writer == new and a.topic in topics:
            key = (a.topic, a.partition)
            first[key] = min(first.get(key, a.offset), a.offset)
    return sum(1 for a in acks if a.writer == old and a.topic in topics
               and a.offset > first.get((a.topic, a.partition), a.offset))


def term_regressions(renewals: Iterable[tuple[int, int, int]]) -> int:
    """``(partition, offset, term)`` of every scheduler LeaderRenewed: renewals of an older
    term that come after a newer term's in their partition (a fenced replica that published)."""
    newest: dict[int, int] = {}
    regressions = 0
    for partition, _, term in sorted(renewals):
        if term < newest.get(partition, 0):
            regressions += 1
        newest[partition] = max(newest.get(partition, 0), term)
    return regressions


def main(argv: list[str]) -> int:
    """``hadar ARGS`` with this process's acknowledged records journaled to ``$HADAR_FAULTS_ACK_JOURNAL``."""
    path = os.environ.get(JOURNAL_ENV)
    if path:
        open_journal(Path(path))
    from services.cli.main import main as hadar

    return hadar(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
