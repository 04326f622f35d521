"""Self-validating frozen records: the typing rules behind the event contract.

A ``Record`` is a frozen keyword-only dataclass whose fields are checked against their
annotations when it is built (``str``, ``int`` within 64 bits, finite ``float``, ``bool``,
``bytes``, ``X | None``, ``tuple[X, ...]``, ``dict[str, X]``, ``Literal[...]``, nested
records) and by its ``_check`` for ranges, so an invalid record cannot exist in memory.
Every failure is an :class:`InvalidEvent` whose ``reason`` names the field. The wire
format itself belongs to :mod:`shared.wire.events`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from shared.errors import HadarError

__all__ = [
    "InvalidEvent", "Record", "Hyperparameters", "JobSpec", "UserCode", "GpuInfo", "Waiting", "CopyWeight",
    "Rejection", "JOB_ID_RE", "NODE_ID_RE", "QUEUE_NAME_RE", "USER_RE", "DATASET_RE", "DIGEST_RE",
    "MAX_CONFIG_CHARS", "new_event_id", "to_wire", "require", "check_job_id", "check_node_id",
    "check_queue_name", "short_repr",
]

JOB_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
QUEUE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
# A user who owns objects in the store (a path segment), a dataset's name, a bundle's SHA-256.
USER_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
DATASET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_CONFIG_CHARS = 16 * 1024
_ENTRYPOINT_RE = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*\.py$")



class InvalidEvent(HadarError, ValueError):
    """Bytes or fields that do not make a valid event. ``reason`` says why.

    Also a ``ValueError``, as ``shared.wire.events`` documents: code that validates a value and
    catches ``ValueError`` treats a bad event field like any other bad value.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))   # version and variant bits
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)         # version 4, RFC 4122 variant


def new_event_id() -> str:
    """A random version-4 UUID in hex, as ``uuid.uuid4().hex`` gives, at half its cost
    (no UUID object): one per event built."""
    return f"{int.from_bytes(os.urandom(16), 'big') & _UUID4_CLEAR | _UUID4_SET:032x}"


# ---------------------------------------------------------------- records


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def to_wire(value: Any) -> Any:
    """The msgpack form of a record (a map of its fields), a tuple or dict of them, or a scalar."""
    if isinstance(value, Record):
        return _codec(type(value)).to_wire(value)
    if isinstance(value, tuple):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


@dataclass(frozen=True, kw_only=True)
class Record:
    """A frozen, self-validating record; base of events and of their nested parts.

    Its fields are checked by a validator compiled once per class from the annotations
    (:mod:`shared.wire.record_codec`), then by each name in ``_CHECKS`` in order.
    """

    #: Methods run after the field types are checked, in order; each raises InvalidEvent.
    _CHECKS: ClassVar[tuple[str, ...]] = ("_check",)
    #: Fields the wire carries outside the record's own map (an event's envelope); the
    #: compiled ``from_wire(data, path, *values)`` takes their values in this order.
    _WIRE_OUTER: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        (_COMPILED.get(type(self)) or _codec(type(self))).validate(self)

    def _check(self) -> None:
        """Range checks beyond the annotations; raise InvalidEvent."""


_COMPILED: dict[type, Any] = {}   # class -> its shared.wire.record_codec.Codec


def _codec(cls: type[Record]) -> Any:
    found = _COMPILED.get(cls)
    if found is None:
        # shared.wire.record_codec builds on this module (InvalidEvent, Record): a late import.
        from shared.wire.record_codec import codec
        found = _COMPILED[cls] = codec(cls)
    return found


def require(cond: bool, reason: str) -> None:
    if not cond:
        raise InvalidEvent(reason)


# Ids that matched their pattern lately: most events name a few jobs and nodes over and
# over, and a set lookup costs a fraction of the regex. Exact str only (a subclass could
# compare equal to an id it does not spell); cleared when full, so bounded.
_VALID_JOB_IDS: set[str] = set()
_VALID_NODE_IDS: set[str] = set()
_VALID_IDS_MAX = 4096


def _remember(valid: set[str], value: str) -> None:
    if type(value) is str:
        if len(valid) >= _VALID_IDS_MAX:
            valid.clear()
        valid.add(value)


def check_job_id(job_id: str, where: str) -> None:
    if type(job_id) is str and job_id in _VALID_JOB_IDS:
        return
    if not JOB_ID_RE.fullmatch(job_id):  # fullmatch: "$" alone accepts a trailing newline
        raise InvalidEvent(f"{where}.job_id: {job_id!r} must be 1-63 chars of lowercase letters, digits, "
                           "'-', '_', '.', starting with a letter or digit")
    _remember(_VALID_JOB_IDS, job_id)


def check_queue_name(name: str, where: str) -> None:
    if not QUEUE_NAME_RE.fullmatch(name):
        raise InvalidEvent(f"{where}: {name!r} must be 1-32 chars of lowercase letters, digits, '-', '_', "
                           "starting with a letter or digit")


def check_node_id(node_id: str, where: str) -> None:
    if type(node_id) is str and node_id in _VALID_NODE_IDS:
        return
    if not NODE_ID_RE.fullmatch(node_id):
        raise InvalidEvent(f"{where}.node_id: {node_id!r} must be 1-63 chars of letters, digits, '-', '_', '.'")
    _remember(_VALID_NODE_IDS, node_id)


# ---------------------------------------------------------------- nested records


@dataclass(frozen=True, kw_only=True)
class Hyperparameters(Record):
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = 0.05
    seed: int = 0

    # Reasons with values are formatted only when raised (these run for every decode).
    def _check(self) -> None:
        if not (0 < self.lr <= 10):
            raise InvalidEvent(f"Hyperparameters.lr: must be in (0, 10], got {self.lr}")
        if not (0 <= self.seed < 2**32):
            raise InvalidEvent(f"Hyperparameters.seed: must be in [0, 2^32), got {self.seed}")


@dataclass(frozen=True, kw_only=True)
class UserCode(Record):
    """A user's own training script: the code bundle named by its SHA-256 ``digest`` (``size``
    bytes) under the submitting user's prefix in the store (``shared.domain.layout``), the
    script in it to run (``entrypoint``, a relative ``.py`` path) with ``args``, the job's
    ``config`` (a JSON object as text, handed to the script), the dataset bundle pinned at
    submission (``data_digest``/``data_size``; "" when the job names none), and ``hint``: a
    built-in model family whose figures stand for the job's until it is measured ("": none)."""

    digest: str
    size: int
    entrypoint: str
    args: tuple[str, ...] = ()
    config: str = ""
    data_digest: str = ""
    data_size: int = 0
    hint: str = ""

    def _check(self) -> None:
        require(DIGEST_RE.fullmatch(self.digest) is not None, "UserCode.digest: must be 64 lowercase hex digits")
        require(0 < self.size <= 2**40, "UserCode.size: must be in 1..2^40")
        require(len(self.entrypoint) <= 256 and _ENTRYPOINT_RE.fullmatch(self.entrypoint) is not None
                and ".." not in self.entrypoint.split("/"),
                "UserCode.entrypoint: must be a relative path to a .py file of the bundle (letters, digits, "
                "'_', '-', '.', '/')")
        require(len(self.args) <= 64 and all(len(a) <= 1024 and "\x00" not in a for a in self.args),
                "UserCode.args: at most 64, each at most 1024 characters")
        require(len(self.config) <= MAX_CONFIG_CHARS, f"UserCode.config: at most {MAX_CONFIG_CHARS} characters")
        require(self.data_digest == "" or DIGEST_RE.fullmatch(self.data_digest) is not None,
                "UserCode.data_digest: must be empty or 64 lowercase hex digits")
        require((self.data_digest == "") == (self.data_size == 0) and 0 <= self.data_size <= 2**44,
                "UserCode.data_size: must be in 1..2^44 with a data_digest, else 0")
        require(len(self.hint) <= 32, "UserCode.hint: at most 32 characters")


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
    # The team queue it belongs to ("": the default queue) and its priority class there:
    # a higher class is placed first and may preempt a lower one (services/scheduler/core/queues.py).
    queue: str = ""
    priority_class: int = 0
    # The user's own training code (None: ``model`` and ``dataset`` name the built-in zoo's).
    code: UserCode | None = None

    def _check(self) -> None:
        check_job_id(self.job_id, "JobSpec")
        require(0 < len(self.user) <= 64, "JobSpec.user: must be 1-64 characters")
        require(0 < len(self.model) <= 64, "JobSpec.model: must be 1-64 characters")
        require(0 < len(self.dataset) <= 64, "JobSpec.dataset: must be 1-64 characters")
        if not (1 <= self.batch_size <= 65536):
            raise InvalidEvent(f"JobSpec.batch_size: must be in 1..65536, got {self.batch_size}")
        if not (1 <= self.workers <= 64):
            raise InvalidEvent(f"JobSpec.workers: must be in 1..64, got {self.workers}")
        if not (1 <= self.iterations <= 10**12):
            raise InvalidEvent(f"JobSpec.iterations: must be in 1..10^12, got {self.iterations}")
        if not (0 < self.priority <= 1000):
            raise InvalidEvent(f"JobSpec.priority: must be in (0, 1000], got {self.priority}")
        require(self.deadline_s is None or self.deadline_s > 0, "JobSpec.deadline_s: must be > 0")
        if self.queue:
            check_queue_name(self.queue, "JobSpec.queue")
        if not (0 <= self.priority_class <= 100):
            raise InvalidEvent(f"JobSpec.priority_class: must be in 0..100, got {self.priority_class}")
        if self.code is not None:
            require(USER_RE.fullmatch(self.user) is not None,
                    "JobSpec.user: a job with code must name its user as 1-63 of lowercase letters, digits, "
                    "'.', '_', '-' (it owns the code's prefix in the store)")
            require(DATASET_RE.fullmatch(self.dataset) is not None or self.dataset == "-",
                    "JobSpec.dataset: a job with code names its dataset (1-63 of lowercase letters, digits, "
                    "'.', '_', '-') or '-' for none")
            require((self.dataset == "-") == (self.code.data_digest == ""),
                    "JobSpec.dataset: '-' exactly when the code names no dataset bundle")

    @property
    def job_type(self) -> str:
        """Throughput-table key of this job, e.g. ``resnet (batch size 32)``; a job of user
        code is keyed by its bundle too (``mynet@3f2a9c1b7d0e (batch size 32)``), so it never
        borrows the figures of a built-in model that shares its name."""
        if self.code is not None:
            return f"{self.model}@{self.code.digest[:12]} (batch size {self.batch_size})"
        return f"{self.model} (batch size {self.batch_size})"


@dataclass(frozen=True, kw_only=True)
class GpuInfo(Record):
    index: int
    type: str
    memory_gb: float = 0.0

    def _check(self) -> None:
        if not (0 <= self.index < 1024):
            raise InvalidEvent(f"GpuInfo.index: must be in 0..1023, got {self.index}")
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

