"""An object store on any S3 server (MinIO in development), through the ``minio`` SDK.

Every SDK call blocks, so each runs in a worker thread (``asyncio.to_thread``). Atomicity
comes from S3 itself: a PUT (single or multipart) becomes visible only when complete,
and replaces the previous object in one step. The secret key never leaves the SDK client.

Outages: every call that fails because the server is away or overloaded (connection
refused or reset, a 5xx, ``ServiceUnavailable``/``SlowDown``) is retried with back-off
(:func:`retry_delays`) for up to ``retry_for_s`` (default :data:`OUTAGE_RETRY_S`, 90 s: a
MinIO restart after a minute down costs no checkpoint), then raises
:class:`~shared.store.base.StoreUnavailable` (retriable). Every retried call is
idempotent: a PUT replaces the whole object, reads and deletes repeat harmlessly. An
answer such as "no such key" is never retried.
"""

from __future__ import annotations

import asyncio
import builtins
import io
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog
import urllib3
from minio import Minio
from minio.commonconfig import Tags
from minio.error import S3Error, ServerError

from shared.clock import Clock, SystemClock
from shared.domain.layout import OWNER_TAG
from shared.store.base import (
    DEFAULT_CHUNK,
    ObjectNotFound,
    StoreDenied,
    StoreUnavailable,
    prefix_can_match,
    validate_key,
    validate_owner,
    validate_prefix,
    validate_range,
)
from shared.store.settings import S3Settings

__all__ = ["MinioStore", "OUTAGE_RETRY_S", "retry_delays", "outage"]

T = TypeVar("T")
OUTAGE_RETRY_S = 90.0      # how long a call keeps retrying while the server is away
FIRST_DELAY_S = 0.25
MAX_DELAY_S = 5.0
_OUTAGE_CODES = frozenset({"ServiceUnavailable", "SlowDown", "XMinioServerNotInitialized", "InternalError",
                           "RequestTimeout", "XMinioReadQuorum", "XMinioWriteQuorum"})

_DENIED_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchObject", "ResourceNotFound"})
_BUCKET_TAKEN_CODES = frozenset({"BucketAlreadyOwnedByYou", "BucketAlreadyExists"})
_PART_SIZE = 16 * 1024 * 1024


def retry_delays(retry_for_s: float) -> list[float]:
    """The back-off between attempts: from :data:`FIRST_DELAY_S` doubling up to
    :data:`MAX_DELAY_S`, as many as fit in ``retry_for_s`` together."""
    delays: list[float] = []
    delay = FIRST_DELAY_S
    while sum(delays) + delay <= retry_for_s:
        delays.append(delay)
        delay = min(2 * delay, MAX_DELAY_S)
    return delays


def outage(exc: BaseException) -> bool:
    """Whether ``exc`` says the server is away or overloaded (worth retrying), not an answer."""
    if isinstance(exc, S3Error):
        return exc.code in _OUTAGE_CODES
    return isinstance(exc, (ServerError, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError))


def _owner_tags(owner: str | None) -> Tags | None:
    """The object tags that name ``owner`` (sent with the PUT itself: the object never
    exists without them)."""
    validate_owner(owner)
    if owner is None:
        return None
    tags = Tags.new_object_tags()
    tags[OWNER_TAG] = owner
    return tags


def _http_client() -> urllib3.PoolManager:
    """The SDK's client, but with few quick retries of its own: the store's back-off
    (:func:`retry_delays`) is what rides out an outage, and a dead port fails fast."""
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=10, read=300), maxsize=10,
        retries=urllib3.Retry(total=2, backoff_factor=0.1, status_forcelist=[500, 502, 503, 504]))


class MinioStore:
    """Objects in ``settings.bucket`` on ``settings.endpoint``; :meth:`start` creates the bucket.

    ``retry_for_s``: how long a call retries while the server is away (module docstring);
    ``clock``: what the back-off sleeps on."""

    def __init__(self, settings: S3Settings, *, retry_for_s: float = OUTAGE_RETRY_S,
                 clock: Clock | None = None) -> None:
        self.settings = settings
        self.bucket = settings.bucket
        self._delays = retry_delays(retry_for_s)
        self._clock = clock or SystemClock()
        self._log = structlog.get_logger(__name__).bind(component="minio_store")
        self._client = Minio(
            settings.host_port,
            access_key=settings.access_key,
            secret_key=settings.secret_key,
            secure=settings.secure,
            http_client=_http_client() if not settings.secure else None,
        )

    def __repr__(self) -> str:
        return f"MinioStore(endpoint={self.settings.endpoint!r}, bucket={self.bucket!r})"

    async def _call(self, what: str, key: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in a worker thread, retried across an outage."""
        for attempt, delay in enumerate([*self._delays, None]):
            try:
                return await asyncio.to_thread(fn, *args, **kwargs)
            except Exception as exc:
                if isinstance(exc, S3Error) and exc.code in _DENIED_CODES:
                    raise StoreDenied(what, key, exc.code) from None
                if not outage(exc):
                    raise
                if delay is None:
                    raise StoreUnavailable(f"{what} {key!r}: server away for {sum(self._delays):.0f} s: "
                                           f"{type(exc).__name__}: {str(exc)[:200]}") from exc
                self._log.warning("store.retry", op=what, key=key, attempt=attempt + 1, retry_in_s=delay,
                                  error=f"{type(exc).__name__}: {str(exc)[:200]}")
                await self._clock.sleep(delay)
        raise AssertionError("unreachable")

    async def start(self) -> None:
        await self._call("create bucket", self.bucket, self._ensure_bucket)

    async def stop(self) -> None:
        return None

    # -- writes -------------------------------------------------------------------------

    async def put(self, key: str, data: bytes, *, owner: str | None = None) -> None:
        validate_key(key)
        tags = _owner_tags(owner)
        payload = bytes(data)
        await self._call("put", key, lambda: self._client.put_object(
            self.bucket, key, io.BytesIO(payload), len(payload), tags=tags))

    async def put_file(self, key: str, path: Path, *, owner: str | None = None) -> None:
        validate_key(key)
        tags = _owner_tags(owner)
        await self._call("put", key, self._client.fput_object, self.bucket, key, str(path), part_size=_PART_SIZE,
                         tags=tags)

    async def delete(self, key: str) -> None:
        validate_key(key)
        await self._call("delete", key, self._client.remove_object, self.bucket, key)

    # -- reads --------------------------------------------------------------------------

    async def get(self, key: str) -> bytes:
        validate_key(key)
        return await self._call("get", key, self._read, key, 0, 0)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        validate_key(key)
        validate_range(offset, length)
        if length == 0:
            await self.size(key)  # raises ObjectNotFound for a missing key
            return b""
        return await self._call("get", key, self._read, key, offset, length)

    async def size(self, key: str) -> int:
        validate_key(key)
        return await self._call("stat", key, self._size, key)

    async def get_file(self, key: str, path: Path) -> None:
        validate_key(key)
        await self._call("get", key, self._download, key, Path(path))

    async def stream(self, key: str, chunk_size: int = DEFAULT_CHUNK) -> AsyncIterator[bytes]:
        validate_key(key)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        response = await self._call("get", key, self._open, key, 0, 0)
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
        return await self._call("list", prefix, self._list, prefix)

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

    def _open(self, key: str, offset: int, length: int) -> urllib3.BaseHTTPResponse | None:
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
