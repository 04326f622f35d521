"""What moving a job's state costs: one model of the data plane, measured, behind every charge.

The live system moves a job's state the same way every round (``services/agent``,
``services/tracker``), and this module prices each move from a :class:`DataPlane` -- a few
bandwidths and start times measured on a deployment (``benchmarks/data_plane.py`` writes
one; ``shared/domain/data/data_plane/`` keeps those measured here). A *checkpoint* is the
FP32 weights plus ``optimizer_slots`` state tensors like them
(:func:`shared.domain.fork_cost.checkpoint_bytes`).

Every store request also costs ``store_request_s`` (the round trip of a small object), which is
what a small model's transfers mostly are. Per copy and round (:func:`copy_charges`), in
seconds the copy does not train:

* **start** -- a *cold* copy (its GPU set is not the one it held last round: first
  placement, resume after preemption, migration, a new fork) starts fresh worker processes
  (``process_start_s``: interpreter, torch, data set, model); a *warm* one reuses its kept
  processes (``warm_start_s``). Then, unless the job has no model yet (its first round:
  it starts from its seed), **every rank downloads** the round's starting checkpoint from
  the store, the model and its optimizer state (two requests); a node's ranks share its
  link: ``max over nodes (ranks on it x checkpoint) / store_download``. A cold copy of more
  than one rank then forms its process group, whose first collective broadcasts rank 0's
  weights: ``weights / intra_node`` on one node, ``weights / inter_node`` across nodes.
* **end** -- rank 0 uploads the copy's checkpoint: one request, ``checkpoint / store_upload``.

Per job and round (:func:`consolidation_s`): the tracker reads the round's ``n`` replicas
and, when there is one, the round's starting model (it screens replicas against it), averages
the replicas, and writes the optimizer state and the model: ``(n + started) x checkpoint /
store_download + n x checkpoint / consolidate + checkpoint / store_upload``, and ``n +
started + 2`` requests. The next round's copies wait for that
model, so the job pays it whether it is charged at this round's end or the next one's start;
a simulator charges it at the end, where a completing job's model is written.

Preemption, migration, resumption and forking are all *cold starts* here, told apart only
by whether the job has a model yet; that is how the live agent behaves
(``services/agent/slots.py``: a warm process is kept only for the same job, GPUs and ranks).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["DataPlane", "copy_charges", "consolidation_s", "load_data_plane"]

_GB = 1e9


@dataclass(frozen=True, kw_only=True)
class DataPlane:
    """Measured figures of one deployment: bandwidths in GB/s (1e9 bytes), times in seconds."""

    store_upload_gbps: float     # one node's writes to the object store
    store_download_gbps: float   # one node's reads from the object store
    consolidate_gbps: float      # the tracker's averaging, replica bytes per second
    intra_node_gbps: float       # a collective within one node (NVLink, PCIe, shared memory)
    inter_node_gbps: float       # a collective across nodes (the network)
    process_start_s: float       # a fresh copy: from its assignment to its first step, less loading
    warm_start_s: float          # a kept copy: from its assignment to its first step, less loading
    store_request_s: float = 0.0  # one store request's round trip (a small object's put or get)
    source: str = ""             # how and where it was measured

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "source":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"data plane: {f.name} must be a finite number, not {value!r}")
            if f.name.endswith("_gbps") and not value > 0:
                raise ValueError(f"data plane: {f.name} must be > 0, not {value}")
            if f.name.endswith("_s") and value < 0:
                raise ValueError(f"data plane: {f.name} must be >= 0, not {value}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DataPlane:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        missing = sorted(f.name for f in fields(cls)
                         if f.name not in ("source", "store_request_s") and f.name not in data)
        if unknown or missing:
            raise ValueError(f"data plane: unknown fields {unknown}, missing {missing}")
        return cls(**dict(data))


def load_data_plane(path: str | Path) -> DataPlane:
    """The :class:`DataPlane` in a JSON file; ``ValueError`` with the path for a bad one."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return DataPlane.from_json(data)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def copy_charges(plane: DataPlane, *, checkpoint_bytes: float, weights_bytes: float,
                 ranks_per_node: Sequence[int], cold: bool, has_model: bool) -> tuple[float, float]:
    """(start, end) seconds one copy on ``ranks_per_node`` ranks loses this round (module docstring)."""
    if not ranks_per_node or min(ranks_per_node) < 1:
        raise ValueError("a copy has at least one rank on each of its nodes")
    if checkpoint_bytes < 0 or weights_bytes < 0:
        raise ValueError("checkpoint_bytes and weights_bytes must be >= 0")
    start = plane.process_start_s if cold else plane.warm_start_s
    if has_model:
        start += 2 * plane.store_request_s + max(ranks_per_node) * checkpoint_bytes / (plane.store_download_gbps * _GB)
    if cold and sum(ranks_per_node) > 1:
        link = plane.inter_node_gbps if len(ranks_per_node) > 1 else plane.intra_node_gbps
        start += weights_bytes / (link * _GB)
    return start, plane.store_request_s + checkpoint_bytes / (plane.store_upload_gbps * _GB)


def consolidation_s(plane: DataPlane, *, checkpoint_bytes: float, copies: int, has_model: bool) -> float:
    """Seconds the tracker takes to make the round's model of ``copies`` replicas (module docstring)."""
    if copies < 1 or checkpoint_bytes < 0:
        raise ValueError("copies must be >= 1 and checkpoint_bytes >= 0")
    objects = copies + (1 if has_model else 0)
    reads = objects * checkpoint_bytes / (plane.store_download_gbps * _GB)
    return ((objects + 2) * plane.store_request_s + reads + copies * checkpoint_bytes / (plane.consolidate_gbps * _GB)
            + checkpoint_bytes / (plane.store_upload_gbps * _GB))
