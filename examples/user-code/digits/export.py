"""Export scikit-learn's bundled digits (offline) as a Hadar dataset folder.

Usage: ``python export.py OUT_DIR`` -- then ``hadar data put OUT_DIR digits``.

Writes plain numpy files (no pickle): ``train-images.npy`` / ``test-images.npy`` (float32,
N x 1 x 8 x 8, scaled to [0, 1]), ``train-labels.npy`` / ``test-labels.npy`` (int64), a
fixed 80/20 split drawn with seed 0 (stratified by class), and ``README.txt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

SPLIT_SEED = 0
TEST_FRACTION = 0.2

README = """\
Handwritten digits, 8x8 grey-level images of the digits 0-9 (1,797 samples).

Source: scikit-learn's bundled copy (sklearn.datasets.load_digits) of the UCI ML
"Optical Recognition of Handwritten Digits" test set (E. Alpaydin, C. Kaynak, 1998),
https://archive.ics.uci.edu/dataset/80 -- licensed CC BY 4.0.

Files (numpy .npy, load with numpy.load(path, mmap_mode="r")):
  train-images.npy  float32 [{n_train}, 1, 8, 8], pixel values 0..16 scaled to [0, 1]
  train-labels.npy  int64   [{n_train}]
  test-images.npy   float32 [{n_test}, 1, 8, 8]
  test-labels.npy   int64   [{n_test}]
Split: a fixed {train_pct}/{test_pct} split, stratified by class, drawn with numpy seed {seed}
(examples/user-code/digits/export.py).
"""


def split(labels: np.ndarray, seed: int, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices: per class, a seeded shuffle, the first ``test_fraction`` to test."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        cut = round(len(members) * test_fraction)
        test.append(members[:cut])
        train.append(members[cut:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def export(out: Path) -> dict[str, int]:
    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]   # N x 1 x 8 x 8 in [0, 1]
    labels = digits.target.astype(np.int64)
    train, test = split(labels, SPLIT_SEED, TEST_FRACTION)
    out.mkdir(parents=True, exist_ok=True)
    for name, index in (("train", train), ("test", test)):
        np.save(out / f"{name}-images.npy", np.ascontiguousarray(images[index]), allow_pickle=False)
        np.save(out / f"{name}-labels.npy", np.ascontiguousarray(labels[index]), allow_pickle=False)
    (out / "README.txt").write_text(README.format(n_train=len(train), n_test=len(test), seed=SPLIT_SEED,
                                                  train_pct=round(100 * (1 - TEST_FRACTION)),
                                                  test_pct=round(100 * TEST_FRACTION)))
    return {"train": len(train), "test": len(test)}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: export.py OUT_DIR", file=sys.stderr)
        return 2
    counts = export(Path(argv[0]))
    print(f"wrote {counts['train']} training and {counts['test']} test images to {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
