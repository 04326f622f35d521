"""What the no-fork TTD bound (``bounds.py``) knows about rounds: a gang holds its GPUs until
the round ends.

A gang placed in a round keeps its W GPUs until the round's end, even when it finishes
early (``simulator.py``: "its GPUs are freed only then", as in Gavel), so job j runs at
least ``n_j = ceil((d_j + w_j / R_j) / round_s)`` rounds (``d_j`` its first start, ``R_j``
its best copy rate) and holds ``W_j (n_j round_s - d_j)`` GPU-seconds besides its first
start. Only the part of a round after the end T can fall outside the bound's window: with
``Z_j`` that part, the rows are::

    sum_{c of j} X_c + Z_j >= W_j (n_j round_s - d_j)     every job where it binds
    Z_j <= W_j round_s,   sum_j Z_j <= N round_s           (one round of the cluster at most)

Why it matters: most jobs of Sia's Philly-derived workloads finish within one round at
their best rate (132-141 of 160 per workload), and a 16-GPU gang that needs a third of a
round holds its 16 A100s for all of it. The fork bound has no such rows: a forked job's
last round may be one small copy.
"""

from __future__ import annotations

import numpy as np


def held_at_least(fastest_s: np.ndarray, start: np.ndarray, widths: np.ndarray, gpu_coef: np.ndarray,
                  col_job: np.ndarray, round_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(the jobs whose whole rounds bind, the GPU-seconds each holds at the least besides its
    first start), from each job's ``fastest_s`` (its work at its best copy rate), ``start``
    (d_j), ``widths`` (W_j) and the bound's columns (``gpu_coef[c]``: GPU-seconds all of
    job ``col_job[c]``'s work takes on column c). A job is kept where that is more than its
    work takes on its cheapest column (else the row cannot bind)."""
    rounds = np.ceil((start + fastest_s) / round_s - 1e-9)
    held = widths * (rounds * round_s - start)
    cheapest = np.full(widths.size, np.inf)
    np.minimum.at(cheapest, col_job, gpu_coef)
    chosen = np.flatnonzero(held > cheapest * (1.0 + 1e-9) + 1e-9)
    return chosen, held[chosen]


def rows(chosen: np.ndarray, held: np.ndarray, *, n_jobs: int, col_job: np.ndarray, gpu_coef: np.ndarray,
         z_base: int, gpus: float, round_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The module's rows as ``A_ub x <= b_ub`` blocks (rows, columns, values, right-hand
    sides; rows numbered from 0), the columns' variables at their indices and ``Z`` of the
    i-th chosen job at ``z_base + i``; the last row is ``sum Z <= gpus round_s``."""
    row_of = np.full(n_jobs, -1)
    row_of[chosen] = np.arange(chosen.size)
    members = np.flatnonzero(row_of[col_job] >= 0)
    z = z_base + np.arange(chosen.size)
    last = np.full(chosen.size, chosen.size)
    return (np.concatenate([row_of[col_job[members]], np.arange(chosen.size), last]),
            np.concatenate([members, z, z]),
            np.concatenate([-gpu_coef[members], -np.ones(chosen.size), np.ones(chosen.size)]),
            np.concatenate([-held, [gpus * round_s]]))
