"""Session fixtures for the real Kafka and S3 server, and the object stores.

``kafka_bootstrap`` and ``s3_settings`` use ``HADAR_BOOTSTRAP`` / ``HADAR_S3_*`` when set
(``make test`` sets them after ``hadar infra up``). ``secure_servers`` always starts its own
secured broker and MinIO (``hadar infra up --secure``) in a private run directory, only
in sessions that run a test using it. Otherwise each starts its server once
per session through :mod:`devinfra`, in a private run directory, and stops it at the
end. A server that cannot start fails the test when ``CI=true`` (never a skip there) and
skips it elsewhere, with the reason.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from hypothesis import settings
from minio import Minio

from devinfra import (
    InfraError,
    InfraPaths,
    down,
    ensure_kafka,
    ensure_minio,
    stop_server,
    up,
)
from devinfra.kafka_config import EXTRA_PROPERTIES
from devinfra.secure_mode import apply
from shared.bus.settings import kafka_from_env
from shared.errors import HadarError
from shared.store import LocalStore, MinioStore, ObjectStore
from shared.store.settings import S3Settings, s3_from_env
from tests.required import unavailable

# Property tests draw the same examples on every run: a red run is reproducible, and a
# landing never depends on which examples a random draw happened to try. Explore with
# HYPOTHESIS_PROFILE=explore (random draws, more examples) when changing a rule.
settings.register_profile("suite", derandomize=True)
settings.register_profile("explore", derandomize=False, max_examples=400)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


@pytest.fixture(scope="session")
def infra_paths(tmp_path_factory: pytest.TempPathFactory) -> InfraPaths:
    """Cache shared with ``hadar infra`` (binaries, jars); a run directory private to this session."""
    return InfraPaths(cache=InfraPaths.from_env().cache, run=tmp_path_factory.mktemp("infra") / "run")


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest) -> Iterator[str]:
    """``host:port`` of a real Kafka broker for the whole session."""
    settings = kafka_from_env()
    if settings is not None:
        yield settings.bootstrap
        return
    paths: InfraPaths = request.getfixturevalue("infra_paths")
    try:
        server, _ = ensure_kafka(paths)
    except InfraError as exc:
        unavailable(f"kafka could not start: {exc}")
    try:
        yield server.bootstrap
    finally:
        stop_server(paths, "kafka")


@pytest.fixture(scope="session")
def s3_settings(request: pytest.FixtureRequest) -> Iterator[S3Settings]:
    """Settings of a real S3 server (MinIO) for the whole session."""
    settings = s3_from_env()
    if settings is not None:
        yield settings
        return
    paths: InfraPaths = request.getfixturevalue("infra_paths")
    try:
        server, _ = ensure_minio(paths)
    except InfraError as exc:
        unavailable(f"minio could not start: {exc}")
    try:
        yield S3Settings(endpoint=server.endpoint, access_key=server.access_key,
                         secret_key=server.secret_key)
    finally:
        stop_server(paths, "minio")


@dataclass(frozen=True, kw_only=True)
class SecureServers:
    """A secured broker and MinIO, and each principal's ``HADAR_*`` settings (from its env file)."""

    paths: InfraPaths
    env: dict[str, dict[str, str]] = field(repr=False)
    secrets: frozenset[str] = field(repr=False)
    reauth_ms: int   # the broker's connections.max.reauth.ms


# How often the test broker makes every connection authenticate again (a deployment's is
# devinfra.broker_auth.REAUTH_MS, minutes): short, so that a revoked login's open connection
# is cut within a test, and so that every secured test's clients ride out the broker closing
# their connections every few seconds, as a deployment's do every few minutes.
SECURE_REAUTH_MS = 8_000


@pytest.fixture(scope="session")
def secure_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureServers]:
    """``hadar infra up --secure`` in a private run directory, for the whole session."""
    paths = InfraPaths(cache=InfraPaths.from_env().cache, run=tmp_path_factory.mktemp("secure") / "run")
    paths.run.mkdir(parents=True, exist_ok=True)
    (paths.run / EXTRA_PROPERTIES).write_text(f"connections.max.reauth.ms={SECURE_REAUTH_MS}\n")
    try:
        written = apply(paths, up(paths, secure=True))
    except (InfraError, HadarError) as exc:
        down(paths)
        unavailable(f"secured kafka/minio could not start: {exc}")
    env = {name: dict(line.split("=", 1) for line in path.read_text().splitlines()) for name, path in written.items()}
    secrets = frozenset(v for e in env.values() for k, v in e.items() if k.endswith(("PASSWORD", "SECRET_KEY")))
    try:
        yield SecureServers(paths=paths, env=env, secrets=secrets, reauth_ms=SECURE_REAUTH_MS)
    finally:
        down(paths)


@pytest.fixture
async def local_store(tmp_path: Path) -> LocalStore:
    """A started LocalStore in a fresh directory."""
    store = LocalStore(tmp_path / "store")
    await store.start()
    return store


@pytest.fixture(params=["local", pytest.param("minio", marks=pytest.mark.s3)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ObjectStore]:
    """A started, empty store of each kind; a MinioStore gets its own bucket, removed afterwards."""
    if request.param == "local":
        local = LocalStore(tmp_path / "store")
        await local.start()
        yield local
        return
    settings = replace(request.getfixturevalue("s3_settings"), bucket=f"test-{uuid.uuid4().hex}")
    remote = MinioStore(settings)
    await remote.start()
    try:
        yield remote
    finally:
        await remote.stop()
        await asyncio.to_thread(_remove_bucket, settings)


def _remove_bucket(settings: S3Settings) -> None:
    client = Minio(settings.host_port, access_key=settings.access_key,
                   secret_key=settings.secret_key, secure=settings.secure)
    for obj in client.list_objects(settings.bucket, recursive=True):
        if obj.object_name is not None:
            client.remove_object(settings.bucket, obj.object_name)
    client.remove_bucket(settings.bucket)


@pytest.fixture
def requires_landlock() -> None:
    """Users' code runs only in the Landlock sandbox (the harness fails closed without it):
    its tests fail under CI where the kernel lacks it, and skip elsewhere."""
    from services.agent.usercode.sandbox import landlock_abi

    if landlock_abi() == 0:
        unavailable("Landlock is unavailable in this kernel: the harness refuses to start any trainer")
