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
    payload   msgpack (shared.persistence.codec): {"service", "seq", "created_at", "offsets", "body"}

Guarantees:

* :func:`load` returns a snapshot only if magic, version, length and checksum all hold and
  the payload decodes; anything else -- a truncated (partial) object, a flipped byte,
  another version, another service's snapshot -- raises :class:`SnapshotCorrupt` with the
  reason. A newer format is refused, never guessed at.
* :meth:`SnapshotStore.recover` tries snapshots from the newest down and returns the first
  one that is valid and that the service's restore function accepts (with the reasons the
  newer ones were skipped), or none: a corrupt, partial or refused snapshot falls back to
  the previous one, and with none valid the service replays from the log start.
* :meth:`SnapshotStore.save` numbers a snapshot past every stored one, encodes it off the
  event loop and writes it under ``snapshot_key(owner, seq)`` (:mod:`shared.domain.layout`; the
  store publishes an object only when complete), then deletes all but the newest ``keep``
  snapshots of the owner, so their number stays bounded.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import structlog

from shared.domain.layout import parse_snapshot_key, snapshot_key, snapshot_prefix
from shared.errors import HadarError
from shared.persistence.codec import SnapshotDecodeError, pack, unpack
from shared.store import ObjectNotFound, ObjectStore

__all__ = ["MAGIC", "FORMAT_VERSION", "StateSnapshot", "SnapshotCorrupt", "dump", "load", "SnapshotStore",
           "Recovered", "Saved", "DEFAULT_KEEP"]

MAGIC = b"HADARSNP"
FORMAT_VERSION = 1
_HEADER = struct.Struct(">8sHQ32s")
DEFAULT_KEEP = 3
T = TypeVar("T")


class SnapshotCorrupt(HadarError):
    """Bytes that are not a valid snapshot for this service; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, retriable=False)
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class StateSnapshot:
    """One service's state after it folded every input record below ``offsets``."""

    service: str
    seq: int = 0                   # its number in the store (SnapshotStore.save sets it; newer is larger)
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
class Recovered(Generic[T]):
    """What :meth:`SnapshotStore.recover` found. ``snapshot``/``key``/``value`` are None
    when no snapshot was valid and restorable (or the store was away: ``unavailable`` says
    why); ``skipped`` holds ``(key, reason)`` of every newer snapshot passed over."""

    snapshot: StateSnapshot | None = None
    key: str | None = None
    value: T | None = None
    skipped: tuple[tuple[str, str], ...] = ()
    unavailable: str | None = None

    def start(self, topic: str) -> dict[int, int] | None:
        """Where to read ``topic`` from: the snapshot's offsets (a partition it does not
        name: from the start), or None (the whole topic) without a snapshot."""
        return self.snapshot.partition_offsets(topic) if self.snapshot is not None else None

    def recovery(self) -> dict[str, Any]:
        """The ``snapshot`` and ``skipped`` keys of a service's ``recovery`` report."""
        return {"snapshot": self.key, "skipped": [key for key, _ in self.skipped]}


@dataclass(frozen=True, kw_only=True)
class Saved:
    """A snapshot :meth:`SnapshotStore.save` stored: its key, its number and its size."""

    key: str
    seq: int
    bytes: int
    snapshot: StateSnapshot


class SnapshotStore:
    """The snapshots of one ``owner`` (a consumer group id) in an object store: the one way
    a service numbers, writes, lists and recovers its snapshots.

    Numbering: every snapshot is numbered one past the largest number stored for the owner
    (1 in an empty store), whatever wrote it, so a new snapshot is always the newest. Keys
    written by earlier code -- the scheduler named them by round, the profiler by clock
    milliseconds, the tracker by its own counter -- are all ``{seq}.snapshot`` names with a
    larger number for a newer snapshot, so they load and order as before, and the first
    snapshot written after them is numbered past them. Warnings are logged as
    ``{service}.snapshot_skipped`` and ``{service}.snapshot_unavailable``.
    """

    def __init__(self, store: ObjectStore, *, owner: str, service: str, keep: int = DEFAULT_KEEP,
                 log: Any = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.store = store
        self.owner = owner
        self.service = service
        self.keep = keep
        self.prefix = snapshot_prefix(owner)
        self._log = log if log is not None else structlog.get_logger(__name__).bind(service=service)

    async def keys(self) -> list[tuple[int, str]]:
        """(seq, key) of every stored snapshot of the owner, newest first."""
        found = []
        for key in await self.store.list(self.prefix):
            parsed = parse_snapshot_key(key)
            if parsed is not None and parsed[0] == self.owner:
                found.append((parsed[1], key))
        return sorted(found, reverse=True)

    async def save(self, capture: Callable[[], StateSnapshot | None], *,
                   hold: AbstractAsyncContextManager[Any] | None = None) -> Saved | None:
        """Capture and store a snapshot numbered past every stored one, then delete all but
        the newest ``keep``; None if ``capture`` returned None (nothing to write now).

        ``capture`` is called and its snapshot encoded (:func:`dump`, in a worker thread, off
        the event loop) while ``hold`` is held: a capture that does not copy the state must
        pass the lock its folds take, so that nothing changes the state until it is
        encoded. Whatever ``seq`` the capture set is replaced by the store's number. Store
        and encoding errors propagate; a failed delete is retried by the next save."""
        stored = await self.keys()
        seq = stored[0][0] + 1 if stored else 1
        async with hold if hold is not None else nullcontext():
            snapshot = capture()
            if snapshot is None:
                return None
            snapshot = replace(snapshot, seq=seq)
            data = await asyncio.to_thread(dump, snapshot)
        key = snapshot_key(self.owner, seq)
        await self.store.put(key, data)
        for _, old in stored[self.keep - 1:]:
            try:
                await self.store.delete(old)
            except ObjectNotFound:
                pass
        return Saved(key=key, seq=seq, bytes=len(data), snapshot=snapshot)

    async def recover(self, restore: Callable[[StateSnapshot], T]) -> Recovered[T]:
        """The newest snapshot that is valid *and* that ``restore`` accepts, with what
        ``restore`` made of it.

        Snapshots are tried from the newest down; each is decoded off the event loop and
        passed to ``restore``, which returns what the service adopts (or adopts it itself)
        and raises :class:`SnapshotCorrupt` -- having changed nothing -- for a body it
        cannot take. A corrupt, partial or refused snapshot is logged and skipped for the
        one before it; with none left the service replays its topics from the start. A
        store that cannot be listed or read is logged and reported as ``unavailable`` (the
        service then replays from the start too). Only an error of ``restore`` other than
        SnapshotCorrupt (a bug) propagates."""
        skipped: list[tuple[str, str]] = []
        try:
            stored = await self.keys()
        except Exception as exc:   # a store that is away: recover from the whole log instead
            return self._unavailable(exc, skipped)
        for _, key in stored:
            try:
                data = await self.store.get(key)
            except ObjectNotFound:
                skipped.append((key, "deleted while listed"))
                continue
            except Exception as exc:
                return self._unavailable(exc, skipped)
            try:
                snapshot = await asyncio.to_thread(load, data, service=self.service)
                value = restore(snapshot)
            except SnapshotCorrupt as exc:
                skipped.append((key, exc.reason))
                continue
            self._log_skipped(skipped)
            return Recovered(snapshot=snapshot, key=key, value=value, skipped=tuple(skipped))
        self._log_skipped(skipped)
        return Recovered(skipped=tuple(skipped))

    def _unavailable(self, exc: Exception, skipped: list[tuple[str, str]]) -> Recovered[Any]:
        reason = f"{type(exc).__name__}: {exc}"[:300]
        self._log_skipped(skipped)
        self._log.warning(f"{self.service}.snapshot_unavailable", error=reason)
        return Recovered(skipped=tuple(skipped), unavailable=reason)

    def _log_skipped(self, skipped: list[tuple[str, str]]) -> None:
        for key, reason in skipped:
            self._log.warning(f"{self.service}.snapshot_skipped", key=key, reason=reason[:300])
