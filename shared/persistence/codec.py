"""State values as msgpack and back: the one module that encodes what a snapshot holds.

A service's state is a tree of Python values -- dicts keyed by tuples, sets, deques,
frozen dataclasses, events, numpy arrays (Hadar's ledger). :func:`pack` writes such a
tree as msgpack, :func:`unpack` gives back an equal tree of the same types. Guarantees:

* **Exact types.** Native msgpack carries only exact ``None``/``bool``/``int``/``float``/
  ``str``/``bytes``/``list`` and ``dict`` with ``str`` keys; everything else travels as an
  ext type with a tag (below), so a tuple comes back a tuple, a ``numpy.float64`` a
  ``numpy.float64``, a set a set, a deque a deque with its ``maxlen``.
* **Nothing is imported or called by name from the data.** Objects (dataclasses and plain
  classes) and enums are written under the stable name they were registered with
  (:func:`snapshot_type`, next to the class: ``"policy.hadar.LedgerState"``), never their
  module path, so moving or renaming a module changes nothing on disk; decoding an
  unregistered name fails. ``formerly`` lists the names earlier versions wrote (module paths
  before names were stable), so their snapshots still load. Wire records (``JobSpec``...) are
  registered here, as ``"wire.<Class>"``. Instances are rebuilt without calling ``__init__``
  (attributes set one by one), so a class's constructor checks and side effects do not run
  twice. Events travel as their own wire form (:func:`shared.wire.events.encode`) and are
  decoded and validated by :func:`shared.wire.events.decode`; nested records (``JobSpec``) by
  their codec. numpy arrays only of numeric or bool dtypes (never ``object``), as raw bytes.
* **Fail closed.** Anything :func:`unpack` cannot rebuild raises :class:`SnapshotDecodeError`.
  Integrity (checksums, versions) is the format's job: :mod:`shared.persistence.snapshot`.
"""

from __future__ import annotations

import enum
import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import MISSING, fields, is_dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import msgpack
import numpy as np

from shared.errors import HadarError
from shared.wire.events import Event, decode, encode
from shared.wire.queues import QueueConfig, QueueSpec, QueueStanding
from shared.wire.records import (
    CopyWeight,
    GpuInfo,
    Hyperparameters,
    InvalidEvent,
    JobSpec,
    Record,
    Rejection,
    Waiting,
    to_wire,
)

__all__ = ["SnapshotDecodeError", "snapshot_type", "register", "registered", "name_of", "pack", "unpack"]

_TUPLE, _SET, _FROZENSET, _UNUSED, _OBJECT, _ENUM, _NDARRAY, _NPSCALAR, _EVENT, _RECORD, _DEQUE, _PROXY = range(1, 13)
_ALLOWED_KINDS = frozenset("biuf")   # numpy dtype kinds: bool, int, uint, float

_BY_NAME: dict[str, type] = {}   # current and former names -> class
_NAME_OF: dict[type, str] = {}   # class -> the name it is written under
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
T = TypeVar("T", bound=type)


class SnapshotDecodeError(HadarError):
    """Snapshot bytes that do not decode to a state (corrupt, or written by other code)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retriable=False)


def register(cls: type, name: str, *, formerly: str | Iterable[str] = ()) -> None:
    """Allow instances of ``cls`` (a dataclass, plain class, enum or record) in a snapshot,
    written under ``name`` and read under ``name`` or any of ``formerly``. Idempotent; two
    classes under one name, or one class under two, is a programming error (ValueError)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"snapshot name {name!r}: dotted identifiers only")
    if _NAME_OF.get(cls, name) != name:
        raise ValueError(f"{cls.__qualname__} is already registered as {_NAME_OF[cls]!r}")
    for alias in (name, *([formerly] if isinstance(formerly, str) else formerly)):
        known = _BY_NAME.get(alias)
        if known is not None and known is not cls:
            raise ValueError(f"two classes registered as {alias!r}: {known.__qualname__}, {cls.__qualname__}")
        _BY_NAME[alias] = cls
    _NAME_OF[cls] = name


def snapshot_type(name: str, *, formerly: str | Iterable[str] = ()) -> Callable[[T], T]:
    """Class decorator: :func:`register` the class under ``name``."""
    def mark(cls: T) -> T:
        register(cls, name, formerly=formerly)
        return cls
    return mark


def name_of(cls: type) -> str | None:
    """The name ``cls`` is written under, None if it is not registered."""
    return _NAME_OF.get(cls)


def registered() -> frozenset[str]:
    """The names snapshots are written under (former names apart)."""
    return frozenset(_NAME_OF.values())


def pack(value: Any) -> bytes:
    """``value`` as msgpack; TypeError for a value of a type this module cannot carry."""
    packed: bytes = msgpack.packb(value, use_bin_type=True, strict_types=True, default=_default)
    return packed


def unpack(data: bytes) -> Any:
    """The value :func:`pack` wrote; :class:`SnapshotDecodeError` for anything else."""
    try:
        # Map keys may be any carried hashable value (tuples, ints): dicts are packed natively.
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_ext_hook)
    except SnapshotDecodeError:
        raise
    except Exception as exc:   # msgpack and rebuilding raise many types; all mean "corrupt"
        raise SnapshotDecodeError(f"snapshot state does not decode: {type(exc).__name__}: {exc}"[:300]) from None


def _ext(tag: int, value: Any) -> msgpack.ExtType:
    return msgpack.ExtType(tag, pack(value))


def _default(value: Any) -> Any:
    t = type(value)
    if t is tuple:
        return _ext(_TUPLE, list(value))
    if t is set:
        return _ext(_SET, list(value))
    if t is frozenset:
        return _ext(_FROZENSET, list(value))
    if t is deque:
        return _ext(_DEQUE, [value.maxlen, list(value)])
    if t is MappingProxyType:
        return _ext(_PROXY, dict(value))
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _ALLOWED_KINDS:
            raise TypeError(f"numpy array of dtype {value.dtype} cannot be snapshot")
        return _ext(_NDARRAY, [value.dtype.str, list(value.shape), np.ascontiguousarray(value).tobytes()])
    if isinstance(value, np.generic):
        if value.dtype.kind not in _ALLOWED_KINDS:
            raise TypeError(f"numpy scalar of dtype {value.dtype} cannot be snapshot")
        return _ext(_NPSCALAR, [value.dtype.str, value.tobytes()])
    if isinstance(value, Event):
        return msgpack.ExtType(_EVENT, encode(value))
    name = _NAME_OF.get(t)
    if name is None:
        raise TypeError(f"{t.__module__}.{t.__qualname__} is not registered for snapshots")
    if isinstance(value, enum.Enum):
        return _ext(_ENUM, [name, value.value])
    if isinstance(value, Record):
        return _ext(_RECORD, [name, to_wire(value)])
    return _ext(_OBJECT, [name, _attributes(value)])


def _attributes(value: Any) -> dict[str, Any]:
    if is_dataclass(value):
        return {f.name: getattr(value, f.name) for f in fields(value)}
    return dict(vars(value))


def _cls(name: Any) -> type:
    cls = _BY_NAME.get(name) if type(name) is str else None
    if cls is None:
        raise SnapshotDecodeError(f"snapshot names a class not registered: {str(name)[:120]!r}")
    return cls


def _ext_hook(tag: int, data: bytes) -> Any:
    if tag == _EVENT:
        try:
            return decode(data)
        except InvalidEvent as exc:
            raise SnapshotDecodeError(f"snapshot event: {exc}") from None
    value = unpack(data)
    if tag == _TUPLE:
        return tuple(value)
    if tag == _SET:
        return set(value)
    if tag == _FROZENSET:
        return frozenset(value)
    if tag == _DEQUE:
        maxlen, items = value
        return deque(items, maxlen)
    if tag == _PROXY:
        return MappingProxyType(value)
    if tag == _NDARRAY:
        dtype, shape, raw = value
        dt = np.dtype(dtype)
        if dt.kind not in _ALLOWED_KINDS:
            raise SnapshotDecodeError(f"snapshot array of dtype {dtype!r}")
        return np.frombuffer(raw, dtype=dt).reshape(shape).copy()
    if tag == _NPSCALAR:
        dtype, raw = value
        dt = np.dtype(dtype)
        if dt.kind not in _ALLOWED_KINDS:
            raise SnapshotDecodeError(f"snapshot scalar of dtype {dtype!r}")
        return np.frombuffer(raw, dtype=dt)[0]
    if tag == _ENUM:
        name, raw = value
        return _cls(name)(raw)
    if tag == _RECORD:
        name, wire = value
        cls = _cls(name)
        from shared.wire.record_codec import codec
        try:
            return codec(cls).from_wire(wire, cls.__name__)
        except InvalidEvent as exc:
            raise SnapshotDecodeError(f"snapshot record: {exc}") from None
    if tag == _OBJECT:
        name, attributes = value
        cls = _cls(name)
        obj: object = object.__new__(cls)
        for attr, item in attributes.items():
            object.__setattr__(obj, attr, item)
        if is_dataclass(cls):
            _fill_added_fields(obj, cls, attributes)
        return obj
    raise SnapshotDecodeError(f"snapshot has an unknown ext type {tag}")


def _fill_added_fields(obj: Any, cls: type, attributes: dict[str, Any]) -> None:
    """A field added to ``cls`` since the snapshot was written takes its default, so a
    service restores what its previous version wrote; one without a default is refused."""
    for f in fields(cls):
        if f.name in attributes:
            continue
        if f.default is not MISSING:
            object.__setattr__(obj, f.name, f.default)
        elif f.default_factory is not MISSING:
            object.__setattr__(obj, f.name, f.default_factory())
        else:
            raise SnapshotDecodeError(f"snapshot {cls.__name__} lacks field {f.name!r}, which has no default")


for _record in (JobSpec, Hyperparameters, GpuInfo, Waiting, CopyWeight, Rejection):
    register(_record, f"wire.{_record.__name__}", formerly=f"shared.records.{_record.__name__}")
for _new in (QueueSpec, QueueConfig, QueueStanding):
    register(_new, f"wire.{_new.__name__}")
