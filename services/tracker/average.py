"""The streaming weighted average behind :func:`services.tracker.consolidate.write_consolidated`.

Pure apart from reads of the replicas and writes to ``out``. Guarantees (the caller's
plan decides which replicas, with which weights, into which layout):

* Floating tensors are averaged element-wise in chunks of at most ``chunk_bytes`` of
  accumulator, one replica at a time (float32, float64 for F64), and rounded back to the
  stored dtype; integer and bool tensors are copied from the plan's integer source.
  Extra memory is a few chunks, never more than about 3x the largest tensor.
* Non-finite values: each chunk's accumulator is checked once, after every replica has
  been added (NaN and inf survive any sum with positive weights, so a bad input always
  shows there); only then is each input's chunk checked to name the culprit(s), and
  :class:`NonFinite` is raised. A clean round pays one pass over a cache-resident chunk;
  finite inputs whose sum overflowed the accumulator name nobody and the write goes on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
from scipy.linalg.blas import daxpy, saxpy

try:  # optional: caps BLAS threads during averaging (see single_threaded_blas)
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover - depends on the installation
    threadpool_limits = None

from services.tracker.safetensors_format import FLOAT_DTYPES, TensorInfo, bf16_to_f32, encode_header, f32_to_bf16
from shared.errors import HadarError

if TYPE_CHECKING:  # the plan types are only annotations here
    from services.tracker.plan import AcceptedReplica, ConsolidationPlan

__all__ = ["NonFinite", "ReadTally", "single_threaded_blas", "write_average"]


class NonFinite(HadarError):
    """Replicas whose chunk of ``tensor`` holds NaN or inf (the write must be redone)."""

    def __init__(self, copies: list[int], tensor: str) -> None:
        super().__init__(f"copies {copies}: non-finite values in {tensor[:60]!r}")
        self.copies = copies
        self.tensor = tensor


class ReadTally:
    """Replica bytes read, across attempts (a mutable count threaded through the loops)."""

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


def single_threaded_blas() -> AbstractContextManager[object]:
    # axpy on cache-sized chunks gains nothing from threads, and OpenBLAS threads that
    # contend with other processes for cores make it 10x slower.
    if threadpool_limits is None:
        return nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def write_average(plan: ConsolidationPlan, out: BinaryIO, metadata: Mapping[str, str] | None,
                  chunk_bytes: int, window_bytes: int, tally: ReadTally) -> int:
    """Write the header, then every tensor of ``plan.layout``; the bytes written."""
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
            bytes_written += _average_tensor(tensor, readers, out, bufs, chunk_bytes, window_bytes, tally)
        else:
            bytes_written += _copy_tensor(tensor, plan.integer_source, out, bufs, chunk_bytes, tally)
    return bytes_written


def _average_tensor(tensor: TensorInfo, readers: Sequence[AcceptedReplica], out: BinaryIO,
                    bufs: _Buffers, chunk_bytes: int, window_bytes: int, tally: ReadTally) -> int:
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
            tally.read += count * size * len(readers)
            if not np.isfinite(acc, out=bufs.array("finite", np.dtype(np.bool_), count)).all():
                _raise_if_an_input_is_non_finite(tensor, readers, mapped, window_first, first, count, bufs,
                                                 tally)
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
                                     count: int, bufs: _Buffers, tally: ReadTally) -> None:
    """The chunk's average is not finite: raise :class:`NonFinite` naming the replicas
    whose chunk holds NaN or inf. Finite inputs whose float32 sum overflowed (values near
    the dtype's maximum) name nobody, and the write goes on."""
    bad = []
    for replica, view in zip(readers, mapped):
        raw = _chunk(replica, view, tensor, first - window_first, first, count, bufs)
        if view is None:
            tally.read += raw.nbytes
        if tensor.dtype == "BF16":  # uint16 bits: all exponent bits set means inf or NaN
            finite = not np.any((raw & np.uint16(0x7F80)) == np.uint16(0x7F80))
        else:
            finite = bool(np.isfinite(raw).all())
        if not finite:
            bad.append(replica.copy)
    if bad:
        raise NonFinite(bad, tensor.name)


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
                 chunk_bytes: int, tally: ReadTally) -> int:
    begin = source.tensors[tensor.name].begin
    for offset in range(0, tensor.nbytes, chunk_bytes):
        count = min(chunk_bytes, tensor.nbytes - offset)
        raw = bufs.array("raw", np.dtype(np.uint8), count)
        source.reader.read_into(begin + offset, memoryview(raw))
        out.write(memoryview(raw))
    tally.read += tensor.nbytes
    return tensor.nbytes
