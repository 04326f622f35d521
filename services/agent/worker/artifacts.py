"""The node's cache of extracted bundles (users' code and datasets), shared by its workers.

Layout under ``root``::

    .lock                   held exclusively while an entry is opened for use, discarded or evicted
    <digest>/fetch.lock     held exclusively while the bundle is downloaded, verified and extracted
    <digest>/inuse          held shared by every process using the entry, for as long as it does
    <digest>/tree/          the extracted bundle, read-only
    <digest>/complete       written last: {"bytes": ..., "files": ...}; its mtime is the last use

Guarantees: a bundle is downloaded at most once per node at a time, however many workers ask
for it together; the archive is checked (size, SHA-256) before anything is extracted, and
deleted once it is; a folder handed out is complete and is not evicted while a process uses it
(:meth:`ArtifactCache.use`). After an entry is added, the least recently used entries not in
use are deleted until the cached bytes are within ``max_bytes``; an entry larger than that on
its own is still served, and evicted later once unused. A failed download or verification
leaves nothing behind (unless another process is waiting for the same digest, which then
downloads it itself). The locks are ``flock``: processes and threads alike, one node only.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shared.domain.bundles import BundleLimits, check_digest, extract, remove_tree, verify

__all__ = ["ArtifactCache", "Fetch"]

Fetch = Callable[[Path], None]    # writes the store object to the path it is given

LOCK, FETCH_LOCK, INUSE, TREE, COMPLETE = ".lock", "fetch.lock", "inuse", "tree", "complete"
_ARCHIVE, _PARTIAL, _MARKER_TMP = "archive.partial", "tree.partial", "complete.partial"


@dataclass(frozen=True, kw_only=True)
class _Cached:
    digest: str
    last_used_ns: int
    nbytes: int


def _open_lock(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _tree_bytes(tree: Path) -> int:
    return sum(os.lstat(os.path.join(folder, name)).st_size
               for folder, _, names in os.walk(tree) for name in names)


def _touch(marker: Path) -> bool:
    """Mark the entry used now; False if it is not complete. Explicit nanoseconds: a file's
    own times come from a coarse clock, and ties would blur the LRU order."""
    now = time.time_ns()
    try:
        os.utime(marker, ns=(now, now))
    except FileNotFoundError:
        return False
    return True


class ArtifactCache:
    """Extracted bundles under ``root``, at most about ``max_bytes`` of them (see the module)."""

    def __init__(self, root: Path, *, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.root = root
        self.max_bytes = max_bytes
        root.mkdir(parents=True, exist_ok=True)

    def get(self, digest: str, size: int, fetch: Fetch, *, limits: BundleLimits) -> Path:
        """The read-only folder of bundle ``digest`` (``size`` bytes), fetched first if it is
        not cached. Nothing keeps it from a later eviction: prefer :meth:`use`."""
        with self.use(digest, size, fetch, limits=limits) as tree:
            return tree

    @contextmanager
    def use(self, digest: str, size: int, fetch: Fetch, *, limits: BundleLimits) -> Iterator[Path]:
        """The read-only folder of bundle ``digest``, kept from eviction until the block ends.
        ``fetch(path)`` must write the archive to ``path``; it runs only if the bundle is not
        cached, and its exceptions pass through. A download that fails verification raises
        BundleError, as does a bundle over ``limits``."""
        entry = self.root / check_digest(digest)
        inuse = self._hold(entry)
        try:
            added = not _touch(entry / COMPLETE) and self._fill(entry, digest, size, fetch, limits)
        except BaseException:
            os.close(inuse)
            self._discard(entry)
            raise
        try:
            if added:
                self._evict(keep=digest)
            yield entry / TREE
        finally:
            os.close(inuse)

    def _hold(self, entry: Path) -> int:
        """A descriptor holding ``entry`` in use (a shared flock on its ``inuse`` file). Taken
        under the cache lock, so an eviction never sees the entry free while it is being taken."""
        with _locked(self.root / LOCK):
            entry.mkdir(exist_ok=True)
            fd = _open_lock(entry / INUSE)
            fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def _fill(self, entry: Path, digest: str, size: int, fetch: Fetch, limits: BundleLimits) -> bool:
        """Download, verify and extract the bundle unless another process did while this one
        waited for the entry's fetch lock; True if this call added it."""
        with _locked(entry / FETCH_LOCK):
            if _touch(entry / COMPLETE):
                return False
            self._clear_partials(entry)
            try:
                archive, partial, tree = entry / _ARCHIVE, entry / _PARTIAL, entry / TREE
                fetch(archive)
                verify(archive, digest=digest, size=size)
                files = extract(archive, partial, limits=limits)
                archive.unlink()
                os.rename(partial, tree)
                marker = entry / _MARKER_TMP
                marker.write_text(json.dumps({"bytes": _tree_bytes(tree), "files": files}), encoding="utf-8")
                _touch(marker)
                os.rename(marker, entry / COMPLETE)
            except BaseException:
                self._clear_partials(entry)
                raise
        return True

    @staticmethod
    def _clear_partials(entry: Path) -> None:
        """Remove what an interrupted fill left: a tree without its marker is incomplete."""
        for name in (_ARCHIVE, _PARTIAL, _MARKER_TMP, TREE):
            remove_tree(entry / name)

    def _discard(self, entry: Path) -> None:
        """Delete the incomplete ``entry`` unless another process holds it in use."""
        with _locked(self.root / LOCK):
            self._remove_if_idle(entry)

    def _remove_if_idle(self, entry: Path) -> bool:
        """Delete ``entry`` if no process holds it in use; the caller holds the cache lock."""
        try:
            fd = _open_lock(entry / INUSE)
        except FileNotFoundError:
            return False      # the entry is gone already
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            remove_tree(entry)
        finally:
            os.close(fd)
        return True

    def _entries(self) -> tuple[list[_Cached], list[Path]]:
        """The complete entries, least recently used first, and the incomplete ones."""
        complete: list[_Cached] = []
        incomplete: list[Path] = []
        for entry in self.root.iterdir():
            if len(entry.name) != 64 or not entry.is_dir():
                continue
            marker = entry / COMPLETE
            try:
                nbytes = int(json.loads(marker.read_text(encoding="utf-8"))["bytes"])
                complete.append(_Cached(digest=entry.name, last_used_ns=marker.stat().st_mtime_ns, nbytes=nbytes))
            except (OSError, ValueError, KeyError, TypeError):
                incomplete.append(entry)
        complete.sort(key=lambda c: (c.last_used_ns, c.digest))
        return complete, incomplete

    def _evict(self, *, keep: str) -> None:
        """Delete unused entries, least recently used first, until the total is within
        ``max_bytes``; never ``keep``, never one in use. Incomplete entries nobody works on
        (left by a process that died) go too."""
        with _locked(self.root / LOCK):
            complete, incomplete = self._entries()
            for entry in incomplete:
                if entry.name != keep:
                    self._remove_if_idle(entry)
            total = sum(c.nbytes for c in complete)
            for cached in complete:
                if total <= self.max_bytes:
                    break
                if cached.digest != keep and self._remove_if_idle(self.root / cached.digest):
                    total -= cached.nbytes

    def cached_bytes(self) -> int:
        """The bytes of every complete entry (their extracted files)."""
        with _locked(self.root / LOCK):
            return sum(c.nbytes for c in self._entries()[0])
