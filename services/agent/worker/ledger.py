"""What this node wrote under its copies' checkpoint keys: a copy resumes only from its own bytes.

A copy started again in a round it already worked in (its Assignment redelivered after an
agent restart) resumes from the checkpoint at its own key, ``checkpoint_key(job, round,
copy)``. That key is not only this node's to write: in the dev setup anyone who reaches the
store can write it, and with ``--secure`` every node shares the agent principal. A file
planted there, with metadata naming the copy and claiming its steps, was taken for the
copy's progress: the round "finished" seconds after it started and the tracker averaged
the planted weights in (issue 26).

Guarantee: :meth:`WrittenLedger.wrote` is true only for a file whose SHA-256 equals the
digest :meth:`WrittenLedger.record` last recorded for that key on this node. The digest is
recorded before the upload: a crash in between leaves a digest that no stored object has,
which is harmless (the copy starts the round over). Records live on the node's own disk,
one small file per key (named by the key's hash, so no key can name a path), and the
oldest are dropped past :data:`MAX_RECORDS` (a record only matters while its round can
still be redelivered).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

__all__ = ["WrittenLedger", "file_sha256", "default_ledger_dir", "own_checkpoint", "MAX_RECORDS"]

T = TypeVar("T")

MAX_RECORDS = 10_000
_CHUNK = 1 << 20


def default_ledger_dir(node_id: str) -> Path:
    return Path.home() / ".cache" / "hadar" / "agent" / node_id / "written"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class WrittenLedger:
    """Checkpoint key -> SHA-256 of the bytes this node last wrote there."""

    def __init__(self, root: Path, *, max_records: int = MAX_RECORDS) -> None:
        self.root = root
        self.max_records = max_records

    def _path(self, key: str) -> Path:
        return self.root / f"{hashlib.sha256(key.encode()).hexdigest()}.json"

    def record(self, key: str, path: Path) -> str:
        """Record ``path``'s digest as what this node writes at ``key``; the digest."""
        sha = file_sha256(path)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".record-")
        with os.fdopen(fd, "w") as out:
            json.dump({"key": key, "sha256": sha}, out)
        os.replace(tmp, self._path(key))
        self._prune()
        return sha

    def recorded(self, key: str) -> str | None:
        """The digest recorded for ``key`` (None: this node never wrote it, or forgot)."""
        try:
            entry = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("sha256"), str):
            return None
        return str(entry["sha256"])

    def wrote(self, key: str, path: Path) -> bool:
        """Whether ``path`` holds exactly the bytes this node last recorded writing at ``key``."""
        want = self.recorded(key)
        return want is not None and file_sha256(path) == want

    def _prune(self) -> None:
        entries = list(self.root.glob("*.json"))
        if len(entries) <= self.max_records:
            return
        entries.sort(key=lambda p: p.stat().st_mtime)
        for old in entries[: len(entries) - self.max_records]:
            old.unlink(missing_ok=True)


class _Store(Protocol):
    def exists(self, key: str) -> bool: ...

    def get_file(self, key: str, path: Path) -> None: ...


def own_checkpoint(store: _Store, key: str, ledger: WrittenLedger, read: Callable[[Path], T],
                   not_ours: Callable[[], None]) -> T | None:
    """``read`` of the object at ``key`` if this node wrote exactly it; None if there is none,
    or (after calling ``not_ours``) if there is one this node did not write."""
    if not store.exists(key):
        return None
    with tempfile.TemporaryDirectory(prefix="hadar-own-") as tmp:
        path = Path(tmp) / "checkpoint.safetensors"
        store.get_file(key, path)
        if not ledger.wrote(key, path):
            not_ours()
            return None
        return read(path)
