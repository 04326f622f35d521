"""Placement options of a (job type, gang size W) on a cluster, for Hadar's dynamic program.

An option is a class of W-GPU placements with a planned rate that every placement of the
class reaches or beats (``ThroughputModel.placement_rate`` semantics):

* ``node`` option of type r: W GPUs of type r on one node; rate = ``rate(job, r, W)``
  exactly. Needs a row (node, type r) of capacity >= W and a positive rate.
* ``spread`` option with bottleneck type b (W >= 2): any W GPUs whose per-worker rate at W
  is >= that of b (the eligible types E_b), on any nodes; planned rate =
  ``W x per_worker(b, W) x cross_node_factor(job, E_b, W)``. A real placement uses a subset
  of E_b (its cross-node factor, a minimum over the types used, is >= the one over E_b) and
  its slowest worker is no slower than b; if it lands on one node there is no penalty. So
  the planned rate is a lower bound and committed progress is never overestimated.
* ``spread`` option with bottleneck b kept across nodes (W >= 2), where a faster type
  loses more across nodes than b does: the types of E_b whose own cross-node factor is at
  least b's (E'_b); planned rate ``W x per_worker(b, W) x factor(b)``, a lower bound by the
  same argument. Without it a job bound by its all-reduce was planned at its fastest type's
  factor: LM (batch size 20) on 8 GPUs across nodes runs 8.23 steps/s on P100s and 7.36 on
  V100s (0.12 of their rate on one node), but "P100 or faster" was planned at 1.73.

Options count is at most 3 x (number of GPU types).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.scheduler.core.throughput import ThroughputModel

RATE_EPS = 1e-12


@dataclass(frozen=True, kw_only=True)
class Option:
    label: str          # e.g. "v100@node", "k80+@spread"
    one_node: bool
    gpu_type: int       # type index: the type (node option) or the bottleneck (spread option)
    eligible: np.ndarray = field(compare=False)  # (R,) bool: types this option may use
    rate: float         # planned steps/s, a lower bound for any placement of the option


@dataclass(frozen=True, kw_only=True, eq=False)
class JobProfile:
    job_type: str
    workers: int
    per_worker: np.ndarray       # (R,) steps/s per worker at gang size W, per cluster type
    options: tuple[Option, ...]
    signature: tuple[float, ...]  # rates the options were derived from (to detect drift)
    tie_order: np.ndarray        # (HR,) rows by preference on equal price (see ``tie_order``)
    candidates: tuple[np.ndarray, ...]  # per option: rows it may use (capacity permitting), in tie order

    @property
    def feasible(self) -> bool:
        return bool(self.options)

    @property
    def best_rate(self) -> float:
        return max((o.rate for o in self.options), default=0.0)

    @property
    def worst_rate(self) -> float:
        return min((o.rate for o in self.options), default=0.0)


def build_profile(throughput: ThroughputModel, job_type: str, workers: int, *, types: tuple[str, ...],
                  gpus_per_type: np.ndarray, max_row_cap: np.ndarray, row_type: np.ndarray,
                  row_cap: np.ndarray) -> JobProfile:
    """The options of ``job_type`` at gang size ``workers`` on a cluster with ``types``."""
    w = workers
    whole = np.array([throughput.rate(job_type, t, w) for t in types], dtype=float)
    per_worker = whole / w
    options: list[Option] = []
    factors: list[float] = []
    for r, t in enumerate(types):
        if whole[r] > RATE_EPS and max_row_cap[r] >= w:
            only = np.zeros(len(types), dtype=bool)
            only[r] = True
            options.append(Option(label=f"{t}@node", one_node=True, gpu_type=r, eligible=only, rate=whole[r]))
    if w >= 2:
        kept = np.array([throughput.cross_node_factor(job_type, [t], w) for t in types], dtype=float)
        for b, t in enumerate(types):
            if per_worker[b] <= RATE_EPS:
                continue
            faster = per_worker >= per_worker[b]
            keeps_as_much = faster & (kept >= kept[b])   # E'_b; the same set as E_b where no faster type loses more
            for eligible, label in ((faster, f"{t}+@spread"), (keeps_as_much, f"{t}+@spread>=x{kept[b]:.2f}")):
                if gpus_per_type[eligible].sum() < w:
                    continue
                factor = throughput.cross_node_factor(job_type, [types[r] for r in np.flatnonzero(eligible)], w)
                factors.append(factor)
                rate = w * per_worker[b] * factor
                same = any(not o.one_node and o.rate >= rate and (o.eligible == eligible).all() for o in options)
                if rate > RATE_EPS and not same:
                    options.append(Option(label=label, one_node=False, gpu_type=b, eligible=eligible, rate=rate))
    order = tie_order(per_worker, row_type, row_cap)
    candidates = tuple(order[option.eligible[row_type[order]] & (row_cap[order] >= (w if option.one_node else 1))]
                       for option in options)
    return JobProfile(job_type=job_type, workers=w, per_worker=per_worker, options=tuple(options),
                      signature=tuple(whole.tolist()) + tuple(factors), tie_order=order, candidates=candidates)


def tie_order(per_worker: np.ndarray, row_type: np.ndarray, row_cap: np.ndarray) -> np.ndarray:
    """Rows in the order used to break price ties: slowest type for this job first (keeps
    fast GPUs for jobs that need them), then larger rows (fewer nodes), then row index."""
    rows = np.arange(row_type.size)
    return np.lexsort((rows, -row_cap, per_worker[row_type]))


def signature_drifted(old: tuple[float, ...], new: tuple[float, ...], tolerance: float) -> bool:
    """True when any rate changed by more than ``tolerance`` (relative) or the shape changed."""
    if len(old) != len(new):
        return True
    return any(abs(a - b) > tolerance * max(abs(a), abs(b), RATE_EPS) for a, b in zip(old, new))


class ProfileBook:
    """Profiles of every (job type, W) seen in one planning round, computed once each."""

    def __init__(self, throughput: ThroughputModel, *, types: tuple[str, ...], row_type: np.ndarray,
                 row_cap: np.ndarray) -> None:
        self._throughput = throughput
        self._types = types
        self._row_type = row_type
        self._row_cap = row_cap
        n = len(types)
        self._gpus_per_type = np.bincount(row_type, weights=row_cap, minlength=n)
        self._max_row_cap = np.zeros(n, dtype=int)
        np.maximum.at(self._max_row_cap, row_type, row_cap)
        self._cache: dict[tuple[str, int], JobProfile] = {}

    def get(self, job_type: str, workers: int) -> JobProfile:
        key = (job_type, workers)
        prof = self._cache.get(key)
        if prof is None:
            prof = build_profile(self._throughput, job_type, workers, types=self._types,
                                 gpus_per_type=self._gpus_per_type, max_row_cap=self._max_row_cap,
                                 row_type=self._row_type, row_cap=self._row_cap)
            self._cache[key] = prof
        return prof
