"""Rows that keep the no-fork LP honest about gangs: a gang holds all its W GPUs at once.

The LPs of ``lp/model`` / ``lp/timeline`` count GPU-seconds, so on their own they
let a gang run part-time on part of its GPUs beside jobs that could never use the rest.
For each gang width w >= 2 of the jobs present (N GPUs in all), with *wide* jobs those of
width >= w and *narrow* the others, and tau the time in an interval of length L during
which some wide gang runs (an extra variable, 0 <= tau <= L):

* (a) at most fit = floor(N / w) wide gangs run at once: sum_wide X / W_j <= fit tau
  (X / W_j: the time gang j runs);
* (a_S) the same within a set S of GPU types, N_S GPUs: a column whose option may use only
  types of S (a GPU type's one-node option, or a spread option whose eligible types are in
  S) holds its gang's W_j GPUs all from S, so at most floor(N_S / w) wide gangs run on such
  columns at once: sum over those columns X / W_j <= floor(N_S / w) L. Without it the LP
  gives two gangs too wide to share the fast type part of it each, throughout, and credits
  each GPU at its own type's rate, where a gang of mixed types steps at its slowest
  worker's. S ranges over the columns' own type sets (a spread option's are the types at
  least as fast as its slowest: Hadar's levels), so the rows stay few;
* while a wide gang runs, narrow jobs hold at most N - w GPUs; otherwise narrow job s holds
  at most W_s. So with y_s >= 0 the part of s's GPU-seconds X_s done beside a wide gang:
  (b) X_s - y_s <= W_s (L - tau) for each narrow job s, and (c) sum_s y_s <= (N - w) tau.

Every schedule of whole gangs satisfies them (take tau = the measure of that time, y_s =
what s does in it), so the LP stays a relaxation. (b) and (c) are what tie a gang's time
to the GPUs narrow jobs leave idle: a narrow job that is done holds nothing, so the LP no
longer fills a gang's off-time with work that does not exist. A width is left out where
its rows cannot cut: at most fit wide gangs and narrow jobs of at most N - w GPUs in all.

Cost: per width and interval, 1 + S variables and S + 3 rows (S narrow jobs), and one row
per set of types that can cut.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix, csr_matrix


@dataclass(frozen=True, kw_only=True)
class GangRows:
    """The rows of one interval: ``x @ X + extra @ E <= length * L`` (X the LP's columns,
    E >= 0 the extra variables tau and y, L the interval's length or the makespan T)."""

    x: csr_matrix
    extra: csr_matrix
    length: np.ndarray

    @property
    def n_extra(self) -> int:
        n: int = self.extra.shape[1]
        return n


def gang_rows(*, width: np.ndarray, members: np.ndarray, total: float, col_job: np.ndarray,
              col_types: np.ndarray | None = None, count: np.ndarray | None = None) -> GangRows:
    """The module's rows for LP rows of gang width ``width[j]`` (0: divisible work, no rows),
    each standing for ``members[j]`` gangs (a pooled class), ``total`` GPUs, and columns of
    jobs ``col_job``; with ``col_types[c]`` (bool per GPU type: what column c may hold) and
    ``count`` (GPUs per type), also the rows (a_S)."""
    n_c = col_job.size
    rows_x: list[tuple[int, int | np.intp, float]] = []   # columns from np.flatnonzero are numpy ints
    rows_e: list[tuple[int, int, float]] = []
    length: list[float] = []
    n_e = 0
    if width.size:
        for w in sorted({float(x) for x in width if x >= 2}):
            fit = math.floor(total / w + 1e-9)
            if fit < 1:
                continue
            wide = width >= w
            narrow = np.flatnonzero(~wide & (width > 0))
            narrow_gpus = float((width[narrow] * members[narrow]).sum())
            splits = narrow_gpus > total - w + 1e-9
            if members[wide].sum() <= fit + 1e-9 and not splits:
                continue
            tau, row = n_e, len(length)
            n_e += 1
            rows_x += [(row, c, 1.0 / width[col_job[c]]) for c in np.flatnonzero(wide[col_job])]   # (a)
            rows_e.append((row, tau, -float(fit)))
            length.append(0.0)
            rows_e.append((row + 1, tau, 1.0))                                                   # tau <= L
            length.append(1.0)
            if not splits:
                continue
            slot = {int(s): i for i, s in enumerate(narrow)}
            first_b = len(length)
            for i, s in enumerate(narrow):                                                       # (b)
                cap = float(width[s] * members[s])
                rows_e += [(first_b + i, n_e + i, -1.0), (first_b + i, tau, cap)]
                length.append(cap)
            rows_x += [(first_b + slot[int(col_job[c])], c, 1.0) for c in range(n_c) if int(col_job[c]) in slot]
            row_c = len(length)                                                                  # (c)
            rows_e += [(row_c, n_e + i, 1.0) for i in range(narrow.size)] + [(row_c, tau, -(total - w))]
            length.append(0.0)
            n_e += narrow.size
    if width.size and col_types is not None and count is not None:
        col_width = np.where(width[col_job] >= 2, width[col_job], 0.0)
        for crowded in crowded_sets(col_width=col_width, col_job=col_job, col_types=col_types, count=count,
                                    members=members, whole_cluster=False):
            rows_x += [(len(length), c, 1.0 / float(width[col_job[c]])) for c in crowded.columns]
            length.append(float(crowded.fit))
    n_rows = len(length)
    return GangRows(x=_sparse(rows_x, (n_rows, n_c)), extra=_sparse(rows_e, (n_rows, n_e)),
                    length=np.array(length))


@dataclass(frozen=True, kw_only=True)
class CrowdedSet:
    """A set S of GPU types and a gang width w whose row (a_S) can cut: more gangs of width
    >= w have columns within S than ``fit`` = floor(N_S / w) of them run on S at once."""

    width: float
    columns: np.ndarray   # the columns of gangs of width >= w whose types all lie in S
    fit: int


def crowded_sets(*, col_width: np.ndarray, col_job: np.ndarray, col_types: np.ndarray, count: np.ndarray,
                 members: np.ndarray, whole_cluster: bool) -> list[CrowdedSet]:
    """Every (S, w) pair that can cut, S ranging over the wide columns' own type sets.

    ``col_width[c]``: the gang width of column c's job (below 2: not a gang); ``col_types[c]``
    (bool per GPU type): the types column c may hold; ``count``: GPUs per type; ``members[j]``:
    how many gangs LP row j stands for (a pooled class). ``whole_cluster=False`` leaves out S =
    every type, where a caller's own row (a) already holds. Used by the policies' LPs
    (:func:`gang_rows`) and the no-fork TTD bound (``sim/bound_gangs``) alike."""
    everything = count > 0
    out = []
    for w in sorted({float(x) for x in col_width if x >= 2}):
        wide_cols = np.flatnonzero(col_width >= w)
        for key in sorted({col_types[c].tobytes() for c in wide_cols}):
            s = np.frombuffer(key, dtype=bool)
            if not whole_cluster and (everything & ~s).sum() == 0:
                continue
            fit = math.floor(float(count[s].sum()) / w + 1e-9)
            inside = wide_cols[~(col_types[wide_cols] & ~s).any(axis=1)]
            if members[np.unique(col_job[inside])].sum() <= fit + 1e-9:
                continue
            out.append(CrowdedSet(width=w, columns=inside, fit=fit))
    return out


def _sparse(entries: Sequence[tuple[int, int | np.intp, float]], shape: tuple[int, int]) -> csr_matrix:
    if not entries:
        return csr_matrix(shape)
    r, c, v = zip(*entries)
    return coo_matrix((v, (r, c)), shape=shape).tocsr()
