"""Weighing a round's replicas before they are averaged (HadarE): which replicas, weighed
how, into which layout.

Pure apart from reading each replica's header (no tensor data is read here; the
streaming average is :mod:`services.tracker.averaging.consolidate`). Given replicas (one
safetensors file per copy, each with the steps it claims this round):

* Every replica's header is parsed. A replica that does not parse,
  or whose tensor names, shapes or dtypes differ from the others', is *rejected* with a
  one-line reason; the reference layout is the one shared by the most replicas that did
  work, steps > 0 (by all of them when none did; ties: the larger total steps, then the
  lowest copy id): a copy that never stepped lacks the optimizer state a first step
  creates and must not outvote one that trained. The rest are averaged. Reasons are at
  most 240 characters of valid UTF-8, fit for an event.
* Steps are a claim, bounded per copy: clamped to ``Replica.max_steps`` (the copy's step
  budget, when the caller knows it); a claim that is negative or above
  :data:`MAX_REPLICA_STEPS` (2**53, exact as a float) after clamping rejects that copy.
* Work is counted in samples (``shared.domain.progress``, docs/architecture.md "Work
  accounting"), as exact integers: a copy on ``k = Replica.workers`` of the job's
  ``W = job_workers`` workers makes ``steps * k`` worker-steps; the job's total after the
  round is ``prior_worker_steps`` plus the accepted copies' worker-steps, and
  ``total_steps`` (job steps, what events carry) is that total ``// W``. It never exceeds
  :data:`MAX_TOTAL_STEPS` (2**64-1, the largest integer an event carries): if it would,
  the copies claiming the most worker-steps are rejected one at a time (ties: the highest
  copy id) until it fits; a job already past the limit gets no model for the round.
* The credit is clipped, never the work: with ``limit_worker_steps`` (the job's
  ``W x iterations``) the job's total after the round is at most that limit, so a job is
  never credited more than it asked for, however its rounds were budgeted (a round planned
  before the previous one was announced gets the whole remainder again). The copies'
  own steps and the weights are unaffected.
* Weights: ``steps`` mode (default) weighs copy ``i`` by its samples,
  ``steps_i * k_i / sum(steps * k)`` (a copy's own steps would under-weigh a copy on more
  workers); ``uniform`` by ``1 / n``. If every accepted copy did 0 steps, ``steps`` mode
  falls back to uniform. Every weight is finite and in [0, 1], and they sum to 1 up to rounding. A
  copy of weight 0 is not read.
* Raises :class:`NoUsableReplica` when nothing is left to average, and ``ValueError``
  only for a caller's mistake (unknown mode, duplicate copy ids, negative ``max_steps``
  or ``prior_worker_steps``, ``workers`` outside ``1..job_workers``) -- never for anything
  a replica or its claim contains.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from services.tracker.averaging.safetensors_format import (
    Header,
    InvalidSafetensors,
    RangeReader,
    TensorInfo,
    read_header,
)
from shared.domain.model_meta import (
    Mode,
    ModelDescription,
    ModelMetadata,
    consolidation_entries,
)
from shared.errors import HadarError
from shared.wire.records import CopyWeight, Rejection

__all__ = [
    "Mode", "Replica", "AcceptedReplica", "Rejected", "Weighing", "NoUsableReplica",
    "weigh_replicas", "short_reason", "MAX_REPLICA_STEPS", "MAX_TOTAL_STEPS",
]

MAX_REPLICA_STEPS = 2**53
MAX_TOTAL_STEPS = 2**64 - 1
_MAX_REASON = 240


@dataclass(frozen=True, kw_only=True)
class Replica:
    """One copy's trained weights: ``steps`` it claims for this round, and where to read them.

    ``max_steps``: the most steps the copy could have done (its budget), if known.
    ``workers``: the copy's world size k; each of its steps trained k per-worker batches.
    """

    copy: int
    steps: int
    reader: RangeReader
    max_steps: int | None = None
    workers: int = 1


@dataclass(frozen=True, kw_only=True)
class AcceptedReplica:
    copy: int
    steps: int
    weight: float
    reader: RangeReader
    tensors: Mapping[str, TensorInfo]
    workers: int = 1

    @property
    def worker_steps(self) -> int:
        return self.steps * self.workers


@dataclass(frozen=True, kw_only=True)
class Rejected:
    copy: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Weighing:
    """What will be averaged, with which weights, into which layout (reference file order)."""

    mode: Mode
    accepted: tuple[AcceptedReplica, ...]
    rejected: tuple[Rejected, ...]
    layout: tuple[TensorInfo, ...]
    format_metadata: Mapping[str, str]
    prior_worker_steps: int = 0
    job_workers: int = 1
    limit_worker_steps: int | None = None

    @property
    def round_steps(self) -> int:
        """The accepted copies' own steps, summed (each in its copy's unit)."""
        return sum(r.steps for r in self.accepted)

    @property
    def round_worker_steps(self) -> int:
        """Worker-steps whose result is in the averaged model: sum of steps x workers."""
        return sum(r.worker_steps for r in self.accepted)

    @property
    def total_worker_steps(self) -> int:
        """The job's exact worker-steps once this round's model counts, at most
        ``limit_worker_steps`` (when given) unless the job was already past it."""
        total = self.prior_worker_steps + self.round_worker_steps
        if self.limit_worker_steps is not None:
            total = min(total, max(self.limit_worker_steps, self.prior_worker_steps))
        return total

    @property
    def total_steps(self) -> int:
        """The job's steps once this round's model counts: ``total_worker_steps // W``; at
        most ``MAX_TOTAL_STEPS``."""
        return self.total_worker_steps // self.job_workers

    @property
    def integer_source(self) -> AcceptedReplica:
        """The copy integer tensors are taken from: most steps, then lowest copy id."""
        return min(self.accepted, key=lambda r: (-r.steps, r.copy))

    def copy_weights(self) -> tuple[CopyWeight, ...]:
        return tuple(CopyWeight(copy=r.copy, steps=r.steps, weight=r.weight) for r in self.accepted)

    def rejections(self) -> tuple[Rejection, ...]:
        return tuple(Rejection(copy=r.copy, reason=r.reason) for r in self.rejected)

    def without(self, rejected: Sequence[Rejected]) -> Weighing:
        """This weighing less the copies in ``rejected``, re-weighted as if they had never been.

        The layout stays the one chosen when planning. Raises :class:`NoUsableReplica`
        if no accepted copy is left.
        """
        gone = {r.copy for r in rejected}
        kept = [r for r in self.accepted if r.copy not in gone]
        all_rejected = tuple(sorted((*self.rejected, *rejected), key=lambda r: r.copy))
        if not kept:
            raise NoUsableReplica(all_rejected)
        weights = _weights([r.worker_steps for r in kept], self.mode)
        return replace(self, accepted=tuple(replace(r, weight=w) for r, w in zip(kept, weights)),
                       rejected=all_rejected)

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` entries every output of this weighing carries (str -> str):
        those of :func:`shared.domain.model_meta.consolidation_entries` and ``total_steps``.
        They describe the weighing actually written, so a replica rejected while writing is
        not in them."""
        return {**consolidation_entries(mode=self.mode, copies=self.copy_weights(), rejected=self.rejections()),
                "total_steps": str(self.total_steps)}

    def model_metadata(self, *, job: str, round_: int, missing: Sequence[int] = (),
                       description: ModelDescription | None = None) -> ModelMetadata:
        """What this weighing's output says about itself as round ``round_`` of ``job``;
        ``missing``: copies that never reported; ``description``: what the model is."""
        return ModelMetadata(job=job, round=round_, total_steps=self.total_steps, mode=self.mode,
                             copies=self.copy_weights(), rejected=self.rejections(), missing=tuple(missing),
                             format=self.format_metadata.get("format"), description=description)



class NoUsableReplica(HadarError):
    """No replica could be averaged; ``rejected`` says why for each."""

    def __init__(self, rejected: Sequence[Rejected]) -> None:
        reasons = "; ".join(f"copy {r.copy}: {r.reason}" for r in rejected) or "no replicas given"
        super().__init__(f"no usable replica ({reasons})"[:1000])
        self.rejected = tuple(rejected)


def weigh_replicas(replicas: Sequence[Replica], *, mode: Mode = "steps",
                       rejected: Sequence[Rejected] = (), prior_worker_steps: int = 0,
                       job_workers: int = 1, limit_worker_steps: int | None = None) -> Weighing:
    """Parse every replica's header, reject the odd ones out, bound the steps, fix the weights.

    ``rejected`` lists copies the caller already excluded (kept in the weighing's record);
    ``prior_worker_steps`` the job's worker-steps before this round; ``job_workers`` its W;
    ``limit_worker_steps`` the most worker-steps the job may be credited (W x iterations).
    See the module guarantees. Raises :class:`NoUsableReplica` when nothing is left to average.
    """
    if mode not in ("steps", "uniform"):
        raise ValueError(f"unknown consolidation mode {mode!r}")
    copies = [r.copy for r in replicas]
    if len(set(copies)) != len(copies):
        raise ValueError(f"duplicate copy ids in {copies}")
    if any(r.max_steps is not None and r.max_steps < 0 for r in replicas):
        raise ValueError("max_steps must be >= 0")
    if prior_worker_steps < 0:
        raise ValueError(f"prior_worker_steps must be >= 0, got {prior_worker_steps}")
    if limit_worker_steps is not None and limit_worker_steps < 0:
        raise ValueError(f"limit_worker_steps must be >= 0, got {limit_worker_steps}")
    if job_workers < 1 or any(not 1 <= r.workers <= job_workers for r in replicas):
        raise ValueError(f"every replica needs 1..{job_workers} workers (job_workers >= 1)")
    out_rejected = list(rejected)
    parsed: list[tuple[Replica, Header]] = []
    for replica in replicas:
        bounded, problem = _bounded_steps(replica)
        if problem:
            out_rejected.append(Rejected(copy=replica.copy, reason=short_reason(problem)))
            continue
        try:
            parsed.append((replace(replica, steps=bounded), read_header(replica.reader)))
        except InvalidSafetensors as exc:
            out_rejected.append(Rejected(copy=replica.copy,
                                         reason=short_reason(f"not valid safetensors: {exc.reason}")))
    if not parsed:
        raise NoUsableReplica(sorted(out_rejected, key=lambda r: r.copy))
    reference = _reference_header(parsed)
    ref_signature = reference.signature()
    kept: list[tuple[Replica, Header]] = []
    for replica, header in parsed:
        if header.signature() == ref_signature:
            kept.append((replica, header))
        else:
            out_rejected.append(Rejected(copy=replica.copy, reason=short_reason(_mismatch(reference, header))))
    kept = _fit_total(kept, prior_worker_steps, job_workers, out_rejected)
    if not kept:
        raise NoUsableReplica(sorted(out_rejected, key=lambda r: r.copy))
    weights = _weights([r.steps * r.workers for r, _ in kept], mode)
    accepted = tuple(
        AcceptedReplica(copy=r.copy, steps=r.steps, weight=w, reader=r.reader, workers=r.workers,
                        tensors={t.name: t for t in h.tensors})
        for (r, h), w in zip(kept, weights))
    fmt = {k: v for k, v in reference.metadata.items() if k == "format"}
    return Weighing(mode=mode, accepted=accepted, layout=reference.tensors,
                             rejected=tuple(sorted(out_rejected, key=lambda r: r.copy)),
                             format_metadata=fmt, prior_worker_steps=prior_worker_steps,
                             job_workers=job_workers, limit_worker_steps=limit_worker_steps)


def _bounded_steps(replica: Replica) -> tuple[int, str]:
    """The copy's steps clamped to its budget, or a reason to reject its claim."""
    steps = replica.steps if replica.max_steps is None else min(replica.steps, replica.max_steps)
    if steps < 0:
        return steps, f"claims {steps} steps"
    if steps > MAX_REPLICA_STEPS:
        return steps, f"claims {steps} steps, more than 2**53"
    return steps, ""


def _fit_total(kept: list[tuple[Replica, Header]], prior_worker_steps: int, job_workers: int,
               out_rejected: list[Rejected]) -> list[tuple[Replica, Header]]:
    """Drop the largest claims until the job's total steps fit an event (``MAX_TOTAL_STEPS``)."""
    kept = list(kept)
    if prior_worker_steps // job_workers > MAX_TOTAL_STEPS:
        reason = short_reason(f"the job already has {prior_worker_steps // job_workers} steps, more than 2**64-1")
        out_rejected.extend(Rejected(copy=r.copy, reason=reason) for r, _ in kept)
        return []
    total = prior_worker_steps + sum(r.steps * r.workers for r, _ in kept)
    while total // job_workers > MAX_TOTAL_STEPS:
        largest = max(kept, key=lambda item: (item[0].steps * item[0].workers, item[0].copy))
        kept.remove(largest)
        total -= largest[0].steps * largest[0].workers
        out_rejected.append(Rejected(copy=largest[0].copy, reason=short_reason(
            f"its {largest[0].steps} steps would take the job's total past 2**64-1")))
    return kept


def _reference_header(parsed: list[tuple[Replica, Header]]) -> Header:
    """The layout the most replicas that did work share (every replica's when none did). A
    copy that never stepped carries no work and may lack state its first step creates (Adam's
    moments): it does not vote, so it cannot outvote a copy that trained."""
    working = [item for item in parsed if item[0].steps > 0] or parsed
    groups: dict[tuple, list[tuple[Replica, Header]]] = {}
    for item in working:
        groups.setdefault(item[1].signature(), []).append(item)
    best = min(groups.values(), key=lambda g: (-len(g), -sum(r.steps for r, _ in g),
                                               min(r.copy for r, _ in g)))
    return min(best, key=lambda item: item[0].copy)[1]


def _mismatch(reference: Header, header: Header) -> str:
    ref = {t.name: t for t in reference.tensors}
    got = {t.name: t for t in header.tensors}
    missing = sorted(set(ref) - set(got))
    extra = sorted(set(got) - set(ref))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing[:3]}" + (" ..." if len(missing) > 3 else ""))
        if extra:
            parts.append(f"unexpected tensors {extra[:3]}" + (" ..." if len(extra) > 3 else ""))
        return "tensor names differ: " + ", ".join(parts)
    for name in sorted(ref):
        if ref[name].dtype != got[name].dtype:
            return f"tensor {name!r} has dtype {got[name].dtype}, expected {ref[name].dtype}"
        if ref[name].shape != got[name].shape:
            return f"tensor {name!r} has shape {list(got[name].shape)}, expected {list(ref[name].shape)}"
    return "layout differs"  # pragma: no cover - signatures differ only by name, dtype or shape


def _weights(samples: list[int], mode: Mode) -> list[float]:
    # Python ints: the total is exact and int / int is correctly rounded, so every ratio is a
    # finite float in [0, 1].
    total = sum(samples)
    if mode == "uniform" or total == 0:
        return [1.0 / len(samples)] * len(samples)
    return [s / total for s in samples]


def short_reason(text: str) -> str:
    """One line of at most 240 characters of valid UTF-8 (lone surrogates escaped)."""
    text = " ".join(text.encode("utf-8", "backslashreplace").decode("utf-8").split())
    return text if len(text) <= _MAX_REASON else text[:_MAX_REASON - 3] + "..."
