"""Streaming weight averaging of a job's copies (HadarE consolidation), pure apart from reads.

Given replicas (one safetensors file per copy, each with the steps it trained this round):

* Planning -- which replicas, which weights, how steps are bounded -- is
  :mod:`services.tracker.plan` (re-exported here): malformed, mismatched or implausible
  replicas are rejected there with a reason, and the rest weighted by steps or uniformly.
  A copy of weight 0 is not read.
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
* Non-finite values (NaN, +-inf) in a floating tensor of a replica of positive weight
  reject that replica, and the output is exactly what averaging the others alone gives.
  Detection is streaming, not a pre-pass: each chunk's accumulator is checked once after
  every replica has been added to it (NaN and inf survive any positive-weight sum, so a
  bad input always shows there); only then are that chunk's inputs checked one by one to
  name the culprit(s), which are rejected, and the output is rewritten from its start
  without them. Memory stays as below, clean rounds read every byte once (the check
  costs one pass over a cache-resident chunk), and a round with ``k`` bad replicas is
  written at most ``k + 1`` times.
* Memory: tensors are processed in chunks of at most ``chunk_bytes`` of accumulator, one
  replica at a time, so extra memory is a few chunks (never more than about 3x the largest
  tensor) however large the model or however many replicas. Local files are read through
  read-only mappings of ``window_bytes`` per replica (page cache, not allocations), other
  readers chunk by chunk. The output is written header first, then tensor by tensor, to
  a caller-supplied seekable binary file.
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

from services.tracker.plan import (
    MAX_REPLICA_STEPS, MAX_TOTAL_STEPS, AcceptedReplica, ConsolidationPlan, Mode, NoUsableReplica, Rejected,
    Replica, plan_consolidation, short_reason,
)
from services.tracker.safetensors_format import (
    FLOAT_DTYPES, FileRangeReader, TensorInfo, bf16_to_f32, encode_header, f32_to_bf16,
)

__all__ = [
    "Mode", "Replica", "AcceptedReplica", "Rejected", "ConsolidationPlan", "WriteStats",
    "NoUsableReplica", "plan_consolidation", "write_consolidated", "consolidate_local",
    "DEFAULT_CHUNK_BYTES", "DEFAULT_WINDOW_BYTES", "MAX_REPLICA_STEPS", "MAX_TOTAL_STEPS",
]

DEFAULT_CHUNK_BYTES = 256 << 10   # the accumulator chunk stays in the CPU's L2 cache
DEFAULT_WINDOW_BYTES = 4 << 20    # mapped at once per replica (local files)


@dataclass(frozen=True, kw_only=True)
class WriteStats:
    """``plan``: the plan actually written -- the one given, less any replica found to hold
    non-finite values. ``bytes_read`` counts every read, including passes that were redone."""

    bytes_read: int
    bytes_written: int
    tensors: int
    plan: ConsolidationPlan


class _NonFinite(Exception):
    """Replicas found holding NaN or inf; the write is redone without them."""

    def __init__(self, copies: list[int], tensor: str) -> None:
        super().__init__(f"copies {copies}: non-finite values in {tensor!r}")
        self.copies = copies
        self.tensor = tensor


class _Counter:
    """Bytes read across attempts (a mutable tally threaded through the chunk loop)."""

    def __init__(self) -> None:
        self.read = 0


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

    ``metadata`` (str -> str) is added to the plan's own (mode, steps, copies, weights,
    rejected). ``chunk_bytes`` bounds the accumulator (and each read of a reader that
    cannot map); ``window_bytes`` bounds what is mapped at once per replica for readers
    that can. ``out`` must be seekable: a replica found holding non-finite values is
    rejected, ``out`` truncated back to where it started and rewritten without it; the
    returned ``WriteStats.plan`` is the plan actually written. Raises
    :class:`NoUsableReplica` if that leaves nothing to average, ``OSError`` if a replica
    cannot be read to the end; ``out`` is then incomplete.
    """
    if chunk_bytes < 8 or window_bytes < 8:
        raise ValueError("chunk_bytes and window_bytes must be >= 8")
    start = out.tell()
    counter = _Counter()
    with _single_threaded_blas():
        while True:
            try:
                return _write(plan, out, metadata, chunk_bytes, window_bytes, counter)
            except _NonFinite as bad:
                reason = short_reason(f"non-finite values (NaN or inf) in tensor {bad.tensor!r}")
                plan = plan.without([Rejected(copy=copy, reason=reason) for copy in bad.copies])
                out.seek(start)
                out.truncate()


def _single_threaded_blas() -> AbstractContextManager[object]:
    # axpy on cache-sized chunks gains nothing from threads, and OpenBLAS threads that
    # contend with other processes for cores make it 10x slower.
    if threadpool_limits is None:
        return nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def _write(plan: ConsolidationPlan, out: BinaryIO, metadata: Mapping[str, str] | None,
           chunk_bytes: int, window_bytes: int, counter: _Counter) -> WriteStats:
    meta = {**plan.format_metadata, **plan.metadata(), **(metadata or {})}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise TypeError("safetensors metadata must map str to str")
    header, _ = encode_header([(t.name, t.dtype, t.shape) for t in plan.layout], meta)
    out.write(header)
    bufs = _Buffers()
    readers = [r for r in plan.accepted if r.weight > 0.0]
    bytes_written = len(header)
    for tensor in plan.layout:
        if tensor.dtype in FLOAT_DTYPES:
            bytes_written += _average_tensor(tensor, readers, out, bufs, chunk_bytes, window_bytes, counter)
        else:
            bytes_written += _copy_tensor(tensor, plan.integer_source, out, bufs, chunk_bytes, counter)
    return WriteStats(bytes_read=counter.read, bytes_written=bytes_written, tensors=len(plan.layout),
                      plan=plan)


def _average_tensor(tensor: TensorInfo, readers: Sequence[AcceptedReplica], out: BinaryIO,
                    bufs: _Buffers, chunk_bytes: int, window_bytes: int, counter: _Counter) -> int:
    dtype = tensor.dtype
    stored = FLOAT_DTYPES[dtype]
    acc_dtype = np.dtype(np.float64) if dtype == "F64" else np.dtype(np.float32)
    numel, size = tensor.numel, stored.itemsize
    step = max(1, chunk_bytes // acc_dtype.itemsize)
    window = max(step, window_bytes // size // step * step)
    bytes_written = 0
    for window_first in range(0, numel, window):
        window_count = min(window, numel - window_first)
        mapped = [_mapped(r, tensor, window_first, window_count, stored) for r in readers]
        for first in range(window_first, window_first + window_count, step):
            count = min(step, window_first + window_count - first)
            acc = bufs.array("acc", acc_dtype, count)
            for i, (replica, view) in enumerate(zip(readers, mapped)):
                raw = _chunk(replica, view, tensor, first - window_first, first, count, bufs)
                _accumulate(acc, raw, replica.weight, dtype, bufs, first=i == 0)
            counter.read += count * size * len(readers)
            if not np.isfinite(acc, out=bufs.array("finite", np.dtype(np.bool_), count)).all():
                _raise_if_an_input_is_non_finite(tensor, readers, mapped, window_first, first, count, bufs,
                                                 counter)
            out.write(memoryview(_stored_bytes(acc, dtype, bufs).view(np.uint8)))
            bytes_written += count * size
        del mapped  # unmaps the windows
    return bytes_written


def _chunk(replica: AcceptedReplica, view: np.ndarray | None, tensor: TensorInfo, in_window: int,
           first: int, count: int, bufs: _Buffers) -> np.ndarray:
    """The replica's elements [first, first + count) of ``tensor``: a slice of its mapped
    window (starting ``in_window`` elements into it) or a read into a scratch buffer."""
    if view is not None:
        return view[in_window:in_window + count]
    stored = FLOAT_DTYPES[tensor.dtype]
    raw = bufs.array("raw", stored, count)
    replica.reader.read_into(replica.tensors[tensor.name].begin + first * stored.itemsize,
                             memoryview(raw.view(np.uint8)))
    return raw


def _raise_if_an_input_is_non_finite(tensor: TensorInfo, readers: Sequence[AcceptedReplica],
                                     mapped: Sequence[np.ndarray | None], window_first: int, first: int,
                                     count: int, bufs: _Buffers, counter: _Counter) -> None:
    """The chunk's average is not finite: raise :class:`_NonFinite` naming the replicas
    whose chunk holds NaN or inf. Finite inputs whose float32 sum overflowed (values near
    the dtype's maximum) name nobody, and the write goes on."""
    bad = []
    for replica, view in zip(readers, mapped):
        raw = _chunk(replica, view, tensor, first - window_first, first, count, bufs)
        if view is None:
            counter.read += raw.nbytes
        if tensor.dtype == "BF16":  # uint16 bits: all exponent bits set means inf or NaN
            finite = not np.any((raw & np.uint16(0x7F80)) == np.uint16(0x7F80))
        else:
            finite = bool(np.isfinite(raw).all())
        if not finite:
            bad.append(replica.copy)
    if bad:
        raise _NonFinite(bad, tensor.name)


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
                 chunk_bytes: int, counter: _Counter) -> int:
    begin = source.tensors[tensor.name].begin
    for offset in range(0, tensor.nbytes, chunk_bytes):
        count = min(chunk_bytes, tensor.nbytes - offset)
        raw = bufs.array("raw", np.dtype(np.uint8), count)
        source.reader.read_into(begin + offset, memoryview(raw))
        out.write(memoryview(raw))
    counter.read += tensor.nbytes
    return tensor.nbytes


def consolidate_local(inputs: Sequence[tuple[str | os.PathLike[str], int]], out_path: str | os.PathLike[str],
                      *, mode: Mode = "steps", metadata: Mapping[str, str] | None = None,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[ConsolidationPlan, WriteStats]:
    """Average local files ``(path, steps)`` into ``out_path``, atomically (temp + rename).

    Copy ids are the inputs' positions. Returns the plan actually written (see
    :func:`write_consolidated`). Raises :class:`NoUsableReplica` if none is usable; no
    file is left behind then.
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
        return stats.plan, stats
    finally:
        for reader in readers:
            reader.close()
