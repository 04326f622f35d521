"""A checkpoint upload survives MinIO being killed and restarted (issue 13 item 6), and an
outage longer than the store's retry costs a round, not the tracker (item 4).

A private MinIO (its own run directory) is SIGKILLed; a ``put_file`` started while it is
down completes once ``restart`` brings the server back on the same port with the same
data and credentials, and the object is there in full. (A 70 s outage, with Kafka down
too: tests/integration/test_long_outage.py.) Past the retry budget the tracker's download
fails, the round is given up with a RoundAbandoned (the scheduler re-plans the job from its
previous model), the tracker stays healthy and consolidates the next round once MinIO is
back.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from safetensors.numpy import save

from devinfra import InfraError, InfraPaths, ensure_minio, restart, stop_server
from devinfra.common import is_running
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.domain.layout import checkpoint_key
from shared.store import MinioStore
from shared.store.settings import S3Settings
from shared.wire.events import RoundAbandoned
from tests.integration.test_tracker_hostile import T0, Cluster, weights
from tests.required import unavailable

pytestmark = [pytest.mark.s3, pytest.mark.slow]

KEY = "checkpoints/job/3/n0/0.safetensors"


async def _upload_across_outage(paths: InfraPaths, settings: S3Settings, source: Path) -> bytes:
    store = MinioStore(settings)
    await store.start()
    await store.put("before", b"kept")
    server, _ = ensure_minio(paths)
    os.kill(server.pid, signal.SIGKILL)
    while is_running(server.pid, server.marker):
        await asyncio.sleep(0.05)
    upload = asyncio.create_task(store.put_file(KEY, source))
    await asyncio.sleep(3.0)             # the upload meets a dead server, and retries
    assert not upload.done()
    await asyncio.to_thread(restart, paths, "minio")
    await asyncio.wait_for(upload, 120)
    assert await store.get("before") == b"kept"
    return await store.get(KEY)


@pytest.fixture
def private_minio(tmp_path: Path):
    """(paths, server) of a MinIO in its own run directory, stopped after the test; fails
    under CI=true, else skips, when it cannot start."""
    paths = InfraPaths(cache=InfraPaths.from_env().cache, run=tmp_path / "run")
    try:
        server, _ = ensure_minio(paths)
    except InfraError as exc:
        unavailable(f"minio could not start: {exc}")
    try:
        yield paths, server
    finally:
        stop_server(paths, "minio")


def _settings(server, bucket: str) -> S3Settings:
    return S3Settings(endpoint=server.endpoint, access_key=server.access_key, secret_key=server.secret_key,
                      bucket=bucket)


def test_upload_started_while_minio_is_down_completes_after_restart(private_minio, tmp_path: Path) -> None:
    paths, server = private_minio
    data = os.urandom(3 << 20)
    source = tmp_path / "ckpt.bin"
    source.write_bytes(data)
    assert asyncio.run(_upload_across_outage(paths, _settings(server, "outage"), source)) == data


async def _round_past_the_retry_budget(paths: InfraPaths, settings: S3Settings, bus: MemoryBus) -> None:
    store = MinioStore(settings, retry_for_s=1.0)   # the budget, shortened: the rule, not its length, is tested
    await store.start()
    cluster = Cluster(bus, store, "j-outage", store_for_tracker=store, max_attempts=2)  # type: ignore[arg-type]
    await store.put(checkpoint_key("j-outage", 0, 0, node="n0"), save(weights(1)))
    await cluster.service.start()
    try:
        server, _ = ensure_minio(paths)
        os.kill(server.pid, signal.SIGKILL)
        while is_running(server.pid, server.marker):
            await asyncio.sleep(0.05)
        await cluster.place(0, ["n0"])
        await cluster.finish(0, 0, "n0", 10, None, checkpoint=checkpoint_key("j-outage", 0, 0, node="n0"))

        async def abandoned() -> list[RoundAbandoned]:
            return [e for e in await cluster.models() if isinstance(e, RoundAbandoned)]
        deadline = asyncio.get_running_loop().time() + 60
        while not await abandoned():
            assert asyncio.get_running_loop().time() < deadline, cluster.service.health()
            await asyncio.sleep(0.2)
        (given_up,) = await abandoned()
        assert given_up.round == 0 and "gave up after 2 attempts" in given_up.reason
        assert cluster.service.registry.get_sample_value("hadar_tracker_rounds_given_up_total") == 1
        assert cluster.service.health()["ok"], cluster.service.health()   # the service stays up

        # MinIO is back: the job's next round (re-planned from its previous model) is consolidated.
        await asyncio.to_thread(restart, paths, "minio")
        await cluster.place(1, ["n0"])
        await cluster.finish(1, 0, "n0", 20, save(weights(2)))
        model = await cluster.wait_model(1, timeout_s=60)
        assert model.total_steps == 20 and [c.copy for c in model.copies] == [0]
    finally:
        await cluster.service.stop()
        await store.stop()


def test_minio_down_past_the_retry_budget_abandons_the_round_and_the_tracker_carries_on(private_minio) -> None:
    paths, server = private_minio

    async def run() -> None:
        bus = MemoryBus(clock=FakeClock(T0))
        await bus.start()
        try:
            await _round_past_the_retry_budget(paths, _settings(server, "past-budget"), bus)
        finally:
            await bus.stop()
    asyncio.run(run())
