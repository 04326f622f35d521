"""An object store in a local directory: one file per object, ``/`` in keys = subdirectories.

Atomicity: every write goes to a temporary file in the object's own directory, is
fsynced, then renamed over the object (``os.replace`` is atomic within a directory) and
the directory is fsynced. A reader that opened the old file keeps reading the old bytes.
Temporary names contain ``\\x7f`` (DEL), which no valid key can contain (keys are
printable), so ``list`` can never confuse one with an object, even after a crash.

Limit of a filesystem that S3 does not have: a key cannot be both an object and a
directory on the way to another object (``a`` and ``a/b``); such a put raises
:class:`InvalidKey`.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import secrets
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import BinaryIO

from shared.store.base import (
    DEFAULT_CHUNK,
    InvalidKey,
    ObjectNotFound,
    prefix_can_match,
    validate_key,
    validate_owner,
    validate_prefix,
    validate_range,
)

__all__ = ["LocalStore"]

_TMP_MARK = "\x7f"
_PRUNED_RETRIES = 8     # puts that lose their directory to a concurrent delete's pruning, in a row


class LocalStore:
    """Objects as files under ``root`` (created on :meth:`start`)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    async def stop(self) -> None:
        return None

    # -- writes -------------------------------------------------------------------------

    async def put(self, key: str, data: bytes, *, owner: str | None = None) -> None:
        target = self._path(key)
        validate_owner(owner)   # no principals here: nothing to record it for
        await asyncio.to_thread(self._write_atomic, key, target, lambda out: out.write(data))

    async def put_file(self, key: str, path: Path, *, owner: str | None = None) -> None:
        target = self._path(key)
        validate_owner(owner)

        def copy(out: BinaryIO) -> None:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, out, DEFAULT_CHUNK)

        await asyncio.to_thread(self._write_atomic, key, target, copy)

    async def delete(self, key: str) -> None:
        target = self._path(key)
        await asyncio.to_thread(self._delete, target)

    # -- reads --------------------------------------------------------------------------

    async def get(self, key: str) -> bytes:
        target = self._path(key)
        return await asyncio.to_thread(self._read, key, target, 0, -1)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        validate_range(offset, length)
        target = self._path(key)
        if length == 0:
            if not await self.exists(key):
                raise ObjectNotFound(key)
            return b""
        return await asyncio.to_thread(self._read, key, target, offset, length)

    async def size(self, key: str) -> int:
        target = self._path(key)
        return await asyncio.to_thread(self._size, key, target)

    async def get_file(self, key: str, path: Path) -> None:
        source = self._path(key)
        await asyncio.to_thread(self._copy_out, key, source, Path(path))

    async def stream(self, key: str, chunk_size: int = DEFAULT_CHUNK) -> AsyncIterator[bytes]:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        target = self._path(key)
        handle = await asyncio.to_thread(self._open, key, target)
        try:
            while chunk := await asyncio.to_thread(handle.read, chunk_size):
                yield chunk
        finally:
            handle.close()

    async def list(self, prefix: str = "") -> builtins.list[str]:
        validate_prefix(prefix)
        return await asyncio.to_thread(self._list, prefix)

    async def exists(self, key: str) -> bool:
        target = self._path(key)
        return await asyncio.to_thread(target.is_file)

    # -- blocking helpers (run in a worker thread) ----------------------------------------

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    def _write_atomic(self, key: str, target: Path, write: Callable[[BinaryIO], object]) -> None:
        directory = target.parent
        tmp = directory / f".{_TMP_MARK}{secrets.token_hex(8)}"
        for attempt in range(_PRUNED_RETRIES):
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                raise InvalidKey(f"key {key!r} runs through an existing object (a LocalStore limit)") from None
            if target.is_dir():
                raise InvalidKey(f"key {key!r} is a prefix of existing objects (a LocalStore limit)")
            try:
                out = open(tmp, "xb")  # noqa: SIM115 - retried in a loop; closed below
                break
            except FileNotFoundError:
                # A concurrent delete pruned the directory, empty until our temporary file
                # exists, between mkdir and open: make it again. Once the file is there,
                # rmdir cannot remove it.
                if attempt == _PRUNED_RETRIES - 1:
                    raise
        try:
            with out:
                write(out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        try:
            _fsync_dir(directory)
        except FileNotFoundError:
            pass                            # a later delete of this key pruned the directory

    def _open(self, key: str, target: Path) -> BinaryIO:
        try:
            return open(target, "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFound(key) from None

    def _size(self, key: str, target: Path) -> int:
        with self._open(key, target) as handle:
            return os.fstat(handle.fileno()).st_size

    def _read(self, key: str, target: Path, offset: int, length: int) -> bytes:
        with self._open(key, target) as handle:
            handle.seek(offset)
            return handle.read(length)

    def _copy_out(self, key: str, source: Path, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.part")
        with self._open(key, source) as src:
            try:
                with open(tmp, "xb") as out:
                    shutil.copyfileobj(src, out, DEFAULT_CHUNK)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

    def _delete(self, target: Path) -> None:
        try:
            target.unlink()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return
        _fsync_dir(target.parent)
        # Drop directories the delete left empty, so the name can become an object again.
        directory = target.parent
        while directory != self.root:
            try:
                directory.rmdir()
            except OSError:
                break
            directory = directory.parent

    def _list(self, prefix: str) -> builtins.list[str]:
        if not prefix_can_match(prefix):
            return []
        head, _, _ = prefix.rpartition("/")
        start = self.root.joinpath(*head.split("/")) if head else self.root
        if not start.is_dir():
            return []
        keys: builtins.list[str] = []
        for dirpath, _dirnames, filenames in os.walk(start):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            base = "" if rel == "." else rel + "/"
            keys.extend(base + name for name in filenames if _TMP_MARK not in name)
        return sorted(key for key in keys if key.startswith(prefix))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
