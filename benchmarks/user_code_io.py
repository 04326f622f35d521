"""User code benchmark, parts 2 and 3 (run by benchmarks/user_code.py, which has the usage).

2. **bundles** -- into a fresh ``LocalStore`` (and, when ``HADAR_S3_ENDPOINT`` and its keys are
   set, MinIO, under a user of its own whose objects are deleted after): pack alone, then
   :func:`~services.cli.usercode.deliver` of ``examples/user-code/digits`` (pack + upload) and
   :func:`~services.cli.usercode.upload_dataset` of a synthetic ``--data-mb`` MB dataset of
   random float32 ``.npy`` files (incompressible), each twice: the second finds the digest
   stored and uploads nothing. Then :class:`~services.agent.worker.artifacts.ArtifactCache`
   ``get`` of each bundle, cold (fetch from the store, verify, extract; ``fetch_s`` is the fetch
   alone) and warm (a hit). Medians over ``min(repeats, 3)`` fresh stores and caches.

3. **placement** -- a ``MemoryBus`` with the profiler service (catalog estimates) and the live
   scheduler service (default policy, ``--round-s`` rounds, no snapshots) over two registered
   nodes of 4 GPUs (v100, t4). A JobSubmitted of a user-code job (``code=UserCode(...)`` of the
   packed digits example, no ``hint``, so its estimate is the provisional one) is published and
   timed to its ThroughputEstimate and to the first Assignment naming it (and that round's
   number, and how many rounds began between submission and it). Two cases, each
   ``min(repeats, 3)`` times on fresh services: *idle* (no other job: the scheduler's loop waits
   for one) and *busy* (a zoo job already placed, rounds running; the job arrives at a random
   point of a round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.user_code import (
    BENCH_USER,
    DATASET,
    DIGITS_EXAMPLE,
    MODEL,
    SEED,
    load_avg,
    median,
    rounded,
    write_synthetic_dataset,
)

# ---------------------------------------------------------------- 2. bundles


def fetch_through(loop: asyncio.AbstractEventLoop, fetch: Callable[[Path], Awaitable[None]],
                  spent: list[float]) -> Callable[[Path], None]:
    """A cache ``Fetch`` (called in a worker thread) that runs ``fetch`` on ``loop`` and adds
    the seconds it took to ``spent``."""
    def run(path: Path) -> None:
        began = time.perf_counter()
        asyncio.run_coroutine_threadsafe(fetch(path), loop).result()
        spent.append(time.perf_counter() - began)
    return run


async def bundle_trial(store: Any, user: str, data_folder: Path, cache_root: Path) -> dict[str, float]:
    """One round of every bundle operation against ``store``; seconds of each."""
    from services.agent.worker.artifacts import ArtifactCache
    from services.cli.usercode import CodeRequest, deliver, upload_dataset
    from shared.domain.bundles import CODE_LIMITS, DATA_LIMITS, pack
    from shared.domain.layout import code_bundle_key, data_bundle_key
    from shared.wire.records import UserCode

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="hadar-bench-pack-") as tmp:
        began = time.perf_counter()
        await asyncio.to_thread(pack, DIGITS_EXAMPLE, Path(tmp) / "code.tar", limits=CODE_LIMITS)
        out["code_pack_s"] = time.perf_counter() - began
        began = time.perf_counter()
        await asyncio.to_thread(pack, data_folder, Path(tmp) / "data.tar", limits=DATA_LIMITS)
        out["data_pack_s"] = time.perf_counter() - began

    request = CodeRequest(folder=DIGITS_EXAMPLE, entrypoint="train.py", args=(), config="", data="", hint="")

    async def accept(code: UserCode) -> UserCode:
        return code

    codes: list[UserCode] = []
    for attempt in ("first", "second"):
        began = time.perf_counter()
        code, uploaded = await deliver(store, request, user, accept)
        out[f"code_submit_{attempt}_s"] = time.perf_counter() - began
        assert uploaded == (attempt == "first"), f"code submit {attempt}: uploaded={uploaded}"
        codes.append(code)
    assert codes[0].digest == codes[1].digest
    pointers = []
    for attempt in ("first", "second"):
        began = time.perf_counter()
        pointer = await upload_dataset(store, data_folder, user, "bench-data")
        out[f"data_put_{attempt}_s"] = time.perf_counter() - began
        assert pointer["uploaded"] == (attempt == "first"), f"data put {attempt}: {pointer}"
        pointers.append(pointer)
    assert pointers[0]["digest"] == pointers[1]["digest"]

    cache = ArtifactCache(cache_root, max_bytes=1 << 40)
    loop = asyncio.get_running_loop()
    for what, digest, size, key, limits in (
            ("code", codes[0].digest, codes[0].size, code_bundle_key(user, codes[0].digest), CODE_LIMITS),
            ("data", pointers[0]["digest"], pointers[0]["size"], data_bundle_key(user, pointers[0]["digest"]),
             DATA_LIMITS)):
        for attempt in ("cold", "warm"):
            spent: list[float] = []
            fetch = fetch_through(loop, lambda path, key=key: store.get_file(key, path), spent)
            began = time.perf_counter()
            tree = await asyncio.to_thread(cache.get, digest, size, fetch, limits=limits)
            out[f"{what}_cache_{attempt}_s"] = time.perf_counter() - began
            assert bool(spent) == (attempt == "cold"), f"{what} {attempt}: fetched {len(spent)} times"
            if spent:
                out[f"{what}_cache_fetch_s"] = spent[0]
            assert tree.is_dir()
    out["data_bytes"] = float(pointers[0]["size"])
    out["code_bytes"] = float(codes[0].size)
    return out


async def measure_bundles(args: argparse.Namespace) -> dict[str, Any]:
    from shared.domain.layout import user_prefix
    from shared.store import LocalStore
    from shared.store.settings import s3_from_env

    trials = max(1, min(args.repeats, 3))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hadar-bench-bundles-") as tmp:
        root = Path(tmp)
        written = write_synthetic_dataset(root / "dataset", args.data_mb)
        targets: list[tuple[str, Callable[[int], Any]]] = [("local", lambda i: LocalStore(root / f"store-{i}"))]
        settings = s3_from_env()
        if settings is not None:
            from shared.store.minio import MinioStore

            targets.append(("minio", lambda i: MinioStore(settings)))
        for label, make in targets:
            runs = []
            for i in range(trials):
                store = make(i)
                user = BENCH_USER if label == "local" else f"{BENCH_USER}-{os.getpid()}-{int(time.time())}-{i}"
                await store.start()
                try:
                    runs.append(await bundle_trial(store, user, root / "dataset", root / f"cache-{label}-{i}"))
                finally:
                    if label != "local":
                        for key in await store.list(user_prefix(user)):
                            await store.delete(key)
                    await store.stop()
            summary = {k: rounded(median([r[k] for r in runs]), 4) for k in runs[0] if k.endswith("_s")}
            summary["code_bytes"] = int(runs[0]["code_bytes"])
            summary["data_bytes"] = int(runs[0]["data_bytes"])
            summary["trials"] = trials
            results[label] = summary
            print(f"bundles {label}: code {summary['code_bytes'] / 1e3:.0f} kB pack {summary['code_pack_s']:.3f} s, "
                  f"submit first {summary['code_submit_first_s']:.3f} s / "
                  f"second {summary['code_submit_second_s']:.3f} s; "
                  f"data {summary['data_bytes'] / 1e6:.0f} MB pack {summary['data_pack_s']:.2f} s, "
                  f"put first {summary['data_put_first_s']:.2f} s / second {summary['data_put_second_s']:.2f} s; "
                  f"cache code cold {summary['code_cache_cold_s']:.3f} / warm {summary['code_cache_warm_s']:.4f} s, "
                  f"data cold {summary['data_cache_cold_s']:.2f} (fetch {summary['data_cache_fetch_s']:.2f}) / "
                  f"warm {summary['data_cache_warm_s']:.4f} s (load {load_avg()})", file=sys.stderr)
        results["dataset_files_bytes"] = written
    return results


# ---------------------------------------------------------------- 3. placement


@dataclass
class Watch:
    """Arrival times (``time.time()``) of what the bench waits for on the bus."""

    estimates: dict[str, float]
    assignments: dict[str, tuple[float, int]]   # job -> (arrival, round) of its first Assignment
    rounds: list[tuple[float, int]]              # (arrival, round) of every RoundStarted


@contextmanager
def _quiet_logs() -> Iterator[None]:
    """The services log every round through structlog: keep stderr to the bench's lines."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        yield
    finally:
        structlog.reset_defaults()


async def placement_trial(round_s: float, busy: bool, code: Any, rng: random.Random) -> dict[str, Any]:
    from services.profiler.service import ProfilerConfig, ProfilerService
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.live.service import SchedulerService
    from shared.bus import MemoryBus
    from shared.wire.events import (
        Assignment,
        GpuInfo,
        JobSpec,
        JobSubmitted,
        NodeRegistered,
        RoundStarted,
        ThroughputEstimate,
    )
    from shared.wire.topics import PLACEMENTS, THROUGHPUT

    bus = MemoryBus()
    await bus.start()
    now = time.time()
    for node_id, gpu in (("n1", "v100"), ("n2", "t4")):
        await bus.publish(NodeRegistered(ts=now, source="agent", node_id=node_id,
                                         gpus=tuple(GpuInfo(index=i, type=gpu) for i in range(4))))
    watch = Watch(estimates={}, assignments={}, rounds=[])
    sub = bus.subscribe([PLACEMENTS, THROUGHPUT], "bench-watch")
    await sub.start()

    async def collect() -> None:
        async for delivery in sub:
            at = time.time()
            event = delivery.event
            await delivery.ack()
            if isinstance(event, ThroughputEstimate):
                watch.estimates.setdefault(event.job_id, at)
            elif isinstance(event, Assignment):
                watch.assignments.setdefault(event.job_id, (at, event.round))
            elif isinstance(event, RoundStarted):
                watch.rounds.append((at, event.round))

    collector = asyncio.create_task(collect())
    profiler = ProfilerService(bus=bus, config=ProfilerConfig(group="bench-profiler"))
    scheduler = SchedulerService(bus=bus, run_rounds=True,
                                 config=SchedulerConfig(round_s=round_s, heartbeat_s=1000, late_copy_s=0,
                                                        consolidation_wait_s=0, round_overhead_factor=0,
                                                        snapshot_every=0, group="bench-scheduler"))

    async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"placement: {what} within {timeout_s:.0f} s")
            await asyncio.sleep(0.005)

    try:
        await profiler.start()
        await scheduler.start()
        if busy:
            spec = JobSpec(job_id="zoo-bg", user="u", model=MODEL, dataset=DATASET, batch_size=32, workers=1,
                           iterations=10**9)
            await bus.publish(JobSubmitted(ts=time.time(), source="cli", job=spec, submitted_at=time.time()))
            await until(lambda: "zoo-bg" in watch.assignments, 10 * round_s + 30, "the background job placed")
            await asyncio.sleep(rng.uniform(0.0, round_s))   # arrive at a random point of a round
        else:
            await asyncio.sleep(1.5)   # the scheduler's idle loop is waiting for a job
        spec = JobSpec(job_id="user-job", user=BENCH_USER, model="digits-cnn", dataset="-", batch_size=32,
                       workers=1, iterations=400, code=code)
        submitted = time.time()
        rounds_before = max((r for _, r in watch.rounds), default=-1)
        await bus.publish(JobSubmitted(ts=submitted, source="cli", job=spec, submitted_at=submitted))
        await until(lambda: "user-job" in watch.assignments, 10 * round_s + 30, "the user-code job placed")
        placed_at, placed_round = watch.assignments["user-job"]
        estimate_at = watch.estimates.get("user-job")
        began_between = sorted({r for at, r in watch.rounds if submitted <= at and r <= placed_round})
    finally:
        await scheduler.stop()
        await profiler.stop()
        collector.cancel()
        await asyncio.gather(collector, return_exceptions=True)
        await sub.stop()
        await bus.stop()
    return {"estimate_s": None if estimate_at is None else estimate_at - submitted,
            "placed_s": placed_at - submitted, "round": placed_round,
            "rounds_begun_until_placed": len(began_between), "last_round_before": rounds_before}


async def measure_placement(args: argparse.Namespace) -> dict[str, Any]:
    from shared.domain.bundles import CODE_LIMITS, pack
    from shared.wire.records import UserCode

    with tempfile.TemporaryDirectory(prefix="hadar-bench-code-") as tmp:
        bundle = pack(DIGITS_EXAMPLE, Path(tmp) / "code.tar", limits=CODE_LIMITS)
    code = UserCode(digest=bundle.digest, size=bundle.size, entrypoint="train.py",
                    config=json.dumps({"lr": 0.05, "total_steps": 400}))
    trials = max(1, min(args.repeats, 3))
    rng = random.Random(SEED)
    results: dict[str, Any] = {"round_s": args.round_s, "policy": "default (SchedulerConfig.policy)", "trials": trials}
    with _quiet_logs():
        from services.scheduler.config import SchedulerConfig

        results["policy"] = SchedulerConfig().policy
        for case, busy in (("idle", False), ("busy", True)):
            runs = [await placement_trial(args.round_s, busy, code, rng) for _ in range(trials)]
            estimates = [r["estimate_s"] for r in runs if r["estimate_s"] is not None]
            results[case] = {
                "estimate_s": rounded(median(estimates), 4),
                "placed_s": rounded(median([r["placed_s"] for r in runs]), 3),
                "placed_s_max": rounded(max(r["placed_s"] for r in runs), 3),
                "rounds": [r["round"] for r in runs],
                "rounds_begun_until_placed": [r["rounds_begun_until_placed"] for r in runs],
            }
            print(f"placement {case}: estimate {results[case]['estimate_s']} s, first Assignment "
                  f"{results[case]['placed_s']} s median (max {results[case]['placed_s_max']}), rounds "
                  f"{results[case]['rounds']}, rounds begun until placed {results[case]['rounds_begun_until_placed']}"
                  f" (round {args.round_s} s, load {load_avg()})", file=sys.stderr)
    return results
