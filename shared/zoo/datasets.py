"""Deterministic datasets that need no download.

Real data where a package ships it (scikit-learn's ``digits`` and ``diabetes``), seeded
synthetic data otherwise (``synthetic-text``, ``synthetic-ratings``). Guarantees:

* The same name always gives bit-identical tensors, on any machine: each dataset has its
  own fixed seed (:data:`DATASET_SEED`), independent of any job's seed, so every copy of
  a job (and every job) trains on the same data and is scored on the same held-out split.
* Train and held-out parts never overlap (for ``synthetic-ratings`` the held-out part is
  a disjoint set of observed (user, item) entries, as in AutoRec's evaluation).
* Tensors are CPU, contiguous; inputs float32 (tokens int64), loaded once per process.

Tasks and their tensors (per sample):

========================  ==============  =========================  ==========================
dataset                   task            x                          y
========================  ==============  =========================  ==========================
digits (1797 images)      classification  float [1, 8, 8] in [0, 1]  int64 class 0..9
diabetes (442 patients)   regression      float [10] (scaled)        float [1], standardised
synthetic-text            language-model  int64 [16] tokens          int64 [16] next tokens
synthetic-ratings         ratings         float [64] centred ratings float [2, 64]: rating, mask
========================  ==============  =========================  ==========================
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

__all__ = ["DatasetInfo", "Dataset", "DATASETS", "DATASET_SEED", "load_dataset", "dataset_info"]

Task = Literal["classification", "regression", "language-model", "ratings"]
InputKind = Literal["image", "tabular", "tokens", "ratings"]

DATASET_SEED = 20240611
"""Seed of every split and every synthetic dataset; fixed so that all jobs share data."""

TEXT_VOCAB = 32
TEXT_SEQ_LEN = 16
TEXT_SUCCESSORS = 3          # each token has this many likely successors: learnable, not trivial
TEXT_TRAIN, TEXT_TEST = 2048, 256
RATINGS_USERS, RATINGS_ITEMS, RATINGS_RANK = 800, 64, 4
RATINGS_OBSERVED = 0.3       # share of (user, item) entries with a rating
RATINGS_HELD_OUT = 0.2       # share of observed entries kept for the held-out metric


@dataclass(frozen=True, kw_only=True)
class DatasetInfo:
    name: str
    task: Task
    input_kind: InputKind
    input_shape: tuple[int, ...]
    n_outputs: int           # classes, 1 (regression), vocabulary size, or items
    train_size: int
    test_size: int
    source: str


@dataclass(frozen=True, kw_only=True, eq=False)
class Dataset:
    info: DatasetInfo
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def _split(n: int, test: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng([DATASET_SEED, len(name)]).permutation(n)
    return np.sort(order[test:]), np.sort(order[:test])


def _digits() -> Dataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    train, test = _split(len(y), 297, "digits")
    info = DatasetInfo(name="digits", task="classification", input_kind="image", input_shape=(1, 8, 8),
                       n_outputs=10, train_size=len(train), test_size=len(test),
                       source="scikit-learn load_digits (UCI optical digits, 8x8)")
    return Dataset(info=info, train_x=x[train].contiguous(), train_y=y[train].contiguous(),
                   test_x=x[test].contiguous(), test_y=y[test].contiguous())


def _diabetes() -> Dataset:
    from sklearn.datasets import load_diabetes

    bunch = load_diabetes()   # features already centred and scaled by scikit-learn
    x = torch.tensor(bunch.data, dtype=torch.float32)
    target = np.asarray(bunch.target, dtype=np.float64)
    train, test = _split(len(target), 88, "diabetes")
    mean, std = target[train].mean(), target[train].std()
    y = torch.tensor((target - mean) / std, dtype=torch.float32).reshape(-1, 1)
    info = DatasetInfo(name="diabetes", task="regression", input_kind="tabular", input_shape=(10,),
                       n_outputs=1, train_size=len(train), test_size=len(test),
                       source="scikit-learn load_diabetes (target standardised on the train split)")
    return Dataset(info=info, train_x=x[train].contiguous(), train_y=y[train].contiguous(),
                   test_x=x[test].contiguous(), test_y=y[test].contiguous())


def _synthetic_text() -> Dataset:
    """Sequences from a seeded sparse Markov chain: next-token accuracy has a ceiling < 1."""
    rng = np.random.default_rng([DATASET_SEED, 1])
    successors = np.stack([rng.choice(TEXT_VOCAB, TEXT_SUCCESSORS, replace=False) for _ in range(TEXT_VOCAB)])
    weights = rng.dirichlet(np.ones(TEXT_SUCCESSORS) * 0.7, size=TEXT_VOCAB)
    n = TEXT_TRAIN + TEXT_TEST
    seq = np.empty((n, TEXT_SEQ_LEN + 1), dtype=np.int64)
    seq[:, 0] = rng.integers(0, TEXT_VOCAB, n)
    for t in range(1, TEXT_SEQ_LEN + 1):
        prev = seq[:, t - 1]
        u = rng.random(n)[:, None]
        pick = (u > np.cumsum(weights[prev], axis=1)).sum(axis=1).clip(max=TEXT_SUCCESSORS - 1)
        seq[:, t] = successors[prev, pick]
    tokens = torch.from_numpy(seq)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    info = DatasetInfo(name="synthetic-text", task="language-model", input_kind="tokens",
                       input_shape=(TEXT_SEQ_LEN,), n_outputs=TEXT_VOCAB, train_size=TEXT_TRAIN,
                       test_size=TEXT_TEST, source="seeded Markov chain (3 successors per token)")
    return Dataset(info=info, train_x=x[:TEXT_TRAIN].contiguous(), train_y=y[:TEXT_TRAIN].contiguous(),
                   test_x=x[TEXT_TRAIN:].contiguous(), test_y=y[TEXT_TRAIN:].contiguous())


def _synthetic_ratings() -> Dataset:
    """A low-rank user x item matrix of 1..5 ratings, 30% observed; AutoRec-style split.

    Train: x = a user's train ratings (centred, 0 where unknown), y = (the same, mask).
    Held-out: x = the same train vector, y = (held-out ratings, held-out mask).
    """
    rng = np.random.default_rng([DATASET_SEED, 2])
    users = rng.normal(size=(RATINGS_USERS, RATINGS_RANK))
    items = rng.normal(size=(RATINGS_ITEMS, RATINGS_RANK))
    noise = rng.normal(scale=0.3, size=(RATINGS_USERS, RATINGS_ITEMS))
    ratings = np.clip(np.rint(3.0 + 0.6 * users @ items.T + noise), 1, 5) - 3.0
    observed = rng.random((RATINGS_USERS, RATINGS_ITEMS)) < RATINGS_OBSERVED
    held = observed & (rng.random((RATINGS_USERS, RATINGS_ITEMS)) < RATINGS_HELD_OUT)
    train_mask, test_mask = observed & ~held, held
    r = torch.tensor(ratings, dtype=torch.float32)
    tm = torch.tensor(train_mask, dtype=torch.float32)
    hm = torch.tensor(test_mask, dtype=torch.float32)
    x = (r * tm).contiguous()
    info = DatasetInfo(name="synthetic-ratings", task="ratings", input_kind="ratings",
                       input_shape=(RATINGS_ITEMS,), n_outputs=RATINGS_ITEMS, train_size=RATINGS_USERS,
                       test_size=RATINGS_USERS, source="seeded rank-4 rating matrix, 30% observed")
    return Dataset(info=info, train_x=x, train_y=torch.stack([r * tm, tm], dim=1).contiguous(),
                   test_x=x.clone(), test_y=torch.stack([r * hm, hm], dim=1).contiguous())


_LOADERS = {
    "digits": _digits,
    "diabetes": _diabetes,
    "synthetic-text": _synthetic_text,
    "synthetic-ratings": _synthetic_ratings,
}

DATASETS: tuple[str, ...] = tuple(sorted(_LOADERS))


@functools.cache
def load_dataset(name: str) -> Dataset:
    """The named dataset (cached per process). ValueError lists the valid names."""
    loader = _LOADERS.get(name)
    if loader is None:
        raise ValueError(f"dataset: unknown {name!r}; valid: {', '.join(DATASETS)}")
    return loader()


def dataset_info(name: str) -> DatasetInfo:
    return load_dataset(name).info
