"""``promtool``: Prometheus's checker, from Debian's ``prometheus`` package, not installed.

The package is fetched with ``apt-get download prometheus`` (no root needed), unpacked with
``dpkg-deb -x`` and only ``promtool`` is kept, in ``<cache>/prometheus/promtool`` (cache as
``hadar infra``: ``HADAR_CACHE`` or ``~/.cache/hadar``), so the second session reuses it.
If it cannot be had, the tests that need it fail under ``CI=true`` and skip elsewhere
(``tests/required.py``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest

from devinfra import InfraPaths
from services.agent.daemon.discovery import cpu_devices
from services.agent.daemon.service import AgentConfig, AgentDaemon
from services.agent.protocol import StoreTarget
from services.profiler.service import ProfilerService
from services.scheduler.config import SchedulerConfig
from services.scheduler.live.service import SchedulerService
from services.tracker.service import TrackerConfig, TrackerService
from shared.bus import MemoryBus
from shared.runtime.service import HttpEndpoint
from shared.store import LocalStore
from shared.wire.events import JobSpec, JobSubmitted, QueueConfig, QueuesApplied, QueueSpec, ThroughputEstimate
from shared.wire.topics import JOBS
from tests.required import unavailable

PACKAGE = "prometheus"


def fetch_promtool(cache: Path) -> Path:
    """``promtool`` from the cache, or from a freshly downloaded Debian package; raises
    RuntimeError with what went wrong."""
    target = cache / "prometheus" / "promtool"
    if target.is_file() and os.access(target, os.X_OK):
        return target
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"promtool is fetched with {tool}, which is not installed")
    with tempfile.TemporaryDirectory(prefix="hadar-promtool-") as tmp:
        got = subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, capture_output=True, text=True,
                             timeout=600)
        debs = sorted(Path(tmp).glob(f"{PACKAGE}_*.deb"))
        if got.returncode != 0 or not debs:
            raise RuntimeError(f"apt-get download {PACKAGE} failed: {got.stderr.strip()[-500:]}")
        unpacked = Path(tmp) / "x"
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], check=True, capture_output=True,
                       timeout=300)
        found = unpacked / "usr" / "bin" / "promtool"
        if not found.is_file():
            raise RuntimeError(f"{debs[0].name} has no usr/bin/promtool")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        shutil.copy2(found, partial)
        partial.chmod(0o755)
        partial.replace(target)   # atomic: a concurrent session sees all of it or nothing
    return target


@pytest.fixture(scope="session")
def promtool() -> Path:
    try:
        return fetch_promtool(InfraPaths.from_env().cache)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        unavailable(f"promtool unavailable: {exc}")




# ---------------------------------------------------------------- the four services' scrapes

FAKE_WORKER = Path(__file__).resolve().parents[1] / "integration" / "fake_worker.py"
NODE = "n1"


async def _until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"{what} not reached within {timeout_s} s"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="session")
async def scrapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``/metrics`` of a scheduler, tracker, profiler and agent, each served by its real
    :class:`~shared.runtime.service.HttpEndpoint` on 127.0.0.1, after they ran together on one
    MemoryBus and LocalStore: a job submitted, rounds planned, a copy run on the agent (by
    the torch-free fake worker), and one undecodable record on hadar.jobs."""
    tmp = tmp_path_factory.mktemp("scrapes")
    python = tmp / "fake-python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE_WORKER}\n")
    python.chmod(0o755)
    bus = MemoryBus()
    await bus.start()
    store = LocalStore(tmp / "store")
    await store.start()
    now = time.time()
    scheduler = SchedulerService(bus=bus, config=SchedulerConfig(policy="yarn-cs", round_s=0.3, heartbeat_s=0.5,
                                                                  consolidation_wait_s=0.5))
    tracker = TrackerService(bus=bus, store=store, config=TrackerConfig(tick_s=0.1, finish_timeout_s=1.0))
    profiler = ProfilerService(bus=bus)
    agent = AgentDaemon(AgentConfig(node_id=NODE, progress_s=0.1, heartbeat_s=0.5, stop_timeout_s=5.0,
                                    spare_workers=0, python=str(python)),
                        bus=bus, store=StoreTarget.local(tmp / "store"), devices=cpu_devices(1))
    services = (scheduler, tracker, profiler, agent)
    endpoints = [HttpEndpoint(s, host="127.0.0.1", port=0) for s in services]
    try:
        for endpoint in endpoints:
            await endpoint.start()
        for service in services:
            await service.start()
        spec = JobSpec(job_id="j1", user="u", model="resnet", dataset="digits", batch_size=8, workers=1,
                       iterations=10**6)
        # under team queues, so the queue gauges are served too
        await bus.publish(QueuesApplied(ts=now, source="cli/admin", config=QueueConfig(
            queues=(QueueSpec(name="team", quota={"cpu": 1}),), default_queue="team")))
        await bus.publish(JobSubmitted(ts=now, source="cli", job=spec, submitted_at=now))
        await bus.publish(ThroughputEstimate(ts=now, source="test", job_id="j1", basis="estimate", workers=1,
                                          rates={"cpu": 50.0}))
        await bus.write_raw(JOBS, "bad", b"\xc1 not msgpack")
        def rounds():
            return scheduler.registry.get_sample_value("hadar_scheduler_rounds_total") or 0
        await _until(lambda: rounds() >= 3, "three rounds")
        await _until(lambda: (tracker.registry.get_sample_value("hadar_tracker_consolidation_seconds_count") or 0)
                     + (tracker.registry.get_sample_value("hadar_tracker_rounds_without_model_total") or 0) >= 1,
                     "a round decided by the tracker")
        out: dict[str, str] = {}
        async with aiohttp.ClientSession() as http:
            for service, endpoint in zip(services, endpoints):
                async with http.get(f"http://127.0.0.1:{endpoint.port}/metrics") as response:
                    assert response.status == 200
                    out[service.name] = await response.text()
        return out
    finally:
        for service in reversed(services):
            await service.stop()
        for endpoint in endpoints:
            await endpoint.stop()
        await bus.stop()
