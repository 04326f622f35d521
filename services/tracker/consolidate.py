"""Streaming weight averaging of a job's copies (HadarE consolidation), pure apart from reads.

Given replicas (one safetensors file per copy, each with the steps it trained this round):

* Every replica's header is parsed (no tensor data read). A replica that does not parse,
  or whose tensor names, shapes or dtypes differ from the others', is *rejected* with a
  one-line reason; the reference layout is the one shared by the most replicas (ties: the
  larger total steps, then the lowest copy id). The rest are averaged.
* Weights: ``steps`` mode (default) weighs copy ``i`` by ``steps_i / sum(steps)``;
  ``uniform`` by ``1 / n``. If every accepted copy did 0 steps, ``steps`` mode falls back
  to uniform. A copy of weight 0 is not read.
* Floating tensors (F16, BF16, F32, F64) are averaged element-wise, accumulating in float32
  (float64 for F64 tensors), and rounded back to their stored dtype (bf16 by
  round-to-nearest-even on the raw bits). Optimizer state stored in the replica (Adam
  moments and the like) is a floating tensor like any weight and is averaged the same
  way: averaging first and second moments is the usual choice in local-SGD/model-soup
  practice and keeps the optimizer's scale consistent with the averaged weights.
* Integer and bool tensors (step counters, BatchNorm ``num_batches_tracked``) are not
  averaged: they are copied from the accepted replica with the most steps (ties: lowest
  copy id). A counter stored as a float (PyTorch keeps Adam's ``step`` as a float32
  tensor) is a floating tensor and gets the weighted mean of the copies' counts.
* Memory: tensors are processed in chunks of at most ``chunk_bytes`` of accumulator, one
  replica at a time, so extra memory is a few chunks (never more than about 3x the largest
  tensor) however large the model or however many replicas. Local files are read through
  read-only mappings of ``window_bytes`` per replica (page cache, not allocations), other
  readers chunk by chunk. The output is written header first, then tensor by tensor, to
  a caller-supplied binary file.
* Deterministic: the same replicas, steps and mode give byte-identical output. One replica
  gives that replica's tensors back exactly.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from scipy.linalg.blas import daxpy, saxpy

try:  # optional: caps BLAS threads during averaging (see _single_threaded_blas)
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover - depends on the installation
    threadpool_limits = None

from services.tracker.safetensors_format import (
    FLOAT_DTYPES, FileRangeReader, Header, InvalidSafetensors, RangeReader, TensorInfo,
    bf16_to_f32, encode_header, f32_to_bf16, read_header,
)
from shared.errors import HadarError
from shared.model_meta import Mode, ModelMetadata, consolidation_entries
from shared.records import CopyWeight, Rejection

__all__ = [
    "Mode", "Replica", "AcceptedReplica", "Rejected", "ConsolidationPlan", "WriteStats",
    "NoUsableReplica", "plan_consolidation", "write_consolidated", "consolidate_local",
    "DEFAULT_CHUNK_BYTES", "DEFAULT_WINDOW_BYTES",
]

DEFAULT_CHUNK_BYTES = 256 << 10   # the accumulator chunk stays in the CPU's L2 cache
DEFAULT_WINDOW_BYTES = 4 << 20    # mapped at once per replica (local files)
_MAX_REASON = 240


@dataclass(frozen=True, kw_only=True)
class Replica:
    """One copy's trained weights: ``steps`` it did this round, and where to read them."""

    copy: int
    steps: int
    reader: RangeReader


@dataclass(frozen=True, kw_only=True)
class AcceptedReplica:
    copy: int
    steps: int
    weight: float
    reader: RangeReader
    tensors: Mapping[str, TensorInfo]


@dataclass(frozen=True, kw_only=True)
class Rejected:
    copy: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class ConsolidationPlan:
    """What will be averaged, with which weights, into which layout (reference file order)."""

    mode: Mode
    accepted: tuple[AcceptedReplica, ...]
    rejected: tuple[Rejected, ...]
    layout: tuple[TensorInfo, ...]
    format_metadata: Mapping[str, str]

    @property
    def round_steps(self) -> int:
        """Steps whose result is in the averaged model: the accepted copies' steps."""
        return sum(r.steps for r in self.accepted)

    @property
    def integer_source(self) -> AcceptedReplica:
        """The copy integer tensors are taken from: most steps, then lowest copy id."""
        return min(self.accepted, key=lambda r: (-r.steps, r.copy))

    def copy_weights(self) -> tuple[CopyWeight, ...]:
        return tuple(CopyWeight(copy=r.copy, steps=r.steps, weight=r.weight) for r in self.accepted)

    def rejections(self) -> tuple[Rejection, ...]:
        return tuple(Rejection(copy=r.copy, reason=r.reason) for r in self.rejected)

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` entries every output of this plan carries (str -> str; see
        :func:`shared.model_meta.consolidation_entries`)."""
        return consolidation_entries(mode=self.mode, copies=self.copy_weights(), rejected=self.rejections())

    def model_metadata(self, *, job: str, round_: int, prior_steps: int, missing: Sequence[int] = ()
                       ) -> ModelMetadata:
        """What this plan's output says about itself as round ``round_`` of ``job``, whose
        starting model had ``prior_steps``; ``missing``: copies that never reported."""
        return ModelMetadata(job=job, round=round_, total_steps=prior_steps + self.round_steps, mode=self.mode,
                             copies=self.copy_weights(), rejected=self.rejections(), missing=tuple(missing),
                             format=self.format_metadata.get("format"))


@dataclass(frozen=True, kw_only=True)
class WriteStats:
    bytes_read: int
    bytes_written: int
    tensors: int


class NoUsableReplica(HadarError):
    """No replica could be averaged; ``rejected`` says why for each."""

    def __init__(self, rejected: Sequence[Rejected]) -> None:
        reasons = "; ".join(f"copy {r.copy}: {r.reason}" for r in rejected) or "no replicas given"
        super().__init__(f"no usable replica ({reasons})"[:1000])
        self.rejected = tuple(rejected)


def plan_consolidation(replicas: Sequence[Replica], *, mode: Mode = "steps",
                       rejected: Sequence[Rejected] = ()) -> ConsolidationPlan:
    """Parse every replica's header, reject the odd ones out, fix the weights.

    ``rejected`` lists copies the caller already excluded (kept in the plan's record).
    Raises :class:`NoUsableReplica` when nothing is left to average.
    """
    if mode not in ("steps", "uniform"):
        raise ValueError(f"unknown consolidation mode {mode!r}")
    copies = [r.copy for r in replicas]
    if len(set(copies)) != len(copies):
        raise ValueError(f"duplicate copy ids in {copies}")
    if any(r.steps < 0 for r in replicas):
        raise ValueError("steps must be >= 0")
    out_rejected = list(rejected)
    parsed: list[tuple[Replica, Header]] = []
    for replica in replicas:
        try:
            parsed.append((replica, read_header(replica.reader)))
        except InvalidSafetensors as exc:
            out_rejected.append(Rejected(copy=replica.copy, reason=_short(f"not valid safetensors: {exc.reason}")))
    if not parsed:
        raise NoUsableReplica(sorted(out_rejected, key=lambda r: r.copy))
    reference = _reference_header(parsed)
    ref_signature = reference.signature()
    kept: list[tuple[Replica, Header]] = []
    for replica, header in parsed:
        if header.signature() == ref_signature:
            kept.append((replica, header))
        else:
            out_rejected.append(Rejected(copy=replica.copy, reason=_short(_mismatch(reference, header))))
    weights = _weights([r.steps for r, _ in kept], mode)
    accepted = tuple(
        AcceptedReplica(copy=r.copy, steps=r.steps, weight=w, reader=r.reader,
                        tensors={t.name: t for t in h.tensors})
        for (r, h), w in zip(kept, weights))
    fmt = {k: v for k, v in reference.metadata.items() if k == "format"}
    return ConsolidationPlan(mode=mode, accepted=accepted, layout=reference.tensors,
                             rejected=tuple(sorted(out_rejected, key=lambda r: r.copy)),
                             format_metadata=fmt)


def _reference_header(parsed: list[tuple[Replica, Header]]) -> Header:
    groups: dict[tuple, list[tuple[Replica, Header]]] = {}
    for item in parsed:
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


def _weights(steps: list[int], mode: Mode) -> list[float]:
    total = sum(steps)
    if mode == "uniform" or total == 0:
        return [1.0 / len(steps)] * len(steps)
    return [s / total for s in steps]


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_REASON else text[:_MAX_REASON - 3] + "..."


class _Buffers:
    """Reusable scratch arrays, grown on demand, so the chunk loop allocates nothing."""

    def __init__(self) -> None:
        self._raw: dict[str, np.ndarray] = {}

    def array(self, slot: str, dtype: np.dtype, count: int) -> np.ndarray:
        nbytes = count * np.dtype(dtype).itemsize
        raw = self._raw.get(slot)
        if raw is None or raw.nbytes < nbytes:
            self._raw.pop(slot, None)
            raw = self._raw[slot] = np.empty(nbytes, dtype=np.uint8)
        return raw[:nbytes].view(dtype)


def write_consolidated(plan: ConsolidationPlan, out: BinaryIO, *,
                       metadata: Mapping[str, str] | None = None,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                       window_bytes: int = DEFAULT_WINDOW_BYTES) -> WriteStats:
    """Stream the average described by ``plan`` into ``out`` (header first, then tensors).

    ``metadata`` (str -> str) is added to the plan's own (mode, copies, weights, rejected).
    ``chunk_bytes`` bounds the accumulator (and each read of a reader that cannot map);
    ``window_bytes`` bounds what is mapped at once per replica for readers that can.
    Raises ``OSError`` if a replica cannot be read to the end; ``out`` is then incomplete.
    """
    if chunk_bytes < 8 or window_bytes < 8:
        raise ValueError("chunk_bytes and window_bytes must be >= 8")
    with _single_threaded_blas():
        return _write(plan, out, metadata, chunk_bytes, window_bytes)


def _single_threaded_blas() -> AbstractContextManager[object]:
    # axpy on cache-sized chunks gains nothing from threads, and OpenBLAS threads that
    # contend with other processes for cores make it 10x slower.
    if threadpool_limits is None:
        return nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def _write(plan: ConsolidationPlan, out: BinaryIO, metadata: Mapping[str, str] | None,
           chunk_bytes: int, window_bytes: int) -> WriteStats:
    meta = {**plan.format_metadata, **plan.metadata(), **(metadata or {})}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise TypeError("safetensors metadata must map str to str")
    header, _ = encode_header([(t.name, t.dtype, t.shape) for t in plan.layout], meta)
    out.write(header)
    bufs = _Buffers()
    readers = [r for r in plan.accepted if r.weight > 0.0]
    bytes_read = bytes_written = 0
    for tensor in plan.layout:
        if tensor.dtype in FLOAT_DTYPES:
            read, written = _average_tensor(tensor, readers, out, bufs, chunk_bytes, window_bytes)
        else:
            read, written = _copy_tensor(tensor, plan.integer_source, out, bufs, chunk_bytes)
        bytes_read += read
        bytes_written += written
    return WriteStats(bytes_read=bytes_read, bytes_written=len(header) + bytes_written,
                      tensors=len(plan.layout))


def _average_tensor(tensor: TensorInfo, readers: Sequence[AcceptedReplica], out: BinaryIO,
                    bufs: _Buffers, chunk_bytes: int, window_bytes: int) -> tuple[int, int]:
    dtype = tensor.dtype
    stored = FLOAT_DTYPES[dtype]
    acc_dtype = np.dtype(np.float64) if dtype == "F64" else np.dtype(np.float32)
    numel, size = tensor.numel, stored.itemsize
    step = max(1, chunk_bytes // acc_dtype.itemsize)
    window = max(step, window_bytes // size // step * step)
    bytes_read = bytes_written = 0
    for window_first in range(0, numel, window):
        window_count = min(window, numel - window_first)
        mapped = [_mapped(r, tensor, window_first, window_count, stored) for r in readers]
        for first in range(window_first, window_first + window_count, step):
            count = min(step, window_first + window_count - first)
            acc = bufs.array("acc", acc_dtype, count)
            for i, (replica, view) in enumerate(zip(readers, mapped)):
                if view is not None:
                    raw = view[first - window_first:first - window_first + count]
                else:
                    raw = bufs.array("raw", stored, count)
                    replica.reader.read_into(replica.tensors[tensor.name].begin + first * size,
                                             memoryview(raw.view(np.uint8)))
                _accumulate(acc, raw, replica.weight, dtype, bufs, first=i == 0)
            bytes_read += count * size * len(readers)
            out.write(memoryview(_stored_bytes(acc, dtype, bufs).view(np.uint8)))
            bytes_written += count * size
        del mapped  # unmaps the windows
    return bytes_read, bytes_written


def _mapped(replica: AcceptedReplica, tensor: TensorInfo, first: int, count: int,
            stored: np.dtype) -> np.ndarray | None:
    """The replica's elements [first, first + count) of ``tensor``, mapped, if it can map."""
    map_window = getattr(replica.reader, "map", None)
    if map_window is None:
        return None
    begin = replica.tensors[tensor.name].begin + first * stored.itemsize
    return np.frombuffer(map_window(begin, count * stored.itemsize), dtype=stored, count=count)


def _accumulate(acc: np.ndarray, raw: np.ndarray, weight: float, dtype: str, bufs: _Buffers,
                *, first: bool) -> None:
    """acc = weight * raw (first replica) or acc += weight * raw, in the accumulator's dtype."""
    if dtype == "BF16":
        values = bf16_to_f32(raw, bufs.array("wide", np.dtype(np.float32), raw.size))
    elif raw.dtype != acc.dtype:
        values = bufs.array("wide", acc.dtype, raw.size)
        np.copyto(values, raw)
    else:
        values = raw
    if first:
        np.multiply(values, weight, out=acc, dtype=acc.dtype)
        return
    axpy = daxpy if acc.dtype == np.float64 else saxpy
    result = axpy(values, acc, a=weight)
    if result is not acc:  # the BLAS wrapper made a copy: keep the accumulator in place
        acc[...] = result


def _stored_bytes(acc: np.ndarray, dtype: str, bufs: _Buffers) -> np.ndarray:
    """The accumulator rounded back to the stored dtype (bf16 by hand)."""
    if dtype == "BF16":
        return f32_to_bf16(acc, bufs.array("out", np.dtype(np.uint16), acc.size))
    stored = FLOAT_DTYPES[dtype]
    if stored == acc.dtype:
        return acc
    result = bufs.array("out", stored, acc.size)
    np.copyto(result, acc, casting="same_kind")
    return result


def _copy_tensor(tensor: TensorInfo, source: AcceptedReplica, out: BinaryIO, bufs: _Buffers,
                 chunk_bytes: int) -> tuple[int, int]:
    begin = source.tensors[tensor.name].begin
    for offset in range(0, tensor.nbytes, chunk_bytes):
        count = min(chunk_bytes, tensor.nbytes - offset)
        raw = bufs.array("raw", np.dtype(np.uint8), count)
        source.reader.read_into(begin + offset, memoryview(raw))
        out.write(memoryview(raw))
    return tensor.nbytes, tensor.nbytes


def consolidate_local(inputs: Sequence[tuple[str | os.PathLike[str], int]], out_path: str | os.PathLike[str],
                      *, mode: Mode = "steps", metadata: Mapping[str, str] | None = None,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[ConsolidationPlan, WriteStats]:
    """Average local files ``(path, steps)`` into ``out_path``, atomically (temp + rename).

    Copy ids are the inputs' positions. Raises :class:`NoUsableReplica` if none is usable.
    """
    out_path = Path(out_path)
    readers = [FileRangeReader(path) for path, _ in inputs]
    try:
        replicas = [Replica(copy=i, steps=steps, reader=reader)
                    for i, (reader, (_, steps)) in enumerate(zip(readers, inputs))]
        plan = plan_consolidation(replicas, mode=mode)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp",
                                        dir=out_path.parent or Path("."))
        try:
            with os.fdopen(fd, "wb") as out:
                stats = write_consolidated(plan, out, metadata=metadata, chunk_bytes=chunk_bytes)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp_name, out_path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        return plan, stats
    finally:
        for reader in readers:
            reader.close()
