"""A crashed development server comes back with its data, port and credentials (issue 13).

Each test runs its own Kafka and MinIO in a private run directory (the shared cache holds
the jars and the binary), kills them with SIGKILL, and brings them back with
``hadar infra restart`` or ``hadar infra up``: a record written before is still there, an
object too, and the ``HADAR_*`` settings are unchanged, so running services reconnect.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from minio import Minio

from devinfra import InfraError, InfraPaths, down, ensure_kafka, status
from devinfra.common import is_running
from devinfra.kafka import load_kafka, start_kafka
from devinfra.minio import load_minio, start_minio
from tests.integration.test_infra import hadar_infra
from tests.required import unavailable

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.slow]

TOPIC = "restart-check"
BUCKET = "restart-check"


@pytest.fixture
def private_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InfraPaths]:
    """A run directory of this test only (never the lead's), stopped and removed afterwards."""
    paths = InfraPaths(cache=InfraPaths.from_env().cache, run=tmp_path / "run")
    monkeypatch.setenv("HADAR_CACHE", str(paths.cache))
    monkeypatch.setenv("HADAR_RUN_DIR", str(paths.run))
    try:
        yield paths
    finally:
        down(paths)


def start(paths: InfraPaths, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    code, out, err = hadar_infra("up", capsys=capsys)
    if code != 0:
        unavailable(f"servers could not start: {err.strip()}")
    return settings(out)


def settings(out: str) -> dict[str, str]:
    """The ``HADAR_*`` settings that ``up`` printed, ``*_FILE`` ones read from their files."""
    printed = dict(line.split("=", 1) for line in out.splitlines())
    return {name.removesuffix("_FILE"): Path(value).read_text().strip() if name.endswith("_FILE") else value
            for name, value in printed.items()}


def masked(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the secret replaced by a digest, to compare without a failure printing it."""
    return {**env, "HADAR_S3_SECRET_KEY": hashlib.sha256(env["HADAR_S3_SECRET_KEY"].encode()).hexdigest()[:12]}


def kill(pid: int, marker: str) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while is_running(pid, marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_running(pid, marker)


def crash_both(paths: InfraPaths) -> None:
    kafka, minio = load_kafka(paths), load_minio(paths)
    assert kafka is not None and minio is not None
    kill(kafka.pid, kafka.marker)
    kill(minio.pid, minio.marker)


def write_data(env: dict[str, str]) -> None:
    asyncio.run(_produce(env["HADAR_BOOTSTRAP"]))
    client = s3(env)
    client.make_bucket(BUCKET)
    client.put_object(BUCKET, "kept.txt", io.BytesIO(b"object kept"), length=11)


def assert_data(env: dict[str, str]) -> None:
    assert asyncio.run(_consume(env["HADAR_BOOTSTRAP"])) == [b"record kept"]
    response = s3(env).get_object(BUCKET, "kept.txt")
    try:
        assert response.read() == b"object kept"
    finally:
        response.close()
        response.release_conn()


def s3(env: dict[str, str]) -> Minio:
    return Minio(env["HADAR_S3_ENDPOINT"].removeprefix("http://"), access_key=env["HADAR_S3_ACCESS_KEY"],
                 secret_key=env["HADAR_S3_SECRET_KEY"], secure=False)


async def _produce(bootstrap: str) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(TOPIC, b"record kept", key=b"k")
    finally:
        await producer.stop()


async def _consume(bootstrap: str) -> list[bytes]:
    consumer = AIOKafkaConsumer(TOPIC, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    try:
        batches = await consumer.getmany(timeout_ms=15_000, max_records=10)
        return [record.value for records in batches.values() for record in records if record.value]
    finally:
        await consumer.stop()


def test_restart_after_sigkill_keeps_data_port_and_credentials(
    private_paths: InfraPaths, capsys: pytest.CaptureFixture[str],
) -> None:
    env = start(private_paths, capsys)
    write_data(env)
    cluster_id = load_kafka(private_paths).cluster_id  # type: ignore[union-attr]
    crash_both(private_paths)

    code, out, _ = hadar_infra("status", capsys=capsys)
    assert code == 1
    lines = dict(line.split(": ", 1) for line in out.splitlines())
    assert lines["kafka"].startswith("crashed") and "`hadar infra restart kafka`" in lines["kafka"], out
    assert lines["minio"].startswith("crashed") and "`hadar infra restart minio`" in lines["minio"], out

    for name in ("kafka", "minio"):
        code, _, err = hadar_infra("restart", name, capsys=capsys)
        assert code == 0, err
    assert load_kafka(private_paths).cluster_id == cluster_id  # type: ignore[union-attr]
    code, out, _ = hadar_infra("status", capsys=capsys)
    assert code == 0, out
    code, out, err = hadar_infra("up", capsys=capsys)
    assert code == 0 and "already running" in err, err
    assert masked(settings(out)) == masked(env)
    assert_data(env)

    # A restart of a running server stops it first and comes back the same way.
    code, _, err = hadar_infra("restart", "kafka", capsys=capsys)
    assert code == 0, err
    assert load_kafka(private_paths).port == int(env["HADAR_BOOTSTRAP"].rpartition(":")[2])  # type: ignore[union-attr]
    assert_data(env)


def test_up_after_a_crash_or_down_keep_data_restarts_with_the_same_data(
    private_paths: InfraPaths, capsys: pytest.CaptureFixture[str],
) -> None:
    env = start(private_paths, capsys)
    write_data(env)
    crash_both(private_paths)

    assert masked(start(private_paths, capsys)) == masked(env)
    assert_data(env)

    code, _, err = hadar_infra("down", "--keep-data", capsys=capsys)
    assert code == 0, err
    assert [s.state for s in status(private_paths)] == ["stopped", "stopped"]
    assert masked(start(private_paths, capsys)) == masked(env)
    assert_data(env)

    code, _, err = hadar_infra("down", capsys=capsys)
    assert code == 0, err
    assert not (private_paths.run / "kafka").exists() and not (private_paths.run / "minio").exists()


def test_restart_with_nothing_recorded_says_so(private_paths: InfraPaths,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = hadar_infra("restart", "kafka", capsys=capsys)
    assert code == 1
    assert "nothing to restart" in err and "`hadar infra up`" in err, err


@pytest.mark.parametrize("name", ["kafka", "minio"])
def test_a_new_server_never_replaces_data_it_has_no_record_for(private_paths: InfraPaths, name: str) -> None:
    data = private_paths.server_dir(name) / "data"
    data.mkdir(parents=True)
    (data / "kept").write_text("something a crashed server stored\n")
    with pytest.raises(InfraError, match="hadar infra down"):
        if name == "kafka":
            start_kafka(private_paths, Path("/no/jars/needed"), "java-not-needed")
        else:
            start_minio(private_paths, Path("/no/binary/needed"))
    assert (data / "kept").exists()


def test_a_restart_that_fails_says_why_and_keeps_the_data(private_paths: InfraPaths,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # A broker whose storage it cannot read exits at start: the error names the exit code and
    # the lines of its log that say why, not the stack frames under them (issue 13: a failed
    # `infra restart kafka` once said only "(no output)").
    try:
        server, _ = ensure_kafka(private_paths)
    except InfraError as exc:
        pytest.skip(f"kafka could not start: {exc}")
    kill(server.pid, server.marker)
    meta = Path(server.run_dir) / "data" / "meta.properties"
    meta.write_text(f"version=7\nnode.id=1\ncluster.id={server.cluster_id}\n")
    code, _, err = hadar_infra("restart", "kafka", capsys=capsys)
    assert code == 1
    error = err.splitlines()[-1]   # progress lines come first
    assert error.startswith("hadar infra: error: kafka exited while starting (exit code 1): "), err
    assert "Unknown meta.properties version number 7" in error and "\tat " not in error, err
    assert meta.exists() and load_kafka(private_paths) is not None   # kept for the next try
