"""Test helpers: safetensors files built byte by byte, and an in-memory RangeReader."""

from __future__ import annotations

import json
import struct


class BytesReader:
    """An in-memory RangeReader that cannot map (as a store object is read).

    ``size`` may claim more than ``data`` holds; reads past ``data`` then return spaces.
    """

    def __init__(self, data: bytes, name: str = "mem", size: int | None = None) -> None:
        self.name = name
        self._data = data
        self._size = len(data) if size is None else size
        self.reads = 0

    def size(self) -> int:
        return self._size

    def read_into(self, offset: int, out: memoryview) -> None:
        if offset + len(out) > self._size:
            raise OSError(f"{self.name}: ends at {self._size}")
        self.reads += 1
        chunk = self._data[offset:offset + len(out)]
        out[:] = chunk + b" " * (len(out) - len(chunk))


def safetensors_bytes(header: dict | bytes, data: bytes) -> bytes:
    """The 8-byte length, ``header`` (a dict, or raw bytes taken as they are), then ``data``."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def entry(dtype: object, shape: object, offsets: object) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}
