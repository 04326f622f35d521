"""An object store on any S3 server (MinIO in development), through the ``minio`` SDK.

Every SDK call blocks, so each runs in a worker thread (``asyncio.to_thread``). Atomicity
comes from S3 itself: a PUT (single or multipart) becomes visible only when complete,
and replaces the previous object in one step. The secret key never leaves the SDK client.
"""

from __future__ import annotations

import asyncio
import builtins
import io
from collections.abc import AsyncIterator
from pathlib import Path

from minio import Minio
from minio.error import S3Error

from shared.config import S3Settings
from shared.store.base import (
    DEFAULT_CHUNK,
    ObjectNotFound,
    prefix_can_match,
    validate_key,
    validate_prefix,
    validate_range,
)

__all__ = ["MinioStore"]

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchObject", "ResourceNotFound"})
_BUCKET_TAKEN_CODES = frozenset({"BucketAlreadyOwnedByYou", "BucketAlreadyExists"})
_PART_SIZE = 16 * 1024 * 1024


class MinioStore:
    """Objects in ``settings.bucket`` on ``settings.endpoint``; :meth:`start` creates the bucket."""

    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings
        self.bucket = settings.bucket
        self._client = Minio(
            settings.host_port,
            access_key=settings.access_key,
            secret_key=settings.secret_key,
            secure=settings.secure,
        )

    def __repr__(self) -> str:
        return f"MinioStore(endpoint={self.settings.endpoint!r}, bucket={self.bucket!r})"

    async def start(self) -> None:
        await asyncio.to_thread(self._ensure_bucket)

    async def stop(self) -> None:
        return None

    # -- writes -------------------------------------------------------------------------

    async def put(self, key: str, data: bytes) -> None:
        validate_key(key)
        payload = bytes(data)
        await asyncio.to_thread(
            self._client.put_object, self.bucket, key, io.BytesIO(payload), len(payload)
        )

    async def put_file(self, key: str, path: Path) -> None:
        validate_key(key)
        await asyncio.to_thread(
            self._client.fput_object, self.bucket, key, str(path), part_size=_PART_SIZE
        )

    async def delete(self, key: str) -> None:
        validate_key(key)
        await asyncio.to_thread(self._client.remove_object, self.bucket, key)

    # -- reads --------------------------------------------------------------------------

    async def get(self, key: str) -> bytes:
        validate_key(key)
        return await asyncio.to_thread(self._read, key, 0, 0)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        validate_key(key)
        validate_range(offset, length)
        if length == 0:
            await self.size(key)  # raises ObjectNotFound for a missing key
            return b""
        return await asyncio.to_thread(self._read, key, offset, length)

    async def size(self, key: str) -> int:
        validate_key(key)
        return await asyncio.to_thread(self._size, key)

    async def get_file(self, key: str, path: Path) -> None:
        validate_key(key)
        await asyncio.to_thread(self._download, key, Path(path))

    async def stream(self, key: str, chunk_size: int = DEFAULT_CHUNK) -> AsyncIterator[bytes]:
        validate_key(key)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        response = await asyncio.to_thread(self._open, key, 0, 0)
        if response is None:
            return
        try:
            while chunk := await asyncio.to_thread(response.read, chunk_size):
                yield chunk
        finally:
            response.close()
            response.release_conn()

    async def list(self, prefix: str = "") -> builtins.list[str]:
        validate_prefix(prefix)
        return await asyncio.to_thread(self._list, prefix)

    async def exists(self, key: str) -> bool:
        try:
            await self.size(key)
        except ObjectNotFound:
            return False
        return True

    # -- blocking helpers (run in a worker thread) ----------------------------------------

    def _ensure_bucket(self) -> None:
        try:
            if self._client.bucket_exists(self.bucket):
                return
        except S3Error as exc:
            # A least-privilege user (shared/security/principals.py) may list only its own
            # prefixes, so it cannot ask about the bucket itself: the setup that made the
            # user made the bucket, and a missing one fails the first operation (NoSuchBucket).
            if exc.code == "AccessDenied":
                return
            raise
        try:
            self._client.make_bucket(self.bucket)
        except S3Error as exc:
            if exc.code not in _BUCKET_TAKEN_CODES:
                raise

    def _open(self, key: str, offset: int, length: int):  # noqa: ANN202 -- urllib3 response
        try:
            return self._client.get_object(self.bucket, key, offset=offset, length=length)
        except S3Error as exc:
            if exc.code in _NOT_FOUND_CODES:
                raise ObjectNotFound(key) from None
            if exc.code == "InvalidRange":
                return None  # offset at or past the end
            raise

    def _read(self, key: str, offset: int, length: int) -> bytes:
        response = self._open(key, offset, length)
        if response is None:
            self._size(key)  # a missing key still raises ObjectNotFound
            return b""
        try:
            return response.read()
        finally:
            response.close()
            response.release_conn()

    def _size(self, key: str) -> int:
        try:
            return int(self._client.stat_object(self.bucket, key).size or 0)
        except S3Error as exc:
            if exc.code in _NOT_FOUND_CODES:
                raise ObjectNotFound(key) from None
            raise

    def _download(self, key: str, path: Path) -> None:
        try:
            self._client.fget_object(self.bucket, key, str(path))
        except S3Error as exc:
            if exc.code in _NOT_FOUND_CODES:
                raise ObjectNotFound(key) from None
            raise

    def _list(self, prefix: str) -> builtins.list[str]:
        if not prefix_can_match(prefix):
            return []  # S3 servers may reject such a prefix; no valid key could match it
        # MinIO refuses a prefix ending in a "." or ".." segment fragment, though keys such as
        # "a/.x" match it: ask for the enclosing "directory" and filter here instead.
        head, sep, tail = prefix.rpartition("/")
        server_prefix = head + sep if tail in (".", "..") else prefix
        objects = self._client.list_objects(self.bucket, prefix=server_prefix or None, recursive=True)
        return sorted(name for obj in objects if (name := obj.object_name) is not None and name.startswith(prefix))
