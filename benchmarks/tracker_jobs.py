"""How long the tracker takes to decide a round of several jobs, consolidating one job at a
time against several at once (``TrackerConfig.consolidation_jobs``), side by side.

``--jobs`` jobs each ran one round as ``--copies`` copies; every replica (``--size-mb`` of
float32, written as an agent writes it) is in the store, and every CopyFinished is on the bus.
A real TrackerService (MemoryBus, the store of the environment: MinIO from ``HADAR_S3_*``, as
``hadar infra up`` writes them, else a LocalStore) starts and decides every round: the time
from its start to the last ModelConsolidated is what the next round of the scheduler would
wait. After one warm-up run (not counted), each setting runs ``--repeat`` times, alternating,
on fresh job ids; medians printed.

    PYTHONPATH=. python benchmarks/tracker_jobs.py [--jobs 6] [--copies 2] [--size-mb 64]
        [--settings 1,4] [--repeat 3]

Last output line: one JSON object, ``{"setting": seconds}`` medians and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import consolidate
from services.tracker.config import TrackerConfig
from services.tracker.service import TrackerService
from shared.bus import MemoryBus
from shared.domain.layout import checkpoint_key
from shared.runtime.logging import configure_logging
from shared.store import LocalStore
from shared.store.settings import s3_from_env
from shared.wire.events import Assignment, CopyFinished, JobSpec, ModelConsolidated, RoundStarted
from shared.wire.topics import MODELS


def open_store(root: Path) -> tuple[Any, str]:
    settings = s3_from_env()
    if settings is None:
        return LocalStore(root / "store"), "LocalStore"
    from shared.store.minio import MinioStore

    return MinioStore(settings), f"MinIO at {settings.endpoint}"


async def one_run(store: Any, replicas: list[Path], *, jobs: int, copies: int, setting: int) -> float:
    bus = MemoryBus()
    await bus.start()
    tag = uuid.uuid4().hex[:6]
    now = time.time()
    specs = [JobSpec(job_id=f"bench-{tag}-{j}", user="bench", model="resnet", dataset="digits", batch_size=32,
                     workers=1, iterations=10**9) for j in range(jobs)]
    await bus.publish(RoundStarted(ts=now, source="bench", round=0, policy="hadare", started_at=now - 10,
                                   ends_at=now, assignments=jobs * copies))
    for spec in specs:
        for copy in range(copies):
            node = f"n{copy}"
            await bus.publish(Assignment(ts=now, source="bench", round=0, job=spec, copy=copy, node_id=node,
                                         gpus=(0,), gpu_type="v100", world_size=1, ranks=(0,), step_budget=100,
                                         deadline=now, copies=copies, fork_workers=copies))
            key = checkpoint_key(spec.job_id, 0, copy, node=node)
            await store.put_file(key, replicas[copy])
            await bus.publish(CopyFinished(ts=now, source=f"agent/{node}", job_id=spec.job_id, round=0, copy=copy,
                                           node_id=node, status="ok", steps_round=50 + copy, checkpoint=key))
    config = TrackerConfig(group=f"bench-{tag}", tick_s=0.05, consolidation_jobs=setting, delete_checkpoints=False,
                           snapshot_every=0)
    service = TrackerService(bus=bus, store=store, config=config)
    began = time.perf_counter()
    await service.start()
    wanted = {s.job_id for s in specs}
    try:
        while True:
            done = {d.event.job_id async for d in bus.read(MODELS) if isinstance(d.event, ModelConsolidated)}
            if wanted <= done:
                return time.perf_counter() - began
            await asyncio.sleep(0.02)
    finally:
        await service.stop()
        await bus.stop()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    settings = [int(s) for s in args.settings.split(",")]
    with tempfile.TemporaryDirectory(prefix="hadar-tracker-jobs-") as tmp:
        root = Path(tmp)
        tensors = consolidate.layout(args.size_mb, 16)
        replicas = []
        for copy in range(args.copies):
            path = root / f"replica-{copy}.safetensors"
            consolidate.write_replica(path, tensors, seed=copy)
            replicas.append(path)
        store, where = open_store(root)
        await store.start()
        try:
            await one_run(store, replicas, jobs=args.jobs, copies=args.copies, setting=settings[0])   # warm-up
            times: dict[int, list[float]] = {s: [] for s in settings}
            for _ in range(args.repeat):
                for setting in settings:
                    seconds = await one_run(store, replicas, jobs=args.jobs, copies=args.copies, setting=setting)
                    times[setting].append(seconds)
                    print(f"consolidation_jobs={setting}: {seconds:.2f} s", flush=True)
        finally:
            await store.stop()
    medians = {str(s): round(statistics.median(v), 3) for s, v in times.items()}
    first, last = str(settings[0]), str(settings[-1])
    return {"store": where, "jobs": args.jobs, "copies": args.copies, "size_mb": args.size_mb,
            "seconds": medians, "ratio": round(medians[first] / medians[last], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--settings", default="1,4")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    configure_logging("bench", level="warning")
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
