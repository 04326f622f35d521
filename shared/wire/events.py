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
* ``decode`` costs memory in proportion to the record, not to what it claims: the
  Python objects msgpack builds are charged as they are built (each map and array
  by its size, plus a fresh scalar per element) against ``16 x len(data) + 64 KiB``,
  and decoding stops with InvalidEvent once that is spent; no single array or map may
  hold more than ``max(65536, len(data) // 8)`` items; ext types are refused unread.
  A 1 MiB record of empty maps costs ~11 MB instead of ~72 MB. Legitimate records
  cost up to ~12x their size, within the budget. Records of at most 585 bytes cannot
  reach the budget and skip the charging (:mod:`shared.wire.bounded_msgpack` says why).
* Constructing an event with a wrong field raises the same ``InvalidEvent``: an invalid
  event cannot exist in memory, so it can never be published.

Records are frozen keyword-only dataclasses; field types are checked from their
annotations (``str``, ``int``, ``float``, ``bool``, ``bytes``, ``X | None``,
``tuple[X, ...]``, ``dict[str, X]``, ``Literal[...]`` and nested records), ranges by each
class's ``_check``. ``id`` defaults to a random UUID (it is only used for idempotence);
``ts`` and ``source`` are always given by the caller, from its clock and its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NoReturn, cast

import msgpack

from shared.wire.bounded_msgpack import COST_PER_BYTE, UNCHARGED_MAX, TooCostly, unpack
from shared.wire.queues import QueueConfig, QueueSpec, QueueStanding
from shared.wire.record_codec import codec
from shared.wire.records import (
    JOB_ID_RE,
    NODE_ID_RE,
    USER_RE,
    CopyWeight,
    GpuInfo,
    Hyperparameters,
    InvalidEvent,
    JobSpec,
    Record,
    Rejection,
    UserCode,
    Waiting,
    check_job_id,
    check_node_id,
    new_event_id,
    require,
    short_repr,
)
from shared.wire.topics import TOPIC_OF_TYPE

__all__ = [
    "InvalidEvent", "Record", "Event", "Hyperparameters", "JobSpec", "UserCode", "GpuInfo", "Waiting",
    "CopyWeight", "Rejection", "JobSubmitted", "JobCancelled", "NodeRegistered",
    "NodeHeartbeat", "ThroughputEstimate", "RoundStarted", "Assignment", "Progress",
    "CopyFinished", "ModelConsolidated", "RoundAbandoned", "JobCompleted", "QueuesApplied", "DeadLetter",
    "EVENT_TYPES", "QueueConfig", "QueueSpec", "QueueStanding",
    "topic_for", "key_for", "encode", "decode", "JOB_ID_RE", "NODE_ID_RE", "MAX_WIRE_BYTES",
    "DEFAULT_OPTIMIZER_SLOTS", "MAX_OPTIMIZER_SLOTS", "MAX_MODEL_BYTES", "DEADLETTER_RAW_LIMIT", "MAX_LOG_TAIL",
]


DEADLETTER_RAW_LIMIT = 1024
MAX_LOG_TAIL = 4096   # characters of a user script's output a CopyFinished carries
# A model's size as a ThroughputEstimate states it (what HadarE charges for consolidating:
# shared/domain/fork_cost.py): optimizer state tensors per parameter, 1 by default (SGD with
# momentum) and at most 2 (the zoo's Adam); at most 4 TiB of FP32 weights (~1.1e12
# parameters), far above any job this scheduler runs.
DEFAULT_OPTIMIZER_SLOTS = 1
MAX_OPTIMIZER_SLOTS = 2
MAX_MODEL_BYTES = 2**42
MAX_WIRE_BYTES = 16 * 1024 * 1024

# ---------------------------------------------------------------- events


@dataclass(frozen=True, kw_only=True)
class Event(Record):
    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1
    _CHECKS: ClassVar[tuple[str, ...]] = ("_check", "_check_envelope")
    _WIRE_OUTER: ClassVar[tuple[str, ...]] = ("id", "ts", "source")

    ts: float
    source: str
    id: str = field(default_factory=new_event_id)

    def _check_envelope(self) -> None:
        # Reasons are formatted only when raised: this runs for every event built or decoded.
        if not 0 < len(self.id) <= 64:
            raise InvalidEvent(f"{self.TYPE}.id: must be 1-64 characters")
        if not self.ts >= 0:
            raise InvalidEvent(f"{self.TYPE}.ts: must be >= 0")
        if not len(self.source) <= 128:
            raise InvalidEvent(f"{self.TYPE}.source: at most 128 characters")


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
    """``user``: who cancels (``hadar cancel`` names the user it runs as); a consumer refuses
    a cancellation that names another user than the job's. With authorship checked
    (:mod:`shared.security.authorship`) it must be the user who sealed the record."""

    TYPE: ClassVar[str] = "JobCancelled"
    job_id: str
    reason: str = ""
    user: str = ""

    def _check(self) -> None:
        check_job_id(self.job_id, self.TYPE)
        require(self.user == "" or USER_RE.fullmatch(self.user) is not None,
                "JobCancelled.user: 1-63 of lowercase letters, digits, '.', '_', '-' (or empty)")


@dataclass(frozen=True, kw_only=True)
class NodeRegistered(Event):
    TYPE: ClassVar[str] = "NodeRegistered"
    node_id: str
    gpus: tuple[GpuInfo, ...]
    address: str = ""
    emulated: bool = False
    emulation_reference: str = ""   # emulated: the type its slowdowns are relative to ("" = catalog default)

    def _check(self) -> None:
        check_node_id(self.node_id, self.TYPE)
        require(len(self.gpus) >= 1, "NodeRegistered.gpus: a node has at least one device")
        indices = [g.index for g in self.gpus]
        require(len(set(indices)) == len(indices), "NodeRegistered.gpus: duplicate GPU index")


@dataclass(frozen=True, kw_only=True)
class NodeHeartbeat(Event):
    TYPE: ClassVar[str] = "NodeHeartbeat"
    node_id: str
    seq: int = 0
    running: tuple[str, ...] = ()
    emulated: bool = False

    def _check(self) -> None:
        check_node_id(self.node_id, self.TYPE)


@dataclass(frozen=True, kw_only=True)
class ThroughputEstimate(Event):
    """Whole-job steps/s on ``workers`` GPUs of each type in ``rates``.

    ``model_bytes``: the job's FP32 weights in bytes and ``optimizer_slots`` the state
    tensors per parameter its optimizer keeps (bounds above), what HadarE charges for
    consolidating forked copies (``shared.domain.fork_cost``); ``model_bytes`` 0 states no
    size (a measurement, or a record written before sizes were carried), and the scheduler
    keeps the last size stated."""

    TYPE: ClassVar[str] = "ThroughputEstimate"
    job_id: str
    basis: Literal["estimate", "measured"]
    workers: int
    rates: dict[str, float]
    model_bytes: int = 0
    optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS

    def _check(self) -> None:
        check_job_id(self.job_id, self.TYPE)
        require(1 <= self.workers <= 64, "ThroughputEstimate.workers: must be in 1..64")
        require(all(r >= 0 for r in self.rates.values()), "ThroughputEstimate.rates: must be >= 0")
        require(0 <= self.model_bytes <= MAX_MODEL_BYTES, "ThroughputEstimate.model_bytes: must be in 0..2^42")
        require(0 <= self.optimizer_slots <= MAX_OPTIMIZER_SLOTS, "ThroughputEstimate.optimizer_slots: must be in 0..2")


@dataclass(frozen=True, kw_only=True)
class RoundStarted(Event):
    """A round's decision, self-described: with ``inputs`` (what was folded), ``nodes`` (the
    cluster it planned on) and the settings (policy, its options as canonical JSON, seed,
    round length, heartbeat period), the round can be re-derived from the log alone.

    ``round_s``/``heartbeat_s`` of 0 and empty ``policy_options`` are what logs written
    before rounds recorded their settings decode to."""

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
    policy_options: str = "{}"
    seed: int = 0
    round_s: float = 0.0
    heartbeat_s: float = 0.0
    # What the round gave each queue (empty without queues): shared/wire/queues.py.
    queues: tuple[QueueStanding, ...] = ()

    def _check(self) -> None:
        require(self.round >= 0, "RoundStarted.round: must be >= 0")
        require(self.ends_at >= self.started_at, "RoundStarted.ends_at: must be >= started_at")
        require(len(self.policy_options) <= 4096, "RoundStarted.policy_options: at most 4096 characters")
        require(self.policy_options.startswith("{"), "RoundStarted.policy_options: must be a JSON object")
        require(self.seed >= 0 and self.round_s >= 0 and self.heartbeat_s >= 0,
                "RoundStarted.seed/round_s/heartbeat_s: must be >= 0")


@dataclass(frozen=True, kw_only=True)
class Assignment(Event):
    """One job copy's work on one node for one round.

    ``ranks`` are this node's DDP ranks within the copy's ``world_size`` workers; a copy
    spanning nodes (Hadar's task-level placement) names ``rendezvous`` (host:port of rank 0)
    and ``peers``, the node of every rank in rank order (its agents keep the ranks' worker
    processes and process group across rounds while the peers stay the same; without
    ``peers`` they start new ones every round). ``start_from`` is the store key of the model
    to start from (None: initialise from seed). ``copies`` is how many copies of the job run
    this round (HadarE forks; 1 otherwise) and ``fork_workers`` the workers of all of them
    together (K; 0: not stated, as in records written before the field existed): what a
    copy's local-SGD recipe (``shared/domain/local_sgd.py``) scales by. With more than one
    copy K is at least this copy's ``world_size``.

    ``evaluation``: the copy trains nothing and uploads nothing; it runs the job's own script
    on ``start_from`` (the completed job's final model) for its held-out metric, which it
    reports as ``CopyFinished.start_metric`` -- how a user-code job's final model is
    evaluated without the tracker ever running user code. Only for user code (the tracker
    evaluates zoo models itself), one copy, step budget 0.
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
    peers: tuple[str, ...] = ()
    copies: int = 1
    fork_workers: int = 0
    evaluation: bool = False

    def _check(self) -> None:
        check_node_id(self.node_id, self.TYPE)
        if self.evaluation:
            require(self.job.code is not None, "Assignment.evaluation: only for a job of user code")
            require(self.step_budget == 0 and self.copies == 1 and self.start_from is not None,
                    "Assignment.evaluation: needs step_budget 0, one copy and a start_from")
        require(1 <= self.copies <= 1024, "Assignment.copies: must be in 1..1024")
        require(0 <= self.fork_workers <= 65536, "Assignment.fork_workers: must be in 0..65536")
        require(self.fork_workers == 0 or self.fork_workers >= self.world_size,
                "Assignment.fork_workers: below the copy's own world_size")
        require(self.round >= 0, "Assignment.round: must be >= 0")
        require(0 <= self.copy < 1024, "Assignment.copy: must be in 0..1023")
        require(len(self.gpus) >= 1, "Assignment.gpus: at least one GPU")
        require(len(self.ranks) == len(self.gpus), "Assignment.ranks: one rank per GPU")
        require(1 <= self.world_size <= 64, "Assignment.world_size: must be in 1..64")
        require(all(0 <= r < self.world_size for r in self.ranks), "Assignment.ranks: out of range")
        require(self.step_budget >= 0, "Assignment.step_budget: must be >= 0")
        require(self.world_size == len(self.ranks) or bool(self.rendezvous),
                 "Assignment.rendezvous: required when the copy spans nodes")
        if self.peers:
            require(len(self.peers) == self.world_size, "Assignment.peers: one node per rank")
            for peer in self.peers:
                check_node_id(peer, f"{self.TYPE}.peers")
            require(all(self.peers[r] == self.node_id for r in self.ranks),
                    "Assignment.peers: this node's ranks must name this node")

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
    loss: float | None              # None: the copy reported none (a user's script need not)
    emulated: bool = False
    emulation_reference: str = ""   # emulated: the type slowdowns are relative to ("" = catalog default)

    def _check(self) -> None:
        check_job_id(self.job_id, self.TYPE)
        require(self.round >= 0 and self.copy >= 0, "Progress.round/copy: must be >= 0")
        require(self.steps_round >= 0 and self.steps_total >= self.steps_round,
                 "Progress.steps: need 0 <= steps_round <= steps_total")
        require(self.samples_per_s >= 0, "Progress.samples_per_s: must be >= 0")
        require(self.workers >= 1, "Progress.workers: must be >= 1")


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
    # User code: the held-out metric its own script computed on the agent (the tracker never
    # runs user code) -- of the model the round started from, and of this copy's final weights
    # -- and the end of the script's output when it failed or was refused.
    metric_name: str = ""
    start_metric: float | None = None
    final_metric: float | None = None
    log_tail: str = ""
    evaluation: bool = False   # the report of an evaluation copy (Assignment.evaluation): no checkpoint
    # Seconds on the reporting agent's clock from taking the copy's GPUs to its rank 0 ready to
    # step (None: it never got there), and whether that worker was warm (kept from last round).
    start_s: float | None = None
    start_warm: bool = False

    def _check(self) -> None:
        check_job_id(self.job_id, self.TYPE)
        require(self.round >= 0 and self.copy >= 0, "CopyFinished.round/copy: must be >= 0")
        require(self.steps_round >= 0, "CopyFinished.steps_round: must be >= 0")
        require(self.start_s is None or 0.0 <= self.start_s <= 86_400.0,
                "CopyFinished.start_s: must be in [0, 86400] seconds")
        if self.evaluation:
            require(self.checkpoint is None and self.steps_round == 0,
                    "CopyFinished.evaluation: an evaluation copy trains no step and writes no checkpoint")
        else:
            require(self.status == "failed" or self.checkpoint is not None,
                    "CopyFinished.checkpoint: required unless status is 'failed'")
        require(len(self.metric_name) <= 32, "CopyFinished.metric_name: at most 32 characters")
        require(len(self.log_tail) <= MAX_LOG_TAIL, f"CopyFinished.log_tail: at most {MAX_LOG_TAIL} characters")


@dataclass(frozen=True, kw_only=True)
class ModelConsolidated(Event):
    """A round's model is stored at ``key``. ``metric_name``/``metric_value``: the model's
    held-out metric (``shared.zoo.evaluate``: "accuracy", higher is better, or "mse", lower
    is better), computed by the tracker on the dataset's test split; absent (``metric_value``
    None; the tracker then leaves ``metric_name`` "") when it could not be computed (a model
    the zoo cannot rebuild, one too large to
    evaluate, or a model announced from an earlier run's file)."""

    TYPE: ClassVar[str] = "ModelConsolidated"
    job_id: str
    round: int
    key: str
    total_steps: int
    copies: tuple[CopyWeight, ...]
    rejected: tuple[Rejection, ...] = ()
    missing: tuple[int, ...] = ()
    seconds: float = 0.0
    metric_name: str = ""
    metric_value: float | None = None

    def _check(self) -> None:
        check_job_id(self.job_id, self.TYPE)
        require(self.total_steps >= 0, "ModelConsolidated.total_steps: must be >= 0")
        require(len(self.metric_name) <= 32, "ModelConsolidated.metric_name: at most 32 characters")


@dataclass(frozen=True, kw_only=True)
class RoundAbandoned(Event):
    """The tracker ended a job's round without a model: no usable replica, or every attempt
    to consolidate failed. The round's work is not counted and the job's next round starts
    from its previous model; the scheduler stops waiting for this round at once."""

    TYPE: ClassVar[str] = "RoundAbandoned"
    job_id: str
    round: int
    reason: str
    rejected: tuple[Rejection, ...] = ()
    missing: tuple[int, ...] = ()

    def _check(self) -> None:
        check_job_id(self.job_id, self.TYPE)
        require(self.round >= 0, "RoundAbandoned.round: must be >= 0")
        require(len(self.reason) <= 1024, "RoundAbandoned.reason: at most 1024 characters")


@dataclass(frozen=True, kw_only=True)
class JobCompleted(Event):
    TYPE: ClassVar[str] = "JobCompleted"
    job_id: str
    final_key: str
    total_steps: int
    jct_s: float
    completed_at: float

    def _check(self) -> None:
        check_job_id(self.job_id, self.TYPE)
        require(self.jct_s >= 0, "JobCompleted.jct_s: must be >= 0")


@dataclass(frozen=True, kw_only=True)
class QueuesApplied(Event):
    """An operator applied the queues in ``config`` (``hadar queues apply``); the latest one
    applied is in force from the next round on. Only the admin principal may publish it."""

    TYPE: ClassVar[str] = "QueuesApplied"
    config: QueueConfig


@dataclass(frozen=True, kw_only=True)
class LeaderRenewed(Event):
    """``holder`` is the active replica of ``role`` in leadership ``term`` and will renew
    within ``ttl_s`` (:mod:`shared.runtime.leadership`). Published only through the role's
    fenced publisher, so a replica whose term was taken over can no longer publish one."""

    TYPE: ClassVar[str] = "LeaderRenewed"
    role: str
    holder: str
    term: int
    ttl_s: float

    def _check(self) -> None:
        require(0 < len(self.role) <= 64 and 0 < len(self.holder) <= 128,
                "LeaderRenewed: role 1-64 and holder 1-128 characters")
        require(1 <= self.term < 2**63, "LeaderRenewed.term: must be in 1..2**63-1")
        require(0 < self.ttl_s <= 3600, "LeaderRenewed.ttl_s: must be in (0, 3600]")


@dataclass(frozen=True, kw_only=True)
class DeadLetter(Event):
    TYPE: ClassVar[str] = "DeadLetter"
    topic: str
    partition: int
    offset: int
    reason: str
    raw: bytes

    def _check(self) -> None:
        require(len(self.raw) <= DEADLETTER_RAW_LIMIT,
                 f"DeadLetter.raw: at most {DEADLETTER_RAW_LIMIT} bytes (truncate it)")


EVENT_TYPES: dict[str, type[Event]] = {
    cls.TYPE: cls for cls in (
        JobSubmitted, JobCancelled, NodeRegistered, NodeHeartbeat, ThroughputEstimate,
        RoundStarted, Assignment, Progress, CopyFinished, ModelConsolidated, RoundAbandoned, JobCompleted,
        QueuesApplied, LeaderRenewed, DeadLetter,
    )
}

if set(TOPIC_OF_TYPE) != set(EVENT_TYPES):  # a new event type must be given a topic (shared.wire.topics)
    raise ImportError(f"event types without a topic: {sorted(set(EVENT_TYPES) ^ set(TOPIC_OF_TYPE))}")


def topic_for(event: Event) -> str:
    """The one topic ``event`` travels on (:data:`shared.wire.topics.TOPIC_OF_TYPE`)."""
    return TOPIC_OF_TYPE[event.TYPE]


def key_for(event: Event) -> str:
    """Partition key: job events by job id, node events by node id (keeps per-job order)."""
    for attr in ("job_id", "node_id"):
        value = getattr(event, attr, None)
        if isinstance(value, str):
            return value
    if isinstance(event, RoundStarted):
        return f"round-{event.round}"
    if isinstance(event, LeaderRenewed):
        return f"leader-{event.role}"
    return event.TYPE


# ---------------------------------------------------------------- wire

_ENVELOPE = ("type", "v", "id", "ts", "source", "body")
# Compiled per event class (shared.wire.record_codec): its type and version, its body's
# to_wire; by type name, its version and its from_wire (which owns the body it is given).
_ENCODER_OF = {cls: (cls.TYPE, cls.VERSION, codec(cls).to_wire) for cls in EVENT_TYPES.values()}
_DECODER_OF: dict[str, tuple[int, Callable[[dict[Any, Any], str, Any, Any, Any], Event]]] = {
    name: (cls.VERSION, cast(Callable[..., Event], codec(cls).from_wire)) for name, cls in EVENT_TYPES.items()}
# One Packer for the process: packing validated events runs no Python code, so under the
# GIL a pack is never interleaved with another, and Packer resets itself on error.
_pack: Callable[[object], bytes] = msgpack.Packer(use_bin_type=True).pack
_unpackb = msgpack.unpackb


def encode(event: Event) -> bytes:
    encoder = _ENCODER_OF.get(type(event))
    if encoder is None:
        raise TypeError(f"not an event: {type(event).__name__}")
    etype, version, body = encoder
    return _pack({"type": etype, "v": version, "id": event.id, "ts": event.ts, "source": event.source,
                  "body": body(event)})


def decode(data: bytes) -> Event:
    if type(data) is not bytes:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidEvent(f"not bytes: {type(data).__name__}")
        data = bytes(data)
    size = len(data)
    if size > MAX_WIRE_BYTES:
        raise InvalidEvent(f"record too large: {size} bytes")
    try:
        # bounded_msgpack.unpack's own path for records too small to spend the budget,
        # inlined: the extra call was 3% of decoding a Progress.
        msg = (_unpackb(data, raw=False, strict_map_key=True, max_ext_len=0) if size <= UNCHARGED_MAX
               else unpack(data))
    except TooCostly:
        raise InvalidEvent(f"record too costly to decode: its objects exceed the limit of "
                           f"{COST_PER_BYTE}x its {len(data)} bytes") from None
    except Exception as exc:  # msgpack raises many types; all mean "not an event"
        raise InvalidEvent(f"not msgpack: {type(exc).__name__}: {exc}"[:200]) from None
    if type(msg) is not dict or len(msg) != 6:   # the six keys of _ENVELOPE
        _bad_envelope(msg)
    try:
        etype, version, body = msg["type"], msg["v"], msg["body"]
        id_, ts, source = msg["id"], msg["ts"], msg["source"]   # Event._WIRE_OUTER's order
    except KeyError:
        _bad_envelope(msg)
    decoder = _DECODER_OF.get(etype) if type(etype) is str else None   # msgpack makes exact str
    if decoder is None:
        _bad_envelope(msg)
    expected, from_wire = decoder
    if version != expected or isinstance(version, bool):
        raise InvalidEvent(f"{etype}: unsupported schema version {short_repr(version)}")
    if not isinstance(body, dict):
        raise InvalidEvent(f"{etype}: body must be a map")
    # id, ts and source come from the envelope; from_wire refuses them in the body.
    return from_wire(body, etype, id_, ts, source)


def _bad_envelope(msg: object) -> NoReturn:
    """Raise the reason ``msg`` is not an envelope (a map of the six keys, a known type)."""
    if not isinstance(msg, dict):
        raise InvalidEvent(f"envelope: expected a map, got {type(msg).__name__}")
    missing = [k for k in _ENVELOPE if k not in msg]
    if missing:
        raise InvalidEvent(f"envelope: missing key {missing[0]!r}")
    extra = [k for k in msg if k not in _ENVELOPE]
    if extra:
        raise InvalidEvent(f"envelope: unknown key {extra[0]!r}")
    raise InvalidEvent(f"envelope: unknown event type {short_repr(msg['type'])}")
