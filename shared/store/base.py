"""The object-store port: what every store guarantees, its errors, and key validation.

Keys are ``/``-separated paths such as ``checkpoints/j1/3/0.safetensors``. A valid key:

* is a non-empty ``str`` of at most 1024 UTF-8 bytes (the S3 limit),
* does not start with ``/``; has no empty segment (no ``//``, no trailing ``/``),
* has no ``.`` or ``..`` segment, and no segment over 255 UTF-8 bytes (a file name),
* contains only printable characters (``str.isprintable``: no control characters,
  no tabs or newlines; spaces are allowed).

Anything else raises :class:`InvalidKey` before any I/O.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol, runtime_checkable

from shared.errors import HadarError
from shared.wire.records import USER_RE

__all__ = ["ObjectStore", "ObjectNotFound", "StoreDenied", "InvalidKey", "validate_key", "validate_prefix",
           "prefix_can_match", "validate_range", "validate_owner"]

MAX_KEY_BYTES = 1024
MAX_SEGMENT_BYTES = 255
DEFAULT_CHUNK = 1 << 20


class ObjectNotFound(HadarError, KeyError):
    """No object is stored under the key. ``key`` names it.

    Also a ``KeyError``, as for a missing key of a mapping; the contract tests hold every
    store to that.
    """

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"no object {self.key!r}"


class StoreUnavailable(HadarError):
    """The store's server stayed away (or overloaded) longer than the store retries;
    raised retriable: trying again later may succeed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retriable=True)


class StoreDenied(HadarError):
    """The store refused this login the operation: the key is outside what its policy allows,
    or the login is unknown (revoked). ``code`` is the server's word for it (``AccessDenied``,
    ``InvalidAccessKeyId``...). Not retriable: the same call is refused again."""

    def __init__(self, op: str, key: str, code: str) -> None:
        super().__init__(f"{op} {key!r}: refused by the store ({code})")
        self.op, self.key, self.code = op, key, code


class InvalidKey(HadarError):
    """A key that breaks the key rules (see the module docstring). The message says which."""


def validate_key(key: object) -> str:
    """Return ``key`` unchanged if it is a valid object key, else raise :class:`InvalidKey`."""
    if not isinstance(key, str):
        raise InvalidKey(f"object key must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidKey("object key must not be empty")
    if not key.isprintable():
        raise InvalidKey(f"object key {key!r} contains a non-printable character")
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise InvalidKey(f"object key is longer than {MAX_KEY_BYTES} bytes")
    if key.startswith("/"):
        raise InvalidKey(f"object key {key!r} must not start with '/'")
    for segment in key.split("/"):
        if not segment:
            raise InvalidKey(f"object key {key!r} has an empty segment")
        if segment in (".", ".."):
            raise InvalidKey(f"object key {key!r} has a {segment!r} segment")
        if len(segment.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise InvalidKey(f"object key {key!r} has a segment longer than {MAX_SEGMENT_BYTES} bytes")
    return key


def validate_prefix(prefix: object) -> str:
    """Return ``prefix`` if it can start a valid key (or is empty), else raise :class:`InvalidKey`."""
    if not isinstance(prefix, str):
        raise InvalidKey(f"key prefix must be a str, got {type(prefix).__name__}")
    if prefix and (not prefix.isprintable() or prefix.startswith("/")):
        raise InvalidKey(f"key prefix {prefix!r} must be printable and not start with '/'")
    return prefix


def prefix_can_match(prefix: str) -> bool:
    """Whether any valid key can start with ``prefix``: its complete segments (those before
    the last ``/``) must themselves form a valid key."""
    head, sep, _ = prefix.rpartition("/")
    if not sep:
        return True
    try:
        validate_key(head)
    except InvalidKey:
        return False
    return True


def validate_range(offset: int, length: int) -> None:
    """Raise ``ValueError`` unless ``offset`` and ``length`` are non-negative ints."""
    if offset < 0 or length < 0:
        raise ValueError(f"offset and length must be >= 0, got offset={offset} length={length}")


def validate_owner(owner: object) -> None:
    """Raise ``ValueError`` unless ``owner`` is None or a user name (``USER_RE``)."""
    if owner is not None and (not isinstance(owner, str) or USER_RE.fullmatch(owner) is None):
        raise ValueError(f"object owner must be a user name (1-63 of a-z, 0-9, '.', '_', '-'), got {owner!r}")


@runtime_checkable
class ObjectStore(Protocol):
    """A flat namespace of immutable-once-written byte objects.

    Guarantees shared by every implementation (the contract tests check them):

    * ``put``/``put_file`` are atomic: a concurrent reader sees the old object or the new
      one, never a mix or a prefix; ``list`` shows only complete objects.
    * ``get_range(key, offset, length)`` returns ``data[offset:offset + length]``
      (shorter, or empty, past the end).
    * ``list(prefix)`` returns every key starting with ``prefix`` (plain string prefix),
      sorted.
    * ``delete`` of a missing key does nothing.
    * ``owner`` (``put``/``put_file``) names the user the object belongs to; a bad one raises
      ``ValueError`` before any I/O. A store with access control records it with the object,
      in the same write, for its policies (MinioStore: the ``owner`` tag that
      ``shared.security.principals.user_s3_policy`` reads); LocalStore has no principals and
      records nothing.
    * Reading a missing key raises :class:`ObjectNotFound`; a bad key raises
      :class:`InvalidKey`; what the store's policy refuses this login raises
      :class:`StoreDenied`.
    """

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def put(self, key: str, data: bytes, *, owner: str | None = None) -> None: ...

    async def put_file(self, key: str, path: Path, *, owner: str | None = None) -> None: ...

    async def get(self, key: str) -> bytes: ...

    async def get_range(self, key: str, offset: int, length: int) -> bytes: ...

    async def size(self, key: str) -> int: ...

    async def get_file(self, key: str, path: Path) -> None: ...

    def stream(self, key: str, chunk_size: int = DEFAULT_CHUNK) -> AsyncIterator[bytes]: ...

    async def list(self, prefix: str = "") -> list[str]: ...

    async def exists(self, key: str) -> bool: ...

    async def delete(self, key: str) -> None: ...
