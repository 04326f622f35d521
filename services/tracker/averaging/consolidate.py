"""Streaming weight averaging of a job's copies (HadarE consolidation), pure apart from reads.

:func:`write_consolidated` writes the average a :class:`Weighing` describes
(:mod:`services.tracker.averaging.weighing`: which replicas, their weights, the layout; its names are
re-exported here). The arithmetic is in :mod:`services.tracker.averaging.average`. Guarantees:

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
  reject that replica, and the output is byte for byte what averaging the others alone
  gives. Detection is streaming, not a pre-pass (:mod:`services.tracker.averaging.average`): each
  chunk's accumulator is checked once after every replica has been added to it; only
  then are that chunk's inputs checked to name the culprit(s), which are rejected, and
  the output is rewritten from its start without them. Memory stays as below, a clean
  round reads every byte once, and a round with ``k`` bad replicas is written at most
  ``k + 1`` times.
* Memory: tensors are processed in chunks of at most ``chunk_bytes`` of accumulator, one
  replica at a time, so extra memory is a few chunks (never more than about 3x the largest
  tensor) however large the model or however many replicas. With ``threads`` > 1 each
  thread has its own few chunks, and two windows of output (``window_bytes`` each, or
  one chunk per thread if more) are staged so that one is written while the next is
  averaged: about ``2 x window_bytes + threads x 3 x chunk_bytes``, still independent of
  the model's size and the number of replicas. Local files are read through
  read-only mappings of ``window_bytes`` per replica (page cache, not allocations), other
  readers chunk by chunk. The output is written header first, then tensor by tensor, to
  a caller-supplied seekable binary file.
* Deterministic: the same replicas, steps and mode give byte-identical output, whatever
  ``threads``, ``window_bytes`` and reader kind (threads split a tensor's chunks, never an
  element's sum: each element is ``w0*x0``, then ``+ wi*xi`` in copy order, by the same
  kernels). One replica gives that replica's tensors back exactly.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from services.tracker.averaging.average import (
    NonFinite,
    ReadTally,
    single_threaded_blas,
    write_average,
)
from services.tracker.averaging.safetensors_format import FileRangeReader
from services.tracker.averaging.weighing import (
    MAX_REPLICA_STEPS,
    MAX_TOTAL_STEPS,
    AcceptedReplica,
    Mode,
    NoUsableReplica,
    Rejected,
    Replica,
    Weighing,
    short_reason,
    weigh_replicas,
)

__all__ = [
    "Mode", "Replica", "AcceptedReplica", "Rejected", "Weighing", "WriteStats",
    "NoUsableReplica", "weigh_replicas", "write_consolidated", "consolidate_local",
    "DEFAULT_CHUNK_BYTES", "DEFAULT_WINDOW_BYTES", "MAX_REPLICA_STEPS", "MAX_TOTAL_STEPS",
]

DEFAULT_CHUNK_BYTES = 1 << 20     # the accumulator chunk stays in the CPU's L2 cache (1 MiB a core here)
DEFAULT_WINDOW_BYTES = 16 << 20   # mapped at once per replica (local files): fewer mmap calls


@dataclass(frozen=True, kw_only=True)
class WriteStats:
    """``weighing``: the weighing actually written -- the one given, less any replica found to hold
    non-finite values. ``bytes_read`` counts every read, including passes that were redone."""

    bytes_read: int
    bytes_written: int
    tensors: int
    weighing: Weighing



def write_consolidated(weighing: Weighing, out: BinaryIO, *,
                       metadata: Mapping[str, str] | None = None,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                       window_bytes: int = DEFAULT_WINDOW_BYTES, threads: int = 1) -> WriteStats:
    """Stream the average described by ``weighing`` into ``out`` (header first, then tensors).

    ``metadata`` (str -> str) is added to the weighing's own (mode, steps, copies, weights,
    rejected). ``chunk_bytes`` bounds the accumulator (and each read of a reader that
    cannot map); ``window_bytes`` bounds what is mapped at once per replica for readers
    that can. ``out`` must be seekable: a replica found holding non-finite values is
    rejected, ``out`` truncated back to where it started and rewritten without it; the
    returned ``WriteStats.weighing`` is the weighing actually written. Raises
    :class:`NoUsableReplica` if that leaves nothing to average, ``OSError`` if a replica
    cannot be read to the end; ``out`` is then incomplete. ``threads`` > 1 averages on
    that many threads, with the same bytes as a result (readers are then read from
    several threads at once).
    """
    if chunk_bytes < 8 or window_bytes < 8:
        raise ValueError("chunk_bytes and window_bytes must be >= 8")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    start = out.tell()
    tally = ReadTally()
    with single_threaded_blas():
        while True:
            try:
                written = write_average(weighing, out, metadata, chunk_bytes, window_bytes, tally, threads)
                return WriteStats(bytes_read=tally.read, bytes_written=written, tensors=len(weighing.layout),
                                  weighing=weighing)
            except NonFinite as bad:
                reason = short_reason(f"non-finite values (NaN or inf) in tensor {bad.tensor!r}")
                weighing = weighing.without([Rejected(copy=copy, reason=reason) for copy in bad.copies])
                out.seek(start)
                out.truncate()


def consolidate_local(inputs: Sequence[tuple[str | os.PathLike[str], int]], out_path: str | os.PathLike[str],
                      *, mode: Mode = "steps", metadata: Mapping[str, str] | None = None,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES, threads: int = 1
                      ) -> tuple[Weighing, WriteStats]:
    """Average local files ``(path, steps)`` into ``out_path``, atomically (temp + rename).

    Copy ids are the inputs' positions. Returns the weighing actually written (see
    :func:`write_consolidated`). Raises :class:`NoUsableReplica` if none is usable; no
    file is left behind then.
    """
    out_path = Path(out_path)
    readers = [FileRangeReader(path) for path, _ in inputs]
    try:
        replicas = [Replica(copy=i, steps=steps, reader=reader)
                    for i, (reader, (_, steps)) in enumerate(zip(readers, inputs))]
        weighing = weigh_replicas(replicas, mode=mode)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp",
                                        dir=out_path.parent or Path("."))
        try:
            with os.fdopen(fd, "wb") as out:
                stats = write_consolidated(weighing, out, metadata=metadata, chunk_bytes=chunk_bytes, threads=threads)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp_name, out_path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        return stats.weighing, stats
    finally:
        for reader in readers:
            reader.close()
