"""The streaming weighted average behind
:func:`services.tracker.averaging.consolidate.write_consolidated`.

Pure apart from reads of the replicas and writes to ``out``. Guarantees (the caller's
weighing decides which replicas, with which weights, into which layout):

* Floating tensors are averaged element-wise in chunks of at most ``chunk_bytes`` of
  accumulator, one replica at a time (float32, float64 for F64), and rounded back to the
  stored dtype; integer and bool tensors are copied from the weighing's integer source.
  Extra memory is a few chunks, never more than about 3x the largest tensor.
* Non-finite values: each chunk's accumulator is checked once, after every replica has
  been added (NaN and inf survive any sum with positive weights, so a bad input always
  shows there); only then is each input's chunk checked to name the culprit(s), and
  :class:`NonFinite` is raised. A clean round pays one pass over a cache-resident chunk;
  finite inputs whose sum overflowed the accumulator name nobody and the write goes on.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, BinaryIO, Self

import numpy as np

try:  # optional: caps BLAS threads during averaging (see single_threaded_blas)
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover - depends on the installation
    threadpool_limits = None

from services.tracker.averaging.blas import axpy
from services.tracker.averaging.safetensors_format import (
    FLOAT_DTYPES,
    TensorInfo,
    bf16_to_f32,
    encode_header,
    f32_to_bf16,
)
from shared.errors import HadarError

if TYPE_CHECKING:  # the weighing types are only annotations here
    from services.tracker.averaging.weighing import AcceptedReplica, Weighing

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


def write_average(weighing: Weighing, out: BinaryIO, metadata: Mapping[str, str] | None,
                  chunk_bytes: int, window_bytes: int, tally: ReadTally, threads: int = 1) -> int:
    """Write the header, then every tensor of ``weighing.layout``; the bytes written. ``threads``
    > 1 averages each window's chunks on that many threads (see :class:`_Parallel`)."""
    meta = {**weighing.format_metadata, **weighing.metadata(), **(metadata or {})}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise TypeError("safetensors metadata must map str to str")
    header, _ = encode_header([(t.name, t.dtype, t.shape) for t in weighing.layout], meta)
    out.write(header)
    readers = [r for r in weighing.accepted if r.weight > 0.0]
    bytes_written = len(header)
    with _Parallel(threads) if threads > 1 else nullcontext() as parallel:
        bufs = _Buffers()
        for tensor in weighing.layout:
            if tensor.dtype in FLOAT_DTYPES and parallel is not None:
                bytes_written += parallel.average_tensor(tensor, readers, out, chunk_bytes, window_bytes, tally)
            elif tensor.dtype in FLOAT_DTYPES:
                bytes_written += _average_tensor(tensor, readers, out, bufs, chunk_bytes, window_bytes, tally)
            else:
                if parallel is not None:
                    parallel.flush(out)
                bytes_written += _copy_tensor(tensor, weighing.integer_source, out, bufs, chunk_bytes, tally)
        if parallel is not None:
            parallel.flush(out)
    return bytes_written


def _grid(tensor: TensorInfo, chunk_bytes: int, window_bytes: int,
          min_chunks: int = 1) -> tuple[np.dtype, int, int]:
    """The accumulator dtype, the chunk (elements) and the window (elements, a whole number of
    chunks, at least ``min_chunks``) of ``tensor``: the same chunk grid whatever the threads."""
    acc_dtype = np.dtype(np.float64) if tensor.dtype == "F64" else np.dtype(np.float32)
    step = max(1, chunk_bytes // acc_dtype.itemsize)
    size = FLOAT_DTYPES[tensor.dtype].itemsize
    return acc_dtype, step, max(step * min_chunks, window_bytes // size // step * step)


def _average_tensor(tensor: TensorInfo, readers: Sequence[AcceptedReplica], out: BinaryIO,
                    bufs: _Buffers, chunk_bytes: int, window_bytes: int, tally: ReadTally) -> int:
    stored = FLOAT_DTYPES[tensor.dtype]
    acc_dtype, step, window = _grid(tensor, chunk_bytes, window_bytes)
    numel, size = tensor.numel, stored.itemsize
    bytes_written = 0
    for window_first in range(0, numel, window):
        window_count = min(window, numel - window_first)
        mapped = [_mapped(r, tensor, window_first, window_count, stored) for r in readers]
        for first in range(window_first, window_first + window_count, step):
            count = min(step, window_first + window_count - first)
            result = _average_chunk(tensor, readers, mapped, window_first, first, count, acc_dtype, bufs, tally)
            out.write(memoryview(result.view(np.uint8)))  # type: ignore[arg-type]  # numpy stubs: a buffer on 3.12+
            bytes_written += count * size
        del mapped  # unmaps the windows
    return bytes_written


def _average_chunk(tensor: TensorInfo, readers: Sequence[AcceptedReplica], mapped: Sequence[np.ndarray | None],
                   window_first: int, first: int, count: int, acc_dtype: np.dtype, bufs: _Buffers,
                   tally: ReadTally, release_gil: bool = False,
                   acc: np.ndarray | None = None) -> np.ndarray:
    """Elements [first, first + count) of the average, in the stored dtype (a view of
    ``bufs``, or ``acc`` itself when given and of the stored dtype). Raises
    :class:`NonFinite` if an input's chunk holds NaN or inf. ``release_gil``: other
    threads average other chunks meanwhile."""
    if acc is None:
        acc = bufs.array("acc", acc_dtype, count)
    for i, (replica, view) in enumerate(zip(readers, mapped)):
        raw = _chunk(replica, view, tensor, first - window_first, first, count, bufs)
        _accumulate(acc, raw, replica.weight, tensor.dtype, bufs, first=i == 0, release_gil=release_gil)
    tally.read += count * FLOAT_DTYPES[tensor.dtype].itemsize * len(readers)
    if not np.isfinite(acc, out=bufs.array("finite", np.dtype(np.bool_), count)).all():
        _raise_if_an_input_is_non_finite(tensor, readers, mapped, window_first, first, count, bufs, tally)
    return _stored_bytes(acc, tensor.dtype, bufs)


class _Window:
    """One window's chunks, claimed in order (``next`` on a shared counter) by the threads
    that average them into ``staging`` at their place. A failed chunk stops further claims;
    every chunk before it was claimed already, so :meth:`raise_first` raises what the
    one-thread path would have raised first."""

    def __init__(self, tensor: TensorInfo, readers: Sequence[AcceptedReplica], mapped: list[np.ndarray | None],
                 window_first: int, window_count: int, step: int, acc_dtype: np.dtype,
                 staging: np.ndarray) -> None:
        self.tensor, self.readers, self.mapped = tensor, readers, mapped
        self.window_first, self.window_count, self.step, self.acc_dtype = window_first, window_count, step, acc_dtype
        self.staging = staging
        # F32 and F64 are accumulated in place in the staging buffer (no copy); others are rounded into it
        self.in_place = FLOAT_DTYPES[tensor.dtype] == acc_dtype
        self.chunks = -(-window_count // step)
        self.errors: dict[int, BaseException] = {}
        self._claims = itertools.count()

    def run(self, bufs: _Buffers, tally: ReadTally) -> None:
        size = FLOAT_DTYPES[self.tensor.dtype].itemsize
        while not self.errors:
            k = next(self._claims)   # atomic: itertools.count.__next__ runs under the GIL
            if k >= self.chunks:
                return
            first = self.window_first + k * self.step
            count = min(self.step, self.window_first + self.window_count - first)
            target = self.staging[k * self.step * size:(k * self.step + count) * size]
            try:
                acc = target.view(self.acc_dtype) if self.in_place else None
                result = _average_chunk(self.tensor, self.readers, self.mapped, self.window_first, first, count,
                                        self.acc_dtype, bufs, tally, release_gil=True, acc=acc)
                if acc is None:
                    np.copyto(target, result.view(np.uint8))
            except BaseException as exc:
                self.errors[k] = exc
                return

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[min(self.errors)]


class _Parallel:
    """Averages floating tensors on ``threads`` threads (this one and ``threads - 1`` pool
    threads), with the one-thread path's chunk grid and per-element order, so the output is
    the same bytes.

    A tensor goes window by window (at least one chunk per thread); a window's chunks are
    claimed by the threads and averaged into a staging buffer at their place (in place for
    F32/F64, rounded into it for F16/BF16), which is written to ``out`` in order while the
    next window is averaged (two staging buffers alternate).
    Extra memory: two windows of stored bytes (``window_bytes`` each, or ``threads`` chunks
    if more) plus each thread's chunk buffers (a few chunks), so about ``2 x window_bytes +
    threads x 3 x chunk_bytes`` whatever the model's size.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="hadar-average")
        self._bufs = [_Buffers() for _ in range(threads)]
        self._staging = [_Buffers(), _Buffers()]
        self._flip = 0
        self._pending: np.ndarray | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self._pool.shutdown(wait=True)

    def flush(self, out: BinaryIO) -> None:
        """Write the window averaged last, if not written yet."""
        if self._pending is not None:
            out.write(memoryview(self._pending))  # type: ignore[arg-type]  # numpy stubs: a buffer on 3.12+
            self._pending = None

    def average_tensor(self, tensor: TensorInfo, readers: Sequence[AcceptedReplica], out: BinaryIO,
                       chunk_bytes: int, window_bytes: int, tally: ReadTally) -> int:
        stored = FLOAT_DTYPES[tensor.dtype]
        acc_dtype, step, window = _grid(tensor, chunk_bytes, window_bytes, min_chunks=self.threads)
        numel, size = tensor.numel, stored.itemsize
        for window_first in range(0, numel, window):
            window_count = min(window, numel - window_first)
            mapped = [_mapped(r, tensor, window_first, window_count, stored) for r in readers]
            staging = self._staging[self._flip].array("stored", np.dtype(np.uint8), window_count * size)
            self._flip ^= 1
            job = _Window(tensor, readers, mapped, window_first, window_count, step, acc_dtype, staging)
            tallies = [ReadTally() for _ in range(min(self.threads, job.chunks))]
            helpers = [self._pool.submit(job.run, bufs, t) for bufs, t in zip(self._bufs[1:], tallies[1:])]
            try:
                self.flush(out)  # the previous window, while this one is averaged
                job.run(self._bufs[0], tallies[0])
            finally:
                if helpers:
                    wait(helpers)
                tally.read += sum(t.read for t in tallies)
            job.raise_first()
            self._pending = staging
            del mapped, job  # unmaps the windows
        return numel * size


def _chunk(replica: AcceptedReplica, view: np.ndarray | None, tensor: TensorInfo, in_window: int,
           first: int, count: int, bufs: _Buffers) -> np.ndarray:
    """The replica's elements [first, first + count) of ``tensor``: a slice of its mapped
    window (starting ``in_window`` elements into it) or a read into a scratch buffer."""
    if view is not None:
        return view[in_window:in_window + count]
    stored = FLOAT_DTYPES[tensor.dtype]
    raw = bufs.array("raw", stored, count)
    replica.reader.read_into(replica.tensors[tensor.name].begin + first * stored.itemsize,
                             memoryview(raw.view(np.uint8)))  # type: ignore[arg-type]  # numpy stubs: a buffer on 3.12+
    return raw


def _raise_if_an_input_is_non_finite(tensor: TensorInfo, readers: Sequence[AcceptedReplica],
                                     mapped: Sequence[np.ndarray | None], window_first: int,
                                     first: int, count: int, bufs: _Buffers, tally:
                                     ReadTally) -> None:
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
                *, first: bool, release_gil: bool) -> None:
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
    axpy(values, acc, weight, release_gil=release_gil)


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
        source.reader.read_into(begin + offset,
                                memoryview(raw))  # type: ignore[arg-type]  # numpy stubs: a buffer on 3.12+
        out.write(memoryview(raw))  # type: ignore[arg-type]  # numpy stubs: a buffer on 3.12+
    tally.read += tensor.nbytes
    return tensor.nbytes
