"""Bundles: a user's code folder or dataset as one reproducible, verifiable tar archive.

``hadar submit`` packs the code folder with :func:`pack`, names the archive by its SHA-256
and uploads it; a GPU agent downloads it, checks it with :func:`verify` and unpacks it with
:func:`extract` into its read-only cache. Datasets (``hadar data put``) use the same format
under :data:`DATA_LIMITS`.

Guarantees:

* :func:`pack` is reproducible: the same tree (names, contents, owner-execute bits) gives the
  same bytes on any machine with the same Python, whatever the files' times, owners, other
  permission bits or creation order. The archive is an uncompressed POSIX (PAX) tar: entries
  sorted by relative path, folders included, mtime 0, owner 0 with no names, mode 0o755 for
  folders and executables, 0o644 otherwise. Only regular files and folders are packed; any
  other kind of file that is not ignored is refused. The limits are checked before a byte is
  written, and the finished archive's size once more.
* :func:`extract` treats the archive as hostile: it creates only regular files and folders
  strictly under a new ``dest``, never follows or creates a link, stops at the first member
  over the limits, and leaves nothing behind when it refuses. What it extracts is read-only.
* Every refusal is a :class:`BundleError` (not retriable, except a full disk) with a
  one-line message that names the path.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import os
import shutil
import stat
import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from shared.errors import HadarError

__all__ = ["BundleLimits", "CODE_LIMITS", "DATA_LIMITS", "BundleError", "DEFAULT_IGNORE", "IGNORE_FILE",
           "HEADER_BYTES", "PackedBundle", "pack", "verify", "extract", "check_digest", "sha256_file",
           "remove_tree", "human_bytes"]

MiB = 1024 ** 2
GiB = 1024 ** 3
HEADER_BYTES = 512           # the estimate of one entry's header, counted against max_bytes
_CHUNK = 1024 * 1024
_SHOWN_CHARS = 100
_HEX = frozenset("0123456789abcdef")
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


@dataclass(frozen=True, kw_only=True)
class BundleLimits:
    """How large a bundle may be: ``max_bytes`` for the archive (its files' bytes plus
    :data:`HEADER_BYTES` per entry, checked before packing and while extracting) and
    ``max_files`` regular files. ``label`` names the kind of bundle in messages."""

    max_bytes: int
    max_files: int
    label: str = "bundle"


CODE_LIMITS = BundleLimits(max_bytes=64 * MiB, max_files=5_000, label="code bundle")
DATA_LIMITS = BundleLimits(max_bytes=16 * GiB, max_files=1_000_000, label="data bundle")

# Matched against basenames at any depth; IGNORE_FILE itself is packed (it documents the bundle).
DEFAULT_IGNORE: tuple[str, ...] = (".git", ".hg", ".svn", "__pycache__", ".mypy_cache", ".pytest_cache",
                                   ".ruff_cache", ".ipynb_checkpoints", ".venv", "*.pyc", ".DS_Store")
IGNORE_FILE = ".hadarignore"


class BundleError(HadarError):
    """A bundle that cannot be packed, verified or extracted; the message names the path."""


@dataclass(frozen=True, kw_only=True)
class PackedBundle:
    """An archive :func:`pack` wrote: its ``digest`` (SHA-256 of its bytes, lowercase hex),
    ``size`` in bytes and number of regular ``files``."""

    path: Path
    digest: str
    size: int
    files: int


def human_bytes(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ``64 MiB``, ``70.2 MiB`` (binary units)."""
    power = 0
    while power < len(_UNITS) - 1 and n >= 1024 ** (power + 1):
        power += 1
    if power == 0:
        return f"{n} B"
    return f"{f'{n / 1024 ** power:.1f}'.removesuffix('.0')} {_UNITS[power]}"


def check_digest(digest: str) -> str:
    """``digest`` if it is 64 lowercase hex characters (a SHA-256); BundleError otherwise."""
    if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= _HEX):
        raise BundleError(f"bundle digest {_show(str(digest))} is not 64 lowercase hex characters")
    return digest


def _show(name: str) -> str:
    """``name`` quoted and escaped on one line, cut to about 100 characters."""
    return repr(name if len(name) <= _SHOWN_CHARS else name[:_SHOWN_CHARS] + "...")


def _name_problem(name: str) -> str | None:
    """Why ``name`` (a path relative to a bundle's root) cannot be in a bundle, or None."""
    if "\x00" in name or "\\" in name:
        return "contains a NUL or a backslash"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    if name.startswith("/"):
        return "is an absolute path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "has an empty, '.' or '..' part"
    return None


# ---------------------------------------------------------------- pack


@dataclass(frozen=True, kw_only=True)
class _Rule:
    pattern: str
    anchored: bool       # matched against the relative path, else against the basename
    folders_only: bool

    def matches(self, rel: str, *, is_dir: bool) -> bool:
        if self.folders_only and not is_dir:
            return False
        return fnmatch.fnmatchcase(rel if self.anchored else rel.rpartition("/")[2], self.pattern)


def _rule(line: str) -> _Rule:
    body = line.rstrip("/")
    return _Rule(pattern=body.lstrip("/"), anchored="/" in body, folders_only=body != line)


def _read_ignore(root: Path, label: str) -> tuple[_Rule, ...]:
    path = root / IGNORE_FILE
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            return ()           # a link or special file: the walk refuses it
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ()
    except (OSError, UnicodeError) as exc:
        raise BundleError(f"{label}: cannot read {IGNORE_FILE}: {exc}") from None
    rules = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("!"):
            raise BundleError(f"{label}: {IGNORE_FILE} line {number}: negation ('!') is not supported; "
                              "list only what to leave out")
        rule = _rule(line)
        if not rule.pattern:
            raise BundleError(f"{label}: {IGNORE_FILE} line {number}: {_show(line)} names no file")
        rules.append(rule)
    return tuple(rules)


@dataclass(frozen=True, kw_only=True)
class _Entry:
    rel: str
    is_dir: bool
    size: int = 0
    executable: bool = False


_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFSOCK: "a socket", stat.S_IFIFO: "a named pipe (fifo)",
          stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}
_MEMBER_KINDS = {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link", tarfile.CHRTYPE: "a device",
                 tarfile.BLKTYPE: "a device", tarfile.FIFOTYPE: "a named pipe (fifo)"}


def _scan(root: Path, rules: tuple[_Rule, ...], label: str) -> list[_Entry]:
    """Every entry of the tree that is not ignored, sorted by relative path."""
    found: list[_Entry] = []
    pending = [""]
    while pending:
        parent = pending.pop()
        try:
            with os.scandir(os.path.join(root, parent)) as it:
                children = [(child.name, child.stat(follow_symlinks=False)) for child in it]
        except OSError as exc:
            raise BundleError(f"{label}: cannot read folder {_show(parent or '.')}: {exc.strerror}") from None
        for name, st in children:
            rel = f"{parent}/{name}" if parent else name
            is_dir = stat.S_ISDIR(st.st_mode)
            if any(rule.matches(rel, is_dir=is_dir) for rule in rules):
                continue
            if (problem := _name_problem(rel)) is not None:
                raise BundleError(f"{label}: the name {_show(rel)} {problem}; rename it or add it to {IGNORE_FILE}")
            if is_dir:
                found.append(_Entry(rel=rel, is_dir=True))
                pending.append(rel)
            elif stat.S_ISREG(st.st_mode):
                found.append(_Entry(rel=rel, is_dir=False, size=st.st_size, executable=bool(st.st_mode & 0o100)))
            else:
                kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
                raise BundleError(f"{label}: {_show(rel)} is {kind}; only regular files and folders are packed")
    found.sort(key=lambda e: e.rel)
    return found


def _check_limits(entries: list[_Entry], limits: BundleLimits) -> None:
    files = [e for e in entries if not e.is_dir]
    label = limits.label
    if len(files) > limits.max_files:
        crowded = Counter(e.rel.partition("/")[0] for e in files).most_common(3)
        where = ", ".join(f"{_show(top)} {count}" for top, count in crowded)
        raise BundleError(f"{label}: {len(files)} files is over the limit of {limits.max_files}; "
                          f"most files in: {where}; add them to {IGNORE_FILE}")
    estimate = sum(e.size for e in files) + HEADER_BYTES * len(entries)
    if estimate > limits.max_bytes:
        largest = sorted(files, key=lambda e: (-e.size, e.rel))[:3]
        names = ", ".join(f"{_show(e.rel)} {human_bytes(e.size)}" for e in largest)
        raise BundleError(f"{label}: {human_bytes(estimate)} in {len(files)} files is over the limit of "
                          f"{human_bytes(limits.max_bytes)}; largest: {names}; add them to {IGNORE_FILE}")


def _tarinfo(entry: _Entry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.rel)
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    info.type = tarfile.DIRTYPE if entry.is_dir else tarfile.REGTYPE
    info.mode = 0o755 if entry.is_dir or entry.executable else 0o644
    info.size = entry.size
    return info


def _write(root: Path, entries: list[_Entry], out: Path, label: str) -> None:
    with tarfile.open(out, mode="w:", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar:
        for entry in entries:
            info = _tarinfo(entry)
            if entry.is_dir:
                tar.addfile(info)
                continue
            fd = os.open(os.path.join(root, entry.rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as src:
                st = os.fstat(src.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
                    raise BundleError(f"{label}: {_show(entry.rel)} changed while it was packed; pack again")
                tar.addfile(info, src)


def sha256_file(path: Path) -> str:
    """The SHA-256 of the file at ``path`` in lowercase hex, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def pack(root: Path, out: Path, *, limits: BundleLimits) -> PackedBundle:
    """Write the tree under ``root`` (less what DEFAULT_IGNORE and ``root/.hadarignore``
    ignore) to the tar ``out`` (replaced if present) and describe it. The same tree gives
    the same bytes; nothing is written when the tree is refused, and a refused or failed
    archive is removed."""
    label = limits.label
    if not root.is_dir():
        raise BundleError(f"{label}: {_show(str(root))} is not a folder")
    if out.resolve().is_relative_to(root.resolve()):
        raise BundleError(f"{label}: the archive {_show(str(out))} must be written outside the folder it packs")
    rules = tuple(_rule(p) for p in DEFAULT_IGNORE) + _read_ignore(root, label)
    entries = _scan(root, rules, label)
    _check_limits(entries, limits)
    try:
        _write(root, entries, out, label)
        size = out.stat().st_size
        if size > limits.max_bytes:
            raise BundleError(f"{label}: the archive is {human_bytes(size)}, over the limit of "
                              f"{human_bytes(limits.max_bytes)}; add large files to {IGNORE_FILE}")
        digest = sha256_file(out)
    except BaseException as exc:
        out.unlink(missing_ok=True)
        if isinstance(exc, (OSError, tarfile.TarError)):
            raise _bundle_error(f"{label}: cannot write {_show(str(out))}", exc) from exc
        raise
    return PackedBundle(path=out, digest=digest, size=size, files=sum(not e.is_dir for e in entries))


def _bundle_error(context: str, exc: BaseException) -> BundleError:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return BundleError(f"{context}: {' '.join(str(reason).split())}", retriable=full)


# ---------------------------------------------------------------- verify


def verify(path: Path, *, digest: str, size: int) -> None:
    """Return if ``path`` is ``size`` bytes long (checked first: cheap) with SHA-256
    ``digest``; BundleError naming what differs otherwise."""
    check_digest(digest)
    try:
        actual_size = path.stat().st_size
    except OSError as exc:
        raise _bundle_error(f"bundle {_show(str(path))}", exc) from None
    if actual_size != size:
        raise BundleError(f"bundle {_show(str(path))} is {actual_size} bytes, expected {size}")
    actual = sha256_file(path)
    if actual != digest:
        raise BundleError(f"bundle {_show(str(path))} has SHA-256 {actual}, expected {digest}")


# ---------------------------------------------------------------- extract


def remove_tree(path: Path) -> None:
    """Delete ``path`` and everything under it, read-only folders included; no error if absent."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        os.unlink(path)
        return
    os.chmod(path, 0o700)
    for folder, subfolders, _ in os.walk(path):
        for sub in subfolders:
            child = os.path.join(folder, sub)
            if not os.path.islink(child):
                os.chmod(child, 0o700)
    shutil.rmtree(path)


class _Extraction:
    """The state of one extraction: what exists under ``dest`` and what it cost so far."""

    def __init__(self, dest: Path, limits: BundleLimits) -> None:
        self.dest, self.limits = dest, limits
        self.is_dir: dict[str, bool] = {}        # every path made so far: folder or file
        self.declared: set[str] = set()          # every member name seen
        self.made: list[tuple[str, int]] = []    # (path, final mode)
        self.files = self.total = 0

    def refuse(self, name: str, why: str) -> BundleError:
        return BundleError(f"{self.limits.label}: member {_show(name)} {why}")

    def admit(self, member: tarfile.TarInfo) -> str:
        """The member's path once it passed every check, counted against the limits."""
        name = member.name
        if (problem := _name_problem(name)) is not None:
            raise self.refuse(name, problem)
        if name in self.declared:
            raise self.refuse(name, "appears twice")
        self.declared.add(name)
        is_file = member.type in (tarfile.REGTYPE, tarfile.AREGTYPE) and member.sparse is None
        if not (is_file or member.type == tarfile.DIRTYPE):
            kind = "a sparse file" if member.sparse is not None else _MEMBER_KINDS.get(member.type, "of another type")
            raise self.refuse(name, f"is {kind}; only regular files and folders are allowed")
        if member.size < 0:
            raise self.refuse(name, "has a negative size")
        self.files += is_file
        self.total += HEADER_BYTES + (member.size if is_file else 0)
        if self.files > self.limits.max_files:
            raise self.refuse(name, f"is over the limit of {self.limits.max_files} files")
        if self.total > self.limits.max_bytes:
            raise self.refuse(name, f"brings the bundle to {human_bytes(self.total)}, over the limit of "
                                    f"{human_bytes(self.limits.max_bytes)}")
        return name

    def make_parents(self, name: str) -> None:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            known = self.is_dir.get(parent)
            if known is None:
                self.mkdir(parent)
            elif not known:
                raise self.refuse(name, f"is inside {_show(parent)}, which is a file")

    def mkdir(self, name: str) -> None:
        os.mkdir(os.path.join(self.dest, name), 0o700)
        self.is_dir[name] = True
        self.made.append((name, 0o555))

    def write(self, name: str, member: tarfile.TarInfo, tar: tarfile.TarFile) -> None:
        if name in self.is_dir:
            raise self.refuse(name, "is a file where the archive already made a folder")
        src = tar.extractfile(member)
        if src is None:
            raise self.refuse(name, "has no data")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(os.path.join(self.dest, name), flags, 0o600)
        self.is_dir[name] = False
        self.made.append((name, 0o555 if member.mode & 0o100 else 0o444))
        with os.fdopen(fd, "wb") as out:
            remaining = member.size
            while remaining > 0:
                chunk = src.read(min(_CHUNK, remaining))
                if not chunk:
                    raise self.refuse(name, "is cut short")
                out.write(chunk)
                remaining -= len(chunk)

    def seal(self) -> None:
        for name, mode in self.made:
            os.chmod(os.path.join(self.dest, name), mode)
        os.chmod(self.dest, 0o555)


def extract(path: Path, dest: Path, *, limits: BundleLimits) -> int:
    """Extract the uncompressed tar ``path`` into the new folder ``dest`` and return how many
    regular files it holds. Refuses, with nothing left behind, an archive over ``limits`` or
    with a member that is not a plain relative path to a regular file or folder (absolute,
    ``..``, links, devices, fifos, duplicates, a file under a file). Files end read-only
    (0o444, 0o555 if the archive marks them executable), folders 0o555."""
    label = limits.label
    try:
        os.mkdir(dest, 0o700)
    except FileExistsError:
        raise BundleError(f"{label}: cannot extract into {_show(str(dest))}: it already exists") from None
    except OSError as exc:
        raise _bundle_error(f"{label}: cannot create {_show(str(dest))}", exc) from None
    job = _Extraction(dest, limits)
    current = ""
    try:
        if (size := path.stat().st_size) > limits.max_bytes:
            raise BundleError(f"{label}: {_show(str(path))} is {human_bytes(size)}, over the limit of "
                              f"{human_bytes(limits.max_bytes)}")
        with tarfile.open(path, mode="r:", encoding="utf-8") as tar:
            while (member := tar.next()) is not None:
                tar.members.clear()  # type: ignore[attr-defined]  # TarFile keeps every member: ~0.4 GB a million
                current = member.name
                name = job.admit(member)
                job.make_parents(name)
                if member.type == tarfile.DIRTYPE:
                    if name not in job.is_dir:
                        job.mkdir(name)
                else:
                    job.write(name, member, tar)
        job.seal()
    except BaseException as exc:
        remove_tree(dest)
        if isinstance(exc, (OSError, tarfile.TarError)):
            where = f"member {_show(current)}" if current else _show(str(path))
            raise _bundle_error(f"{label}: cannot extract {where}", exc) from exc
        raise
    return job.files
