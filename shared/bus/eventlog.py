"""Event logs read whole from a bus, and on disk for replay without a broker.

:func:`read_bus` / :func:`fetch_log` are the one way to read every record of some topics
into a list (the CLI's replay, ``hadar demo --record``, the fault harness, the end-to-end
tests).

A log file is a stream of msgpack maps, one per record:
``{"topic", "partition", "offset", "ts_ms", "value"}`` where ``value`` is the record's
bytes exactly as the bus carried them (the event codec's encoding). Reading decodes each
value with ``shared.wire.events.decode``; a record that does not decode is reported, not hidden.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack

from shared.bus import Bus
from shared.errors import HadarError
from shared.wire.events import Event, InvalidEvent, decode, encode
from shared.wire.topics import ALL_TOPICS


@dataclass(frozen=True, kw_only=True)
class LogRecord:
    topic: str
    partition: int
    offset: int
    ts_ms: int
    event: Event


class EventLogError(HadarError):
    """A file that cannot be read as an event log; the message names the file and record."""


def write_log(path: str | Path, records: Iterable[LogRecord]) -> int:
    """Write ``records`` atomically to ``path``; returns how many were written."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    n = 0
    with open(tmp, "wb") as fh:
        packer = msgpack.Packer(use_bin_type=True)
        for r in records:
            fh.write(packer.pack({"topic": r.topic, "partition": r.partition, "offset": r.offset,
                                  "ts_ms": r.ts_ms, "value": encode(r.event)}))
            n += 1
    tmp.replace(target)
    return n


def read_log(path: str | Path) -> Iterator[LogRecord]:
    try:
        fh = open(path, "rb")  # noqa: SIM115 - opened apart to name an unreadable log; closed by "with fh"
    except OSError as exc:
        raise EventLogError(f"cannot read event log {path}: {exc.strerror}") from None
    with fh:
        unpacker = msgpack.Unpacker(fh, raw=False)
        try:
            for i, item in enumerate(unpacker):
                try:
                    yield LogRecord(topic=item["topic"], partition=int(item["partition"]),
                                    offset=int(item["offset"]), ts_ms=int(item["ts_ms"]),
                                    event=decode(item["value"]))
                except (KeyError, TypeError, InvalidEvent) as exc:
                    raise EventLogError(f"{path}: record {i} is not a logged event: {exc}") from None
        except (msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError, ValueError) as exc:
            raise EventLogError(f"{path}: not an event log ({exc})") from None


async def read_bus(bus: Bus, topics: Iterable[str] = ALL_TOPICS) -> list[LogRecord]:
    """Every record of ``topics`` on a started ``bus`` now, as a list: topic after topic in
    the order given, each topic as :meth:`Bus.read` replays it from its start (records
    appended meanwhile are not waited for; undecodable ones are skipped)."""
    records: list[LogRecord] = []
    for topic in topics:
        async for d in bus.read(topic):
            records.append(LogRecord(topic=d.topic, partition=d.partition, offset=d.offset,
                                     ts_ms=d.timestamp_ms, event=d.event))
    return records


async def fetch_log(bus: Bus, topics: Iterable[str] = ALL_TOPICS) -> list[LogRecord]:
    """:func:`read_bus` on a bus of its own: starts ``bus``, reads, and stops it (on error too)."""
    await bus.start()
    try:
        return await read_bus(bus, topics)
    finally:
        await bus.stop()


async def dump_bus(bus: Bus, path: str | Path, topics: Iterable[str] = ALL_TOPICS) -> int:
    """Write every record of ``topics`` currently on ``bus`` to ``path``."""
    return write_log(path, await read_bus(bus, topics))
