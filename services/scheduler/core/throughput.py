"""Throughput model: steps/s of a job copy on a placement of GPUs.

Unit: a rate is a copy's own steps per second, one step being one optimizer step of the
copy's global batch (its workers x the per-worker batch), as the agent counts them. How a
copy's steps count toward its job is ``shared.domain.progress`` (docs/architecture.md "Work
accounting").

Rules (how the policies use them: docs/architecture.md "Policies"):

* ``rate(job_type, gpu_type, n)`` is a copy's steps/s on ``n`` GPUs of one type on one
  node ("consolidated"). Taken from the table when it has the exact entry (a 0 there
  means the job cannot run that way, e.g. ResNet-50 at batch 128 on several K80s); else
  the step rate of the nearest measured worker count of that type (preferring a smaller
  one: per-worker throughput held, as Gavel's linear scaling of per-worker steps); else
  from the ``fallback`` estimator (GPU types the table lacks), in the same unit; else 0.
* Gavel's table counts a step per *worker*: its scheduler sums the steps of a gang's
  workers, and its entry at scale n is n x the copy's step rate. ``from_gavel_table``
  divides every entry (consolidated and unconsolidated) by its n.
* A placement is a list of parts ``(node, gpu_type, count)`` with n = sum of counts
  workers. One type on one node runs at ``rate(type, n)``. Otherwise the synchronous
  data-parallel copy steps at the pace of its slowest worker, ``min over used types of
  rate(type, n)``, times the cross-node factor when it spans nodes.
* Cross-node factor, for a placement spanning nodes: the table's
  ``<type>_unconsolidated / <type>`` ratio at scale n (minimum over the used types, capped
  at 1) where the table has it; else ``default_cross_node`` (0.8: a typical allreduce
  slowdown over 10-25 GbE for the mid-sized models of the table). ``cross_node=False``
  ignores placement, as Gavel's simulator does (it models GPUs, not machines).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources

Fallback = Callable[[str, str, int], float]  # (job type, GPU type, n) -> a copy's steps/s, as ``rate``
_KEY_RE = re.compile(r"^\('(?P<job>.+)', (?P<scale>\d+)\)$")
DEFAULT_CROSS_NODE = 0.8


@dataclass(frozen=True)
class Part:
    """``count`` GPUs of ``gpu_type`` on ``node_id`` used by one job copy."""

    node_id: str
    gpu_type: str
    count: int


@dataclass(frozen=True, kw_only=True)
class ThroughputModel:
    rates: Mapping[tuple[str, str, int], float]
    unconsolidated: Mapping[tuple[str, str, int], float] = field(default_factory=dict)
    fallback: Fallback | None = None
    default_cross_node: float = DEFAULT_CROSS_NODE
    cross_node: bool = True
    # (job_type, gpu_type) -> sorted measured worker counts, derived from ``rates``.
    _scales: dict[tuple[str, str], tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        scales: dict[tuple[str, str], list[int]] = {}
        for job_type, gpu_type, n in self.rates:
            scales.setdefault((job_type, gpu_type), []).append(n)
        object.__setattr__(self, "_scales", {k: tuple(sorted(v)) for k, v in scales.items()})

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gavel_table(cls, path: str | None = None, *, fallback: Fallback | None = None,
                         cross_node: bool = True) -> ThroughputModel:
        """Load Gavel's ``simulation_throughputs.json`` (the packaged copy by default), each
        entry divided by its worker count (module docstring)."""
        if path is None:
            text = resources.files("shared.domain").joinpath("data/gavel_throughputs.json").read_text()
        else:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        raw = json.loads(text)
        rates: dict[tuple[str, str, int], float] = {}
        uncons: dict[tuple[str, str, int], float] = {}
        for table_type, entries in raw.items():
            gpu_type, _, suffix = table_type.partition("_")
            target = uncons if suffix == "unconsolidated" else rates
            for key, value in entries.items():
                m = _KEY_RE.match(key)
                if m is None or "null" not in value:
                    continue
                scale = int(m["scale"])
                # Gavel: steps summed over the gang's workers -> the copy's own steps
                target[(m["job"], gpu_type, scale)] = float(value["null"]) / scale
        return cls(rates=rates, unconsolidated=uncons, fallback=fallback, cross_node=cross_node)

    def with_rates(self, extra: Mapping[tuple[str, str, int], float]) -> ThroughputModel:
        """A model where ``extra`` entries override or add to this one's (e.g. measurements)."""
        merged = dict(self.rates)
        merged.update(extra)
        return ThroughputModel(rates=merged, unconsolidated=self.unconsolidated, fallback=self.fallback,
                               default_cross_node=self.default_cross_node, cross_node=self.cross_node)

    # ------------------------------------------------------------------ queries

    @property
    def job_types(self) -> tuple[str, ...]:
        return tuple(sorted({j for j, _, _ in self.rates}))

    def scales(self, job_type: str, gpu_type: str) -> tuple[int, ...]:
        """Worker counts measured for this job type on this GPU type."""
        return self._scales.get((job_type, gpu_type), ())

    def rate(self, job_type: str, gpu_type: str, n: int) -> float:
        """A copy's own steps/s on ``n`` GPUs of ``gpu_type`` on one node."""
        if n <= 0:
            return 0.0
        exact = self.rates.get((job_type, gpu_type, n))
        if exact is not None:
            return exact
        measured = self._scales.get((job_type, gpu_type))
        if measured:
            smaller = [s for s in measured if s < n]
            return self.rates[(job_type, gpu_type, smaller[-1] if smaller else measured[0])]
        if self.fallback is not None:
            return max(0.0, float(self.fallback(job_type, gpu_type, n)))
        return 0.0

    def per_worker(self, job_type: str, gpu_type: str, n: int) -> float:
        return self.rate(job_type, gpu_type, n) / n if n > 0 else 0.0

    def cross_node_factor(self, job_type: str, gpu_types: Iterable[str], n: int) -> float:
        if not self.cross_node:
            return 1.0
        factors = []
        for gpu_type in set(gpu_types):
            cons = self.rates.get((job_type, gpu_type, n))
            unc = self.unconsolidated.get((job_type, gpu_type, n))
            if cons and unc is not None:
                factors.append(min(1.0, unc / cons))
        return min(factors) if factors else self.default_cross_node

    def spanning_bound(self, job_type: str, gpu_type: str, n: int) -> float | None:
        """An upper bound on a copy's steps/s on any placement of ``n`` workers across nodes
        that includes a ``gpu_type`` GPU, for a model whose spanning rates are not ``rate``
        times a factor (``services.scheduler.sim.sia_table``); None here: the lower bounds use
        ``rate`` and the cross-node factor (``services/scheduler/sim/bounds.py``)."""
        return None

    def placement_rate(self, job_type: str, parts: Iterable[Part]) -> float:
        """A copy's own steps/s on a placement made of ``parts`` (see module docstring)."""
        parts = [p for p in parts if p.count > 0]
        if not parts:
            return 0.0
        n = sum(p.count for p in parts)
        types = {p.gpu_type for p in parts}
        nodes = {p.node_id for p in parts}
        base = min(self.rate(job_type, t, n) for t in types)
        if len(nodes) > 1:
            base *= self.cross_node_factor(job_type, types, n)
        return base
