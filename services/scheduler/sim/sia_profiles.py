"""Sia's measured step times (``shared/domain/data/sia/profiles``) -> seconds per iteration.

Source: the Sia (SOSP'23) artifact, github.com/siasosp23/artifacts, ``sia-simulator/``
(data copied unchanged; its README names the commit and columns). The rules below restate
how that artifact's simulator reads the data (``applications.py``: ``get_throughput``,
``get_max_local_bsz``; ``job.py``: ``update_local_bsz`` with batch-size tuning off, as its
Gavel baseline runs), so that a rigid job here takes the time it takes there:

* A placement is the replica count per node, e.g. ``(4, 4, 2)``; it is first rotated to its
  lexicographically smallest rotation (a ring has no first node).
* ``step_and_sync_s(placement, local_bsz)``: if the placement has rows in
  ``placements-<cluster>.csv``, linear interpolation over ``local_bsz`` of that placement's
  (step_time, sync_time), ``None`` outside the measured range. Otherwise piecewise-linear
  interpolation (``scipy.interpolate.LinearNDInterpolator``, Delaunay triangulation) over
  (nodes, replicas, local_bsz) of the placement rows averaged per (nodes, replicas,
  local_bsz), plus the ``scalability-<cluster>.csv`` rows, nodes capped at 16; ``None``
  outside their convex hull.
* ``max_local_bsz(placement)``: the largest measured ``local_bsz`` of that placement's rows,
  else of the scalability rows with at least as many nodes and replicas.
* ``iteration(placement, batch)`` for a job of global ``batch`` on ``n`` GPUs: per-GPU
  ``local = ceil(batch / n)``; ``accum = ceil(local / max_local_bsz) - 1`` gradient
  accumulation steps (at least 1 when ``n == 1`` and ``batch`` is above the smallest
  validated batch); ``atomic = ceil(local / (accum + 1))``, capped by the largest measured
  ``local_bsz`` at ``n`` replicas (memory) and by ``max validated batch / (n (accum + 1))``.
  One iteration (one optimizer step of the global batch) takes
  ``step + accum * (step - sync)`` seconds: each accumulation step computes without
  synchronising.

A profile is immutable once built; every query is a pure function of the data.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources

import numpy as np
from scipy.interpolate import LinearNDInterpolator

# Sia's cluster names -> our GPU catalog type and GPUs per node (sia-simulator/simulator_config.py).
CLUSTER_GPU_TYPE = {"aws": "t4", "rtx": "rtx2080ti", "dgx-ext": "a100"}
GPUS_PER_NODE = {"aws": 4, "rtx": 8, "dgx-ext": 8}
APPLICATIONS = ("bert", "cifar10", "deepspeech2", "imagenet", "yolov3")
MAX_INTERPOLATED_NODES = 16  # applications.py caps num_nodes at 16 before interpolating
_EPS = 1e-8                  # Sia's ceil(x - 1e-8): an exact quotient is not rounded up


@dataclass(frozen=True, kw_only=True)
class StepRow:
    """One measured configuration: ``local_bsz`` per GPU on ``placement``."""

    placement: tuple[int, ...]
    local_bsz: int
    step_s: float
    sync_s: float


@dataclass(frozen=True, kw_only=True)
class Iteration:
    """How a rigid job runs one iteration of its global batch on a placement."""

    atomic_bsz: int      # samples per GPU per forward/backward pass
    accum_steps: int     # extra passes accumulated before the synchronising one
    seconds: float       # wall time of one iteration (one optimizer step)

    def realized_batch(self, replicas: int) -> int:
        return replicas * self.atomic_bsz * (self.accum_steps + 1)


def canonical_placement(counts: Sequence[int]) -> tuple[int, ...]:
    """Per-node replica counts without empty nodes, as their smallest rotation."""
    shape = tuple(c for c in counts if c > 0)
    if not shape:
        return ()
    return min(shape[i:] + shape[:i] for i in range(len(shape)))


def packed_placement(replicas: int, gpus_per_node: int) -> tuple[int, ...]:
    """``replicas`` on as few nodes of ``gpus_per_node`` as possible, full nodes first."""
    full, rest = divmod(replicas, gpus_per_node)
    return (gpus_per_node,) * full + ((rest,) if rest else ())


def _data_text(*parts: str) -> str:
    return resources.files("shared.domain").joinpath("data/sia", *parts).read_text(encoding="utf-8")


def _read_rows(text: str, source: str) -> list[dict[str, str]]:
    rows = list(csv.DictReader(text.splitlines()))
    if not rows:
        raise ValueError(f"{source}: no rows")
    return rows


@dataclass(frozen=True, kw_only=True)
class AppProfile:
    """One application's measured step times on one of Sia's clusters (module docstring)."""

    application: str
    cluster: str
    rows: tuple[StepRow, ...]
    shapes: tuple[tuple[int, int, int, float, float], ...]  # scalability: nodes, replicas, local_bsz, step, sync
    _by_placement: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = field(
        init=False, repr=False, compare=False)
    _interpolator: LinearNDInterpolator = field(init=False, repr=False, compare=False)
    _max_local_at: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        grouped: dict[tuple[int, ...], list[StepRow]] = {}
        for row in self.rows:
            grouped.setdefault(canonical_placement(row.placement), []).append(row)
        by_placement = {}
        for shape, group in grouped.items():
            group.sort(key=lambda r: r.local_bsz)
            by_placement[shape] = (np.array([r.local_bsz for r in group], dtype=float),
                                   np.array([r.step_s for r in group]), np.array([r.sync_s for r in group]))
        object.__setattr__(self, "_by_placement", by_placement)
        mean: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
        for row in self.rows:
            key = (len(row.placement), sum(row.placement), row.local_bsz)
            mean.setdefault(key, []).append((row.step_s, row.sync_s))
        points = [(*k, float(np.mean([v[0] for v in vs])), float(np.mean([v[1] for v in vs])))
                  for k, vs in mean.items()]
        points += [(n, r, b, s, y) for n, r, b, s, y in self.shapes]
        xs = np.array([p[:3] for p in points], dtype=float)
        ys = np.array([p[3:] for p in points], dtype=float)
        object.__setattr__(self, "_interpolator", LinearNDInterpolator(xs, ys))
        max_local: dict[int, int] = {}
        for row in self.rows:
            n = sum(row.placement)
            max_local[n] = max(max_local.get(n, 0), row.local_bsz)
        object.__setattr__(self, "_max_local_at", max_local)

    @classmethod
    def load(cls, application: str, cluster: str) -> AppProfile:
        """The packaged profile; ``ValueError`` for an application or cluster it lacks."""
        if application not in APPLICATIONS or cluster not in CLUSTER_GPU_TYPE:
            raise ValueError(f"no Sia profile for {application!r} on {cluster!r}; applications: "
                             f"{', '.join(APPLICATIONS)}; clusters: {', '.join(CLUSTER_GPU_TYPE)}")
        source = f"profiles/{application}/placements-{cluster}.csv"
        rows = tuple(StepRow(placement=tuple(int(c) for c in r["placement"].strip()),
                             local_bsz=int(r["local_bsz"]), step_s=float(r["step_time"]),
                             sync_s=float(r["sync_time"]))
                     for r in _read_rows(_data_text("profiles", application, f"placements-{cluster}.csv"), source))
        scal = f"profiles/{application}/scalability-{cluster}.csv"
        shapes = tuple((int(r["num_nodes"]), int(r["num_replicas"]), int(r["local_bsz"]), float(r["step_time"]),
                        float(r["sync_time"]))
                       for r in _read_rows(_data_text("profiles", application, f"scalability-{cluster}.csv"), scal))
        return cls(application=application, cluster=cluster, rows=rows, shapes=shapes)

    @property
    def min_local_bsz(self) -> int:
        return min(r.local_bsz for r in self.rows)

    def measured_shapes(self, replicas: int) -> tuple[tuple[int, ...], ...]:
        """The placements with rows that hold ``replicas`` GPUs in all."""
        return tuple(shape for shape in self._by_placement if sum(shape) == replicas)

    def step_and_sync_s(self, placement: Sequence[int], local_bsz: float, *,
                        use_rows: bool = True) -> tuple[float, float] | None:
        """(step, sync) seconds of one pass at ``local_bsz`` per GPU, or None where unmeasured.

        ``use_rows=False``: as for a placement without rows (the interpolation, which depends
        only on the node and replica counts).
        """
        shape = canonical_placement(placement)
        if not shape:
            return None
        measured = self._by_placement.get(shape) if use_rows else None
        if measured is not None:
            bsz, step, sync = measured
            if not bsz[0] <= local_bsz <= bsz[-1]:
                return None
            return float(np.interp(local_bsz, bsz, step)), float(np.interp(local_bsz, bsz, sync))
        nodes = min(len(shape), MAX_INTERPOLATED_NODES)
        value = self._interpolator([[nodes, sum(shape), local_bsz]])[0]
        if not np.all(np.isfinite(value)):
            return None
        return float(value[0]), float(value[1])

    def max_local_bsz(self, placement: Sequence[int], *, use_rows: bool = True) -> int | None:
        shape = canonical_placement(placement)
        measured = self._by_placement.get(shape) if use_rows else None
        if measured is not None:
            return int(measured[0][-1])
        nodes, replicas = len(shape), sum(shape)
        wider = [b for n, r, b, _, _ in self.shapes if n >= nodes and r >= replicas]
        return max(wider) if wider else None

    def iteration(self, placement: Sequence[int], batch: int, *, min_batch: int,
                  max_batch: int, use_rows: bool = True) -> Iteration | None:
        """One iteration of global ``batch`` on ``placement`` (module docstring), or None.

        ``min_batch`` / ``max_batch``: the application's smallest and largest validated
        global batch (``sia_work``). None where the data cannot say how fast it runs.
        """
        shape = canonical_placement(placement)
        n = sum(shape)
        max_local = self.max_local_bsz(shape, use_rows=use_rows)
        if n == 0 or max_local is None:
            return None
        local = math.ceil(batch / n - _EPS)
        accum = math.ceil(local / max_local - _EPS) - 1
        if n == 1 and batch > min_batch:
            accum = max(1, accum)
        atomic = math.ceil(local / (accum + 1) - _EPS)
        if n in self._max_local_at:
            atomic = min(atomic, self._max_local_at[n])
        atomic = min(atomic, int(max_batch / (n * (accum + 1))))
        times = self.step_and_sync_s(shape, atomic, use_rows=use_rows) if atomic > 0 else None
        if times is None:
            return None
        step, sync = times
        seconds = step + accum * (step - sync)
        if not seconds > 0:
            return None
        return Iteration(atomic_bsz=atomic, accum_steps=accum, seconds=seconds)
