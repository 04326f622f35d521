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

__all__ = ["ObjectStore", "ObjectNotFound", "InvalidKey", "validate_key", "validate_prefix",
           "prefix_can_match", "validate_range"]

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
    * Reading a missing key raises :class:`ObjectNotFound`; a bad key raises
      :class:`InvalidKey`.
    """

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def put(self, key: str, data: bytes) -> None: ...

    async def put_file(self, key: str, path: Path) -> None: ...

    async def get(self, key: str) -> bytes: ...

    async def get_range(self, key: str, offset: int, length: int) -> bytes: ...

    async def size(self, key: str) -> int: ...

    async def get_file(self, key: str, path: Path) -> None: ...

    def stream(self, key: str, chunk_size: int = DEFAULT_CHUNK) -> AsyncIterator[bytes]: ...

    async def list(self, prefix: str = "") -> list[str]: ...

    async def exists(self, key: str) -> bool: ...

    async def delete(self, key: str) -> None: ...
