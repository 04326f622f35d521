"""Long outages of Kafka and MinIO, under the limits that end a service, cost nothing (issue
13 item 4).

A private broker and MinIO (their own run directory, never the session's) are SIGKILLed
together, as a host outage would take both, while an agent on the broker runs a copy (the
fake worker: the worker protocol without torch) and a checkpoint upload and a model
download are started on MinIO. After :data:`DOWN_S` both are brought back with ``hadar
infra restart``'s code, MinIO first (down ~70 s: over the 30 s measured before, under the
store's 90 s retry), then Kafka, whose start adds 5-30 s (down 75-100 s: over the 20 s
measured before, under the watchdog's 120 s; restarts share the infra lock, so they run one
after the other). The copy finishes while the broker is away. What is checked, by event id:

* every Progress and CopyFinished the agent produced reaches a consumer group once the
  broker is back, and the CopyFinished was made when the copy finished, not when the broker
  came back (a broker outage does not stall the copy's runner);
* the consumer group resumes from its committed offsets: what it had acked and committed
  before the outage is not delivered again;
* the agent stays healthy and gives up no result;
* the upload and the download started while MinIO was down complete once it is back, byte
  for byte, and nothing stored before is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from devinfra import (
    InfraError,
    InfraPaths,
    ensure_kafka,
    ensure_minio,
    restart,
    stop_server,
)
from devinfra.common import is_running
from services.agent.daemon.discovery import cpu_devices
from services.agent.daemon.service import AgentConfig, AgentDaemon
from services.agent.protocol import StoreTarget
from shared.bus import BusError, KafkaBus
from shared.domain.layout import checkpoint_key
from shared.store import MinioStore
from shared.store.settings import S3Settings
from shared.wire.events import CopyFinished, Event, Progress, RoundStarted
from shared.wire.topics import PROGRESS
from tests.integration.test_agent_hostile import NODE, assign
from tests.required import unavailable

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

DOWN_S = 70.0   # both servers; Kafka's own start comes on top (module docstring)
CHECKPOINT = checkpoint_key("long-outage", 0, 0, node=NODE)   # as the agent on NODE would write it
MODEL = "models/long-outage/0.safetensors"
STEPS = 1500          # the fake worker's steps take 10 ms: ~15 s of training


class RecordingKafkaBus(KafkaBus):
    """The real KafkaBus, remembering every Progress and CopyFinished it was asked to send."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.produced: dict[str, Event] = {}

    async def publish_pipelined(self, event: Event, *, topic: str | None = None,
                                key: str | None = None) -> Awaitable[tuple[int, int]]:
        if isinstance(event, (Progress, CopyFinished)):
            self.produced.setdefault(event.id, event)
        return await super().publish_pipelined(event, topic=topic, key=key)


@pytest.fixture
def private_servers(tmp_path: Path) -> Iterator[InfraPaths]:
    paths = InfraPaths(cache=InfraPaths.from_env().cache, run=tmp_path / "run")
    try:
        try:
            ensure_kafka(paths)
            ensure_minio(paths)
        except InfraError as exc:
            unavailable(f"servers could not start: {exc}")
        yield paths
    finally:
        for name in ("kafka", "minio"):
            stop_server(paths, name)  # type: ignore[arg-type]


async def _observe(bus: KafkaBus, consumed: list[tuple[str, float, Event]]) -> None:
    """A consumer group on the progress topic, as the tracker's: ack each record, ride out fetch errors."""
    async with bus.subscribe(PROGRESS, "outage-observer") as sub:
        while True:
            try:
                delivery = await anext(sub)
            except BusError as exc:
                if not exc.retriable:
                    raise
                await asyncio.sleep(1.0)
                continue
            consumed.append((delivery.event.id, time.monotonic(), delivery.event))
            await delivery.ack()


async def _kill_both(paths: InfraPaths) -> None:
    for server in (ensure_kafka(paths)[0], ensure_minio(paths)[0]):
        os.kill(server.pid, signal.SIGKILL)
        while is_running(server.pid, server.marker):
            await asyncio.sleep(0.05)


async def _bring_back(paths: InfraPaths) -> tuple[float, float, float]:
    """After DOWN_S restart MinIO, then Kafka; when MinIO was back, when Kafka was (monotonic, unix)."""
    await asyncio.sleep(DOWN_S)
    await asyncio.to_thread(restart, paths, "minio")
    minio_back = time.monotonic()
    await asyncio.to_thread(restart, paths, "kafka")
    return minio_back, time.monotonic(), time.time()


async def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        await asyncio.sleep(0.2)


async def _across_outage(paths: InfraPaths, tmp_path: Path, python: str) -> None:
    server, _ = ensure_kafka(paths)
    minio, _ = ensure_minio(paths)
    store = MinioStore(S3Settings(endpoint=minio.endpoint, access_key=minio.access_key,
                                  secret_key=minio.secret_key, bucket="outage"))
    await store.start()
    model = os.urandom(1 << 20)
    await store.put(MODEL, model)
    checkpoint = os.urandom(3 << 20)
    (tmp_path / "ckpt").write_bytes(checkpoint)
    agent_bus = RecordingKafkaBus(server.bootstrap, source="agent", request_timeout_ms=10_000)
    observer_bus = KafkaBus(server.bootstrap, source="observer", request_timeout_ms=10_000)
    await agent_bus.start()
    await observer_bus.start()
    await observer_bus.ensure_topics()
    agent = AgentDaemon(AgentConfig(node_id=NODE, progress_s=0.5, heartbeat_s=1.0, stop_timeout_s=5.0,
                                    spare_workers=0, python=python, result_retry_s=0.2, result_retry_max_s=2.0),
                        bus=agent_bus, store=StoreTarget.local(tmp_path / "store"), devices=cpu_devices(1))
    consumed: list[tuple[str, float, Event]] = []
    observer = asyncio.create_task(_observe(observer_bus, consumed))
    await agent.start()
    try:
        # The observer's group must have joined before the copy trains: a fresh broker's
        # group coordinator took ~40 s under load, and the copy (~15 s) was over before the
        # kill, so no Progress fell in the outage.
        await observer_bus.publish(Progress(ts=time.time(), source="observer", job_id="warm-up", round=0, copy=0,
                                         node_id=NODE, gpu_type="cpu", workers=1, steps_round=0,
                                         steps_total=0, samples_per_s=0.0, loss=0.0))
        await _until(lambda: len(consumed) >= 1, 120, "the observer's group joined")
        now = time.time()
        await observer_bus.publish(RoundStarted(ts=now, source="scheduler", round=0, policy="hadare",
                                             started_at=now, ends_at=now + 600))
        await observer_bus.publish(assign("long-outage", 0, budget=STEPS, deadline=now + 600))

        def copy_reports() -> int:
            return sum(isinstance(e, Progress) and e.job_id == "long-outage" for _, _, e in consumed)
        await _until(lambda: copy_reports() >= 2, 120, "Progress before the outage")
        await asyncio.sleep(1.5)          # > the observer's commit interval: what it acked is committed
        before = {event_id for event_id, _, _ in consumed}
        await _kill_both(paths)
        killed_at = time.monotonic()
        upload = asyncio.create_task(store.put_file(CHECKPOINT, tmp_path / "ckpt"))
        download = asyncio.create_task(store.get_file(MODEL, tmp_path / "model"))
        minio_back, back_at, back_ts = await _bring_back(paths)
        await asyncio.wait_for(asyncio.gather(upload, download), 60)
        assert await store.get(CHECKPOINT) == checkpoint
        assert (tmp_path / "model").read_bytes() == model

        def result_seen() -> bool:
            return any(isinstance(e, CopyFinished) for _, _, e in consumed)
        await _until(result_seen, 120, "the copy's CopyFinished, consumed")
        await _until(lambda: set(agent_bus.produced) <= {i for i, _, _ in consumed}, 30,
                     "every produced Progress and CopyFinished, consumed")
        print(f"outage: MinIO down {minio_back - killed_at:.1f} s, Kafka down {back_at - killed_at:.1f} s "
              f"(restarts included), all consumed "
              f"{time.monotonic() - back_at:.1f} s after the broker was back; "
              f"{len(agent_bus.produced)} events produced, {len(consumed)} consumed")

        results = [e for e in agent_bus.produced.values() if isinstance(e, CopyFinished)]
        assert [r.status for r in results] == ["ok"]
        assert results[0].steps_round == STEPS
        # Made when the copy finished (~15 s in), not when the broker came back.
        assert results[0].ts < back_ts, "the result waited for the broker to be made"
        during = [e for e in agent_bus.produced.values() if isinstance(e, Progress)
                  and killed_at - back_at < e.ts - back_ts < 0]
        assert during, "no Progress was produced while the broker was away"
        again = [i for i, at, _ in consumed if i in before and at > killed_at]
        assert not again, f"{len(again)} records committed before the outage were delivered again"
        assert agent.health()["ok"]
        for reason in ("abandoned", "not_retriable"):
            assert agent.registry.get_sample_value("hadar_agent_results_undelivered_total",
                                                   {"node": NODE, "emulated": "false", "reason": reason}) in (None, 0.0)
    finally:
        await agent.stop()
        observer.cancel()
        with contextlib.suppress(asyncio.CancelledError, BusError):
            await observer
        await observer_bus.stop()
        await agent_bus.stop()
        await store.stop()


def test_kafka_and_minio_down_seventy_seconds_or_more_lose_no_event_and_no_checkpoint(
        private_servers: InfraPaths, tmp_path: Path, fake_python: str) -> None:
    asyncio.run(_across_outage(private_servers, tmp_path, fake_python))
