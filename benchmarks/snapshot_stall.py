"""How long a snapshot write stalls the event loop: encoded on the loop (how the tracker and
the profiler wrote theirs before ``SnapshotStore.save``) vs by ``SnapshotStore.save`` (the
encoding in a worker thread), for the same body on a LocalStore.

A ticker task sleeps 1 ms at a time while the snapshot is written; the longest gap between
its wake-ups is the stall every other task of the service (the consumer, /healthz) sees.
``--entries`` sizes the body (default 40,000 jobs: about 8 MB encoded). Runs alternate the
two ways ``--runs`` times. Last line: one JSON object.

    .venv/bin/python benchmarks/snapshot_stall.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from pathlib import Path

import structlog

from shared.domain.layout import snapshot_key
from shared.persistence.snapshot import SnapshotStore, StateSnapshot, dump
from shared.store import LocalStore


def body(entries: int) -> dict:
    return {f"job-{i}": {("v100", w): (float(i), [i] * 8) for w in range(4)} for i in range(entries)}


async def _ticker(stop: asyncio.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def write_once(way: str, snapshot: StateSnapshot) -> tuple[float, float, int]:
    """(seconds to write, longest loop stall in seconds, bytes) for one write ``way``."""
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp))
        await store.start()
        stop, gaps = asyncio.Event(), []
        ticker = asyncio.create_task(_ticker(stop, gaps))
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        if way == "on_loop":
            data = dump(snapshot)
            await store.put(snapshot_key("stall", 1), data)
            size = len(data)
        else:
            saved = await SnapshotStore(store, owner="stall", service=snapshot.service).save(lambda: snapshot)
            assert saved is not None
            size = saved.bytes
        took = time.perf_counter() - t0
        stop.set()
        await ticker
        return took, max(gaps), size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=40_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    logging.disable(logging.CRITICAL)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    snapshot = StateSnapshot(service="bench", created_at=0.0, body=body(args.entries))
    stalls: dict[str, list[float]] = {"on_loop": [], "save": []}
    size = 0
    for _ in range(args.runs):
        for way in stalls:
            took, stall, size = asyncio.run(write_once(way, snapshot))
            stalls[way].append(round(stall, 3))
            print(f"{way:8s} write {took:.3f} s, longest loop stall {stall * 1000:.0f} ms", flush=True)
    print(json.dumps({"bytes": size, "stall_s": stalls,
                      "worst_ratio": round(max(stalls["on_loop"]) / max(stalls["save"]), 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
