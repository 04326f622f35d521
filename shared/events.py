"""Every event Hadar's services exchange, and the only code that turns them into bytes.

Wire format: one msgpack map per event::

    {"type": "Progress", "v": 1, "id": "<hex>", "ts": <unix s>, "source": "agent/n1",
     "body": {...the event's own fields...}}

Guarantees:

* ``decode(encode(e)) == e`` for every valid event.
* ``decode`` raises :class:`InvalidEvent` (a ``ValueError``) for any input it cannot
  accept -- not msgpack, a wrong envelope, an unknown type or version, a missing,
  unknown, mistyped or out-of-range field -- and never any other exception. Its
  ``reason`` names what was wrong, so the bus can dead-letter the record with it.
* Constructing an event with a wrong field raises the same ``InvalidEvent``: an invalid
  event cannot exist in memory, so it can never be published.

Records are frozen keyword-only dataclasses; field types are checked from their
annotations (``str``, ``int``, ``float``, ``bool``, ``bytes``, ``X | None``,
``tuple[X, ...]``, ``dict[str, X]``, ``Literal[...]`` and nested records), ranges by each
class's ``_check``. ``id`` defaults to a random UUID (it is only used for idempotence);
``ts`` and ``source`` are always given by the caller, from its clock and its name.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import msgpack

__all__ = [
    "InvalidEvent", "Record", "Event", "Hyperparameters", "JobSpec", "GpuInfo", "Waiting",
    "CopyWeight", "Rejection", "JobSubmitted", "JobCancelled", "NodeRegistered",
    "NodeHeartbeat", "ThroughputEstimate", "RoundStarted", "Assignment", "Progress",
    "CopyFinished", "ModelConsolidated", "JobCompleted", "DeadLetter", "EVENT_TYPES",
    "TOPICS", "topic_for", "key_for", "encode", "decode", "JOB_ID_RE",
]

JOB_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
DEADLETTER_RAW_LIMIT = 1024
_MAX_WIRE_BYTES = 16 * 1024 * 1024


class InvalidEvent(ValueError):
    """Bytes or fields that do not make a valid event. ``reason`` says why."""

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


def _short_repr(value: Any) -> str:
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
        raise InvalidEvent(f"{path}: must be one of {list(typing.get_args(hint))}, got {_short_repr(value)}")
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


def _to_wire(value: Any) -> Any:
    if isinstance(value, Record):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
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
            raise InvalidEvent(f"{path}: unknown field {_short_repr(unknown[0])}")
        missing = sorted(_required(cls) - set(data))
        if missing:
            raise InvalidEvent(f"{path}: missing field {missing[0]!r}")
        try:
            return cls(**data)
        except InvalidEvent:
            raise
        except (TypeError, ValueError) as exc:  # defensive: never leak another error type
            raise InvalidEvent(f"{path}: {exc}") from None


def _require(cond: bool, reason: str) -> None:
    if not cond:
        raise InvalidEvent(reason)


def _check_job_id(job_id: str, where: str) -> None:
    _require(bool(JOB_ID_RE.match(job_id)),
             f"{where}.job_id: {job_id!r} must be 1-63 chars of lowercase letters, digits, "
             "'-', '_', '.', starting with a letter or digit")


def _check_node_id(node_id: str, where: str) -> None:
    _require(bool(NODE_ID_RE.match(node_id)),
             f"{where}.node_id: {node_id!r} must be 1-63 chars of letters, digits, '-', '_', '.'")


# ---------------------------------------------------------------- nested records


@dataclass(frozen=True, kw_only=True)
class Hyperparameters(Record):
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = 0.05
    seed: int = 0

    def _check(self) -> None:
        _require(0 < self.lr <= 10, f"Hyperparameters.lr: must be in (0, 10], got {self.lr}")
        _require(0 <= self.seed < 2**32, f"Hyperparameters.seed: must be in [0, 2^32), got {self.seed}")


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
        _check_job_id(self.job_id, "JobSpec")
        _require(0 < len(self.user) <= 64, "JobSpec.user: must be 1-64 characters")
        _require(0 < len(self.model) <= 64, "JobSpec.model: must be 1-64 characters")
        _require(0 < len(self.dataset) <= 64, "JobSpec.dataset: must be 1-64 characters")
        _require(1 <= self.batch_size <= 65536, f"JobSpec.batch_size: must be in 1..65536, got {self.batch_size}")
        _require(1 <= self.workers <= 64, f"JobSpec.workers: must be in 1..64, got {self.workers}")
        _require(1 <= self.iterations <= 10**12, f"JobSpec.iterations: must be in 1..10^12, got {self.iterations}")
        _require(0 < self.priority <= 1000, f"JobSpec.priority: must be in (0, 1000], got {self.priority}")
        _require(self.deadline_s is None or self.deadline_s > 0, "JobSpec.deadline_s: must be > 0")

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
        _require(0 <= self.index < 1024, f"GpuInfo.index: must be in 0..1023, got {self.index}")
        _require(0 < len(self.type) <= 32, "GpuInfo.type: must be 1-32 characters")


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


# ---------------------------------------------------------------- events


@dataclass(frozen=True, kw_only=True)
class Event(Record):
    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1

    ts: float
    source: str
    id: str = field(default_factory=new_event_id)

    def _check_envelope(self) -> None:
        _require(0 < len(self.id) <= 64, f"{self.TYPE}.id: must be 1-64 characters")
        _require(self.ts >= 0, f"{self.TYPE}.ts: must be >= 0")
        _require(len(self.source) <= 128, f"{self.TYPE}.source: at most 128 characters")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_envelope()


@dataclass(frozen=True, kw_only=True)
class JobSubmitted(Event):
    TYPE: ClassVar[str] = "JobSubmitted"
    job: JobSpec
    submitted_at: float

    @property
    def job_id(self) -> str:
        return self.job.job_id


@dataclass(frozen=True, kw_only=True)
class JobCancelled(Event):
    TYPE: ClassVar[str] = "JobCancelled"
    job_id: str
    reason: str = ""

    def _check(self) -> None:
        _check_job_id(self.job_id, self.TYPE)


@dataclass(frozen=True, kw_only=True)
class NodeRegistered(Event):
    TYPE: ClassVar[str] = "NodeRegistered"
    node_id: str
    gpus: tuple[GpuInfo, ...]
    address: str = ""
    emulated: bool = False

    def _check(self) -> None:
        _check_node_id(self.node_id, self.TYPE)
        _require(len(self.gpus) >= 1, "NodeRegistered.gpus: a node has at least one device")
        indices = [g.index for g in self.gpus]
        _require(len(set(indices)) == len(indices), "NodeRegistered.gpus: duplicate GPU index")


@dataclass(frozen=True, kw_only=True)
class NodeHeartbeat(Event):
    TYPE: ClassVar[str] = "NodeHeartbeat"
    node_id: str
    seq: int = 0
    running: tuple[str, ...] = ()
    emulated: bool = False

    def _check(self) -> None:
        _check_node_id(self.node_id, self.TYPE)


@dataclass(frozen=True, kw_only=True)
class ThroughputEstimate(Event):
    """Whole-job steps/s on ``workers`` GPUs of each type in ``rates``."""

    TYPE: ClassVar[str] = "ThroughputEstimate"
    job_id: str
    basis: Literal["estimate", "measured"]
    workers: int
    rates: dict[str, float]

    def _check(self) -> None:
        _check_job_id(self.job_id, self.TYPE)
        _require(1 <= self.workers <= 64, "ThroughputEstimate.workers: must be in 1..64")
        _require(all(r >= 0 for r in self.rates.values()), "ThroughputEstimate.rates: must be >= 0")


@dataclass(frozen=True, kw_only=True)
class RoundStarted(Event):
    TYPE: ClassVar[str] = "RoundStarted"
    round: int
    policy: str
    started_at: float
    ends_at: float
    nodes: tuple[str, ...] = ()
    assignments: int = 0
    waiting: tuple[Waiting, ...] = ()
    decision_ms: float = 0.0
    # "topic:partition" -> records of it the scheduler had folded when it planned: replay
    # folds exactly these (plus earlier rounds' placements) to re-derive the decision.
    inputs: dict[str, int] = field(default_factory=dict)

    def _check(self) -> None:
        _require(self.round >= 0, "RoundStarted.round: must be >= 0")
        _require(self.ends_at >= self.started_at, "RoundStarted.ends_at: must be >= started_at")


@dataclass(frozen=True, kw_only=True)
class Assignment(Event):
    """One job copy's work on one node for one round.

    ``ranks`` are this node's DDP ranks within the copy's ``world_size`` workers; a copy
    spanning nodes (Hadar's task-level placement) names ``rendezvous`` (host:port of rank 0).
    ``start_from`` is the store key of the model to start from (None: initialise from seed).
    """

    TYPE: ClassVar[str] = "Assignment"
    round: int
    job: JobSpec
    copy: int
    node_id: str
    gpus: tuple[int, ...]
    gpu_type: str
    world_size: int
    ranks: tuple[int, ...]
    step_budget: int
    deadline: float
    start_from: str | None = None
    rendezvous: str | None = None

    def _check(self) -> None:
        _check_node_id(self.node_id, self.TYPE)
        _require(self.round >= 0, "Assignment.round: must be >= 0")
        _require(0 <= self.copy < 1024, "Assignment.copy: must be in 0..1023")
        _require(len(self.gpus) >= 1, "Assignment.gpus: at least one GPU")
        _require(len(self.ranks) == len(self.gpus), "Assignment.ranks: one rank per GPU")
        _require(1 <= self.world_size <= 64, "Assignment.world_size: must be in 1..64")
        _require(all(0 <= r < self.world_size for r in self.ranks), "Assignment.ranks: out of range")
        _require(self.step_budget >= 0, "Assignment.step_budget: must be >= 0")
        _require(self.world_size == len(self.ranks) or bool(self.rendezvous),
                 "Assignment.rendezvous: required when the copy spans nodes")

    @property
    def job_id(self) -> str:
        return self.job.job_id


@dataclass(frozen=True, kw_only=True)
class Progress(Event):
    TYPE: ClassVar[str] = "Progress"
    job_id: str
    round: int
    copy: int
    node_id: str
    gpu_type: str
    workers: int
    steps_round: int
    steps_total: int
    samples_per_s: float
    loss: float
    emulated: bool = False

    def _check(self) -> None:
        _check_job_id(self.job_id, self.TYPE)
        _require(self.round >= 0 and self.copy >= 0, "Progress.round/copy: must be >= 0")
        _require(self.steps_round >= 0 and self.steps_total >= self.steps_round,
                 "Progress.steps: need 0 <= steps_round <= steps_total")
        _require(self.samples_per_s >= 0, "Progress.samples_per_s: must be >= 0")
        _require(self.workers >= 1, "Progress.workers: must be >= 1")


@dataclass(frozen=True, kw_only=True)
class CopyFinished(Event):
    TYPE: ClassVar[str] = "CopyFinished"
    job_id: str
    round: int
    copy: int
    node_id: str
    status: Literal["ok", "preempted", "failed"]
    steps_round: int
    gpu_type: str = ""
    checkpoint: str | None = None
    reason: str = ""
    emulated: bool = False

    def _check(self) -> None:
        _check_job_id(self.job_id, self.TYPE)
        _require(self.round >= 0 and self.copy >= 0, "CopyFinished.round/copy: must be >= 0")
        _require(self.steps_round >= 0, "CopyFinished.steps_round: must be >= 0")
        _require(self.status == "failed" or self.checkpoint is not None,
                 "CopyFinished.checkpoint: required unless status is 'failed'")


@dataclass(frozen=True, kw_only=True)
class ModelConsolidated(Event):
    TYPE: ClassVar[str] = "ModelConsolidated"
    job_id: str
    round: int
    key: str
    total_steps: int
    copies: tuple[CopyWeight, ...]
    rejected: tuple[Rejection, ...] = ()
    missing: tuple[int, ...] = ()
    seconds: float = 0.0

    def _check(self) -> None:
        _check_job_id(self.job_id, self.TYPE)
        _require(self.total_steps >= 0, "ModelConsolidated.total_steps: must be >= 0")


@dataclass(frozen=True, kw_only=True)
class JobCompleted(Event):
    TYPE: ClassVar[str] = "JobCompleted"
    job_id: str
    final_key: str
    total_steps: int
    jct_s: float
    completed_at: float

    def _check(self) -> None:
        _check_job_id(self.job_id, self.TYPE)
        _require(self.jct_s >= 0, "JobCompleted.jct_s: must be >= 0")


@dataclass(frozen=True, kw_only=True)
class DeadLetter(Event):
    TYPE: ClassVar[str] = "DeadLetter"
    topic: str
    partition: int
    offset: int
    reason: str
    raw: bytes

    def _check(self) -> None:
        _require(len(self.raw) <= DEADLETTER_RAW_LIMIT,
                 f"DeadLetter.raw: at most {DEADLETTER_RAW_LIMIT} bytes (truncate it)")


EVENT_TYPES: dict[str, type[Event]] = {
    cls.TYPE: cls for cls in (
        JobSubmitted, JobCancelled, NodeRegistered, NodeHeartbeat, ThroughputEstimate,
        RoundStarted, Assignment, Progress, CopyFinished, ModelConsolidated, JobCompleted,
        DeadLetter,
    )
}

# Topic of each event type (DESIGN.md "Services and events").
TOPICS: dict[str, str] = {
    "JobSubmitted": "hadar.jobs", "JobCancelled": "hadar.jobs",
    "NodeRegistered": "hadar.nodes", "NodeHeartbeat": "hadar.nodes",
    "ThroughputEstimate": "hadar.throughput",
    "Progress": "hadar.progress", "CopyFinished": "hadar.progress",
    "RoundStarted": "hadar.placements", "Assignment": "hadar.placements",
    "ModelConsolidated": "hadar.models", "JobCompleted": "hadar.models",
    "DeadLetter": "hadar.deadletter",
}
ALL_TOPICS: tuple[str, ...] = tuple(sorted(set(TOPICS.values())))
DEADLETTER_TOPIC = "hadar.deadletter"


def topic_for(event: Event) -> str:
    return TOPICS[event.TYPE]


def key_for(event: Event) -> str:
    """Partition key: job events by job id, node events by node id (keeps per-job order)."""
    for attr in ("job_id", "node_id"):
        value = getattr(event, attr, None)
        if isinstance(value, str):
            return value
    if isinstance(event, RoundStarted):
        return f"round-{event.round}"
    return event.TYPE


# ---------------------------------------------------------------- wire

_ENVELOPE = ("type", "v", "id", "ts", "source", "body")


def encode(event: Event) -> bytes:
    if not isinstance(event, Event) or type(event) not in EVENT_TYPES.values():
        raise TypeError(f"not an event: {type(event).__name__}")
    body = {f.name: _to_wire(getattr(event, f.name)) for f in dataclasses.fields(event)
            if f.name not in ("id", "ts", "source")}
    return msgpack.packb(
        {"type": event.TYPE, "v": event.VERSION, "id": event.id, "ts": event.ts,
         "source": event.source, "body": body},
        use_bin_type=True,
    )


def decode(data: bytes) -> Event:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidEvent(f"not bytes: {type(data).__name__}")
    if len(data) > _MAX_WIRE_BYTES:
        raise InvalidEvent(f"record too large: {len(data)} bytes")
    try:
        msg = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types; all mean "not an event"
        raise InvalidEvent(f"not msgpack: {type(exc).__name__}: {exc}"[:200]) from None
    if not isinstance(msg, dict):
        raise InvalidEvent(f"envelope: expected a map, got {type(msg).__name__}")
    missing = [k for k in _ENVELOPE if k not in msg]
    if missing:
        raise InvalidEvent(f"envelope: missing key {missing[0]!r}")
    extra = [k for k in msg if k not in _ENVELOPE]
    if extra:
        raise InvalidEvent(f"envelope: unknown key {extra[0]!r}")
    etype = msg["type"]
    cls = EVENT_TYPES.get(etype) if isinstance(etype, str) else None
    if cls is None:
        raise InvalidEvent(f"envelope: unknown event type {_short_repr(etype)}")
    if msg["v"] != cls.VERSION or isinstance(msg["v"], bool):
        raise InvalidEvent(f"{etype}: unsupported schema version {_short_repr(msg['v'])}")
    body = msg["body"]
    if not isinstance(body, dict):
        raise InvalidEvent(f"{etype}: body must be a map")
    for key in ("id", "ts", "source"):
        if key in body:
            raise InvalidEvent(f"{etype}: body must not contain envelope key {key!r}")
    fields = dict(body, id=msg["id"], ts=msg["ts"], source=msg["source"])
    event = cls._from_wire(fields, etype)
    assert isinstance(event, Event)
    return event
