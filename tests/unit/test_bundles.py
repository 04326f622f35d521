"""Bundles: reproducible packing, the ignore rules, verification, and extraction of hostile archives."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from shared.domain.bundles import (
    CODE_LIMITS,
    DATA_LIMITS,
    BundleError,
    BundleLimits,
    check_digest,
    extract,
    human_bytes,
    pack,
    remove_tree,
    verify,
)
from shared.errors import HadarError

SMALL = BundleLimits(max_bytes=64 * 1024, max_files=10, label="code bundle")

FILES = {
    "train.py": b"print('train')\n",
    "pkg/__init__.py": b"",
    "pkg/model.py": b"import torch\n" * 20,
    "data/x.bin": bytes(range(256)) * 4,
    "run.sh": b"#!/bin/sh\nexec python train.py\n",
}


def make_tree(root: Path, *, order: list[str] | None = None, mode: int = 0o644, mtime: int | None = None) -> Path:
    for rel in order or list(FILES):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(FILES[rel])
        path.chmod(0o755 if rel == "run.sh" else mode)
        if mtime is not None:
            os.utime(path, (mtime, mtime))
    (root / "empty").mkdir(exist_ok=True)
    return root


def names(archive: Path) -> list[str]:
    with tarfile.open(archive) as tar:
        return tar.getnames()


def test_the_same_tree_packs_to_the_same_bytes(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "a")
    first = pack(root, tmp_path / "1.tar", limits=CODE_LIMITS)
    second = pack(root, tmp_path / "2.tar", limits=CODE_LIMITS)
    assert first.path.read_bytes() == second.path.read_bytes()
    assert first.digest == second.digest and first.size == second.size == (tmp_path / "1.tar").stat().st_size
    assert first.files == len(FILES)


def test_times_other_permission_bits_and_creation_order_do_not_change_the_bytes(tmp_path: Path) -> None:
    a = pack(make_tree(tmp_path / "a"), tmp_path / "a.tar", limits=CODE_LIMITS)
    other = make_tree(tmp_path / "b", order=list(reversed(FILES)), mode=0o600, mtime=1_000_000_000)
    os.utime(other / "pkg", (5, 5))
    b = pack(other, tmp_path / "b.tar", limits=CODE_LIMITS)
    assert a.path.read_bytes() == b.path.read_bytes() and a.digest == b.digest

    (other / "train.py").chmod(0o700)          # the owner-execute bit counts
    assert pack(other, tmp_path / "c.tar", limits=CODE_LIMITS).digest != a.digest
    (other / "train.py").chmod(0o644)
    (other / "train.py").write_bytes(b"print('trainX')\n")
    assert pack(other, tmp_path / "d.tar", limits=CODE_LIMITS).digest != a.digest


def test_the_archive_is_a_sorted_uncompressed_tar_with_neutral_metadata(tmp_path: Path) -> None:
    bundle = pack(make_tree(tmp_path / "a"), tmp_path / "a.tar", limits=CODE_LIMITS)
    assert bundle.path.read_bytes()[:2] != b"\x1f\x8b"
    with tarfile.open(bundle.path, mode="r:") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted([*FILES, "pkg", "data", "empty"])
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
        assert m.isdir() or m.isreg()
        assert m.mode == (0o755 if m.isdir() or m.name == "run.sh" else 0o644), m.name


def test_default_ignores_and_the_ignore_file_itself_is_kept(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "a")
    for rel in (".git/HEAD", "__pycache__/m.cpython-311.pyc", "pkg/__pycache__/x.pyc", "pkg/old.pyc",
                ".venv/bin/python", ".DS_Store", ".mypy_cache/x", ".ipynb_checkpoints/n.ipynb"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    (root / ".hadarignore").write_text("# nothing\n")
    assert names(pack(root, tmp_path / "a.tar", limits=CODE_LIMITS).path) == sorted(
        [*FILES, "pkg", "data", "empty", ".hadarignore"])


def test_ignore_file_patterns(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "a")
    for rel in ("ckpt/last.ckpt", "pkg/deep/best.ckpt", "logs/run.log", "pkg/logs", "data/big.npy",
                "pkg/data/keep.npy", "pkg/secret.txt", "pkg/sub/secret.txt", "notes.md"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    (root / ".hadarignore").write_text(
        "# checkpoints anywhere\n*.ckpt\n\n  logs/  \n/data/*.npy\npkg/secret.txt\nnote?.m[d]\n")
    kept = set(names(pack(root, tmp_path / "a.tar", limits=CODE_LIMITS).path))
    assert {"pkg/logs", "pkg/data/keep.npy", "pkg/sub/secret.txt", "data/x.bin", "ckpt", "pkg/deep"} <= kept
    assert not kept & {"ckpt/last.ckpt", "pkg/deep/best.ckpt", "logs", "logs/run.log", "data/big.npy",
                       "pkg/secret.txt", "notes.md"}


def test_an_ignored_folder_is_not_descended_into(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "a")
    (root / "node_modules").mkdir()
    os.symlink("/etc/passwd", root / "node_modules" / "link")   # would be refused if it were walked
    (root / ".hadarignore").write_text("node_modules/\n")
    assert "node_modules" not in names(pack(root, tmp_path / "a.tar", limits=CODE_LIMITS).path)


def test_negation_is_refused_with_its_line_number(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "a")
    (root / ".hadarignore").write_text("*.log\n# keep one\n!important.log\n")
    with pytest.raises(BundleError, match=r"\.hadarignore line 3: negation"):
        pack(root, tmp_path / "a.tar", limits=CODE_LIMITS)
    assert not (tmp_path / "a.tar").exists()


@pytest.mark.parametrize("make, kind", [
    (lambda p: os.symlink("../train.py", p), "a symbolic link"),
    (lambda p: os.mkfifo(p), "a named pipe (fifo)"),
])
def test_anything_but_files_and_folders_is_refused_with_its_path(tmp_path: Path, make, kind: str) -> None:
    root = make_tree(tmp_path / "a")
    make(root / "pkg" / "odd")
    with pytest.raises(BundleError) as info:
        pack(root, tmp_path / "a.tar", limits=CODE_LIMITS)
    assert str(info.value) == f"code bundle: 'pkg/odd' is {kind}; only regular files and folders are packed"
    assert not (tmp_path / "a.tar").exists()


def test_a_folder_over_the_byte_limit_is_refused_naming_the_largest_files(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "a")
    (root / "data" / "big.bin").write_bytes(b"\0" * 70 * 1024)
    (root / "data" / "mid.bin").write_bytes(b"\0" * 3 * 1024)
    with pytest.raises(BundleError) as info:
        pack(root, tmp_path / "a.tar", limits=SMALL)
    assert str(info.value) == ("code bundle: 79.3 KiB in 7 files is over the limit of 64 KiB; largest: "
                               "'data/big.bin' 70 KiB, 'data/mid.bin' 3 KiB, 'data/x.bin' 1 KiB; "
                               "add them to .hadarignore")
    assert not (tmp_path / "a.tar").exists()


def test_too_many_files_is_refused_before_writing(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "a")
    for i in range(8):
        (root / "data" / f"{i}.txt").write_text("x")
    with pytest.raises(BundleError, match=r"13 files is over the limit of 10; most files in: 'data' 9"):
        pack(root, tmp_path / "a.tar", limits=SMALL)
    assert not (tmp_path / "a.tar").exists()


def test_root_must_be_a_folder_and_the_archive_outside_it(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="is not a folder"):
        pack(tmp_path / "missing", tmp_path / "a.tar", limits=CODE_LIMITS)
    root = make_tree(tmp_path / "a")
    with pytest.raises(BundleError, match="outside the folder"):
        pack(root, root / "self.tar", limits=CODE_LIMITS)


def test_bundle_error_is_a_hadar_error_and_not_retriable() -> None:
    assert issubclass(BundleError, HadarError) and not BundleError("x").retriable
    assert DATA_LIMITS.max_bytes == 16 * 1024 ** 3 and CODE_LIMITS.max_files == 5_000


# ---------------------------------------------------------------- verify


def test_verify_accepts_the_bundle_and_refuses_a_changed_byte_or_size(tmp_path: Path) -> None:
    bundle = pack(make_tree(tmp_path / "a"), tmp_path / "a.tar", limits=CODE_LIMITS)
    verify(bundle.path, digest=bundle.digest, size=bundle.size)
    with pytest.raises(BundleError, match=rf"is {bundle.size} bytes, expected {bundle.size + 1}$"):
        verify(bundle.path, digest=bundle.digest, size=bundle.size + 1)
    data = bytearray(bundle.path.read_bytes())
    data[700] ^= 1
    bundle.path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=rf"has SHA-256 [0-9a-f]{{64}}, expected {bundle.digest}$"):
        verify(bundle.path, digest=bundle.digest, size=bundle.size)
    with pytest.raises(BundleError, match="not 64 lowercase hex"):
        verify(bundle.path, digest=bundle.digest.upper(), size=bundle.size)
    with pytest.raises(BundleError, match="No such file"):
        verify(tmp_path / "gone.tar", digest=bundle.digest, size=1)


def test_check_digest() -> None:
    assert check_digest("a" * 64) == "a" * 64
    for bad in ("a" * 63, "../" + "a" * 61, "A" * 64, "g" * 64, "a" * 64 + "\n"):
        with pytest.raises(BundleError):
            check_digest(bad)


# ---------------------------------------------------------------- extract


def test_extract_gives_the_same_files_read_only(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "a")
    bundle = pack(root, tmp_path / "a.tar", limits=CODE_LIMITS)
    dest = tmp_path / "out"
    assert extract(bundle.path, dest, limits=CODE_LIMITS) == len(FILES)
    for rel, data in FILES.items():
        assert (dest / rel).read_bytes() == data
        assert stat.S_IMODE((dest / rel).stat().st_mode) == (0o555 if rel == "run.sh" else 0o444)
    for folder in (dest, dest / "pkg", dest / "empty"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o555
    remove_tree(dest)
    assert not dest.exists()


def test_extract_refuses_an_existing_destination(tmp_path: Path) -> None:
    bundle = pack(make_tree(tmp_path / "a"), tmp_path / "a.tar", limits=CODE_LIMITS)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine").write_text("x")
    with pytest.raises(BundleError, match="already exists"):
        extract(bundle.path, tmp_path / "out", limits=CODE_LIMITS)
    assert (tmp_path / "out" / "mine").read_text() == "x"


def member(name: str, data: bytes = b"", **fields: object) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in fields.items():
        setattr(info, key, value)
    return info, data


def hostile(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, mode="w", format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


OK = member("ok.txt", b"fine")

HOSTILE = {
    "parent": ([member("../evil", b"x")], r"member '../evil' has an empty, '.' or '..' part"),
    "absolute": ([member("/etc/x", b"x")], r"member '/etc/x' is an absolute path"),
    "climbs": ([member("a/../../b", b"x")], r"'a/../../b' has an empty"),
    "dot": ([member("./a", b"x")], r"'./a' has an empty"),
    "empty part": ([member("a//b", b"x")], r"'a//b' has an empty"),
    "symlink": ([member("link", type=tarfile.SYMTYPE, linkname="/etc/passwd")], r"'link' is a symbolic link"),
    "hard link": ([OK, member("hard", type=tarfile.LNKTYPE, linkname="ok.txt")], r"'hard' is a hard link"),
    "fifo": ([member("pipe", type=tarfile.FIFOTYPE)], r"'pipe' is a named pipe"),
    "char device": ([member("null", type=tarfile.CHRTYPE, devmajor=1, devminor=3)], r"'null' is a device"),
    "block device": ([member("sda", type=tarfile.BLKTYPE, devmajor=8)], r"'sda' is a device"),
    "duplicate": ([OK, member("ok.txt", b"again")], r"'ok.txt' appears twice"),
    "file under a file": ([OK, member("ok.txt/x", b"x")], r"'ok.txt/x' is inside 'ok.txt', which is a file"),
    "file over a folder": ([member("d/x", b"x"), member("d", b"x")], r"'d' is a file where"),
    "backslash": ([member("a\\..\\b", b"x")], r"contains a NUL or a backslash"),
    "not utf-8": ([member("bad\udcff", b"x")], r"is not valid UTF-8"),
    "too many files": ([member(f"f{i}", b"x") for i in range(11)], r"'f10' is over the limit of 10 files"),
    "too many bytes": ([OK, member("big", b"\0" * 40_000), member("big2", b"\0" * 30_000)],
                       r"over the limit of 64 KiB"),
}


@pytest.mark.parametrize("case", HOSTILE, ids=list(HOSTILE))
def test_extract_refuses_a_hostile_archive_and_leaves_nothing(tmp_path: Path, case: str) -> None:
    members, message = HOSTILE[case]
    archive = hostile(tmp_path / "evil.tar", members)
    work = tmp_path / "work"
    work.mkdir()
    limits = BundleLimits(max_bytes=64 * 1024 if case == "too many bytes" else 1024 ** 2, max_files=10)
    with pytest.raises(BundleError, match=message) as info:
        extract(archive, work / "dest", limits=limits)
    assert "\n" not in str(info.value)
    assert list(work.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.tar", "work"]


def test_extract_checks_declared_sizes_before_reading_data(tmp_path: Path) -> None:
    info = tarfile.TarInfo("huge.bin")
    info.size = 2 ** 40                          # header only: the data is not there
    archive = tmp_path / "huge.tar"
    archive.write_bytes(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "strict") + b"\0" * 1024)
    with pytest.raises(BundleError, match=r"'huge.bin' brings the bundle to 1 TiB, over the limit of 16 GiB"):
        extract(archive, tmp_path / "dest", limits=DATA_LIMITS)
    assert not (tmp_path / "dest").exists()


def test_a_bundle_that_was_fine_is_refused_by_tighter_limits(tmp_path: Path) -> None:
    bundle = pack(make_tree(tmp_path / "a"), tmp_path / "a.tar", limits=CODE_LIMITS)
    with pytest.raises(BundleError, match="over the limit of 2 files"):
        extract(bundle.path, tmp_path / "dest", limits=BundleLimits(max_bytes=2**20, max_files=2))
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("data", [b"", b"not a tar at all" * 100, b"\x1f\x8b\x08" + b"\0" * 2000])
def test_extract_refuses_what_is_not_an_uncompressed_tar(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "x.tar").write_bytes(data)
    with pytest.raises(BundleError, match="cannot extract"):
        extract(tmp_path / "x.tar", tmp_path / "dest", limits=CODE_LIMITS)
    assert not (tmp_path / "dest").exists()


def test_extract_refuses_a_cut_short_archive(tmp_path: Path) -> None:
    bundle = pack(make_tree(tmp_path / "a"), tmp_path / "a.tar", limits=CODE_LIMITS)
    data = bundle.path.read_bytes()
    cut = data.index(FILES["data/x.bin"][:64]) + 100
    (tmp_path / "cut.tar").write_bytes(data[:cut])
    with pytest.raises(BundleError, match=r"'data/x\.bin'"):
        extract(tmp_path / "cut.tar", tmp_path / "dest", limits=CODE_LIMITS)
    assert not (tmp_path / "dest").exists()


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 64 * 1024 ** 2, int(70.2 * 1024 ** 2), 16 * 1024 ** 3)] == [
        "0 B", "1023 B", "1 KiB", "1.5 KiB", "64 MiB", "70.2 MiB", "16 GiB"]
