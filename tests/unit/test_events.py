"""Properties of the event codec (shared/wire/events.py).

Strategies are derived from each record's dataclass fields and annotations; the table
below narrows the fields whose ``_check`` restricts them, and a few classes with rules
that tie fields together get those fields drawn jointly.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Literal

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.wire.events import (
    DEADLETTER_RAW_LIMIT,
    EVENT_TYPES,
    JOB_ID_RE,
    MAX_MODEL_BYTES,
    MAX_OPTIMIZER_SLOTS,
    NODE_ID_RE,
    Assignment,
    CopyFinished,
    Event,
    GpuInfo,
    InvalidEvent,
    JobCancelled,
    JobSpec,
    JobSubmitted,
    NodeHeartbeat,
    NodeRegistered,
    Progress,
    QueueConfig,
    QueueSpec,
    Record,
    RoundStarted,
    decode,
    encode,
)
from shared.wire.records import DIGEST_RE, QUEUE_NAME_RE, USER_RE, UserCode

USER_FOR_CODE = "alice"   # a job with code names a user that owns a store prefix

INT64 = (-(2**63), 2**63 - 1)  # what msgpack can carry
# Twelve types times ROUND_TRIP examples: kept small so the suite stays fast on 2 cores.
ROUND_TRIP = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HOSTILE = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def floats(lo: float | None = None, hi: float | None = None, *, exclude_lo: bool = False
           ) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, exclude_min=exclude_lo)


def text(lo: int = 0, hi: int = 24) -> st.SearchStrategy[str]:
    return st.text(min_size=lo, max_size=hi)


job_ids = st.from_regex(JOB_ID_RE, fullmatch=True)
node_ids = st.from_regex(NODE_ID_RE, fullmatch=True)
non_negative = st.integers(0, INT64[1])
queue_names = st.from_regex(QUEUE_NAME_RE, fullmatch=True)
digests = st.from_regex(DIGEST_RE, fullmatch=True)
users = st.from_regex(USER_RE, fullmatch=True)
gpu_counts = st.dictionaries(text(1, 32), st.integers(0, 1 << 20), max_size=3)

# (class name or "*", field) -> strategy, for fields whose _check narrows the annotation.
FIELDS: dict[tuple[str, str], st.SearchStrategy[Any]] = {
    ("*", "job_id"): job_ids,
    ("*", "node_id"): node_ids,
    ("*", "id"): text(1, 64),
    ("*", "ts"): floats(0),
    ("*", "source"): text(0, 128),
    ("*", "round"): non_negative,
    ("*", "copy"): non_negative,
    ("*", "steps_round"): non_negative,
    ("RoundStarted", "policy_options"): st.dictionaries(text(1, 8), st.integers() | text(0, 8), max_size=3).map(
        lambda d: json.dumps(d, sort_keys=True, separators=(",", ":"))),
    ("RoundStarted", "seed"): non_negative,
    ("RoundStarted", "round_s"): floats(0),
    ("RoundStarted", "heartbeat_s"): floats(0),
    ("Hyperparameters", "lr"): floats(0, 10, exclude_lo=True),
    ("Hyperparameters", "seed"): st.integers(0, 2**32 - 1),
    ("JobSpec", "user"): text(1, 64),
    ("JobCancelled", "user"): st.just("") | users,
    ("JobSpec", "model"): text(1, 64),
    ("JobSpec", "dataset"): text(1, 64),
    ("JobSpec", "batch_size"): st.integers(1, 65536),
    ("JobSpec", "workers"): st.integers(1, 64),
    ("JobSpec", "iterations"): st.integers(1, 10**12),
    ("JobSpec", "priority"): floats(0, 1000, exclude_lo=True),
    ("JobSpec", "deadline_s"): st.none() | floats(0, exclude_lo=True),
    ("JobSpec", "queue"): st.just("") | queue_names,
    ("JobSpec", "priority_class"): st.integers(0, 100),
    ("CopyFinished", "metric_name"): text(0, 32),
    ("CopyFinished", "log_tail"): text(0, 64),
    ("CopyFinished", "start_s"): st.none() | floats(0, 86_400),
    ("UserCode", "digest"): digests,
    ("UserCode", "size"): st.integers(1, 2**40),
    ("UserCode", "entrypoint"): st.from_regex(r"[a-z_]{1,8}(/[a-z_]{1,8}){0,2}\.py", fullmatch=True),
    ("UserCode", "args"): st.lists(text(0, 16).filter(lambda a: "\x00" not in a), max_size=4).map(tuple),
    ("UserCode", "config"): st.dictionaries(text(1, 8), st.integers(), max_size=3).map(json.dumps),
    ("UserCode", "data_digest"): st.just("") | digests,
    ("UserCode", "data_size"): st.integers(0, 2**44),
    ("UserCode", "hint"): text(0, 32),
    ("QueueSpec", "name"): queue_names,
    ("QueueSpec", "weight"): floats(0, 1000, exclude_lo=True),
    ("QueueSpec", "quota"): gpu_counts,
    ("QueueSpec", "borrowing_limit"): st.none() | st.integers(0, 1 << 20),
    ("QueueSpec", "user_max_gpus"): st.none() | st.integers(0, 1 << 20),
    ("QueueSpec", "user_max_queued"): st.none() | st.integers(0, 1 << 20),
    ("QueueConfig", "fair_share_half_life_s"): floats(60, 365 * 86400),
    ("QueueConfig", "queues"): st.lists(st.deferred(lambda: records(QueueSpec)), min_size=1, max_size=4,
                                        unique_by=lambda q: q.name).map(tuple),
    ("QueueStanding", "name"): queue_names,
    ("QueueStanding", "entitled"): gpu_counts,
    ("QueueStanding", "used"): gpu_counts,
    ("QueueStanding", "borrowed"): st.integers(0, 1 << 20),
    ("QueueStanding", "lent"): st.integers(0, 1 << 20),
    ("QueueStanding", "usage"): floats(0),
    ("QueueStanding", "pending"): non_negative,
    ("QueueStanding", "running"): non_negative,
    ("GpuInfo", "index"): st.integers(0, 1023),
    ("GpuInfo", "type"): text(1, 32),
    ("ThroughputEstimate", "workers"): st.integers(1, 64),
    ("ThroughputEstimate", "rates"): st.dictionaries(text(), floats(0), max_size=4),
    ("ThroughputEstimate", "model_bytes"): st.integers(0, MAX_MODEL_BYTES),
    ("ThroughputEstimate", "optimizer_slots"): st.integers(0, MAX_OPTIMIZER_SLOTS),
    ("Assignment", "copy"): st.integers(0, 1023),
    ("Assignment", "step_budget"): non_negative,
    ("Assignment", "copies"): st.integers(1, 1024),
    ("ModelConsolidated", "total_steps"): non_negative,
    ("ModelConsolidated", "metric_name"): text(0, 32),
    ("Progress", "samples_per_s"): floats(0),
    ("Progress", "workers"): st.integers(1, INT64[1]),
    ("JobCompleted", "jct_s"): floats(0),
    ("DeadLetter", "raw"): st.binary(max_size=DEADLETTER_RAW_LIMIT),
    ("LeaderRenewed", "role"): text(1, 64),
    ("LeaderRenewed", "holder"): text(1, 128),
    ("LeaderRenewed", "term"): st.integers(1, 2**63 - 1),
    ("LeaderRenewed", "ttl_s"): floats(0, 3600, exclude_lo=True),
    ("NodeRegistered", "gpus"): st.lists(st.deferred(lambda: records(GpuInfo)), min_size=1,
                                         max_size=4, unique_by=lambda g: g.index).map(tuple),
}


def annotation_strategy(hint: Any) -> st.SearchStrategy[Any]:
    """Any valid value of an annotation, unconstrained beyond the type."""
    origin = typing.get_origin(hint)
    if hint is str:
        return text()
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(*INT64)
    if hint is float:
        return floats()
    if hint is bytes:
        return st.binary(max_size=64)
    if origin is Literal:
        return st.sampled_from(typing.get_args(hint))
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return st.none() | annotation_strategy(inner[0])
    if origin is tuple:
        return st.lists(annotation_strategy(typing.get_args(hint)[0]), max_size=3).map(tuple)
    if origin is dict:
        key, value = typing.get_args(hint)
        return st.dictionaries(annotation_strategy(key), annotation_strategy(value), max_size=3)
    if isinstance(hint, type) and issubclass(hint, Record):
        return records(hint)
    raise AssertionError(f"no strategy for {hint!r}")


def field_kwargs(cls: type[Record]) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments for ``cls``: required fields always, defaulted ones sometimes."""
    hints = typing.get_type_hints(cls)
    required, optional = {}, {}
    for f in dataclasses.fields(cls):
        strategy = FIELDS.get((cls.__name__, f.name), FIELDS.get(("*", f.name)))
        if strategy is None:
            strategy = annotation_strategy(hints[f.name])
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        (optional if has_default else required)[f.name] = strategy
    return st.fixed_dictionaries(required, optional=optional)


@st.composite
def _assignment_kwargs(draw: st.DrawFn) -> dict[str, Any]:
    kwargs = draw(field_kwargs(Assignment))
    gpus = draw(st.lists(st.integers(0, 1023), min_size=1, max_size=8, unique=True))
    world_size = draw(st.integers(len(gpus), 64))
    ranks = draw(st.lists(st.integers(0, world_size - 1), min_size=len(gpus), max_size=len(gpus),
                          unique=True))
    spans_nodes = world_size != len(gpus)
    rendezvous = draw(text(1, 30)) if spans_nodes else draw(st.none() | text(0, 30))
    peers: tuple[str, ...] = ()
    if draw(st.booleans()):   # each rank's node; this node's ranks name it
        others = draw(st.lists(node_ids, min_size=world_size,
                               max_size=world_size))
        peers = tuple(kwargs["node_id"] if r in ranks else other for r, other in enumerate(others))
    fork_workers = draw(st.just(0) | st.integers(world_size, 65536))
    return dict(kwargs, gpus=tuple(gpus), world_size=world_size, ranks=tuple(ranks),
                rendezvous=rendezvous, peers=peers, fork_workers=fork_workers)


def _joint(kwargs: dict[str, Any], cls: type[Record]) -> dict[str, Any]:
    """Make fields that _check ties together consistent."""
    if cls is Progress:
        kwargs["steps_total"] = min(INT64[1], kwargs["steps_round"] + abs(kwargs["steps_total"]))
    elif cls is CopyFinished and kwargs.get("evaluation"):
        kwargs["checkpoint"], kwargs["steps_round"] = None, 0
    elif cls is CopyFinished and kwargs["status"] != "failed" and kwargs.get("checkpoint") is None:
        kwargs["checkpoint"] = "checkpoints/x/0/n0/0.safetensors"
    elif cls is Assignment and kwargs.get("evaluation"):
        if kwargs["job"].code is None:
            kwargs["evaluation"] = False
        else:
            kwargs.update(step_budget=0, copies=1, start_from=kwargs.get("start_from") or "models/x/final.safetensors")
    elif cls is QueueConfig:
        kwargs["default_queue"] = kwargs["queues"][0].name
    elif cls is RoundStarted:
        low, high = sorted((kwargs["started_at"], kwargs["ends_at"]))
        kwargs["started_at"], kwargs["ends_at"] = low, high
    elif cls is UserCode:
        kwargs["data_size"] = (1 + kwargs.get("data_size", 0) % 2**44) if kwargs.get("data_digest") else 0
    elif cls is JobSpec and kwargs.get("code") is not None:
        kwargs["user"] = USER_FOR_CODE
        kwargs["dataset"] = "data-1" if kwargs["code"].data_digest else "-"
    return kwargs


def records(cls: type[Record]) -> st.SearchStrategy[Record]:
    kwargs = _assignment_kwargs() if cls is Assignment else field_kwargs(cls)
    return kwargs.map(lambda kw: cls(**_joint(kw, cls)))


any_event = st.one_of([records(cls) for cls in EVENT_TYPES.values()])


@pytest.mark.parametrize("cls", list(EVENT_TYPES.values()), ids=list(EVENT_TYPES))
@ROUND_TRIP
@given(data=st.data())
def test_every_event_type_round_trips(cls: type[Event], data: st.DataObject) -> None:
    event = data.draw(records(cls))
    wire = encode(event)
    assert decode(wire) == event
    assert encode(decode(wire)) == wire


# ---------------------------------------------------------------- hostile input

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(*INT64) | st.floats() | text() | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(text(0, 8) | st.binary(max_size=4), inner, max_size=4),
    max_leaves=20,
)


def field_names(cls: type[Record]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


@st.composite
def envelope_shaped(draw: st.DrawFn) -> dict[Any, Any]:
    """Maps that look like an envelope: known or unknown types and versions, bodies that use
    the type's real field names (and some others) with random values."""
    type_name = draw(st.sampled_from(list(EVENT_TYPES)) | text(0, 12))
    cls = EVENT_TYPES.get(type_name, Progress)
    names = field_names(cls) + ["job", "hyper", "gpus", "extra"]
    body = draw(st.dictionaries(st.sampled_from(names), msgpack_values, max_size=len(names)))
    envelope = {"type": type_name, "v": draw(st.sampled_from([1, 1, 2, 0, True, "1", None])),
                "id": draw(text(0, 70) | msgpack_values), "ts": draw(floats() | msgpack_values),
                "source": draw(text() | msgpack_values), "body": body}
    drop = draw(st.sets(st.sampled_from(list(envelope)), max_size=1))
    return {k: v for k, v in envelope.items() if k not in drop}


@st.composite
def mutated_valid(draw: st.DrawFn) -> bytes:
    """A valid event's wire map with one body field (or nested field) replaced at random."""
    wire = msgpack.unpackb(encode(draw(any_event)), raw=False)
    target = wire["body"]
    nested = [k for k, v in target.items() if isinstance(v, dict) and v]
    if nested and draw(st.booleans()):
        target = target[draw(st.sampled_from(nested))]
    key = draw(st.sampled_from(sorted(target)))
    target[key] = draw(msgpack_values)
    return msgpack.packb(wire, use_bin_type=True)


def decode_or_invalid(data: bytes) -> None:
    try:
        event = decode(data)
    except InvalidEvent as exc:
        assert exc.reason and str(exc) == exc.reason
    else:
        assert isinstance(event, Event)


@HOSTILE
@given(st.binary(max_size=256))
def test_random_bytes_only_ever_raise_invalid_event(data: bytes) -> None:
    decode_or_invalid(data)


@HOSTILE
@given(msgpack_values)
def test_random_msgpack_only_ever_raises_invalid_event(value: Any) -> None:
    decode_or_invalid(msgpack.packb(value, use_bin_type=True))


@HOSTILE
@given(envelope_shaped())
def test_envelope_shaped_maps_only_ever_raise_invalid_event(envelope: dict[Any, Any]) -> None:
    decode_or_invalid(msgpack.packb(envelope, use_bin_type=True))


@HOSTILE
@given(mutated_valid())
def test_mutated_valid_events_only_ever_raise_invalid_event(data: bytes) -> None:
    decode_or_invalid(data)


# ---------------------------------------------------------------- explicit bad cases

def _spec(**changes: Any) -> dict[str, Any]:
    spec = dict(job_id="resnet-1", user="u", model="resnet", dataset="cifar", batch_size=32,
                workers=2, iterations=100)
    return dict(spec, **changes)


def _wire(event: Event, **changes: Any) -> dict[str, Any]:
    wire = msgpack.unpackb(encode(event), raw=False)
    wire.update(changes)
    return wire


def _progress() -> Progress:
    return Progress(ts=1.0, source="agent/n1", job_id="resnet-1", round=2, copy=0, node_id="n1",
                    gpu_type="v100", workers=1, steps_round=5, steps_total=10,
                    samples_per_s=3.5, loss=0.25)


def _with_body(event: Event, **changes: Any) -> dict[str, Any]:
    wire = _wire(event)
    wire["body"].update(changes)
    return wire


def _without(event: Event, name: str) -> dict[str, Any]:
    wire = _wire(event)
    del wire["body"][name]
    return wire


submitted = JobSubmitted(ts=1.0, source="cli", job=JobSpec(**_spec()), submitted_at=1.0)
submitted_wire = _wire(submitted)
submitted_wire["body"]["job"]["workers"] = 65

BAD_WIRE = [
    ("wrong version", _wire(_progress(), v=2), "Progress: unsupported schema version 2"),
    ("unknown type", _wire(_progress(), type="Nope"), "envelope: unknown event type 'Nope'"),
    ("missing field", _without(_progress(), "job_id"), "Progress: missing field 'job_id'"),
    ("unknown field", _with_body(_progress(), colour="red"), "Progress: unknown field 'colour'"),
    ("wrong field type", _with_body(_progress(), round="2"), "Progress.round: expected int, got str"),
    ("bool is not int", _with_body(_progress(), round=True), "Progress.round: expected int, got bool"),
    ("workers out of range", submitted_wire, "JobSpec.workers: must be in 1..64, got 65"),
    ("bad job id", _with_body(_progress(), job_id="A/../x"), "Progress.job_id: 'A/../x' must be"),
    ("envelope key in body", _with_body(_progress(), ts=2.0), "Progress: body must not contain envelope key 'ts'"),
    ("missing envelope key", {"type": "Progress", "v": 1}, "envelope: missing key 'id'"),
    ("not a map", [1, 2, 3], "envelope: expected a map, got list"),
]


@pytest.mark.parametrize("wire, reason", [(w, r) for _, w, r in BAD_WIRE], ids=[n for n, _, _ in BAD_WIRE])
def test_bad_records_are_rejected_with_their_reason(wire: Any, reason: str) -> None:
    with pytest.raises(InvalidEvent) as err:
        decode(msgpack.packb(wire, use_bin_type=True))
    assert err.value.reason.startswith(reason)


def test_bytes_that_are_not_msgpack_say_so() -> None:
    with pytest.raises(InvalidEvent, match=r"^not msgpack"):
        decode(b"\xc1")
    with pytest.raises(InvalidEvent, match=r"^not bytes"):
        decode("a string")  # type: ignore[arg-type]


@pytest.mark.parametrize("make, reason", [
    (lambda: JobSpec(**_spec(workers=0)), "JobSpec.workers: must be in 1..64, got 0"),
    (lambda: JobCancelled(ts=1.0, source="s", job_id="A/../x"), "JobCancelled.job_id: 'A/../x'"),
    (lambda: NodeRegistered(ts=1.0, source="s", node_id="n1", gpus=()), "NodeRegistered.gpus"),
    (lambda: dataclasses.replace(_progress(), steps_total=1), "Progress.steps"),
    (lambda: dataclasses.replace(_progress(), loss=float("nan")), "Progress.loss: must be a finite"),
], ids=["workers", "job id", "no gpus", "steps", "nan"])
def test_invalid_events_cannot_be_constructed(make: Any, reason: str) -> None:
    with pytest.raises(InvalidEvent) as err:
        make()
    assert err.value.reason.startswith(reason)


def _spanning(**change: Any) -> Assignment:
    fields: dict[str, Any] = dict(ts=1.0, source="s", round=1, job=JobSpec(**_spec(workers=3)), copy=0,
                                  node_id="n2", gpus=(0,), gpu_type="v100", world_size=3, ranks=(2,),
                                  step_budget=5, deadline=2.0, rendezvous="n1:29500", peers=("n1", "n1", "n2"))
    return Assignment(**{**fields, **change})


@pytest.mark.parametrize("peers, reason", [
    (("n1", "n2"), "Assignment.peers: one node per rank"),
    (("n1", "n1", "n1"), "Assignment.peers: this node's ranks must name this node"),
    (("n1", "bad/node", "n2"), "Assignment.peers.node_id: 'bad/node'"),
], ids=["length", "not this node", "bad id"])
def test_an_assignments_peers_name_one_valid_node_per_rank_and_this_node_for_its_ranks(peers: tuple,
                                                                                       reason: str) -> None:
    assert _spanning().peers == ("n1", "n1", "n2") and _spanning(peers=()).peers == ()
    with pytest.raises(InvalidEvent) as err:
        _spanning(peers=peers)
    assert err.value.reason.startswith(reason)


def _evaluation(**change: Any) -> Assignment:
    code = UserCode(digest="a" * 64, size=10, entrypoint="train.py")
    job = JobSpec(**_spec(user="alice", dataset="-", code=code))
    fields: dict[str, Any] = dict(ts=1.0, source="s", round=9, job=job, copy=0, node_id="n1", gpus=(0,),
                                  gpu_type="v100", world_size=1, ranks=(0,), step_budget=0, deadline=2.0,
                                  start_from="models/resnet-1/final.safetensors", evaluation=True)
    return Assignment(**{**fields, **change})


@pytest.mark.parametrize("change", [
    {"job": JobSpec(**_spec())}, {"step_budget": 1}, {"start_from": None}, {"copies": 2},
], ids=["zoo job", "steps", "no model", "forked"])
def test_an_evaluation_copy_is_one_copy_of_user_code_that_trains_nothing_from_a_model(change: dict) -> None:
    assert _evaluation().evaluation
    with pytest.raises(InvalidEvent) as err:
        _evaluation(**change)
    assert err.value.reason.startswith("Assignment.evaluation:")


def test_an_evaluation_report_carries_no_checkpoint_and_no_step() -> None:
    fields: dict[str, Any] = dict(ts=1.0, source="s", job_id="resnet-1", round=9, copy=0, node_id="n1",
                                  status="ok", steps_round=0, evaluation=True, metric_name="accuracy",
                                  start_metric=0.9)
    assert CopyFinished(**fields).checkpoint is None
    for change in ({"checkpoint": "checkpoints/resnet-1/9/n1/0.safetensors"}, {"steps_round": 3}):
        with pytest.raises(InvalidEvent, match=r"CopyFinished\.evaluation:"):
            CopyFinished(**{**fields, **change})
    with pytest.raises(InvalidEvent, match=r"CopyFinished\.checkpoint:"):
        CopyFinished(**{**fields, "evaluation": False})


def test_values_msgpack_cannot_carry_are_rejected_when_the_event_is_built():
    from shared.wire.events import InvalidEvent, JobCancelled, Progress

    with pytest.raises(InvalidEvent, match="64-bit"):
        Progress(ts=1.0, source="a", job_id="j", round=2**70, copy=0, node_id="n", gpu_type="t4", workers=1,
                 steps_round=0, steps_total=0, samples_per_s=0.0, loss=0.0)
    with pytest.raises(InvalidEvent, match="UTF-8"):
        JobCancelled(ts=1.0, source="a", job_id="j", reason="bad \ud800 surrogate")


def test_reasons_stay_short_whatever_the_input():
    import msgpack

    from shared.wire.events import InvalidEvent, decode

    huge = "x" * 100_000
    with pytest.raises(InvalidEvent) as info:
        decode(msgpack.packb({"type": huge, "v": 1, "id": "a", "ts": 1.0, "source": "s", "body": {}}))
    assert len(info.value.reason) < 200


@pytest.mark.parametrize("bad", ["job\n", "a" * 63 + "\n"])
def test_an_id_with_a_trailing_newline_is_refused(bad):
    with pytest.raises(InvalidEvent, match="job_id"):
        JobCancelled(ts=1.0, source="cli", job_id=bad)
    with pytest.raises(InvalidEvent, match="node_id"):
        NodeHeartbeat(ts=1.0, source="agent", node_id=bad)
