"""Export a small text corpus that every Python install has: its standard library's source.

Usage: ``python export.py OUT_DIR`` -- then ``hadar data put OUT_DIR stdlib-text``.

Takes the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (without the test suites,
``site-packages``, ``lib2to3`` and the ``encodings`` codec tables), sorted by path: the first
300 become ``train/*.txt`` and the 30 after them ``test/*.txt`` (held-out files), each the
file's bytes unchanged, named after its module (``email/utils.py`` -> ``email.utils.txt``).
About 5-6 MB. Also writes ``README.txt`` and the Python license beside them.
"""

from __future__ import annotations

import platform
import shutil
import sys
import sysconfig
from pathlib import Path

TRAIN_FILES, TEST_FILES = 300, 30
SKIP_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "encodings"}

README = """\
Python source text: the standard library of CPython {version}, as bytes.

Source: the .py files of the standard library folder (sysconfig.get_paths()["stdlib"])
of the interpreter that ran examples/user-code/tiny-lm/export.py, without the test suites,
site-packages, lib2to3 and the encodings codec tables, sorted by path.
  train/  the first {n_train} files ({train_bytes:,} bytes)
  test/   the {n_test} files after them ({test_bytes:,} bytes), held out
Each file is the module's source unchanged, named after the module (email/utils.py ->
email.utils.txt). Another Python version gives a slightly different corpus.

License: the Python Software Foundation License (PSF License Agreement, Python 2.0 /
PSF-2.0); copyright the Python Software Foundation. See LICENSE.txt (copied from the
interpreter when it ships one) and https://docs.python.org/3/license.html.
"""


def sources(stdlib: Path) -> list[Path]:
    """The candidate ``.py`` files, relative to ``stdlib``, in sorted order."""
    found = []
    for path in stdlib.rglob("*.py"):
        relative = path.relative_to(stdlib)
        if not SKIP_FOLDERS & set(relative.parts[:-1]) and path.is_file():
            found.append(relative)
    return sorted(found, key=lambda p: p.as_posix())


def export(out: Path) -> dict[str, int]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sources(stdlib)[:TRAIN_FILES + TEST_FILES]
    if len(files) < TRAIN_FILES + TEST_FILES:
        raise SystemExit(f"only {len(files)} source files under {stdlib}")
    counts = {"train_bytes": 0, "test_bytes": 0}
    for split, chosen in (("train", files[:TRAIN_FILES]), ("test", files[TRAIN_FILES:])):
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        for relative in chosen:
            name = ".".join(relative.with_suffix("").parts) + ".txt"
            data = (stdlib / relative).read_bytes()
            (folder / name).write_bytes(data)
            counts[f"{split}_bytes"] += len(data)
    license_file = stdlib / "LICENSE.txt"
    if license_file.is_file():
        shutil.copyfile(license_file, out / "LICENSE.txt")
    (out / "README.txt").write_text(README.format(version=platform.python_version(),
                                                  n_train=TRAIN_FILES, n_test=TEST_FILES, **counts))
    return counts


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: export.py OUT_DIR", file=sys.stderr)
        return 2
    counts = export(Path(argv[0]))
    print(f"wrote {TRAIN_FILES} training files ({counts['train_bytes']:,} bytes) and {TEST_FILES} test files "
          f"({counts['test_bytes']:,} bytes) to {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
