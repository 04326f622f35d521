"""The object-store contract, run on LocalStore and on MinioStore (a real S3 server).

The ``store`` fixture (tests/conftest.py) gives each test an empty store of each kind.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.store import (
    InvalidKey,
    LocalStore,
    ObjectNotFound,
    ObjectStore,
    validate_key,
)

AWKWARD_KEYS = [
    "plain",
    "checkpoints/job-1/3/n0/0.safetensors",
    "with space/and+plus=equals&amp",
    "unicode/ünïcødé/名前",
    "dots/.hidden/..double/x.",
    "percent%20/hash#/question?/star*",
]
BAD_KEYS = ["", "/abs", "a//b", "a/", "a/../b", "..", "a/./b", "tab\there", "new\nline",
            "nul\x00", "del\x7f", "x" * 256, "/".join(["abcd"] * 300)]


def pattern(size: int, seed: int) -> bytes:
    """Deterministic bytes in which no two positions' neighbourhoods repeat soon."""
    block = bytes((seed * 31 + i * 7) % 251 for i in range(4096))
    return (block * (size // len(block) + 1))[:size]


async def test_put_get_round_trip(store: ObjectStore) -> None:
    payloads = {key: pattern(1000 + i, i) for i, key in enumerate(AWKWARD_KEYS)}
    payloads["empty"] = b""
    for key, data in payloads.items():
        await store.put(key, data)
    for key, data in payloads.items():
        assert await store.get(key) == data
        assert await store.size(key) == len(data)
        assert await store.exists(key)


async def test_overwrite_replaces_object(store: ObjectStore) -> None:
    await store.put("m/final.safetensors", b"first version, longer than the second")
    await store.put("m/final.safetensors", b"second")
    assert await store.get("m/final.safetensors") == b"second"
    assert await store.size("m/final.safetensors") == 6
    assert await store.list() == ["m/final.safetensors"]


async def test_put_file_get_file_round_trip(store: ObjectStore, tmp_path: Path) -> None:
    data = pattern(3 * 1024 * 1024 + 17, 5)
    source = tmp_path / "in.bin"
    source.write_bytes(data)
    await store.put_file("files/big.bin", source)
    target = tmp_path / "out.bin"
    await store.get_file("files/big.bin", target)
    assert target.read_bytes() == data
    assert {p.name for p in tmp_path.iterdir()} - {"store"} == {"in.bin", "out.bin"}


async def test_reader_during_put_file_sees_old_or_new(store: ObjectStore, tmp_path: Path) -> None:
    old, new = pattern(512 * 1024, 1), pattern(24 * 1024 * 1024, 2)
    await store.put("ckpt/model.safetensors", old)
    source = tmp_path / "new.bin"
    source.write_bytes(new)
    writer = asyncio.create_task(store.put_file("ckpt/model.safetensors", source))
    reads = 0
    while not writer.done():
        seen = await store.get("ckpt/model.safetensors")
        assert seen in (old, new), f"partial object of {len(seen)} bytes"
        assert await store.list("ckpt/") == ["ckpt/model.safetensors"]
        reads += 1
    await writer
    assert reads >= 1
    assert await store.get("ckpt/model.safetensors") == new
    assert await store.list() == ["ckpt/model.safetensors"]


async def test_failed_put_file_keeps_old_object(store: ObjectStore, tmp_path: Path) -> None:
    await store.put("keep/me", b"old")
    with pytest.raises(FileNotFoundError):
        await store.put_file("keep/me", tmp_path / "does-not-exist")
    assert await store.get("keep/me") == b"old"
    assert await store.list() == ["keep/me"]


async def test_an_object_may_name_its_owning_user_and_reads_back_the_same(store: ObjectStore,
                                                                         tmp_path: Path) -> None:
    """``owner``: the user whose object it is (a job's models). A store with access control
    records it for its policies (shared/domain/layout.py); every store keeps the bytes as given
    and refuses, before any I/O, an owner that is not a user name."""
    source = tmp_path / "final.bin"
    source.write_bytes(b"final weights")
    await store.put("models/j/0.safetensors", b"round weights", owner="alice")
    await store.put_file("models/j/final.safetensors", source, owner="alice")
    assert await store.get("models/j/0.safetensors") == b"round weights"
    assert await store.get("models/j/final.safetensors") == b"final weights"
    for bad in ("", "Alice", "a b", "x" * 64, "../x", "-lead"):
        with pytest.raises(ValueError, match="owner"):
            await store.put("models/j/bad", b"x", owner=bad)
        with pytest.raises(ValueError, match="owner"):
            await store.put_file("models/j/bad", source, owner=bad)
    assert await store.list("models/") == ["models/j/0.safetensors", "models/j/final.safetensors"]


async def test_get_range(store: ObjectStore) -> None:
    data = pattern(10_000, 3)
    await store.put("r/obj", data)
    cases = [(0, 10), (0, 10_000), (1, 1), (9_990, 10), (9_995, 100), (5_000, 0), (10_000, 5),
             (20_000, 5), (123, 4_567)]
    for offset, length in cases:
        assert await store.get_range("r/obj", offset, length) == data[offset:offset + length], (offset, length)
    with pytest.raises(ValueError):
        await store.get_range("r/obj", -1, 5)
    with pytest.raises(ValueError):
        await store.get_range("r/obj", 0, -5)


async def test_stream_yields_whole_object_in_bounded_chunks(store: ObjectStore) -> None:
    data = pattern(2 * 1024 * 1024 + 3, 4)
    await store.put("s/obj", data)
    chunks = [chunk async for chunk in store.stream("s/obj", chunk_size=256 * 1024)]
    assert b"".join(chunks) == data
    assert all(0 < len(chunk) <= 256 * 1024 for chunk in chunks)
    await store.put("s/empty", b"")
    assert [chunk async for chunk in store.stream("s/empty")] == []


async def test_list_is_sorted_and_filters_by_string_prefix(store: ObjectStore) -> None:
    keys = ["b/2", "a/b/c", "a/bc", "a/b/a", "a/a", "z", "ax/y", "models/j1/final.safetensors",
            "h/.x", "h/..y", "dot."]
    for key in reversed(keys):
        await store.put(key, key.encode())
    assert await store.list() == sorted(keys)
    assert await store.list("a/") == ["a/a", "a/b/a", "a/b/c", "a/bc"]
    assert await store.list("a/b") == ["a/b/a", "a/b/c", "a/bc"]
    assert await store.list("a/b/") == ["a/b/a", "a/b/c"]
    assert await store.list("models/j1/final") == ["models/j1/final.safetensors"]
    assert await store.list("nothing") == []
    assert await store.list("a/../") == []
    assert await store.list("a/.") == []
    assert await store.list("h/.") == ["h/..y", "h/.x"]
    assert await store.list("h/..") == ["h/..y"]
    assert await store.list(".") == []


async def test_exists_and_delete_is_idempotent(store: ObjectStore) -> None:
    assert not await store.exists("d/x")
    await store.delete("d/x")
    await store.put("d/x", b"1")
    await store.put("d/y", b"2")
    assert await store.exists("d/x")
    await store.delete("d/x")
    await store.delete("d/x")
    assert not await store.exists("d/x")
    assert await store.list() == ["d/y"]
    await store.delete("d/y")
    assert await store.list() == []


async def test_missing_key_raises_object_not_found(store: ObjectStore, tmp_path: Path) -> None:
    await store.put("present", b"x")
    for read in (store.get("absent"), store.size("absent"), store.get_range("absent", 0, 1),
                 store.get_range("absent", 0, 0), store.get_file("absent", tmp_path / "out")):
        with pytest.raises(ObjectNotFound) as caught:
            await read
        assert isinstance(caught.value, KeyError)
        assert caught.value.key == "absent"
    with pytest.raises(ObjectNotFound):
        async for _ in store.stream("absent"):
            pass
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", BAD_KEYS, ids=lambda key: repr(key)[:20])
async def test_bad_keys_raise_invalid_key(store: ObjectStore, bad: str, tmp_path: Path) -> None:
    calls = [store.put(bad, b"x"), store.put_file(bad, tmp_path / "f"), store.get(bad),
             store.get_range(bad, 0, 1), store.size(bad), store.get_file(bad, tmp_path / "o"),
             store.exists(bad), store.delete(bad)]
    for call in calls:
        with pytest.raises(InvalidKey):
            await call
    with pytest.raises(InvalidKey):
        async for _ in store.stream(bad):
            pass
    assert await store.list() == []


async def test_local_store_leaves_no_temporary_files(local_store: LocalStore, tmp_path: Path) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(pattern(1024 * 1024, 6))
    await local_store.put_file("a/b/c", source)
    await local_store.put("a/b/c", b"again")
    with pytest.raises(FileNotFoundError):
        await local_store.put_file("a/b/c", tmp_path / "missing")
    files = sorted(str(p.relative_to(local_store.root)) for p in local_store.root.rglob("*"))
    assert files == ["a", "a/b", "a/b/c"]


async def test_local_store_refuses_object_inside_object(local_store: LocalStore) -> None:
    await local_store.put("a", b"object")
    with pytest.raises(InvalidKey):
        await local_store.put("a/b", b"below an object")
    await local_store.put("p/q", b"x")
    with pytest.raises(InvalidKey):
        await local_store.put("p", b"over a prefix")
    await local_store.delete("p/q")
    await local_store.put("p", b"fine once p/ is empty")
    assert await local_store.list() == ["a", "p"]


async def test_local_store_put_survives_a_delete_pruning_its_directory(local_store: LocalStore,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # A delete drops the directories it leaves empty; one that runs between a put's mkdir and
    # its write removed the put's directory, and the put failed with FileNotFoundError (seen
    # in the tracker's restart test: an agent re-reported a copy while a round was pruned).
    await local_store.put("ckpt/j/0/0", b"old")
    real_mkdir = Path.mkdir
    raced: list[Path] = []

    def mkdir_then_pruned(self: Path, *args, **kwargs) -> None:
        real_mkdir(self, *args, **kwargs)
        if not raced and self.name == "0" and self.parent.name == "j":
            raced.append(self)
            (self / "0").unlink()                # the concurrent delete of ckpt/j/0/0 ...
            self.rmdir()                         # ... and its pruning of the empty directory
    monkeypatch.setattr(Path, "mkdir", mkdir_then_pruned)
    await local_store.put("ckpt/j/0/1", b"new")
    assert raced and await local_store.get("ckpt/j/0/1") == b"new"
    assert await local_store.list("ckpt/") == ["ckpt/j/0/1"]


# -- key rules, as properties ---------------------------------------------------------------

segment = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp", "Cf", "Co", "Cn"),
                           blacklist_characters="/"),
    min_size=1, max_size=20,
).filter(lambda s: s not in (".", "..") and s.isprintable())
valid_key = st.lists(segment, min_size=1, max_size=5).map("/".join)


def follows_rules(key: str) -> bool:
    segments = key.split("/")
    return (bool(key) and key.isprintable() and len(key.encode()) <= 1024
            and all(s and s not in (".", "..") and len(s.encode()) <= 255 for s in segments))


@given(st.text(max_size=40))
def test_validate_key_accepts_exactly_the_rules(text: str) -> None:
    try:
        assert validate_key(text) == text
        accepted = True
    except InvalidKey:
        accepted = False
    assert accepted == follows_rules(text)


@given(valid_key, st.sampled_from(["/", "//", "/../", "/./", "\n", "\x00", "\t"]))
def test_validate_key_rejects_any_broken_key(key: str, breaker: str) -> None:
    with pytest.raises(InvalidKey):
        validate_key(breaker + key if breaker == "/" else key + breaker + key)


@settings(max_examples=40, deadline=None)
@given(st.lists(valid_key, min_size=1, max_size=4, unique=True))
def test_local_store_round_trips_any_valid_keys(keys: list[str]) -> None:
    # Keys where one is a directory of another cannot coexist on a filesystem (documented).
    keys = [k for k in keys if not any(o.startswith(k + "/") or k.startswith(o + "/") for o in keys)]

    async def run(root: Path) -> None:
        store = LocalStore(root)
        await store.start()
        for key in keys:
            await store.put(key, key.encode())
        assert await store.list() == sorted(keys)
        for key in keys:
            assert await store.get(key) == key.encode()

    with tempfile.TemporaryDirectory() as root:
        asyncio.run(run(Path(root) / "s"))
