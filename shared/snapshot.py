"""State snapshots: a versioned, checksummed file format, and where snapshots are kept.

A service that snapshots writes, every few rounds, its whole state together with the input
offsets that state covers (``"topic:partition" -> next offset``: every record below it is
folded in). A restart loads the newest snapshot that is valid and replays only the records
from those offsets on, so start-up time does not grow with history and records deleted by
retention before the snapshot are not needed.

File format (``FORMAT_VERSION`` 1)::

    8 bytes   MAGIC b"HADARSNP"
    2 bytes   format version, big-endian
    8 bytes   payload length, big-endian
    32 bytes  SHA-256 of the payload
    payload   msgpack (shared.snapshot_codec): {"service", "seq", "created_at", "offsets", "body"}

Guarantees:

* :func:`load` returns a snapshot only if magic, version, length and checksum all hold and
  the payload decodes; anything else -- a truncated (partial) object, a flipped byte,
  another version, another service's snapshot -- raises :class:`SnapshotCorrupt` with the
  reason. A newer format is refused, never guessed at.
* :meth:`SnapshotStore.newest` tries snapshots from the newest down and returns the first
  valid one (with the reasons the newer ones were skipped), or None: a corrupt snapshot
  falls back to the previous one, and with none valid the service replays from the log start.
* :meth:`SnapshotStore.save` writes under ``snapshot_key(owner, seq)``
  (:mod:`shared.layout`; the store publishes an object only when complete), then deletes
  all but the newest ``keep`` snapshots of the owner, so their number stays bounded.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any

from shared.errors import HadarError
from shared.layout import parse_snapshot_key, snapshot_key, snapshot_prefix
from shared.snapshot_codec import SnapshotDecodeError, pack, unpack
from shared.store import ObjectNotFound, ObjectStore

__all__ = ["MAGIC", "FORMAT_VERSION", "StateSnapshot", "SnapshotCorrupt", "dump", "load", "SnapshotStore",
           "DEFAULT_KEEP"]

MAGIC = b"HADARSNP"
FORMAT_VERSION = 1
_HEADER = struct.Struct(">8sHQ32s")
DEFAULT_KEEP = 3


class SnapshotCorrupt(HadarError):
    """Bytes that are not a valid snapshot for this service; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, retriable=False)
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class StateSnapshot:
    """One service's state after it folded every input record below ``offsets``."""

    service: str
    seq: int                       # increases with every snapshot of the service (e.g. its round)
    created_at: float
    offsets: dict[str, int] = field(default_factory=dict)   # "topic:partition" -> next offset
    body: Any = None               # what the service saves (its snapshot module decides)

    def partition_offsets(self, topic: str) -> dict[int, int]:
        """``offsets`` of one topic as ``partition -> offset``, as :meth:`Bus.read` takes a start."""
        found: dict[int, int] = {}
        for tp, offset in self.offsets.items():
            name, _, partition = tp.rpartition(":")
            if name == topic:
                found[int(partition)] = offset
        return found


def dump(snapshot: StateSnapshot) -> bytes:
    """The file bytes of ``snapshot`` (TypeError if its body holds a type the codec cannot carry)."""
    payload = pack({"service": snapshot.service, "seq": snapshot.seq, "created_at": snapshot.created_at,
                    "offsets": dict(snapshot.offsets), "body": snapshot.body})
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest()) + payload


def load(data: bytes, *, service: str) -> StateSnapshot:
    """The snapshot in ``data``; :class:`SnapshotCorrupt` unless it is whole, of this format
    version, with a matching checksum, and ``service``'s."""
    if len(data) < _HEADER.size:
        raise SnapshotCorrupt(f"truncated: {len(data)} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotCorrupt("not a Hadar snapshot (bad magic)")
    if version != FORMAT_VERSION:
        raise SnapshotCorrupt(f"format version {version}; this code reads version {FORMAT_VERSION}")
    payload = data[_HEADER.size:]
    if len(payload) != length:
        raise SnapshotCorrupt(f"payload is {len(payload)} bytes, header says {length} (partial write?)")
    if hashlib.sha256(payload).digest() != digest:
        raise SnapshotCorrupt("checksum mismatch")
    try:
        fields_ = unpack(payload)
    except SnapshotDecodeError as exc:
        raise SnapshotCorrupt(str(exc)) from None
    if not isinstance(fields_, dict) or fields_.get("service") != service:
        found = fields_.get("service") if isinstance(fields_, dict) else None
        raise SnapshotCorrupt(f"a snapshot of {found!r}, not of {service!r}")
    offsets, seq = fields_.get("offsets"), fields_.get("seq")
    if not isinstance(seq, int) or not isinstance(offsets, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in offsets.items()):
        raise SnapshotCorrupt("malformed seq or offsets")
    return StateSnapshot(service=service, seq=seq, created_at=float(fields_.get("created_at", 0.0)),
                         offsets=offsets, body=fields_.get("body"))


@dataclass(frozen=True, kw_only=True)
class Loaded:
    """What :meth:`SnapshotStore.newest` found: the snapshot (None: no valid one) and the
    ``(key, reason)`` of every newer snapshot it skipped."""

    snapshot: StateSnapshot | None
    key: str | None
    skipped: tuple[tuple[str, str], ...] = ()


class SnapshotStore:
    """The snapshots of one ``owner`` (a consumer group id) in an object store."""

    def __init__(self, store: ObjectStore, *, owner: str, service: str, keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.store = store
        self.owner = owner
        self.service = service
        self.keep = keep
        self.prefix = snapshot_prefix(owner)

    async def keys(self) -> list[tuple[int, str]]:
        """(seq, key) of every stored snapshot of the owner, newest first."""
        found = []
        for key in await self.store.list(self.prefix):
            parsed = parse_snapshot_key(key)
            if parsed is not None and parsed[0] == self.owner:
                found.append((parsed[1], key))
        return sorted(found, reverse=True)

    async def save(self, snapshot: StateSnapshot, data: bytes | None = None) -> str:
        """Store ``snapshot`` (``data``: its :func:`dump`, if already made), then delete all
        but the newest ``keep``. Store errors propagate; a failed delete is retried by the next save."""
        key = snapshot_key(self.owner, snapshot.seq)
        await self.store.put(key, data if data is not None else dump(snapshot))
        for _, old in (await self.keys())[self.keep:]:
            try:
                await self.store.delete(old)
            except ObjectNotFound:
                pass
        return key

    async def newest(self) -> Loaded:
        """The newest valid snapshot, falling back past corrupt ones (see the module)."""
        skipped: list[tuple[str, str]] = []
        for _, key in await self.keys():
            try:
                data = await self.store.get(key)
                return Loaded(snapshot=load(data, service=self.service), key=key, skipped=tuple(skipped))
            except SnapshotCorrupt as exc:
                skipped.append((key, exc.reason))
            except ObjectNotFound:
                skipped.append((key, "deleted while listed"))
        return Loaded(snapshot=None, key=None, skipped=tuple(skipped))
