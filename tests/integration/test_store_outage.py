"""A checkpoint upload survives MinIO being killed and restarted (issue 13 item 6).

A private MinIO (its own run directory) is SIGKILLed; a ``put_file`` started while it is
down completes once ``restart`` brings the server back on the same port with the same
data and credentials, and the object is there in full.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from shared.config import S3Settings
from shared.infra import InfraError, InfraPaths, ensure_minio, restart, stop_server
from shared.infra.common import is_running
from shared.store import MinioStore

pytestmark = [pytest.mark.s3, pytest.mark.slow]

KEY = "checkpoints/job/3/0.safetensors"


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


def test_upload_started_while_minio_is_down_completes_after_restart(tmp_path: Path) -> None:
    paths = InfraPaths(cache=InfraPaths.from_env().cache, run=tmp_path / "run")
    try:
        server, _ = ensure_minio(paths)
    except InfraError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"minio could not start: {exc}")
        pytest.skip(f"minio could not start: {exc}")
    try:
        settings = S3Settings(endpoint=server.endpoint, access_key=server.access_key,
                              secret_key=server.secret_key, bucket="outage")
        data = os.urandom(3 << 20)
        source = tmp_path / "ckpt.bin"
        source.write_bytes(data)
        assert asyncio.run(_upload_across_outage(paths, settings, source)) == data
    finally:
        stop_server(paths, "minio")
