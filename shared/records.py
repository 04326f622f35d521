"""Self-validating frozen records: the typing rules behind the event contract.

A ``Record`` is a frozen keyword-only dataclass whose fields are checked against their
annotations when it is built (``str``, ``int`` within 64 bits, finite ``float``, ``bool``,
``bytes``, ``X | None``, ``tuple[X, ...]``, ``dict[str, X]``, ``Literal[...]``, nested
records) and by its ``_check`` for ranges, so an invalid record cannot exist in memory.
Every failure is an :class:`InvalidEvent` whose ``reason`` names the field. The wire
format itself belongs to :mod:`shared.events`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.errors import HadarError

__all__ = [
    "InvalidEvent", "Record", "Hyperparameters", "JobSpec", "GpuInfo", "Waiting", "CopyWeight",
    "Rejection", "JOB_ID_RE", "NODE_ID_RE", "new_event_id", "to_wire", "require", "check_job_id",
    "check_node_id", "short_repr",
]

JOB_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")



class InvalidEvent(HadarError, ValueError):
    """Bytes or fields that do not make a valid event. ``reason`` says why.

    Also a ``ValueError``, as ``shared.events`` documents: code that validates a value and
    catches ``ValueError`` treats a bad event field like any other bad value.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def new_event_id() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------- typed conversion

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = hints = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return hints


_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1   # what msgpack can carry


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_REQUIRED: dict[type, frozenset[str]] = {}


def _required(cls: type) -> frozenset[str]:
    required = _REQUIRED.get(cls)
    if required is None:
        required = _REQUIRED[cls] = frozenset(
            f.name for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return required


def _convert(hint: Any, value: Any, path: str) -> Any:
    """Check ``value`` against ``hint``; return it in its canonical Python form."""
    if hint is str:
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise InvalidEvent(f"{path}: not valid UTF-8 text") from None
            return value
        raise InvalidEvent(f"{path}: expected str, got {type(value).__name__}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not _INT_MIN <= value <= _INT_MAX:
                raise InvalidEvent(f"{path}: integer out of the 64-bit range")
            return value
        raise InvalidEvent(f"{path}: expected int, got {type(value).__name__}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise InvalidEvent(f"{path}: must be a finite number, got {value!r}")
            return float(value)
        raise InvalidEvent(f"{path}: expected float, got {type(value).__name__}")
    origin = typing.get_origin(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is bytes:
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
    elif origin is Literal:
        if isinstance(value, str) and value in typing.get_args(hint):
            return value
        raise InvalidEvent(f"{path}: must be one of {list(typing.get_args(hint))}, got {short_repr(value)}")
    elif origin in (types.UnionType, typing.Union):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path)
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            item = typing.get_args(hint)[0]
            return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    elif origin is dict:
        if isinstance(value, dict):
            key_t, val_t = typing.get_args(hint)
            out = {}
            for k, v in value.items():
                out[_convert(key_t, k, f"{path} key")] = _convert(val_t, v, f"{path}[{k!r}]")
            return out
    elif isinstance(hint, type) and issubclass(hint, Record):
        if isinstance(value, hint):
            return value
        if isinstance(value, dict):
            return hint._from_wire(value, path)
    else:  # pragma: no cover - a programming error in this module
        raise TypeError(f"unsupported annotation {hint!r} at {path}")
    raise InvalidEvent(f"{path}: expected {_type_name(hint)}, got {type(value).__name__}")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)


def to_wire(value: Any) -> Any:
    if isinstance(value, Record):
        return {f.name: to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


@dataclass(frozen=True, kw_only=True)
class Record:
    """A frozen, self-validating record; base of events and of their nested parts."""

    def __post_init__(self) -> None:
        cls = type(self)
        for name, hint in _hints(cls).items():
            value = getattr(self, name)
            converted = _convert(hint, value, f"{cls.__name__}.{name}")
            if converted is not value:
                object.__setattr__(self, name, converted)
        self._check()

    def _check(self) -> None:
        """Range checks beyond the annotations; raise InvalidEvent."""

    @classmethod
    def _from_wire(cls, data: dict, path: str) -> "Record":
        names = _hints(cls)
        unknown = [k for k in data if k not in names]
        if unknown:
            raise InvalidEvent(f"{path}: unknown field {short_repr(unknown[0])}")
        missing = sorted(_required(cls) - set(data))
        if missing:
            raise InvalidEvent(f"{path}: missing field {missing[0]!r}")
        try:
            return cls(**data)
        except InvalidEvent:
            raise
        except (TypeError, ValueError) as exc:  # defensive: never leak another error type
            raise InvalidEvent(f"{path}: {exc}") from None


def require(cond: bool, reason: str) -> None:
    if not cond:
        raise InvalidEvent(reason)


def check_job_id(job_id: str, where: str) -> None:
    require(bool(JOB_ID_RE.match(job_id)),
             f"{where}.job_id: {job_id!r} must be 1-63 chars of lowercase letters, digits, "
             "'-', '_', '.', starting with a letter or digit")


def check_node_id(node_id: str, where: str) -> None:
    require(bool(NODE_ID_RE.match(node_id)),
             f"{where}.node_id: {node_id!r} must be 1-63 chars of letters, digits, '-', '_', '.'")


# ---------------------------------------------------------------- nested records


@dataclass(frozen=True, kw_only=True)
class Hyperparameters(Record):
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = 0.05
    seed: int = 0

    def _check(self) -> None:
        require(0 < self.lr <= 10, f"Hyperparameters.lr: must be in (0, 10], got {self.lr}")
        require(0 <= self.seed < 2**32, f"Hyperparameters.seed: must be in [0, 2^32), got {self.seed}")


@dataclass(frozen=True, kw_only=True)
class JobSpec(Record):
    """What a user asks for: everything the scheduler and the agents need to run a job."""

    job_id: str
    user: str
    model: str
    dataset: str
    batch_size: int
    workers: int
    iterations: int
    priority: float = 1.0
    deadline_s: float | None = None
    hyper: Hyperparameters = field(default_factory=Hyperparameters)

    def _check(self) -> None:
        check_job_id(self.job_id, "JobSpec")
        require(0 < len(self.user) <= 64, "JobSpec.user: must be 1-64 characters")
        require(0 < len(self.model) <= 64, "JobSpec.model: must be 1-64 characters")
        require(0 < len(self.dataset) <= 64, "JobSpec.dataset: must be 1-64 characters")
        require(1 <= self.batch_size <= 65536, f"JobSpec.batch_size: must be in 1..65536, got {self.batch_size}")
        require(1 <= self.workers <= 64, f"JobSpec.workers: must be in 1..64, got {self.workers}")
        require(1 <= self.iterations <= 10**12, f"JobSpec.iterations: must be in 1..10^12, got {self.iterations}")
        require(0 < self.priority <= 1000, f"JobSpec.priority: must be in (0, 1000], got {self.priority}")
        require(self.deadline_s is None or self.deadline_s > 0, "JobSpec.deadline_s: must be > 0")

    @property
    def job_type(self) -> str:
        """Throughput-table key of this job, e.g. ``resnet (batch size 32)``."""
        return f"{self.model} (batch size {self.batch_size})"


@dataclass(frozen=True, kw_only=True)
class GpuInfo(Record):
    index: int
    type: str
    memory_gb: float = 0.0

    def _check(self) -> None:
        require(0 <= self.index < 1024, f"GpuInfo.index: must be in 0..1023, got {self.index}")
        require(0 < len(self.type) <= 32, "GpuInfo.type: must be 1-32 characters")


@dataclass(frozen=True, kw_only=True)
class Waiting(Record):
    """A job the round left waiting, and why (``code`` is a policy WaitCode value)."""

    job_id: str
    code: str
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class CopyWeight(Record):
    copy: int
    steps: int
    weight: float


@dataclass(frozen=True, kw_only=True)
class Rejection(Record):
    copy: int
    reason: str

