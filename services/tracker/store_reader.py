"""Blocking random access to a store object, for consolidation running in a worker thread.

The store is async and lives on the service's event loop; consolidation is CPU work run
off the loop (``asyncio.to_thread``). :class:`StoreRangeReader` bridges the two: each read
is one ``store.get_range`` scheduled on the loop and waited for from the thread. It must
never be used on the loop's own thread (it would wait on itself).

A worker thread cannot be cancelled from the loop, so a reader may be given a ``stop``
event (:class:`threading.Event`): once it is set, the read in flight is given up (within
:data:`POLL_S`) and every read raises :class:`ConsolidationStopped` -- not an ``OSError``,
so a stop is never mistaken for a bad replica. Consolidation reads every replica chunk by
chunk, so setting ``stop`` ends it at its next chunk (:mod:`services.tracker.consolidator`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

from shared.errors import HadarError
from shared.store import ObjectStore

__all__ = ["StoreRangeReader", "ConsolidationStopped", "POLL_S"]

POLL_S = 0.05     # how often a read waiting for the store looks at its stop event


class ConsolidationStopped(HadarError):
    """The consolidation reading this replica was stopped (the tracker is shutting down); the
    round stays unannounced for the next tracker, so each raise says ``retriable=True``."""


class StoreRangeReader:
    """``RangeReader`` over one object of ``store``; ``size`` is known up front."""

    def __init__(self, store: ObjectStore, key: str, size: int, loop: asyncio.AbstractEventLoop,
                 *, timeout_s: float = 300.0, stop: threading.Event | None = None) -> None:
        self.name = key
        self._store = store
        self._key = key
        self._size = size
        self._loop = loop
        self._timeout_s = timeout_s
        self._stop = stop

    def size(self) -> int:
        return self._size

    def read_into(self, offset: int, out: memoryview) -> None:
        self._check_stop()
        if offset + len(out) > self._size:
            raise OSError(f"{self._key}: object ends at byte {self._size}, needed {offset + len(out)}")
        future = asyncio.run_coroutine_threadsafe(
            self._store.get_range(self._key, offset, len(out)), self._loop)
        try:
            data = self._wait(future)
        except ConsolidationStopped:
            future.cancel()
            raise
        except Exception as exc:  # any store failure is a failed read of this replica
            future.cancel()
            raise OSError(f"{self._key}: {type(exc).__name__}: {exc}"[:300]) from exc
        if len(data) != len(out):
            raise OSError(f"{self._key}: got {len(data)} bytes at {offset}, needed {len(out)}")
        out[:] = data

    def _wait(self, future: concurrent.futures.Future[bytes]) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        while not future.done():
            self._check_stop()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from the store in {self._timeout_s:g} s")
            concurrent.futures.wait([future], timeout=min(POLL_S if self._stop is not None else left, left))
        return future.result()

    def _check_stop(self) -> None:
        if self._stop is not None and self._stop.is_set():
            raise ConsolidationStopped(f"{self._key}: consolidation stopped", retriable=True)
