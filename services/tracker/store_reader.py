"""Blocking random access to a store object, for consolidation running in a worker thread.

The store is async and lives on the service's event loop; consolidation is CPU work run
off the loop (``asyncio.to_thread``). :class:`StoreRangeReader` bridges the two: each read
is one ``store.get_range`` scheduled on the loop and waited for from the thread. It must
never be used on the loop's own thread (it would wait on itself).
"""

from __future__ import annotations

import asyncio

from shared.store import ObjectStore

__all__ = ["StoreRangeReader"]


class StoreRangeReader:
    """``RangeReader`` over one object of ``store``; ``size`` is known up front."""

    def __init__(self, store: ObjectStore, key: str, size: int, loop: asyncio.AbstractEventLoop,
                 *, timeout_s: float = 300.0) -> None:
        self.name = key
        self._store = store
        self._key = key
        self._size = size
        self._loop = loop
        self._timeout_s = timeout_s

    def size(self) -> int:
        return self._size

    def read_into(self, offset: int, out: memoryview) -> None:
        if offset + len(out) > self._size:
            raise OSError(f"{self._key}: object ends at byte {self._size}, needed {offset + len(out)}")
        future = asyncio.run_coroutine_threadsafe(
            self._store.get_range(self._key, offset, len(out)), self._loop)
        try:
            data = future.result(self._timeout_s)
        except Exception as exc:  # any store failure is a failed read of this replica
            future.cancel()
            raise OSError(f"{self._key}: {type(exc).__name__}: {exc}"[:300]) from exc
        if len(data) != len(out):
            raise OSError(f"{self._key}: got {len(data)} bytes at {offset}, needed {len(out)}")
        out[:] = data
