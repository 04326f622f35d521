"""What the no-fork TTD bound (``bounds.py``) knows about gangs: levels and type sets.

A gang of W GPUs steps at its slowest worker's rate, so a GPU it holds earns at most
``rho[j, k]`` for the slowest type k among its GPUs, not its own type's ``rho[j, r]``. The
bound's columns for a gang (W >= 2, no forking) are therefore per *level* k: GPU-seconds of
a type r in ``U_j(k) = {r : rho[j, r] >= rho[j, k]}``, each credited ``rho[j, k]``. Every
whole-gang schedule gives a point (a gang's GPUs at a moment are counted at the level of
its slowest type), so the LP stays a lower bound; a single GPU (W = 1) or a forked copy's
GPU keeps its own type's column.

Levels alone change nothing: the LP credits a pure gang per GPU anyway. They make the
*set rows* valid: a gang at level k holds all its W GPUs from ``U_j(k)``, so for a set S of
types with ``N_S`` GPUs, at most ``floor(N_S / w)`` gangs of width >= w run at levels whose
set lies in S at once. Over [a_0 + s, a_0 + T], for the jobs arriving at offset s or later::

    sum_{j: s_j >= s, W_j >= w} sum_{level columns c of j with U(c) in S} X_c / W_j
        <= floor(N_S / w) (T - s)

(``X_c / W_j``: the time gang j runs at that level). Four ImageNet gangs of 10-14 GPUs and
sia-64's 16 A100s: only one runs on A100s alone at a time, where the per-type rows let
each hold a quarter of them throughout. S ranges over the levels' own sets, w over the
gang widths present; :func:`violated` finds the (S, w) pairs whose rows the solution
breaks, and ``bounds.py`` adds each such pair's rows for every arrival offset at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.scheduler.policies.lp.gang_cuts import crowded_sets


def level_columns(rho: np.ndarray, *, gang: bool) -> list[tuple[int, float, int]]:
    """(type r, credited rate per GPU-second, bit mask of the column's type set) of one job
    with per-GPU rates ``rho[r]``: per level for a gang, else one per usable type."""
    usable = [r for r in range(rho.size) if rho[r] > 0]
    if not gang:
        return [(r, float(rho[r]), 1 << r) for r in usable]
    out = []
    for value in sorted({float(rho[r]) for r in usable}, reverse=True):
        members = [r for r in usable if rho[r] >= value]
        mask = sum(1 << r for r in members)
        out += [(r, value, mask) for r in members]
    return out


@dataclass(frozen=True, kw_only=True)
class SetRow:
    """One (type set S, width w) pair: its columns' weight 1 / W_j (0: not in the row) and
    how many gangs of width >= w fit on S's GPUs at once."""

    weight: np.ndarray      # per column
    fit: int


def candidates(col_job: np.ndarray, col_set: np.ndarray, widths: np.ndarray, counts: np.ndarray,
               gang_job: np.ndarray) -> list[SetRow]:
    """The (S, w) pairs that can cut (``lp/gang_cuts.crowded_sets``): S a level's set, w a gang
    width present, more gangs of width >= w with columns in S than fit on it."""
    col_width = np.where(gang_job[col_job], widths[col_job], 0).astype(float)
    col_types = (col_set[:, None] >> np.arange(counts.size)) & 1 == 1
    out = []
    for crowded in crowded_sets(col_width=col_width, col_job=col_job, col_types=col_types,
                                count=np.asarray(counts, dtype=float), members=np.ones(widths.size),
                                whole_cluster=True):
        weight = np.zeros(col_job.size)
        weight[crowded.columns] = 1.0 / widths[col_job[crowded.columns]]
        out.append(SetRow(weight=weight, fit=crowded.fit))
    return out


def violated(row: SetRow, seconds: np.ndarray, col_level: np.ndarray, levels: np.ndarray, t_end: float,
             slack: float) -> bool:
    """Whether the solution (``seconds[c]`` GPU-seconds per column; ``col_level[c]`` the
    arrival level of its job) breaks ``row`` at some arrival offset."""
    time = np.bincount(col_level, weights=seconds * row.weight, minlength=levels.size)
    later = np.cumsum(time[::-1])[::-1]                     # gang time of jobs arriving at level k or later
    room = row.fit * (t_end - levels)
    return bool((later - room > slack * (1.0 + row.fit * t_end)).any())
