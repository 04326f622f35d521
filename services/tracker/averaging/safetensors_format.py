"""The safetensors file format, read one tensor (or part of one) at a time.

Layout (https://huggingface.co/docs/safetensors): 8 bytes little-endian ``N``, then ``N``
bytes of JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}``, then the data buffer; offsets are relative to the buffer.

Guarantees:

* :func:`read_header` reads only the 8-byte length and the header, never tensor data, and
  fails closed: for any bytes it is given it returns a well-formed :class:`Header` or
  raises :class:`InvalidSafetensors` (with a one-line, UTF-8-safe ``reason``) -- never
  another exception. It refuses what the reference (Rust) reader refuses and a little
  more: a header longer than ``MAX_HEADER_BYTES`` or than the file; JSON nested deeper
  than a header needs (``MAX_JSON_DEPTH``, checked on the raw bytes before parsing, so
  parsing cannot recurse); integers of more than 20 digits (checked before conversion),
  floats, ``NaN``/``Infinity`` literals, duplicate keys, strings that are not valid
  UTF-8 (lone surrogates); a wrong type anywhere; an unknown dtype; more than
  ``MAX_DIMS`` dims; a shape whose element count times the dtype size overflows 63
  bits (even if another dim is 0); offsets that disagree with shape x dtype size, leave
  the file, overlap, leave a gap, or stop short of the file's end (trailing bytes).
  Memory: the header is at most ``MAX_HEADER_BYTES``, and parsing it costs a small
  multiple of that.
* :func:`encode_header` produces a header the ``safetensors`` library loads, padded with
  spaces to a multiple of 8 bytes so the data buffer stays aligned.
* bf16 conversions are exact in the f32 -> bf16 direction up to round-to-nearest-even, as
  PyTorch does it; NaN stays NaN.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Self

import numpy as np

from services.tracker.averaging import header_json
from shared.errors import HadarError

__all__ = [
    "InvalidSafetensors", "TensorInfo", "Header", "RangeReader", "FileRangeReader",
    "read_header", "encode_header", "FLOAT_DTYPES", "COPIED_DTYPES", "DTYPE_SIZES",
    "bf16_to_f32", "f32_to_bf16", "MAX_HEADER_BYTES", "MAX_JSON_DEPTH", "MAX_DIMS",
]

# 8 MiB holds ~100k tensor entries, far more than any model Hadar trains, while keeping
# the parse of a hostile header (many tiny objects) to ~100 MB; the format allows 100 MB.
MAX_HEADER_BYTES = 8 << 20
MAX_JSON_DEPTH = 3   # {name: {"shape": [...]}} and {"__metadata__": {k: v}}
MAX_DIMS = 16
_MAX_INT_DIGITS = 20  # 2**64 - 1 has 20 digits
_MAX_SIZE = 2**63 - 1  # bytes of one tensor, counting every non-zero dim
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})

# Floating-point dtypes that are averaged, and the numpy dtype their raw bytes are viewed as
# (bf16 has no numpy dtype: its bits are viewed as uint16 and converted by hand).
FLOAT_DTYPES: dict[str, np.dtype] = {
    "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
}
# Integer and boolean dtypes: step counters and the like, copied from one replica, never averaged.
COPIED_DTYPES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8,
}
DTYPE_SIZES: dict[str, int] = {**{k: v.itemsize for k, v in FLOAT_DTYPES.items()}, **COPIED_DTYPES}


class InvalidSafetensors(HadarError):
    """Bytes that are not a usable safetensors file; ``reason`` says why in one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """One tensor of a file; ``begin``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


@dataclass(frozen=True, kw_only=True)
class Header:
    """A parsed header: tensors in file order (by offset), metadata, where data starts."""

    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]
    data_start: int

    def signature(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """What two replicas must share to be averaged: names, dtypes and shapes."""
        return tuple(sorted((t.name, t.dtype, t.shape) for t in self.tensors))


class RangeReader(Protocol):
    """Random access to one file or object. Methods may block; call them off the event loop."""

    name: str

    def size(self) -> int: ...

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; raise ``OSError`` if it cannot. May be
        called from several threads at once (averaging on threads)."""


class FileRangeReader:
    """A local file read with ``pread`` (no shared file position, no whole-file read).

    It can also :meth:`map` a window of the file (read-only ``mmap``), which lets averaging
    read the page cache directly instead of copying it into a buffer first.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.name = str(path)
        self._fd: int | None = None
        self._lock = threading.Lock()   # threads that read at once open the file once

    def _open(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            return self._fd

    def size(self) -> int:
        return os.fstat(self._open()).st_size

    def read_into(self, offset: int, out: memoryview) -> None:
        fd = self._open()
        done, total = 0, len(out)
        while done < total:
            got = os.preadv(fd, [out[done:]], offset + done)
            if got == 0:
                raise OSError(f"{self.name}: file ends at byte {offset + done}, "
                              f"needed {offset + total}")
            done += got

    def map(self, offset: int, length: int) -> memoryview:
        """A read-only view of ``length`` bytes at ``offset``, backed by a private mapping.

        The mapping lives as long as the view (or anything made from it) does. Raises
        ``OSError`` if the file no longer extends that far (touching a mapping past the end
        of a file would kill the process).
        """
        fd = self._open()
        if length <= 0 or offset + length > os.fstat(fd).st_size:
            raise OSError(f"{self.name}: cannot map {length} bytes at {offset}")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(fd, offset + length - start, offset=start, access=mmap.ACCESS_READ)
        return memoryview(mapping)[offset - start:]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def read_header(reader: RangeReader) -> Header:
    """Parse and check the header of ``reader``'s file without reading any tensor data."""
    try:
        size = reader.size()
    except OSError as exc:
        raise InvalidSafetensors(f"cannot read: {exc}"[:200]) from None
    if size < 8:
        raise InvalidSafetensors(f"file of {size} bytes is too short for a safetensors header")
    prefix = bytearray(8)
    _read(reader, 0, prefix)
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise InvalidSafetensors(f"header length {length} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + length > size:
        raise InvalidSafetensors(f"header length {length} exceeds the file size {size}")
    raw = bytearray(length)
    _read(reader, 8, raw)
    try:
        parsed = header_json.load(bytes(raw), max_depth=MAX_JSON_DEPTH, max_int_digits=_MAX_INT_DIGITS)
    except header_json.UnsafeJson as exc:
        raise InvalidSafetensors(exc.reason) from None
    data_start = 8 + length
    try:
        return _parse_entries(parsed, data_start, size - data_start)
    except InvalidSafetensors:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        # Every field is type-checked above; this only keeps the one-exception guarantee
        # should a case have been missed.
        raise InvalidSafetensors(f"malformed header: {type(exc).__name__}: {exc}"[:200]) from None


def _read(reader: RangeReader, offset: int, buf: bytearray) -> None:
    try:
        reader.read_into(offset, memoryview(buf))
    except OSError as exc:
        raise InvalidSafetensors(f"cannot read: {exc}"[:200]) from None


def _parse_entries(parsed: object, data_start: int, data_len: int) -> Header:
    if not isinstance(parsed, dict):
        raise InvalidSafetensors(f"header is a JSON {type(parsed).__name__}, not an object")
    metadata = parsed.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise InvalidSafetensors("__metadata__ must map strings to strings")
    _check_text(metadata.items(), "__metadata__")
    tensors = sorted((_parse_tensor(name, entry, data_len) for name, entry in parsed.items()),
                     key=lambda t: (t.begin, t.end))
    position = 0  # tensors must tile the data buffer exactly, as the reference reader demands
    for t in tensors:
        if t.begin < position:
            raise InvalidSafetensors(f"tensor {_short(t.name)} overlaps the tensor before it")
        if t.begin > position:
            raise InvalidSafetensors(f"tensor {_short(t.name)} starts at {t.begin}, leaving a gap after {position}")
        position = t.end
    if position != data_len:
        raise InvalidSafetensors(f"{data_len - position} trailing bytes after the last tensor")
    return Header(tensors=tuple(TensorInfo(name=t.name, dtype=t.dtype, shape=t.shape, begin=data_start + t.begin,
                                           end=data_start + t.end) for t in tensors),
                  metadata=dict(metadata), data_start=data_start)


def _parse_tensor(name: str, entry: object, data_len: int) -> TensorInfo:
    """One entry, with offsets relative to the data buffer."""
    if not name:
        raise InvalidSafetensors("a tensor has an empty name")
    _check_text([(name, "")], "tensor name")
    label = f"tensor {_short(name)}"
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        raise InvalidSafetensors(f"{label}: entry must have exactly dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise InvalidSafetensors(f"{label}: unsupported dtype {_short(dtype)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise InvalidSafetensors(f"{label}: shape must be a list of non-negative integers")
    if len(shape) > MAX_DIMS:
        raise InvalidSafetensors(f"{label}: {len(shape)} dims, more than {MAX_DIMS}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
            or offsets[0] > offsets[1]):
        raise InvalidSafetensors(f"{label}: data_offsets must be [begin, end] with begin <= end")
    begin, end = offsets
    if end > data_len:
        raise InvalidSafetensors(f"{label}: data ends at {end}, past the file's {data_len} data bytes")
    itemsize = DTYPE_SIZES[dtype]
    if math.prod(d for d in shape if d) * itemsize > _MAX_SIZE:
        raise InvalidSafetensors(f"{label}: shape {_short(shape)} overflows a 64-bit byte count")
    expected = math.prod(shape) * itemsize
    if end - begin != expected:
        raise InvalidSafetensors(f"{label}: {end - begin} bytes for shape {_short(shape)} of {dtype} "
                                 f"(needs {expected})")
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_text(pairs: Iterable[tuple[str, str]], where: str) -> None:
    """Refuse lone surrogates (JSON ``\\ud800``): valid to Python, not UTF-8, and the
    reference reader -- which must load the consolidated model -- refuses them."""
    for key, value in pairs:
        try:
            key.encode("utf-8")
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidSafetensors(f"{where}: a string is not valid UTF-8") from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def encode_header(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]
                  ) -> tuple[bytes, list[int]]:
    """The 8-byte length plus JSON header for ``(name, dtype, shape)`` laid out back to back.

    Returns the header bytes and each tensor's byte offset within the data buffer.
    """
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = dict(metadata)
    offsets, position = [], 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + nbytes]}
        offsets.append(position)
        position += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def bf16_to_f32(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Widen bf16 values (as uint16 bits) into ``out`` (float32): exact."""
    wide = out.view(np.uint32)
    np.left_shift(bits, 16, out=wide, dtype=np.uint32)
    return out


def f32_to_bf16(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Round float32 ``values`` to bf16 bits in ``out`` (uint16), nearest-even; NaN stays NaN."""
    bits = values.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    np.right_shift(rounded, 16, out=out, casting="unsafe")
    nan = np.isnan(values)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out
