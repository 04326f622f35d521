"""StoreRangeReader: a stop ends its reads with ConsolidationStopped, never an OSError.

A LocalStore is the store (real files); the reader runs in a worker thread as the
consolidation does, the store on the test's loop.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from services.tracker.averaging.safetensors_format import (
    InvalidSafetensors,
    read_header,
)
from services.tracker.store_reader import ConsolidationStopped, StoreRangeReader
from shared.store import LocalStore

DATA = bytes(range(256)) * 16


class StalledReads:
    """A LocalStore whose ranged reads wait until ``release`` is set (a store that hangs)."""

    def __init__(self, inner: LocalStore) -> None:
        self._inner = inner
        self.release = asyncio.Event()
        self.started = threading.Event()

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        self.started.set()
        await self.release.wait()
        return await self._inner.get_range(key, offset, length)


async def reader(tmp_path: Path, *, stop: threading.Event | None, stalled: bool = False):
    store = LocalStore(tmp_path / "store")
    await store.start()
    await store.put("checkpoints/j/0/n0/0.safetensors", DATA)
    front = StalledReads(store) if stalled else store
    return front, StoreRangeReader(front, "checkpoints/j/0/n0/0.safetensors", len(DATA),  # type: ignore[arg-type]
                                   asyncio.get_running_loop(), stop=stop)


async def test_reads_go_through_until_the_stop_and_then_raise_consolidation_stopped(tmp_path: Path) -> None:
    stop = threading.Event()
    _, r = await reader(tmp_path, stop=stop)
    out = bytearray(100)
    await asyncio.to_thread(r.read_into, 10, memoryview(out))
    assert bytes(out) == DATA[10:110]
    stop.set()
    with pytest.raises(ConsolidationStopped):
        await asyncio.to_thread(r.read_into, 10, memoryview(out))


async def test_a_stop_is_not_taken_for_an_unreadable_replica(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    _, r = await reader(tmp_path, stop=stop)
    # read_header turns an OSError into InvalidSafetensors (the replica is rejected); a stop passes through.
    with pytest.raises(ConsolidationStopped):
        await asyncio.to_thread(read_header, r)
    assert not issubclass(ConsolidationStopped, (OSError, InvalidSafetensors))


async def test_a_read_waiting_on_a_stalled_store_is_given_up_when_stopped(tmp_path: Path) -> None:
    stop = threading.Event()
    store, r = await reader(tmp_path, stop=stop, stalled=True)
    pending = asyncio.ensure_future(asyncio.to_thread(r.read_into, 0, memoryview(bytearray(8))))
    await asyncio.to_thread(store.started.wait, 10)
    assert not pending.done()
    stop.set()
    with pytest.raises(ConsolidationStopped):
        await asyncio.wait_for(pending, 10)   # the store never answered: the stop alone ended the read
