"""The ``__metadata__`` of a consolidated round model (``models/{job}/{round}.safetensors``).

The tracker writes it when it averages a round and reads it back to announce a model an
earlier run wrote but did not announce; the agent reads ``total_steps`` of the model it
starts from. Safetensors metadata maps str to str; the entries, in the order written::

    format       the replicas' checkpoint format, carried over (absent if they had none)
    mode         "steps" or "uniform": how the copies were weighed
    round_steps  sum of the averaged copies' own steps (decimal)
    copies       JSON [{"copy": int, "steps": int, "weight": float}, ...]: the averaged copies
    rejected     JSON [{"copy": int, "reason": str}, ...]: copies left out, and why
    job          the job id
    round        the round (decimal)
    total_steps  job steps in the model (decimal): the job's worker-steps, the starting
                 model's plus the copies' steps x their workers, floor-divided by the job's
                 W (``shared.domain.progress``); a copy on k < W workers adds k/W of a job step
                 per step, so this is not comparable with round_steps
    missing      JSON [int, ...]: copies assigned that never reported

and, when the tracker knows the job (it always does for a job submitted through Hadar),
what the file *is*, enough to rebuild the module it fits (``shared.zoo.build_from_metadata``)::

    model        the zoo model name, e.g. "resnet-w16-d2"
    dataset      the zoo dataset name, e.g. "digits"
    width        the model's width (decimal); depth: its depth (decimal)
    zoo          JSON {"family", "width", "depth", "task", "input_shape", "n_outputs"}
    library      "hadar <version>": the code that wrote the file and whose zoo builds the module
    samples      training samples credited to the model (decimal): the job's worker-steps
                 (clipped to W x iterations) x the per-worker batch

The file holds the model's weights only (its ``state_dict``): the averaged optimizer state
of a round model is a sibling object (``shared.domain.layout.optim_key``).

:meth:`ModelMetadata.to_metadata` writes the first group exactly, byte for byte as the
tracker always has, then the description entries that are set.
:meth:`ModelMetadata.from_metadata` reads them back, ignores entries it does not
know, tolerates the absence of ``rejected``, ``missing``, ``round_steps``, ``format`` and of
every description entry, and raises :class:`InvalidModelMetadata` -- and nothing else --
for anything malformed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from shared.errors import HadarError
from shared.wire.records import JOB_ID_RE, CopyWeight, InvalidEvent, JobSpec, Rejection

__all__ = ["InvalidModelMetadata", "ModelMetadata", "ModelDescription", "Mode", "consolidation_entries",
           "code_metadata", "OPTIM_PREFIX"]

# Tensors named with this prefix are optimizer state (a checkpoint holds both; a model
# file holds none, its round's optimizer state is the sibling ``shared.domain.layout.optim_key``).
OPTIM_PREFIX = "optim."
Mode = Literal["steps", "uniform"]
MODES: tuple[Mode, ...] = ("steps", "uniform")
_MAX_INT = 2**63 - 1
_COUNT_RE = re.compile(r"0|[1-9][0-9]*")
_COMPACT = (",", ":")


class InvalidModelMetadata(HadarError, ValueError):
    """Metadata that is not a consolidated model's; the message names the entry and why."""


@dataclass(frozen=True, kw_only=True)
class ModelDescription:
    """What a model file is: the zoo model and dataset it was trained as, by which code, on
    how many samples (see the module docstring). ``zoo`` is a JSON object text."""

    model: str
    dataset: str
    width: int
    depth: int
    zoo: str
    library: str
    samples: int

    def __post_init__(self) -> None:
        for name in ("model", "dataset", "library"):
            value = getattr(self, name)
            if not isinstance(value, str) or not 0 < len(value) <= 200:
                raise InvalidModelMetadata(f"model metadata: {name}: expected 1-200 characters, got {_short(value)}")
        for name in ("width", "depth", "samples"):
            _check_count(name, getattr(self, name))
        try:
            zoo = json.loads(self.zoo) if isinstance(self.zoo, str) else None
        except (ValueError, RecursionError):
            zoo = None
        if not isinstance(zoo, dict):
            raise InvalidModelMetadata(f"model metadata: zoo: expected a JSON object, got {_short(self.zoo)}")

    def to_metadata(self) -> dict[str, str]:
        return {"model": self.model, "dataset": self.dataset, "width": str(self.width), "depth": str(self.depth),
                "zoo": self.zoo, "library": self.library, "samples": str(self.samples)}

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str]) -> ModelDescription | None:
        """The description in ``meta``; None if it has none (a model written before there was one)."""
        if "model" not in meta:
            return None
        return cls(model=_entry(meta, "model"), dataset=_entry(meta, "dataset"), width=_count(meta, "width"),
                   depth=_count(meta, "depth"), zoo=_entry(meta, "zoo"), library=_entry(meta, "library"),
                   samples=_count(meta, "samples"))


@dataclass(frozen=True, kw_only=True)
class ModelMetadata:
    """What a consolidated round model says about itself. Invalid values cannot be built:
    the constructor raises :class:`InvalidModelMetadata`.

    Copy ids are unique across ``copies``, ``rejected`` and ``missing``; ``copies`` is not
    empty; weights lie in [0, 1].
    """

    job: str
    round: int
    total_steps: int
    mode: Mode
    copies: tuple[CopyWeight, ...]
    rejected: tuple[Rejection, ...] = ()
    missing: tuple[int, ...] = ()
    format: str | None = None
    description: ModelDescription | None = None

    def __post_init__(self) -> None:
        for name in ("copies", "rejected", "missing"):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)):
                raise InvalidModelMetadata(f"model metadata: {name}: expected a sequence, got {type(value).__name__}")
            object.__setattr__(self, name, tuple(value))
        if not isinstance(self.job, str) or JOB_ID_RE.fullmatch(self.job) is None:
            raise InvalidModelMetadata(f"model metadata: job: not a job id: {_short(self.job)}")
        _check_count("round", self.round)
        _check_count("total_steps", self.total_steps)
        if self.mode not in MODES:
            raise InvalidModelMetadata(f"model metadata: mode: must be one of {list(MODES)}, got {_short(self.mode)}")
        if self.format is not None and not isinstance(self.format, str):
            raise InvalidModelMetadata(f"model metadata: format: expected str, got {type(self.format).__name__}")
        if self.description is not None and not isinstance(self.description, ModelDescription):
            raise InvalidModelMetadata(f"model metadata: description: expected ModelDescription, "
                                       f"got {type(self.description).__name__}")
        if not self.copies:
            raise InvalidModelMetadata("model metadata: copies: a model averages at least one copy")
        for c in self.copies:
            if not isinstance(c, CopyWeight):
                raise InvalidModelMetadata(f"model metadata: copies: expected CopyWeight, got {type(c).__name__}")
            _check_count("copies.copy", c.copy)
            _check_count("copies.steps", c.steps)
            if not 0.0 <= c.weight <= 1.0:
                raise InvalidModelMetadata(f"model metadata: copies.weight: must be in [0, 1], got {c.weight!r}")
        for r in self.rejected:
            if not isinstance(r, Rejection):
                raise InvalidModelMetadata(f"model metadata: rejected: expected Rejection, got {type(r).__name__}")
            _check_count("rejected.copy", r.copy)
        for m in self.missing:
            _check_count("missing", m)
        ids = [c.copy for c in self.copies] + [r.copy for r in self.rejected] + list(self.missing)
        if len(set(ids)) != len(ids):
            raise InvalidModelMetadata(f"model metadata: a copy id appears twice in copies/rejected/missing: {ids}")

    @property
    def round_steps(self) -> int:
        """The averaged copies' own steps this round, summed."""
        return sum(c.steps for c in self.copies)

    def to_metadata(self) -> dict[str, str]:
        """The safetensors ``__metadata__`` entries, in the order the tracker writes them."""
        meta = {"format": self.format} if self.format is not None else {}
        meta.update(consolidation_entries(mode=self.mode, copies=self.copies, rejected=self.rejected))
        meta.update({
            "job": self.job,
            "round": str(self.round),
            "total_steps": str(self.total_steps),
            "missing": json.dumps(list(self.missing)),  # default separators: the bytes written since the start
        })
        if self.description is not None:
            meta.update(self.description.to_metadata())
        return meta

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str]) -> ModelMetadata:
        """Parse ``meta`` (see the module docstring); :class:`InvalidModelMetadata` if malformed."""
        if not isinstance(meta, Mapping):
            raise InvalidModelMetadata(f"model metadata: expected a mapping, got {type(meta).__name__}")
        for key, value in meta.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise InvalidModelMetadata(f"model metadata: entry {_short(key)} does not map str to str")
        copies = tuple(_copy_weight(item) for item in _json_list(meta, "copies", required=True))
        rejected = tuple(_rejection(item) for item in _json_list(meta, "rejected", required=False))
        missing = tuple(_json_count("missing", item) for item in _json_list(meta, "missing", required=False))
        parsed = cls(job=_entry(meta, "job"), round=_count(meta, "round"), total_steps=_count(meta, "total_steps"),
                     mode=_entry(meta, "mode"),  # type: ignore[arg-type]  # checked on construction
                     copies=copies, rejected=rejected, missing=missing, format=meta.get("format"),
                     description=ModelDescription.from_metadata(meta))
        if "round_steps" in meta and _count(meta, "round_steps") != parsed.round_steps:
            raise InvalidModelMetadata(f"model metadata: round_steps {meta['round_steps']} is not the sum "
                                       f"of the copies' steps ({parsed.round_steps})")
        return parsed


def consolidation_entries(*, mode: str, copies: Iterable[CopyWeight],
                          rejected: Iterable[Rejection]) -> dict[str, str]:
    """The entries any consolidated file carries, ``hadar consolidate``'s output included
    (which has no job or round): ``mode``, ``round_steps``, ``copies``, ``rejected``."""
    copies = tuple(copies)
    return {
        "mode": mode,
        "round_steps": str(sum(c.steps for c in copies)),
        "copies": json.dumps([{"copy": c.copy, "steps": c.steps, "weight": c.weight} for c in copies],
                             separators=_COMPACT),
        "rejected": json.dumps([{"copy": r.copy, "reason": r.reason} for r in rejected], separators=_COMPACT),
    }


# ---------------------------------------------------------------- parsing helpers


def _entry(meta: Mapping[str, str], name: str) -> str:
    if name not in meta:
        raise InvalidModelMetadata(f"model metadata: {name}: missing")
    return meta[name]


def _count(meta: Mapping[str, str], name: str) -> int:
    text = _entry(meta, name)
    if _COUNT_RE.fullmatch(text) is None or len(text) > 19:
        raise InvalidModelMetadata(f"model metadata: {name}: expected a non-negative decimal integer, "
                                   f"got {_short(text)}")
    return _check_count(name, int(text))


def _json_list(meta: Mapping[str, str], name: str, *, required: bool) -> list[Any]:
    if name not in meta and not required:
        return []
    text = _entry(meta, name)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidModelMetadata(f"model metadata: {name}: not JSON ({type(exc).__name__})") from None
    if not isinstance(value, list):
        raise InvalidModelMetadata(f"model metadata: {name}: expected a JSON list, got {_short(text)}")
    return value


def _json_object(name: str, item: Any, fields: frozenset[str]) -> dict[str, Any]:
    if not isinstance(item, dict) or set(item) != fields:
        raise InvalidModelMetadata(f"model metadata: {name}: expected an object with exactly "
                                   f"{sorted(fields)}, got {_short(item)}")
    return item


def _copy_weight(item: Any) -> CopyWeight:
    fields = _json_object("copies", item, frozenset({"copy", "steps", "weight"}))
    weight = fields["weight"]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise InvalidModelMetadata(f"model metadata: copies.weight: expected a finite number, got {_short(weight)}")
    return _record(CopyWeight, copy=_json_count("copies.copy", fields["copy"]),
                   steps=_json_count("copies.steps", fields["steps"]), weight=float(weight))


def _rejection(item: Any) -> Rejection:
    fields = _json_object("rejected", item, frozenset({"copy", "reason"}))
    if not isinstance(fields["reason"], str):
        got = _short(fields["reason"])
        raise InvalidModelMetadata(f"model metadata: rejected.reason: expected a string, got {got}")
    return _record(Rejection, copy=_json_count("rejected.copy", fields["copy"]), reason=fields["reason"])


_R = TypeVar("_R")


def _record(cls: type[_R], **fields: Any) -> _R:
    try:
        return cls(**fields)
    except InvalidEvent as exc:   # e.g. a reason that is not valid UTF-8
        raise InvalidModelMetadata(f"model metadata: {exc.reason}") from None


def _json_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidModelMetadata(f"model metadata: {name}: expected an integer, got {_short(value)}")
    return _check_count(name, value)


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
        raise InvalidModelMetadata(f"model metadata: {name}: expected an integer in [0, 2**63), got {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def code_metadata(spec: JobSpec) -> dict[str, str]:
    """What a model of user code records about how to rebuild it (empty for a zoo job): the
    code bundle's SHA-256, the entrypoint, args (JSON) and config (JSON text), the user's
    label for the model, its dataset, and its user. ``hadar model JOB --json`` shows them."""
    if spec.code is None:
        return {}
    return {"code_digest": spec.code.digest, "code_entrypoint": spec.code.entrypoint,
            "code_args": json.dumps(list(spec.code.args)), "code_config": spec.code.config or "{}",
            "code_model": spec.model, "code_dataset": spec.dataset, "code_user": spec.user}

