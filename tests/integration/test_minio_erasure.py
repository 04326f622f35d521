"""MinIO over four drives (``hadar infra up --drives 4``) keeps serving with one lost, and
heals (issue 28).

Each test runs its own MinIO (one erasure set: 2 data + 2 parity shards per object) in a
private run directory and writes through the project's :class:`MinioStore`. A drive is
"lost" by renaming its directory away and leaving a plain file in its place: given an empty
or missing path, MinIO would make a fresh directory there at once and heal it, which is a
replacement, not a loss. ``mc admin heal`` is not available here; what is checked instead:

* a lost drive: every object reads back unchanged and new objects are written;
* an empty drive put in its place: MinIO formats and heals it by itself, without reads --
  every object's ``xl.meta`` appears on it -- and then, with the two *other* drives taken
  away as well, every object still reads back: its shards on the healed drive are real;
* the lost drive coming back with what it had: the objects it missed are healed onto it
  when they are read.

Each test prints what it measured (``pytest -s``).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from devinfra import InfraError, InfraPaths, MinioServer, ensure_minio, stop_server
from shared.store import MinioStore
from shared.store.settings import S3Settings
from tests.required import unavailable

pytestmark = [pytest.mark.s3, pytest.mark.slow]

BUCKET = "erasure-check"
OBJECTS = 20
HEAL_LIMIT_S = 40.0   # MinIO looks for fresh drives every 10 s or so
# Large enough for MinIO to keep the shards in part files rather than inline in xl.meta.
OBJECT_BYTES = 256 * 1024


@pytest.fixture
def erasure_minio(tmp_path: Path) -> Iterator[MinioServer]:
    paths = InfraPaths(cache=InfraPaths.from_env().cache, run=tmp_path / "run")
    try:
        try:
            server, _ = ensure_minio(paths, drives=4)
        except InfraError as exc:
            unavailable(f"minio over four drives could not start: {exc}")
        yield server
    finally:
        stop_server(paths, "minio")


@pytest.fixture
async def store(erasure_minio: MinioServer) -> AsyncIterator[MinioStore]:
    # A short outage retry: with too few drives a call must fail here, not retry for 90 s.
    store = MinioStore(S3Settings(endpoint=erasure_minio.endpoint, access_key=erasure_minio.access_key,
                                  secret_key=erasure_minio.secret_key, bucket=BUCKET), retry_for_s=10.0)
    await store.start()
    try:
        yield store
    finally:
        await store.stop()


def content(key: str) -> bytes:
    return (key.encode() * (OBJECT_BYTES // len(key) + 1))[:OBJECT_BYTES]


async def write(store: MinioStore, keys: list[str]) -> None:
    for key in keys:
        await store.put(key, content(key))


async def assert_readable(store: MinioStore, keys: list[str]) -> None:
    for key in keys:
        assert await store.get(key) == content(key), key


def lose(drive: Path) -> Path:
    """Take ``drive`` away; returns where its contents went."""
    kept = drive.with_name(drive.name + ".lost")
    os.rename(drive, kept)
    drive.write_text("this drive is lost\n")
    return kept


def healed(drive: Path, keys: list[str]) -> bool:
    return all((drive / BUCKET / key / "xl.meta").is_file() for key in keys)


def wait_healed(drive: Path, keys: list[str]) -> float:
    began = time.monotonic()
    while not healed(drive, keys):
        missing = [key for key in keys if not (drive / BUCKET / key / "xl.meta").is_file()]
        assert time.monotonic() - began < HEAL_LIMIT_S, f"{len(missing)} objects not healed onto {drive}"
        time.sleep(0.2)
    return time.monotonic() - began


async def test_a_lost_drive_costs_no_object_and_a_new_one_is_healed_by_itself(
        erasure_minio: MinioServer, store: MinioStore) -> None:
    drives = erasure_minio.drive_dirs
    assert len(drives) == 4
    before = [f"checkpoints/job{i}/0/n0/0.safetensors" for i in range(OBJECTS)]
    await write(store, before)

    lose(drives[1])
    await assert_readable(store, before)
    during = [f"models/job{i}/1.safetensors" for i in range(OBJECTS // 2)]
    await write(store, during)
    await assert_readable(store, during)

    drives[1].unlink()
    drives[1].mkdir()     # a new, empty drive where the lost one was
    heal_s = wait_healed(drives[1], before + during)

    for other in drives[2:]:
        lose(other)
    await assert_readable(store, before + during)   # from drive1 and the healed drive2 alone
    print(f"\nlost drive2: {len(before)} objects read, {len(during)} written; an empty drive2 was healed "
          f"in {heal_s:.1f}s; with drive3 and drive4 gone too, every object read from drive1 + drive2")


async def test_a_drive_that_returns_gets_what_it_missed_when_read(
        erasure_minio: MinioServer, store: MinioStore) -> None:
    drive = erasure_minio.drive_dirs[1]
    before = [f"checkpoints/job{i}/0/n0/0.safetensors" for i in range(OBJECTS)]
    await write(store, before)
    kept = lose(drive)
    during = [f"models/job{i}/1.safetensors" for i in range(OBJECTS // 2)]
    await write(store, during)

    assert healed(kept, before) and not any((kept / BUCKET / key).exists() for key in during)

    drive.unlink()
    os.rename(kept, drive)
    began = time.monotonic()
    await assert_readable(store, before + during)
    wait_healed(drive, during)
    heal_s = time.monotonic() - began
    print(f"\ndrive2 returned: the {len(during)} objects it missed were healed onto it {heal_s:.1f}s after "
          "they were first read")
