"""Throughput model: steps/s of a job on a placement of GPUs.

Rules (how the policies use them: docs/architecture.md "Policies"):

* ``rate(job_type, gpu_type, n)`` is the whole job's steps/s on ``n`` GPUs of one type on
  one node ("consolidated"). Taken from the table when it has the exact entry (a 0 there
  means the job cannot run that way, e.g. ResNet-50 at batch 128 on several K80s); else
  scaled linearly from the nearest measured worker count of that type (preferring a
  smaller one); else from the ``fallback`` estimator (GPU types the table lacks); else 0.
* A placement is a list of parts ``(node, gpu_type, count)`` with n = sum of counts
  workers. One type on one node runs at ``rate(type, n)``. Otherwise the synchronous
  data-parallel job runs at ``n x min over used types of rate(type, n) / n`` -- every
  worker waits for the slowest -- times the cross-node factor when it spans nodes.
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

Fallback = Callable[[str, str, int], float]
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
                         cross_node: bool = True) -> "ThroughputModel":
        """Load Gavel's ``simulation_throughputs.json`` (the packaged copy by default)."""
        if path is None:
            text = resources.files("shared").joinpath("data/gavel_throughputs.json").read_text()
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
                target[(m["job"], gpu_type, int(m["scale"]))] = float(value["null"])
        return cls(rates=rates, unconsolidated=uncons, fallback=fallback, cross_node=cross_node)

    def with_rates(self, extra: Mapping[tuple[str, str, int], float]) -> "ThroughputModel":
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
        """Whole-job steps/s on ``n`` GPUs of ``gpu_type`` on one node."""
        if n <= 0:
            return 0.0
        exact = self.rates.get((job_type, gpu_type, n))
        if exact is not None:
            return exact
        measured = self._scales.get((job_type, gpu_type))
        if measured:
            smaller = [s for s in measured if s < n]
            base = smaller[-1] if smaller else measured[0]
            base_rate = self.rates[(job_type, gpu_type, base)]
            return base_rate * n / base
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

    def placement_rate(self, job_type: str, parts: Iterable[Part]) -> float:
        """Whole-copy steps/s of a placement made of ``parts`` (see module docstring)."""
        parts = [p for p in parts if p.count > 0]
        if not parts:
            return 0.0
        n = sum(p.count for p in parts)
        types = {p.gpu_type for p in parts}
        nodes = {p.node_id for p in parts}
        if len(types) == 1:
            (gpu_type,) = types
            base = self.rate(job_type, gpu_type, n)
        else:
            base = n * min(self.per_worker(job_type, t, n) for t in types)
        if len(nodes) > 1:
            base *= self.cross_node_factor(job_type, types, n)
        return base
