"""Event logs on disk, for replay without a broker.

A log file is a stream of msgpack maps, one per record:
``{"topic", "partition", "offset", "ts_ms", "value"}`` where ``value`` is the record's
bytes exactly as the bus carried them (the event codec's encoding). Reading decodes each
value with ``shared.events.decode``; a record that does not decode is reported, not hidden.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack

from shared.bus import Bus
from shared.errors import HadarError
from shared.events import Event, InvalidEvent, decode, encode
from shared.topics import ALL_TOPICS


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
        fh = open(path, "rb")
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


async def dump_bus(bus: Bus, path: str | Path, topics: Iterable[str] = ALL_TOPICS) -> int:
    """Write every record of ``topics`` currently on ``bus`` to ``path``."""
    records: list[LogRecord] = []
    for topic in topics:
        async for d in bus.read(topic):
            records.append(LogRecord(topic=d.topic, partition=d.partition, offset=d.offset,
                                     ts_ms=d.timestamp_ms, event=d.event))
    return write_log(path, records)
