"""Hadar's resource prices and job utilities.

Price of one GPU of row (node h, type r) in future round t, as a function of the
fraction ``zeta = z_h^r(t) / C_h^r`` of that row already committed::

    k(zeta) = (L / eta) * (eta^2 * U / L) ** zeta

so ``k(0) = L / eta`` (below the lowest value per GPU-round of any job: on an idle
cluster every job can pay) and ``k(1) = eta * U`` (above the highest: no job could pay for
a GPU of a full row). ``L`` (``value_lo``) and ``U`` (``value_hi``) are the lowest and
highest value per GPU-round over the jobs (see ``value_density_bounds``), ``eta``
(``PRICE_SCALE``) is the scaling constant. ``alpha = max(1, ln(eta^2 U / L))`` is the
factor of the competitive bound (module docstring of ``hadar.py``).

A utility maps a job and a completion time to a value; it must be non-increasing in the
completion time. The default, ``InverseSlowdown``, is ``priority x min(1, iso / JCT)``:
the job's weight times the reciprocal of its finish-time slowdown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from services.scheduler.core.policy import JobState

PRICE_SCALE = 2.0    # eta: k(0) = L / eta, k(1) = eta * U
VALUE_FLOOR = 1e-12  # L is never below this (a job of zero priority would otherwise make L = 0)


class Utility(Protocol):
    def values(self, job: JobState, iso_s: float, completion_s: np.ndarray) -> np.ndarray:
        """Value of finishing ``job`` at each of ``completion_s`` (non-increasing in it)."""
        ...


@dataclass(frozen=True, kw_only=True)
class InverseSlowdown:
    """``u = priority x min(1, iso_s / (completion_s - arrival_s))``.

    ``iso_s`` is the job's isolated run time (all its steps on the fastest placement the
    cluster offers it), so the ratio is the reciprocal of its finish-time slowdown.
    """

    def values(self, job: JobState, iso_s: float, completion_s: np.ndarray) -> np.ndarray:
        jct = np.maximum(np.asarray(completion_s, dtype=float) - job.arrival_s, 1e-9)
        return max(job.priority, 0.0) * np.minimum(1.0, iso_s / jct)


@dataclass(frozen=True, kw_only=True)
class PriceCurve:
    value_lo: float            # L: lowest value per GPU-round of any job
    value_hi: float            # U: highest value per GPU-round of any job
    scale: float = PRICE_SCALE  # eta >= 1

    def __post_init__(self) -> None:
        if not (self.value_lo > 0 and self.value_hi >= self.value_lo and self.scale >= 1):
            raise ValueError(f"PriceCurve needs 0 < L <= U and eta >= 1, got {self}")

    @property
    def floor(self) -> float:
        """k(0) = L / eta."""
        return self.value_lo / self.scale

    @property
    def ceiling(self) -> float:
        """k(1) = eta * U."""
        return self.value_hi * self.scale

    @property
    def alpha(self) -> float:
        return max(1.0, math.log(self.ceiling / self.floor))

    def price(self, fill: np.ndarray | float) -> np.ndarray:
        """k(zeta) for committed fractions ``fill`` in [0, 1]; non-decreasing in ``fill``."""
        return self.floor * (self.ceiling / self.floor) ** np.asarray(fill, dtype=float)

    def table(self, max_cap: int) -> np.ndarray:
        """``t[C, z] = k(z / C)`` for 1 <= C <= max_cap, 0 <= z <= C (other cells +inf)."""
        t = np.full((max_cap + 1, max_cap + 1), np.inf)
        for cap in range(1, max_cap + 1):
            t[cap, : cap + 1] = self.price(np.arange(cap + 1) / cap)
        return t


@dataclass(frozen=True, kw_only=True)
class DensityInput:
    """What ``value_density_bounds`` needs of one job (built by the policy)."""

    job: JobState
    iso_s: float
    fastest_steps: float   # steps per round of the job's fastest option
    slowest_steps: float   # steps per round of its slowest option


def value_densities(items: list[DensityInput], utility: Utility, *, now_s: float, round_s: float,
                    horizon: int) -> dict[str, tuple[float, float]]:
    """Per job with work left: (best, worst) value per GPU-round.

    Best: the fastest option from now, ``u(now + n_fast rounds) / (W n_fast)``. Worst: the
    slowest option finishing after the horizon, ``u(now + (H + n_slow) rounds) / (W n_slow)``.
    """
    out: dict[str, tuple[float, float]] = {}
    for it in items:
        job = it.job
        if job.remaining <= 0 or it.fastest_steps <= 0 or it.slowest_steps <= 0:
            continue
        n_fast = max(1, math.ceil(job.remaining / it.fastest_steps))
        n_slow = max(1, math.ceil(job.remaining / it.slowest_steps))
        when = now_s + round_s * np.array([n_fast, horizon + n_slow], dtype=float)
        u_fast, u_slow = utility.values(job, it.iso_s, when)
        out[job.job_id] = (float(u_fast) / (job.workers * n_fast), float(u_slow) / (job.workers * n_slow))
    return out


def density_bounds(densities: dict[str, tuple[float, float]]) -> tuple[float, float] | None:
    """(L, U): the lowest worst and the highest best density (L floored at VALUE_FLOOR);
    None when there is no job or every value is 0."""
    hi = max((best for best, _ in densities.values()), default=0.0)
    if hi <= 0:
        return None
    lo = max(min(worst for _, worst in densities.values()), VALUE_FLOOR)
    return lo, max(hi, lo)
