"""Measuring what each replica did to the round's starting model, for the screen of
:mod:`shared.domain.replica_screen` (the rule and why are stated there).

Pure apart from reads. :func:`screen_replicas` reads the starting model's header, then,
tensor by tensor and chunk by chunk (at most ``chunk_bytes`` of float64 per array), the
starting model once and every replica of the weighing that enters the average (weight > 0)
once, and gives each replica's update norm ``||w_i - w_0||`` (float64) over the floating
tensors both hold with the same name, dtype and shape -- optimizer state (``optim.*``) is
not compared -- or the first of those tensors where it holds NaN or inf. Memory: a few
chunks, whatever the model's size or the number of replicas. Cost: one more read of those
tensors of every replica (the model's weights, not its optimizer state) and one of the
starting model.

It raises :class:`StartUnusable` when the starting model cannot be judged against (not
valid safetensors, no tensor in common with the replicas, NaN or inf in it) -- the caller
then averages without the screen -- ``OSError`` when a replica or the starting model cannot
be read, and whatever the readers raise to stop (``ConsolidationStopped``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from services.tracker.averaging.average import single_threaded_blas
from services.tracker.averaging.safetensors_format import (
    FLOAT_DTYPES,
    InvalidSafetensors,
    RangeReader,
    TensorInfo,
    bf16_to_f32,
    read_header,
)
from services.tracker.averaging.weighing import AcceptedReplica, Rejected, Weighing, short_reason
from shared.domain.model_meta import OPTIM_PREFIX
from shared.domain.replica_screen import ReplicaUpdate, Screened, screen
from shared.errors import HadarError

__all__ = ["StartUnusable", "Screening", "measure_updates", "screen_replicas"]


class StartUnusable(HadarError):
    """The starting model cannot serve to judge the replicas; the message says why."""


@dataclass(frozen=True, kw_only=True)
class Screening:
    """The screen's verdicts on a weighing: ``updates`` measured, ``verdicts`` (the replicas
    rejected, by rule), ``start_norm`` (``||w_0||`` over the ``tensors`` compared) and the
    ``bytes_read``."""

    start_norm: float
    updates: tuple[ReplicaUpdate, ...]
    verdicts: tuple[Screened, ...]
    tensors: int
    bytes_read: int

    def rejections(self) -> tuple[Rejected, ...]:
        """The verdicts as the weighing records rejections."""
        return tuple(Rejected(copy=v.copy, reason=short_reason(v.reason)) for v in self.verdicts)


def screen_replicas(weighing: Weighing, start: RangeReader, *, chunk_bytes: int) -> Screening:
    """Measure the weighing's replicas against ``start`` and screen them (module docstring)."""
    with single_threaded_blas():
        start_norm, updates, tensors, read = measure_updates(weighing, start, chunk_bytes=chunk_bytes)
    return Screening(start_norm=start_norm, updates=updates, verdicts=screen(updates, start_norm=start_norm),
                     tensors=tensors, bytes_read=read)


def measure_updates(weighing: Weighing, start: RangeReader, *, chunk_bytes: int
                    ) -> tuple[float, tuple[ReplicaUpdate, ...], int, int]:
    """``(||w_0||, the updates of the replicas of weight > 0, tensors compared, bytes read)``."""
    if chunk_bytes < 8:
        raise ValueError("chunk_bytes must be >= 8")
    try:
        header = read_header(start)
    except InvalidSafetensors as exc:
        raise StartUnusable(f"starting model {start.name!r} is not valid safetensors: {exc.reason}") from None
    own = {t.name: t for t in header.tensors}
    pairs = [(t, own[t.name]) for t in weighing.layout
             if t.dtype in FLOAT_DTYPES and not t.name.startswith(OPTIM_PREFIX) and t.name in own
             and (own[t.name].dtype, own[t.name].shape) == (t.dtype, t.shape)]
    if not pairs:
        raise StartUnusable(f"starting model {start.name!r} has no floating tensor in common with the replicas")
    replicas = [r for r in weighing.accepted if r.weight > 0.0]
    squares = dict.fromkeys((r.copy for r in replicas), 0.0)
    bad: dict[int, str] = {}
    start_squares, read = 0.0, 0
    step = max(1, chunk_bytes // 8)
    for ours, theirs in pairs:
        for first in range(0, ours.numel, step):
            count = min(step, ours.numel - first)
            base = _chunk(start, theirs, first, count)
            read += count * FLOAT_DTYPES[theirs.dtype].itemsize
            if not np.isfinite(base).all():
                raise StartUnusable(f"starting model {start.name!r} holds NaN or inf in {ours.name[:120]!r}")
            start_squares += float(np.dot(base, base))
            for replica in replicas:
                if replica.copy in bad:
                    continue
                values = _chunk(replica.reader, replica.tensors[ours.name], first, count)
                read += count * FLOAT_DTYPES[ours.dtype].itemsize
                if not np.isfinite(values).all():
                    bad[replica.copy] = ours.name
                    continue
                np.subtract(values, base, out=values)
                squares[replica.copy] += float(np.dot(values, values))
    if not math.isfinite(start_squares):
        raise StartUnusable(f"starting model {start.name!r}: its norm overflows float64")
    updates = tuple(_update(r, squares[r.copy], bad.get(r.copy)) for r in replicas)
    return math.sqrt(start_squares), updates, len(pairs), read


def _update(replica: AcceptedReplica, squares: float, non_finite: str | None) -> ReplicaUpdate:
    return ReplicaUpdate(copy=replica.copy, steps=replica.steps, non_finite=non_finite,
                         update_norm=math.nan if non_finite is not None else math.sqrt(squares))


def _chunk(reader: RangeReader, tensor: TensorInfo, first: int, count: int) -> np.ndarray:
    """Elements [first, first + count) of ``tensor`` as float64 (exact for every float dtype)."""
    stored = FLOAT_DTYPES[tensor.dtype]
    raw = np.empty(count, dtype=stored)
    reader.read_into(tensor.begin + first * stored.itemsize,
                     memoryview(raw.view(np.uint8)))  # type: ignore[arg-type]  # numpy stubs: a buffer on 3.12+
    if tensor.dtype == "BF16":
        raw = bf16_to_f32(raw, np.empty(count, dtype=np.float32))
    return raw.astype(np.float64)
