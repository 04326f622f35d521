"""The node's bundle cache: fetched once, verified before extraction, LRU eviction that spares
entries in use, and nothing left behind by a failed download."""

from __future__ import annotations

import io
import multiprocessing
import os
import stat
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from services.agent.worker.artifacts import ArtifactCache
from shared.domain.bundles import CODE_LIMITS, BundleError, PackedBundle, pack, sha256_file

KB = 1024


def bundle(tmp_path: Path, name: str, *, payload: bytes = b"", fill: int = 0) -> PackedBundle:
    root = tmp_path / "src" / name
    root.mkdir(parents=True)
    (root / "train.py").write_text(f"print({name!r})\n")
    (root / "blob.bin").write_bytes(payload or bytes([len(name)]) * fill)
    return pack(root, tmp_path / f"{name}.tar", limits=CODE_LIMITS)


class Fetcher:
    """Copies a bundle's bytes to the path it is given, and counts the calls."""

    def __init__(self, source: Path, *, data: bytes | None = None) -> None:
        self.source, self.data, self.calls = source, data, 0

    def __call__(self, path: Path) -> None:
        self.calls += 1
        path.write_bytes(self.source.read_bytes() if self.data is None else self.data)


def get(cache: ArtifactCache, b: PackedBundle, fetch: Callable[[Path], None]) -> Path:
    return cache.get(b.digest, b.size, fetch, limits=CODE_LIMITS)


def cached(cache: ArtifactCache) -> set[str]:
    return {p.name for p in cache.root.iterdir() if len(p.name) == 64}


def test_a_second_get_is_served_without_fetching(tmp_path: Path) -> None:
    b = bundle(tmp_path, "a", fill=100)
    cache = ArtifactCache(tmp_path / "cache", max_bytes=10 * KB)
    fetch = Fetcher(b.path)
    tree = get(cache, b, fetch)
    assert tree == cache.root / b.digest / "tree"
    assert (tree / "train.py").read_text() == "print('a')\n" and (tree / "blob.bin").read_bytes() == b"\1" * 100
    assert stat.S_IMODE(tree.stat().st_mode) == 0o555 and stat.S_IMODE((tree / "train.py").stat().st_mode) == 0o444
    assert get(cache, b, fetch) == tree and fetch.calls == 1
    assert get(ArtifactCache(cache.root, max_bytes=10 * KB), b, fetch) == tree and fetch.calls == 1
    assert sorted(p.name for p in tree.parent.iterdir()) == ["complete", "fetch.lock", "inuse", "tree"]
    assert cache.cached_bytes() == len("print('a')\n") + 100


@pytest.mark.parametrize("digest", ["../" + "a" * 61, "A" * 64, "a" * 63, ""])
def test_a_digest_must_be_64_lowercase_hex_characters(tmp_path: Path, digest: str) -> None:
    cache = ArtifactCache(tmp_path / "cache", max_bytes=KB)
    with pytest.raises(BundleError, match="not 64 lowercase hex"):
        cache.get(digest, 1, Fetcher(tmp_path), limits=CODE_LIMITS)
    assert list(cache.root.iterdir()) == []


def test_a_corrupted_download_is_refused_before_extraction_and_leaves_nothing(tmp_path: Path) -> None:
    good = bundle(tmp_path, "a", payload=b"x" * 100)
    evil = bundle(tmp_path, "b", payload=b"y" * 100)     # a valid tar of the same size, other bytes
    assert evil.size == good.size and evil.digest != good.digest
    cache = ArtifactCache(tmp_path / "cache", max_bytes=10 * KB)
    with pytest.raises(BundleError, match=f"has SHA-256 {evil.digest}, expected {good.digest}"):
        get(cache, good, Fetcher(evil.path))
    with pytest.raises(BundleError, match="bytes, expected"):
        get(cache, good, Fetcher(good.path, data=good.path.read_bytes()[:-1]))
    assert cached(cache) == set()
    assert (get(cache, good, Fetcher(good.path)) / "blob.bin").read_bytes() == b"x" * 100


def test_a_failing_fetch_raises_its_own_error_and_leaves_nothing(tmp_path: Path) -> None:
    b = bundle(tmp_path, "a", fill=10)
    cache = ArtifactCache(tmp_path / "cache", max_bytes=10 * KB)

    def broken(path: Path) -> None:
        path.write_bytes(b"half")
        raise ConnectionError("store went away")

    with pytest.raises(ConnectionError, match="store went away"):
        get(cache, b, broken)
    assert cached(cache) == set()


def test_a_hostile_bundle_that_verifies_is_still_refused_and_leaves_nothing(tmp_path: Path) -> None:
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, mode="w") as tar:
        info = tarfile.TarInfo("../escape")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    cache = ArtifactCache(tmp_path / "cache", max_bytes=10 * KB)
    with pytest.raises(BundleError, match=r"'\.\./escape'"):
        cache.get(sha256_file(archive), archive.stat().st_size, Fetcher(archive), limits=CODE_LIMITS)
    assert cached(cache) == set() and not (tmp_path / "escape").exists()


def test_least_recently_used_entries_are_evicted_first(tmp_path: Path) -> None:
    a, b, c = (bundle(tmp_path, n, fill=1000) for n in ("a", "b", "c"))
    cache = ArtifactCache(tmp_path / "cache", max_bytes=2500)    # two entries fit
    fetches = {x.digest: Fetcher(x.path) for x in (a, b, c)}
    for x in (a, b, a, c):      # a used again after b: b is the least recently used
        get(cache, x, fetches[x.digest])
    assert cached(cache) == {a.digest, c.digest}
    get(cache, b, fetches[b.digest])                               # back, fetched again; a goes now
    assert cached(cache) == {b.digest, c.digest}
    assert [fetches[x.digest].calls for x in (a, b, c)] == [1, 2, 1]


def test_an_entry_in_use_is_not_evicted(tmp_path: Path) -> None:
    a, b, c = (bundle(tmp_path, n, fill=1000) for n in ("a", "b", "c"))
    cache = ArtifactCache(tmp_path / "cache", max_bytes=1500)    # one entry fits
    with cache.use(a.digest, a.size, Fetcher(a.path), limits=CODE_LIMITS) as tree:
        get(cache, b, Fetcher(b.path))
        get(cache, c, Fetcher(c.path))
        assert a.digest in cached(cache) and (tree / "blob.bin").read_bytes() == b"\1" * 1000
        assert cached(cache) == {a.digest, c.digest}
    get(cache, b, Fetcher(b.path))
    assert cached(cache) == {b.digest}


def test_an_entry_larger_than_the_cache_is_served_then_evicted(tmp_path: Path) -> None:
    a, b = (bundle(tmp_path, n, fill=5000) for n in ("a", "b"))
    cache = ArtifactCache(tmp_path / "cache", max_bytes=100)
    assert (get(cache, a, Fetcher(a.path)) / "blob.bin").stat().st_size == 5000
    assert cached(cache) == {a.digest}
    get(cache, b, Fetcher(b.path))
    assert cached(cache) == {b.digest}


def test_leftovers_of_a_process_that_died_are_cleared(tmp_path: Path) -> None:
    a, b = (bundle(tmp_path, n, fill=10) for n in ("a", "b"))
    cache = ArtifactCache(tmp_path / "cache", max_bytes=10 * KB)
    dead = cache.root / a.digest
    (dead / "tree.partial" / "x").mkdir(parents=True)
    (dead / "tree.partial").chmod(0o555)
    (dead / "archive.partial").write_bytes(b"half")
    (dead / "tree").mkdir()                       # renamed, but no marker written
    fetch = Fetcher(a.path)
    assert (get(cache, a, fetch) / "train.py").read_text() == "print('a')\n" and fetch.calls == 1
    assert sorted(p.name for p in dead.iterdir()) == ["complete", "fetch.lock", "inuse", "tree"]
    stale = cache.root / ("f" * 64)
    (stale / "tree.partial").mkdir(parents=True)
    get(cache, b, Fetcher(b.path))               # an eviction pass removes incomplete entries nobody holds
    assert cached(cache) == {a.digest, b.digest}


def _slow_fetch(source: str, counter: str) -> Callable[[Path], None]:
    def fetch(path: Path) -> None:
        fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, b"fetch\n")
        os.close(fd)
        time.sleep(0.3)
        path.write_bytes(Path(source).read_bytes())
    return fetch


def _worker(root: str, digest: str, size: int, source: str, counter: str, start, results) -> None:
    start.wait()
    cache = ArtifactCache(Path(root), max_bytes=10 * KB)
    with cache.use(digest, size, _slow_fetch(source, counter), limits=CODE_LIMITS) as tree:
        results.put((tree / "train.py").read_text())


def test_processes_asking_for_the_same_bundle_at_once_fetch_it_once(tmp_path: Path) -> None:
    b = bundle(tmp_path, "a", fill=100)
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    counter = tmp_path / "fetches"
    procs = [ctx.Process(target=_worker, args=(str(tmp_path / "cache"), b.digest, b.size, str(b.path),
                                               str(counter), start, results)) for _ in range(4)]
    for p in procs:
        p.start()
    start.set()
    got = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0] * 4
    assert got == ["print('a')\n"] * 4
    assert counter.read_text() == "fetch\n"
